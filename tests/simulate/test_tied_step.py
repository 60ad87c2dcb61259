"""A tensor tied across stages in the simulator (``StageCosts.tied``): the holders' STEPs meet.

The runtime's exchange (``runtime/engine/tied_sync.py``) all-reduces a tied tensor's gradient
over the ranks of every holding stage inside each of their STEPs, so those STEPs leave the
all-reduce together. The simulator does the same:

- every holder's STEP of a minibatch ends exactly ``collective + its own step`` after the
  last holder reached that STEP (the ring time of the tensor's bytes over the group);
- a tie of 0 bytes still makes the holders meet, so a schedule whose holders reach STEP at
  different times is slower than without it (the wait is the cost, not the bytes);
- the bytes are in the simulated traffic as ``allreduce``;
- a tie naming a stage the schedule lacks, and one rank holding two tied stages, are one
  clear error.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from pipetrain.errors import ScheduleError
from pipetrain.schedule import get_schedule
from pipetrain.schedule.action import Op
from pipetrain.schedule.traffic import TiedBuffer
from pipetrain.simulate import StageCosts, simulate


def _costs(forward: list[float], backward: list[float], step: float, bandwidth: float) -> StageCosts:
    c = StageCosts.synthetic(len(forward), forward, backward, step_time=step)
    c.bandwidth = bandwidth
    return c


@pytest.mark.parametrize("name,replicas", [("flush", [1, 1]), ("zerobubble", [1, 1]), ("gpipe", [1, 1, 1]),
                                           ("flush", [2, 1])])
def test_the_holders_steps_leave_the_all_reduce_together(name: str, replicas: list[int]) -> None:
    S = len(replicas)
    sched = get_schedule(name).build(replicas, 4, 3)
    costs = replace(_costs([1.0 + k for k in range(S)], [2.0] * S, 0.25, bandwidth=2.0),
                    tied=(TiedBuffer(3.0, (0, S - 1)),))
    sim = simulate(sched, costs)
    group = sorted({r for k in (0, S - 1) for r in sched.stage_ranks[k]})
    r = len(group)
    ring = 2 * (r - 1) / r * 3.0 / 2.0  # the ring all-reduce of 3 bytes at 2 bytes/s
    steps = [e for tl in sim.timelines for e in tl if e.action.op is Op.STEP and e.action.stage in (0, S - 1)]
    for t in range(sched.steps):
        mine = [e for e in steps if e.action.mb == t]
        assert sorted(e.rank for e in mine) == group
        last = max(e.start for e in mine)  # a STEP's event starts when its rank reaches it
        for e in mine:
            assert e.end == pytest.approx(last + ring + 0.25)
    untied = simulate(sched, replace(costs, tied=()))
    assert sim.time_per_minibatch > untied.time_per_minibatch


def test_a_tie_of_no_bytes_still_makes_the_holders_wait_for_each_other() -> None:
    """Without the tie the last stage steps as soon as its backward is done; with it, it waits
    for the first stage's last backward, and the first stage waits for nobody: the first
    stage's STEP ends as before, the last stage's later."""
    sched = get_schedule("flush").build([1, 1], 4, 2)
    costs = _costs([1.0, 1.0], [2.0, 2.0], 0.5, bandwidth=1.0)
    untied = simulate(sched, costs)
    tied = simulate(sched, replace(costs, tied=(TiedBuffer(0.0, (0, 1)),)))

    def step_ends(sim: object, stage: int) -> list[float]:
        return [e.end for tl in sim.timelines for e in tl  # type: ignore[attr-defined]
                if e.action.op is Op.STEP and e.action.stage == stage]

    assert step_ends(tied, 0) == pytest.approx(step_ends(untied, 0))
    assert all(a > b for a, b in zip(step_ends(tied, 1), step_ends(untied, 1)))
    assert tied.summary()["bytes_per_minibatch"]["allreduce"] == 0


def test_the_tied_bytes_are_simulated_traffic() -> None:
    sched = get_schedule("flush").build([1, 1], 2, 3)
    costs = replace(_costs([1.0, 1.0], [1.0, 1.0], 0.0, bandwidth=1e9), tied=(TiedBuffer(1000.0, (0, 1)),))
    sim = simulate(sched, costs)
    # two ranks: each sends and receives 2 (r-1)/r = 1 copy of the bytes per STEP, one STEP per minibatch
    assert sim.summary()["bytes_per_minibatch"]["allreduce"] == pytest.approx(2 * 1000.0)


def test_bad_ties_are_one_clear_error() -> None:
    sched = get_schedule("flush").build([1, 1], 2, 2)
    costs = _costs([1.0, 1.0], [1.0, 1.0], 0.0, bandwidth=1.0)
    with pytest.raises(ScheduleError, match=r"tied tensor 0 needs bytes >= 0 and stages in 0\.\.1"):
        simulate(sched, replace(costs, tied=(TiedBuffer(8.0, (0, 2)),)))
    inter = get_schedule("interleaved").build([1, 1, 1, 1], 4, 2, virtual_stages=2)
    costs4 = _costs([1.0] * 4, [1.0] * 4, 0.0, bandwidth=1.0)
    with pytest.raises(ScheduleError, match=r"rank 0 holds stages 0 and 2, which both hold tied tensors"):
        simulate(inter, replace(costs4, tied=(TiedBuffer(8.0, (0, 2)),)))
