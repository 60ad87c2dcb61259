"""Evaluation that leaves training as it is, for every schedule.

Asynchronous schedules are not cut at evaluation points (``Segment.evals``): each stage's
weights are copied right after its update of the evaluation step and evaluated at the
segment's end (runtime/worker/pipeline_eval.py, ``EvalSnapshots``). So, for pipedream (with
and without weight stashing, with vertical sync), 2bw, flush and zero-bubble:

- a run with ``--eval-every 3`` ends with the weights of the run without evaluation, bit for
  bit, and with the same losses;
- its evaluation at step 3 is the model made of each stage's weights after its update of
  step 3: bit for bit the end-of-run evaluation of the 3-step run (whose drain at its end
  changes nothing of minibatches 1..3);
- with periodic checkpoints too (``--checkpoint-every 2``, cut inside the pipeline,
  tests/runtime/test_checkpoint_async.py), a pipedream run is one segment and still the run
  without either.

All 19 runs share one launch of two workers (``launch_local`` runs resolved runs in turn).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pipetrain.job import OptimizerConfig, TrainConfig
from pipetrain.run import resolve_run
from pipetrain.runtime import launch_local

pytestmark = pytest.mark.timeout(240)

TIMEOUT = 60
MLP = {"depth": 4, "width": 32}
#: (name, schedule, microbatches, schedule options)
CASES = [("pipedream", "pipedream", 1, {}), ("nostash", "pipedream", 1, {"stashing": False}),
         ("vsync", "pipedream", 1, {"vertical_sync": True}), ("2bw", "2bw", 2, {}),
         ("flush", "flush", 2, {}), ("zerobubble", "zerobubble", 2, {})]
ASYNC = ["pipedream", "nostash", "vsync", "2bw"]
#: run kind -> (steps, --eval-every)
KINDS = {"eval": (6, 3), "plain": (6, None), "short": (3, 3)}


def cfg(schedule: str, microbatches: int, steps: int, eval_every: int | None, **kw: Any) -> TrainConfig:
    return TrainConfig.of(model="mlp", model_options=MLP, data="digits", loader_workers=0, schedule=schedule,
                          workers=2, config="1-1", microbatches=microbatches, batch_size=16, steps=steps,
                          eval_every=eval_every, seed=0, return_state=True, timeout=TIMEOUT, quiet=True, threads=1,
                          optimizer=OptimizerConfig("sgd", lr=0.05, momentum=0.9), **kw)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Any]:
    keys, resolved = [], []
    for name, sched, m, opts in CASES:
        for kind, (steps, every) in KINDS.items():
            keys.append((name, kind))
            resolved.append(resolve_run(cfg(sched, m, steps, every, **opts)))
    root: Path = tmp_path_factory.mktemp("ck")
    keys.append(("pipedream", "ck+eval"))  # checkpoints at steps 2, 4 and 6
    resolved.append(resolve_run(cfg("pipedream", 1, 6, 3, checkpoint_dir=str(root / "ck"), checkpoint_every=2)))
    results = launch_local(resolved, timeout=TIMEOUT * 3)
    return {k: (run, res) for k, run, res in zip(keys, resolved, results)}


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_evaluation_leaves_weights_bitwise(runs: dict[tuple[str, str], Any], name: str) -> None:
    (_, ev), (_, plain) = runs[(name, "eval")], runs[(name, "plain")]
    assert set(ev.state) == set(plain.state)
    for n, t in plain.state.items():
        assert torch.equal(ev.state[n], t), f"{name} {n}: the run with --eval-every 3 differs from the run without"
    assert ev.losses == plain.losses
    assert [e["step"] for e in ev.eval_history] == [3, 6]


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_evaluation_is_the_model_after_each_stages_update(runs: dict[tuple[str, str], Any], name: str) -> None:
    (_, ev), (_, short) = runs[(name, "eval")], runs[(name, "short")]
    at3 = ev.eval_history[0]
    end3 = short.eval_history[-1]
    assert (at3["step"], end3["step"]) == (3, 3)
    assert (at3["loss"], at3["accuracy"]) == (end3["loss"], end3["accuracy"])
    assert at3["wall_time"] <= ev.eval_history[1]["wall_time"]


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_asynchronous_runs_are_not_cut_at_evaluations(runs: dict[tuple[str, str], Any], name: str) -> None:
    run, _ = runs[(name, "eval")]
    if name in ASYNC:
        assert [(s.steps, s.evals, s.evaluate) for s in run.segments] == [(6, (3,), True)]
    else:  # a flush every step: the cut changes nothing
        assert [(s.steps, s.evals) for s in run.segments] == [(3, ()), (3, ())]


def test_evaluations_and_checkpoints_together_leave_weights_bitwise(runs: dict[tuple[str, str], Any]) -> None:
    (run, ev), (_, plain) = runs[("pipedream", "ck+eval")], runs[("pipedream", "plain")]
    assert [(s.steps, s.evals) for s in run.segments] == [(6, (3,))]
    for n, t in plain.state.items():
        assert torch.equal(ev.state[n], t), f"{n}: evaluating and checkpointing changed the run"
    assert [e["step"] for e in ev.eval_history] == [3, 6]
