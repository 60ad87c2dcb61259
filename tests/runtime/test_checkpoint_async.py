"""Checkpoints that leave training as it is, and an exact restart of an asynchronous run.

Asynchronous schedules are not cut at checkpoint points: the checkpoint of step ``K`` is
written inside the segment at a consistent cut (each stage at its update of minibatch ``K``,
with the stashed versions its later units name; runtime/checkpoints/periodic.py,
``CutCheckpoints``), and an elastic restart runs the segment's suffix
(schedule/resume.py). So:

- a run with ``--checkpoint-every 2`` ends with the weights of the run without, bit for bit,
  for pipedream (with and without stashing, vertical sync), 2bw, flush and zero-bubble; the
  asynchronous ones' checkpoints inside the segment say ``drained: false``;
- a 4-worker pipedream run whose rank 2 is SIGKILLed after the checkpoint of step 4
  (``--max-restarts 1``) ends with the weights of the uninterrupted run without checkpoints
  (to 1e-5), and its restarted attempt trains minibatches 4 and 5 only; the same for
  2-worker runs of pipedream without stashing (versions dropped before the cut, copied when
  made) and 2bw (two microbatches a minibatch).

The file runs 18 trainings (two of 4 workers and three restarts): about 2 minutes of CPU on
2 cores.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from restart_cases import MLP, SGD, max_rel_err, wait_no_children

from pipetrain.checkpoint import latest_checkpoint, read_manifest
from pipetrain.job import TrainConfig
from pipetrain.run import resolve_run, train
from pipetrain.runtime import launch_local

pytestmark = pytest.mark.timeout(300)

TIMEOUT = 60
#: (name, schedule, microbatches, schedule options)
CASES = [("pipedream", "pipedream", 1, {}), ("nostash", "pipedream", 1, {"stashing": False}),
         ("vsync", "pipedream", 1, {"vertical_sync": True}), ("2bw", "2bw", 2, {}),
         ("flush", "flush", 2, {}), ("zerobubble", "zerobubble", 2, {})]
ASYNC = ["pipedream", "nostash", "vsync", "2bw"]


def cfg(schedule: str, workers: int, config: str, microbatches: int = 1, **kw: Any) -> TrainConfig:
    base: dict[str, Any] = dict(model="mlp", model_options=MLP, batch_size=8, steps=6, optimizer=SGD, seed=0,
                                microbatches=microbatches, return_state=True, timeout=TIMEOUT, quiet=True, threads=1)
    base.update(kw)
    return TrainConfig.of(schedule=schedule, workers=workers, config=config, **base)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], Any]:
    root = tmp_path_factory.mktemp("ck")
    keys, resolved = [], []
    for name, sched, m, opts in CASES:
        for ck in (True, False):
            extra = dict(checkpoint_dir=str(root / name), checkpoint_every=2) if ck else {}
            keys.append((name, ck))
            resolved.append(resolve_run(cfg(sched, 2, "1-1", m, **opts, **extra)))
    results = launch_local(resolved, timeout=TIMEOUT * 3)
    return {k: (run, res) for k, run, res in zip(keys, resolved, results)}


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_checkpoints_leave_weights_bitwise(runs: dict[tuple[str, bool], Any], name: str) -> None:
    (run, ck), (_, plain) = runs[(name, True)], runs[(name, False)]
    for n, t in plain.state.items():
        assert torch.equal(ck.state[n], t), f"{name} {n}: --checkpoint-every 2 changed the weights"
    assert ck.losses == plain.losses
    root = Path(run.config.checkpoint.checkpoint_dir)
    manifests = {int(p.name.split("_")[1]): read_manifest(p) for p in sorted(root.glob("step_*"))}
    assert sorted(manifests) == [2, 4, 6]
    drained = {step: m.info["drained"] for step, m in manifests.items()}
    assert drained == ({2: False, 4: False, 6: True} if name in ASYNC else {2: True, 4: True, 6: True})
    if name in ASYNC:
        assert len(run.segments) == 1   # no cut at the checkpoint points


@pytest.mark.parametrize("name", ["pipedream", "nostash", "2bw"])
def test_sigkill_restart_equals_the_run_without_checkpoints(runs: dict[tuple[str, bool], Any], tmp_path: Path,
                                                             name: str) -> None:
    _, sched, m, opts = next(c for c in CASES if c[0] == name)
    if name == "pipedream":  # 4 workers, rank 2 killed
        straight = train(cfg(sched, 4, "1-1-1-1", m, **opts))
        layout, fail = (4, "1-1-1-1"), "2:5:kill"
    else:                    # the 2-worker run of the module's fixture, rank 1 killed
        straight, layout, fail = runs[(name, False)][1], (2, "1-1"), "1:5:kill"
    killed = train(cfg(sched, *layout, m, **opts, checkpoint_dir=str(tmp_path / "killed"), checkpoint_every=2,
                       max_restarts=1, debug_fail=fail))
    assert straight is not None and straight.state is not None
    assert killed is not None and killed.state is not None
    assert max_rel_err(killed.state, straight.state) <= 1e-5
    # the restarted attempt resumed inside the segment, at step 4: it trained minibatches 4 and 5 only
    assert killed.start_step == 0 and killed.losses == pytest.approx(straight.losses[4:], rel=1e-6)
    at4 = read_manifest(tmp_path / "killed" / "step_00000004")
    assert at4.info["drained"] is False and at4.stash   # the in-flight units' stashed versions
    last = latest_checkpoint(tmp_path / "killed")
    assert last is not None and read_manifest(last).step == 6
    assert wait_no_children() == []


def test_restart_with_evaluations_inside_the_segment(tmp_path: Path) -> None:
    """Evaluations and checkpoints inside one pipedream segment, rank 1 killed after the
    checkpoint of step 4: the restart equals the uninterrupted run, and evaluates step 6 alone
    (the evaluation of step 3 was pending in the killed attempt, to be taken at the segment's end)."""
    data = dict(model_options={"depth": 4, "width": 32}, data="digits", loader_workers=0, eval_every=3,
                batch_size=16)
    straight = train(cfg("pipedream", 2, "1-1", **data))
    killed = train(cfg("pipedream", 2, "1-1", **data, checkpoint_dir=str(tmp_path / "killed"), checkpoint_every=2,
                       max_restarts=1, debug_fail="1:5:kill"))
    assert straight is not None and killed is not None
    assert max_rel_err(killed.state, straight.state) <= 1e-5
    assert [e["step"] for e in straight.eval_history] == [3, 6]
    assert [(e["step"], e["loss"]) for e in killed.eval_history] == [(6, straight.eval_history[1]["loss"])]
    assert killed.steps == 2 and killed.losses == pytest.approx(straight.losses[4:], rel=1e-6)
    assert wait_no_children() == []


def test_relaunch_resumes_a_cut_checkpoint_exactly(runs: dict[tuple[str, bool], Any], tmp_path: Path) -> None:
    """The command launched again (the launcher resolves the run once more) after rank 1 of a
    2-worker pipedream run is SIGKILLed past the checkpoint of step 4: the same layout and
    checkpoint points, so the launcher does not cut the segment there; the workers resume the
    cut's versions and the run ends as the uninterrupted one without checkpoints. With another
    ``--checkpoint-every`` the step is not one of the run's own points: resumed as if drained."""
    from pipetrain.runtime import WorkerFailure

    straight = runs[("pipedream", False)][1]
    kw = dict(checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=2)
    with pytest.raises(WorkerFailure, match="SIGKILL"):
        train(cfg("pipedream", 2, "1-1", **kw, debug_fail="1:5:kill"))
    last = latest_checkpoint(tmp_path / "ck")
    assert last is not None and read_manifest(last).step == 4 and read_manifest(last).info["drained"] is False
    again = resolve_run(cfg("pipedream", 2, "1-1", **kw))
    from pipetrain.run.launcher import _check_checkpointing

    assert len(_check_checkpointing(again).segments) == len(again.segments)  # not cut at 4
    other = resolve_run(cfg("pipedream", 2, "1-1", checkpoint_dir=kw["checkpoint_dir"], checkpoint_every=3))
    assert len(_check_checkpointing(other).segments) == len(other.segments) + 1  # cut: resumed as if drained
    resumed = train(cfg("pipedream", 2, "1-1", **kw))
    assert resumed is not None and resumed.state is not None and straight.state is not None
    assert max_rel_err(resumed.state, straight.state) <= 1e-5
    assert resumed.losses == pytest.approx(straight.losses[4:], rel=1e-6)
    assert wait_no_children() == []
