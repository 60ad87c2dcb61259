"""A rehearsal (pipetrain.runtime.rehearsal): every rank's actions run as its worker runs
them, one rank after another in one process, timed.

- it runs what the workers run: each stage's forward and its backward as the schedule has
  it (B; I and W for zero-bubble), every unit after the first minibatch timed;
- one rank per distinct set of stages (replicas do the same work), in pipeline order;
- a forward receive gets the previous stage's real output for that unit, a backward receive
  a fixed, finite stand-in; no process group is needed or made;
- it times the updates without training: however long, it cannot overflow;
- a candidate of the automatic choice resolves into a valid short run of its own schedule,
  microbatches and plan, and its rehearsal gives one measured unit per stage (a replicated
  stage, a Hugging Face model with a tied embedding).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pipetrain.auto.choose import Candidate
from pipetrain.job import TrainConfig
from pipetrain.models import TINY_OPTIONS
from pipetrain.plan.cuts import split_by_config
from pipetrain.run.rehearse import (
    REHEARSAL_MAX_STEPS,
    REHEARSAL_SECONDS,
    REHEARSAL_UNITS,
    CandidateRehearsal,
    rehearsal_steps,
)
from pipetrain.run.resolve import _load_captured
from pipetrain.runtime.rehearsal import STAND_IN_GRADIENT, RehearsalComm, _Wires, rehearsal_ranks, rehearse
from pipetrain.schedule import get_schedule
from pipetrain.schedule.action import Action, Op
from pipetrain.stages.boundary import WireSpec

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


def test_one_rank_per_distinct_set_of_stages_in_pipeline_order() -> None:
    assert rehearsal_ranks(get_schedule("flush").build([1, 1, 1], 3, 2)) == [0, 1, 2]
    assert rehearsal_ranks(get_schedule("pipedream").build([2, 1], 1, 2)) == [0, 2]
    assert rehearsal_ranks(get_schedule("dp").build([2], 2, 2)) == [0]
    inter = get_schedule("interleaved").build([1, 1, 1, 1], 4, 1, virtual_stages=2)
    assert rehearsal_ranks(inter) == [0, 1]


def test_rehearsal_steps_time_enough_units_on_every_rank() -> None:
    assert rehearsal_steps("flush", [1, 1], 8) == 2
    assert rehearsal_steps("flush", [1, 1], 2) == 1 + REHEARSAL_UNITS // 2
    assert rehearsal_steps("pipedream", [1, 1], 1) == 1 + REHEARSAL_UNITS
    steps = rehearsal_steps("pipedream", [2, 1], 1)  # a replica runs every other minibatch
    assert steps % 2 == 0 and steps >= 1 + REHEARSAL_UNITS


def test_a_rehearsal_of_short_minibatches_times_them_for_its_seconds() -> None:
    slow = 10 * REHEARSAL_SECONDS  # the unit count rules: as without a prediction
    assert rehearsal_steps("flush", [1, 1], 2, slow) == rehearsal_steps("flush", [1, 1], 2) == 1 + REHEARSAL_UNITS // 2
    short = REHEARSAL_SECONDS / 12  # 12 minibatches for the seconds, more than the 4 the units need
    assert rehearsal_steps("flush", [1, 1], 2, short) == 1 + 12
    assert rehearsal_steps("pipedream", [2, 1], 1, REHEARSAL_SECONDS / 19) == 20  # 1 + 19, to the period 2
    assert rehearsal_steps("flush", [1, 1], 2, 1e-6) == REHEARSAL_MAX_STEPS


def test_receives_get_the_previous_stages_real_output_and_finite_stand_in_gradients() -> None:
    sched = get_schedule("flush").build([1, 1], 2, 1)

    class Codec:  # what the comm reads of a boundary codec: its wires' specs and which carry gradients
        specs = [WireSpec((2, 3), torch.float32), WireSpec((2,), torch.int64)]
        grad_indices = [0]

    wires = _Wires()
    comm = RehearsalComm(0, sched, [Codec()], torch.device("cpu"), wires)  # type: ignore[list-item]
    assert not comm.distributed and not comm.groups and not dist.is_initialized()
    sent = [torch.randn(2, 3), torch.tensor([4, 5])]
    comm.send(Action(0, Op.SEND_F, 1, peer=1), sent)
    got = comm.wait(Action(1, Op.RECV_F, 1, peer=0))
    assert all(torch.equal(a, b) for a, b in zip(got, sent))
    other = comm.wait(Action(1, Op.RECV_F, 3, peer=0))  # a unit nobody sent: the cut's last wires
    assert all(torch.equal(a, b) for a, b in zip(other, sent))
    g1 = comm.wait(Action(0, Op.RECV_B, 1, peer=1))
    g2 = comm.wait(Action(0, Op.RECV_B, 2, peer=1))
    assert [tuple(g.shape) for g in g1] == [(2, 3)]
    assert torch.equal(g1[0], g2[0]) and bool(torch.isfinite(g1[0]).all())
    assert 0 < float(g1[0].abs().max()) < 10 * STAND_IN_GRADIENT


def test_a_replicated_stages_step_divides_by_every_replicas_units() -> None:
    """The count a run's all-reduce sums over the replicas, so STEP divides as in the run."""
    comm = RehearsalComm(0, get_schedule("dp").build([3], 3, 2), [], torch.device("cpu"), _Wires())
    flat = torch.tensor([6.0, 9.0, 2.0])  # gradients, then this rank's unit count
    comm.allreduce_count(0, flat)
    assert flat.tolist() == [6.0, 9.0, 6.0]
    one = RehearsalComm(0, get_schedule("flush").build([1, 1], 2, 1), [], torch.device("cpu"), _Wires())
    flat = torch.tensor([6.0, 2.0])
    one.allreduce_count(0, flat)
    assert flat.tolist() == [6.0, 2.0]


def mlp_candidate(schedule: str, m: int, replicas: list[int], predicted: float = 1.0,
                  **options: Any) -> tuple[CandidateRehearsal, Candidate]:
    """A tiny MLP's candidate, predicted at ``predicted`` seconds a minibatch (which sets how
    many minibatches it is rehearsed for); ``options``: more of the run's settings."""
    cfg = TrainConfig.of(model="mlp", model_options=dict(TINY_OPTIONS["mlp"], depth=4, width=64), batch_size=8,
                         workers=sum(replicas), threads=1, **options)
    spec = get_schedule(schedule)
    unit = 8 // (1 if spec.unit == "minibatch" else m)
    _, captured = _load_captured(cfg, unit)
    plan = split_by_config(captured, replicas, "mlp", 8)
    return CandidateRehearsal(cfg, sum(replicas), 8), Candidate(schedule, m, plan, predicted)


@pytest.mark.parametrize("schedule, m, halves", [("flush", 2, False), ("zerobubble", 2, True),
                                                  ("pipedream", 1, False)])
def test_a_rehearsal_times_what_each_stage_runs(schedule: str, m: int, halves: bool) -> None:
    rehearsal, cand = mlp_candidate(schedule, m, [1, 1])
    run = rehearsal.run_of(cand)
    assert (run.config.parallel.schedule, run.microbatches, run.plan) == (schedule, m, cand.plan)
    got = rehearse(run)
    assert got.ranks == (0, 1) and len(got.stages) == 2
    units = 1 if get_schedule(schedule).unit == "minibatch" else m
    assert got.forwards == ((run.schedule.steps - 1) * units,) * 2  # all but the first minibatch
    for u in got.stages:
        assert u.forward > 0 and u.step is not None and u.step > 0
        if halves:
            assert u.backward is None and u.input is not None and u.weight is not None and u.weight > 0
        else:
            assert u.backward is not None and u.backward > 0 and u.input is None and u.weight is None


def test_a_long_rehearsal_does_not_train_so_it_cannot_overflow() -> None:
    """A rehearsal's updates run at a learning rate of 0: its stand-in gradients, fixed per
    wire, would move stage 0's weights the same way every update (the default MLP's pipedream
    rehearsal overflowed at minibatch 12-18 of 24 and the choice lost its fastest candidate).
    Here at a learning rate that overflows them within 15 updates, over 24 minibatches."""
    rehearsal, cand = mlp_candidate("pipedream", 1, [1, 1], predicted=1e-6, lr=1e4)
    run = rehearsal.run_of(cand)
    assert run.schedule.steps == REHEARSAL_MAX_STEPS
    got = rehearse(run)
    assert got.forwards == (REHEARSAL_MAX_STEPS - 1,) * 2
    assert all(u.step is not None and u.step > 0 for u in got.stages)  # the updates are still timed


def test_a_replicated_stage_is_rehearsed_once() -> None:
    rehearsal, cand = mlp_candidate("dp", 2, [2])
    assert rehearsal.run_of(cand).model is None  # a model initialised by its own code: each rank captures it
    got = rehearse(rehearsal.run_of(cand))
    assert got.ranks == (0,) and len(got.stages) == 1 and got.stages[0].backward is not None


def test_a_hugging_face_model_with_a_tied_embedding_is_rehearsed_from_its_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ranks hold the tied embedding, so their guards read the gradients in full at STEP,
    as the workers' guards do (their gradients are summed across stages)."""
    pytest.importorskip("transformers")
    from test_hf_dir import llama

    import pipetrain.runtime.rehearsal as rh

    tied: list[bool] = []
    real_guard = rh.NumericsGuard

    def guard(*args: Any, **kwargs: Any) -> Any:
        tied.append(bool(kwargs.get("tied")))
        return real_guard(*args, **kwargs)

    monkeypatch.setattr(rh, "NumericsGuard", guard)

    path = llama(tmp_path, tie=True)
    cfg = TrainConfig.of(model=f"hf:{path}", model_options={"seq_len": 16}, batch_size=4, workers=2, threads=1)
    _, captured = _load_captured(cfg, 2)
    plan = split_by_config(captured, [1, 1], "llama", 4)
    rehearsal = CandidateRehearsal(cfg, 2, 4)
    cand = Candidate("flush", 2, plan, 1.0)
    assert rehearsal.run_of(cand).model is not None  # its workers' own path: the launcher's capture, shipped
    assert len(list(rehearsal(cand))) == 2
    assert tied == [True, True]
    tied.clear()
    mlp, mlp_cand = mlp_candidate("flush", 2, [1, 1])  # nothing tied
    rehearse(mlp.run_of(mlp_cand))
    assert tied == [False, False]



def test_a_rehearsal_at_the_whole_minibatch_takes_the_launcher_s_trace(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Given the launcher's capture at the whole minibatch (``whole``: what the resolve traced
    for the choice and ships), a candidate of that unit is rehearsed on it, the model not
    traced again, and what is shipped afterwards is unchanged (its values read from the files)."""
    pytest.importorskip("transformers")
    import importlib

    from test_hf_dir import llama

    from pipetrain.run.resolve import _load_shipped

    path = llama(tmp_path)
    cfg = TrainConfig.of(model=f"hf:{path}", model_options={"seq_len": 16}, batch_size=4, workers=2, threads=1)
    _, captured, shipped = _load_shipped(cfg, 4)
    assert shipped is not None
    kept = {n: t.clone() for n, t in shipped.kept.items()}
    graph_capture = importlib.import_module("pipetrain.graph.capture")  # the module, not the function it exports
    real_capture = graph_capture.capture
    traced: list[int] = []

    def capture(*args: Any, **kwargs: Any) -> Any:
        traced.append(1)
        return real_capture(*args, **kwargs)

    monkeypatch.setattr(graph_capture, "capture", capture)
    rehearsal = CandidateRehearsal(cfg, 2, 4, (captured, shipped))
    cand = Candidate("pipedream", 1, split_by_config(captured, [1, 1], "llama", 4), 1.0)
    assert rehearsal.run_of(cand).model is not None
    assert len(list(rehearsal(cand))) == 2
    assert traced == []  # the launcher's trace, rehearsed on; without it, traced once more
    assert shipped.kept.keys() == kept.keys() and all(torch.equal(shipped.kept[n], kept[n]) for n in kept)
    CandidateRehearsal(cfg, 2, 4).run_of(cand)
    assert traced == [1]


def test_a_rehearsal_runs_at_its_workers_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers compute with ``--threads``; so does their rehearsal, whatever the caller's
    setting, which is restored after (a benchmark rehearsing at 2 threads predicted half the time)."""
    import pipetrain.runtime.rehearsal as rh

    seen: list[int] = []
    real = rh.Executor.run

    def spy(self: object, actions: object) -> None:
        seen.append(torch.get_num_threads())
        real(self, actions)  # type: ignore[arg-type]

    monkeypatch.setattr(rh.Executor, "run", spy)
    rehearsal, cand = mlp_candidate("flush", 2, [1, 1])
    torch.set_num_threads(2)
    try:
        rehearse(rehearsal.run_of(cand))
        assert seen == [1, 1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)
