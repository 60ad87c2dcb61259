"""One resolved run: every decision made once, before any worker starts (no process launched)."""
from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest

from pipetrain.errors import PipetrainError, RuntimeConfigError
from pipetrain.job import ResolvedRun, TrainConfig
from pipetrain.models import TINY_OPTIONS
from pipetrain.plan.types import Plan, Stage
from pipetrain.run import implied_workers, resolve_run
from pipetrain.schedule import get_schedule

pytestmark = pytest.mark.timeout(120)

MLP = dict(TINY_OPTIONS["mlp"], depth=6)


def cfg(**kw: object) -> TrainConfig:
    base: dict[str, object] = dict(model="mlp", model_options=MLP, batch_size=8, steps=4, quiet=True)
    base.update(kw)
    return TrainConfig.of(**base)


def test_config_run_is_resolved_once_with_every_segment() -> None:
    run = resolve_run(cfg(schedule="flush", config="2-1", warmup_steps=2))
    assert run.world_size == 3 and run.plan is not None and run.plan.config == "2-1"
    spec = get_schedule("flush")
    assert run.microbatches == spec.default_microbatches(2, [2, 1])  # the one default rule
    assert [(s.kind, s.steps) for s in run.segments] == [("warmup", 2), ("timed", 4)]
    assert all(s.schedule is not None and s.schedule.num_workers == 3 for s in run.segments)
    assert run.schedule.grid() == spec.build([2, 1], run.microbatches, 4).grid()
    nodes = [n for s in run.stage_nodes for n in s]
    assert len(nodes) == len(set(nodes)) and run.plan_note.startswith("--config 2-1")
    assert run.to_json()["plan"]["stages"][0]["replicas"] == 2


def test_resolved_run_pickles_to_the_same_value() -> None:
    run = resolve_run(cfg(schedule="2bw", workers=2, config="1-1", microbatches=2))
    back = pickle.loads(pickle.dumps(run))
    assert back.config == run.config and back.stage_nodes == run.stage_nodes
    assert [s.schedule.grid() for s in back.segments] == [s.schedule.grid() for s in run.segments]  # type: ignore[union-attr]


@pytest.mark.parametrize("kw, world, stages", [
    (dict(schedule="interleaved", workers=2, microbatches=4), 2, 4),     # 2 chunks per rank
    (dict(schedule="dp", workers=3, microbatches=3, batch_size=9), 3, 1),  # one stage on every worker
    (dict(schedule="pipedream", cut="_2", config="1-1"), 2, 2),
])
def test_layouts_come_from_the_schedule(kw: dict[str, object], world: int, stages: int) -> None:
    run = resolve_run(cfg(**kw))
    assert run.world_size == world and run.plan is not None and run.plan.num_stages == stages
    assert run.schedule.num_stages == stages and run.schedule.num_workers == world


def test_planner_plans_for_workers_without_a_config() -> None:
    run = resolve_run(cfg(schedule="pipedream", workers=2))
    assert run.plan is not None and run.plan.num_workers == 2 and run.microbatches == 1
    assert "planner" in run.plan_note or "balanced split" in run.plan_note


def test_one_process_run_has_no_plan() -> None:
    run = resolve_run(cfg(schedule="flush", workers=1, microbatches=2))
    assert run.in_process and run.plan is None and [s.schedule for s in run.segments] == [None]
    with pytest.raises(RuntimeConfigError, match="batch size 8 is not divisible by microbatches 3"):
        resolve_run(cfg(schedule="flush", workers=1, microbatches=3))


def test_plan_file_must_fit_the_workers_and_the_graph(tmp_path: Path) -> None:
    run = resolve_run(cfg(schedule="flush", config="1-1", microbatches=2))
    path = tmp_path / "plan.json"
    Plan(stages=[Stage(nodes=n) for n in run.stage_nodes], model="mlp").save(path)
    assert implied_workers(cfg(plan=str(path))) == 2
    assert resolve_run(cfg(plan=str(path), schedule="flush", microbatches=2)).stage_nodes == run.stage_nodes
    with pytest.raises(RuntimeConfigError, match=r"--workers 3 does not match the plan .*which needs 2 workers"):
        resolve_run(cfg(plan=str(path), workers=3))
    Plan(stages=[Stage(nodes=["nosuch"]), Stage(nodes=run.stage_nodes[1])], model="mlp").save(path)
    with pytest.raises(PipetrainError, match="lists node 'nosuch'"):
        resolve_run(cfg(plan=str(path), schedule="flush", microbatches=2))


def test_check_catches_an_inconsistent_value() -> None:
    run = resolve_run(cfg(schedule="flush", config="1-1", microbatches=2))
    run.check()
    with pytest.raises(RuntimeConfigError, match="needs 2 workers but the run has 3"):
        dataclasses.replace(run, world_size=3).check()
    with pytest.raises(RuntimeConfigError, match="not divisible by microbatches 3"):
        dataclasses.replace(run, microbatches=3).check()
    assert isinstance(run, ResolvedRun)
