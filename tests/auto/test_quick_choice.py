"""A configuration the user did not name is explained: what the planner chose for the named
schedule, the predicted times per minibatch that decided it, and the ``--config`` that trains
the fastest pipeline instead (pipetrain.auto.quick.explain_choice, logged by resolve_run)."""
from __future__ import annotations

import logging
import re

import pytest

from pipetrain.auto.quick import explain_choice
from pipetrain.job import TrainConfig
from pipetrain.models import TINY_OPTIONS
from pipetrain.plan.types import Plan, Stage
from pipetrain.run import resolve_run

pytestmark = pytest.mark.timeout(180)

MLP = dict(TINY_OPTIONS["mlp"], depth=6)


def _plan(replicas: list[int], predicted: float, data_parallel: float | None = None) -> Plan:
    return Plan(stages=[Stage(nodes=[f"n{i}"], replicas=r) for i, r in enumerate(replicas)],
                predicted_time=predicted, data_parallel_time=data_parallel)


def test_data_parallelism_names_the_fastest_pipeline_and_its_flag() -> None:
    line = explain_choice(_plan([2], 0.0012345), _plan([1, 1], 0.002), "pipedream", 2)
    assert line == ("one stage on 2 replicas (data parallelism) is predicted 1.234 ms per minibatch under pipedream, "
                    "the fastest pipeline (1-1) 2.000 ms; pass --config 1-1 to train that pipeline")


def test_data_parallelism_without_a_runnable_pipeline_says_so() -> None:
    line = explain_choice(_plan([4], 0.003), None, "flush", 4)
    assert line == ("one stage on 4 replicas (data parallelism) is predicted 3.000 ms per minibatch under flush; "
                    "no pipeline of 2 or more stages runs on 4 workers with flush")


def test_a_pipeline_is_compared_with_data_parallelism() -> None:
    line = explain_choice(_plan([3, 1], 0.010, data_parallel=0.025), None, "pipedream", 4)
    assert line == ("2 stages are predicted 10.000 ms per minibatch under pipedream, data parallelism 25.000 ms; "
                    "--config names another configuration")


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.parametrize("schedule", ["pipedream", "flush"])
def test_resolve_logs_the_choice_once_with_the_planners_own_times(schedule: str) -> None:
    """The line resolve_run logs is the run's plan note; its times are the plans' predictions,
    and the pipeline it names is one the planner predicts no faster than the choice, which
    ``--config`` then trains."""
    logger = logging.getLogger("pipetrain.run.resolve")
    handler, level = _Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        run = resolve_run(TrainConfig.of(model="mlp", model_options=MLP, batch_size=8, steps=4, quiet=True,
                                         schedule=schedule, workers=2))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert run.plan is not None
    note = run.plan_note
    assert handler.lines == [f"plan: {note}"]
    assert note.startswith(f"planner ({run.plan.config}) from a quick profile on this machine and default costs: ")
    chosen = re.search(r"is predicted ([\d.]+) ms per minibatch under " + schedule, note)
    if chosen is None:  # stages are predicted ...
        chosen = re.search(r"stages are predicted ([\d.]+) ms per minibatch under " + schedule, note)
    assert chosen is not None, note
    assert float(chosen.group(1)) == pytest.approx(run.plan.predicted_time * 1e3, abs=5e-4)
    if run.plan.num_stages > 1:
        return
    other = re.search(r"the fastest pipeline \(([\d-]+)\) ([\d.]+) ms; pass --config \1 to train that pipeline$",
                      note)
    assert other is not None, note
    assert float(other.group(2)) >= float(chosen.group(1))
    forced = resolve_run(TrainConfig.of(model="mlp", model_options=MLP, batch_size=8, steps=4, quiet=True,
                                        schedule=schedule, workers=2, config=other.group(1)))
    assert forced.plan is not None and forced.plan.config == other.group(1) and forced.plan.num_stages == 2
