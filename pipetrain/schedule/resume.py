"""A consistent cut of an asynchronous schedule, and the schedule that continues from it.

A checkpoint of an asynchronous schedule at step ``K`` of a segment does not drain the
pipeline: it holds each stage at its own update of minibatch ``K`` (its version
``u_k = K * S_k / n``, where stage ``k`` makes ``S_k`` updates in the segment's ``n``
minibatches). What the rest of the segment needs of the past is then only:

- the weight versions ``<= u_k`` that the actions of the later units name (the stashed
  versions of the units in flight, and ``u_k``): :func:`needed_versions`;
- the optimizer state after update ``u_k``.

:func:`suffix` is the segment's schedule restricted to the units of minibatches ``>= K`` and
to the updates after ``u_k``: the units in flight at the cut run their forwards again, with
the versions their actions name, so the continued run computes what the uninterrupted one
computes. Both ends of every transfer belong to one unit, so a transfer is kept or dropped
as a whole, and the suffix runs in the order of the full schedule, without a deadlock.

:func:`pause_points` gives, per rank, the position after which the rank may join a
collective (the checkpoint's write) while the others are still inside the segment: after its
last action of a unit ``< K`` and its update ``u_k``, moved later wherever a dry run (sends
never block, receives wait for their send, every rank waits at its pause point) finds a rank
waiting for a send that its peer makes only after its own pause point.

>>> from pipetrain.schedule.registry import build_schedule
>>> s = build_schedule("pipedream", [1, 1], 1, 4)
>>> [str(a) for a in suffix(s, 2).workers[1]]
['1RECV_F2', '1F2', '1B2', '1SEND_B2', '1STEP2', '1RECV_F3', '1F3', '1B3', '1SEND_B3', '1STEP3']
>>> pause_points(s, 2)
[12, 10]
"""
from __future__ import annotations

from collections.abc import Sequence

from .action import COMPUTE_OPS, Action, Op, Schedule

__all__ = ["needed_versions", "pause_points", "stage_updates", "suffix"]

_UPDATE_OPS = (Op.STEP, Op.ALLREDUCE)


def stage_updates(schedule: Schedule, stage: int, done: int) -> int:
    """The updates stage ``stage`` has made once minibatches ``0..done-1`` of the segment are
    trained (``done * S_k / n``); an error where that is not a whole number."""
    rank = schedule.stage_ranks[stage][0]  # STEP g makes version g + 1 (also in a suffix, which lacks the first)
    per_segment = 1 + max((a.mb for a in schedule.workers[rank] if a.stage == stage and a.op is Op.STEP), default=-1)
    updates, rest = divmod(done * per_segment, schedule.steps)
    if rest:
        raise ValueError(f"stage {stage} makes {per_segment} updates in {schedule.steps} steps and has no update "
                         f"that completes step {done}; pick a step its schedule can stop at")
    return updates


def _kept(schedule: Schedule, a: Action, done: int, updates: Sequence[int]) -> bool:
    if a.op in _UPDATE_OPS:
        return a.mb >= updates[a.stage]
    return a.mb // schedule.microbatches >= done


def suffix(schedule: Schedule, done: int) -> Schedule:
    """The actions of ``schedule`` for the units of minibatches ``>= done`` and the updates
    after each stage's ``stage_updates(done)``, in their order (module docstring)."""
    updates = [stage_updates(schedule, k, done) for k in range(schedule.num_stages)]
    workers = [[a for a in w if _kept(schedule, a, done, updates)] for w in schedule.workers]
    return Schedule(f"{schedule.name}-from-{done}", workers, [list(r) for r in schedule.stage_ranks],
                    microbatches=schedule.microbatches, steps=schedule.steps, options=dict(schedule.options))


def needed_versions(schedule: Schedule, done: int, rank: int) -> dict[int, set[int]]:
    """Stage -> the versions ``<= stage_updates(done)`` that the suffix's actions of ``rank``
    name, and that version itself (the newest at the cut)."""
    out: dict[int, set[int]] = {}
    for k in schedule.stages_of_rank(rank):
        u = stage_updates(schedule, k, done)
        out[k] = {u}
    updates = [stage_updates(schedule, k, done) for k in range(schedule.num_stages)]
    for a in schedule.workers[rank]:
        if a.op in COMPUTE_OPS and a.version is not None and _kept(schedule, a, done, updates) \
                and a.version <= updates[a.stage]:
            out[a.stage].add(a.version)
    return out


def _message(a: Action) -> tuple[str, int, int] | None:
    """The message a transfer action sends or receives: (direction, cut, unit)."""
    if a.op is Op.SEND_F:
        return "F", a.stage, a.mb
    if a.op is Op.RECV_F:
        return "F", a.stage - 1, a.mb
    if a.op is Op.SEND_B:
        return "B", a.stage - 1, a.mb
    if a.op is Op.RECV_B:
        return "B", a.stage, a.mb
    return None


def pause_points(schedule: Schedule, done: int) -> list[int]:
    """Per rank, the number of its actions to run before it may join a collective of all
    ranks inside the segment (module docstring)."""
    updates = [stage_updates(schedule, k, done) for k in range(schedule.num_stages)]
    points = []
    for w in schedule.workers:
        dropped = [i for i, a in enumerate(w) if not _kept(schedule, a, done, updates)]
        points.append(max(dropped, default=-1) + 1)
    while True:
        moves = _dry_run(schedule, points)
        if not moves:
            return points
        for peer, point in moves:
            points[peer] = max(points[peer], point)


def _dry_run(schedule: Schedule, points: list[int]) -> list[tuple[int, int]]:
    """Run every rank up to its pause point; the later pause points of the ranks whose sends
    (or all-reduces) a waiting rank needs (empty: every rank reached its pause point)."""
    pos = [0] * schedule.num_workers
    sent: set[tuple[str, int, int] | None] = set()
    arrived: dict[tuple[int, int], int] = {}   # (stage, group) -> replicas at its ALLREDUCE
    progress = True
    while progress:
        progress = False
        for r, w in enumerate(schedule.workers):
            while pos[r] < points[r]:
                a = w[pos[r]]
                if a.op in (Op.RECV_F, Op.RECV_B) and _message(a) not in sent:
                    break
                if a.op is Op.STEP and len(schedule.stage_ranks[a.stage]) > 1 \
                        and arrived.get((a.stage, a.mb), 0) < len(schedule.stage_ranks[a.stage]):
                    break
                if a.op in (Op.SEND_F, Op.SEND_B):
                    sent.add(_message(a))
                if a.op is Op.ALLREDUCE:
                    arrived[(a.stage, a.mb)] = arrived.get((a.stage, a.mb), 0) + 1
                pos[r] += 1
                progress = True
    moves: list[tuple[int, int]] = []   # (rank, later pause point) that unblock a waiting rank
    for r, w in enumerate(schedule.workers):
        if pos[r] >= points[r]:
            continue
        a = w[pos[r]]
        peers: list[tuple[int, Op | None, int]]
        if a.op is Op.STEP:  # a replica waits at the all-reduce: every replica pauses after its own
            peers = [(q, Op.ALLREDUCE, a.mb) for q in schedule.stage_ranks[a.stage]]
        else:                # a receive: its sender pauses after the send
            peers = [(a.peer, None, 0)] if a.peer is not None else []
        for q, op, mb in peers:
            for i, b in enumerate(schedule.workers[q]):
                if b.stage == a.stage and op is Op.ALLREDUCE and b.op is op and b.mb == mb \
                        or op is None and b.op in (Op.SEND_F, Op.SEND_B) and _message(b) == _message(a):
                    if i + 1 > points[q]:
                        moves.append((q, i + 1))
                    break
    if not moves and any(p < q for p, q in zip(pos, points)):
        raise ValueError(f"the schedule {schedule.name} cannot pause at these points: {points}")
    return moves
