"""The communication pass: insert SEND/RECV with peers, and ALLREDUCE before STEP.

Builders emit compute only (F, B or I+W, STEP). This pass adds, on every worker's list:

- before the forward of unit ``u`` at stage ``k > 0``: ``kRECV_Fu<p`` from the rank ``p``
  that ran ``(k-1)F u``; after the forward at stage ``k < S-1``: ``kSEND_Fu>q`` to the
  rank ``q`` that runs ``(k+1)F u`` (relay: everything crossing cut ``k`` goes ``k -> k+1``);
- before the backward (or I) of ``u`` at stage ``k < S-1``: ``kRECV_Bu<q`` from the rank
  ``q`` of ``(k+1, u)``; after it at stage ``k > 0``: ``kSEND_Bu>p`` to the rank of
  ``(k-1, u)``;
- right before ``kSTEPs`` of a replicated stage: ``kALLREDUCEs`` (same step index ``s``).

A transfer's action carries its own stage: ``0SEND_F3>1`` pairs with ``1RECV_F3<0``, and
``1SEND_B3>0`` with ``0RECV_B3<1``. Each SEND sits right after the compute producing it and
each RECV right before the compute consuming it; the runtime posts receives ahead itself.
"""
from __future__ import annotations

from ..errors import ScheduleError
from .action import Action, Op, Schedule


def unit_ranks(schedule: Schedule) -> dict[tuple[int, int], int]:
    """``(stage, unit) -> rank`` of every forward in the schedule."""
    where: dict[tuple[int, int], int] = {}
    for rank, actions in enumerate(schedule.workers):
        for a in actions:
            if a.op is Op.F:
                where[(a.stage, a.mb)] = rank
    return where


def insert_comm(schedule: Schedule) -> Schedule:
    """Return a copy of a compute-only ``schedule`` with transfers and all-reduces inserted."""
    where = unit_ranks(schedule)
    last = schedule.num_stages - 1

    def peer(stage: int, unit: int, rank: int) -> int:
        try:
            return where[(stage, unit)]
        except KeyError:
            raise ScheduleError(
                f"rank {rank} needs unit {unit} of stage {stage}, which no worker runs; the builder must cover "
                f"every unit at every stage"
            ) from None

    workers: list[list[Action]] = []
    for rank, actions in enumerate(schedule.workers):
        out: list[Action] = []
        for a in actions:
            k, u = a.stage, a.mb
            if a.op is Op.F:
                if k > 0:
                    out.append(Action(k, Op.RECV_F, u, peer=peer(k - 1, u, rank)))
                out.append(a)
                if k < last:
                    out.append(Action(k, Op.SEND_F, u, peer=peer(k + 1, u, rank)))
            elif a.op in (Op.B, Op.I):
                if k < last:
                    out.append(Action(k, Op.RECV_B, u, peer=peer(k + 1, u, rank)))
                out.append(a)
                if k > 0:
                    out.append(Action(k, Op.SEND_B, u, peer=peer(k - 1, u, rank)))
            elif a.op is Op.STEP:
                if len(schedule.stage_ranks[k]) > 1:
                    out.append(Action(k, Op.ALLREDUCE, u))
                out.append(a)
            elif a.op in (Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B, Op.ALLREDUCE):
                raise ScheduleError(f"insert_comm expects a compute-only schedule, found {a.long} on rank {rank}")
            else:
                out.append(a)
        workers.append(out)
    return Schedule(schedule.name, workers, [list(r) for r in schedule.stage_ranks],
                    microbatches=schedule.microbatches, steps=schedule.steps, options=dict(schedule.options))


def strip_comm(schedule: Schedule) -> Schedule:
    """The compute-only view of a schedule (drops SEND/RECV/ALLREDUCE); inverse of :func:`insert_comm`."""
    drop = (Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B, Op.ALLREDUCE)
    return Schedule(schedule.name, [[a for a in acts if a.op not in drop] for acts in schedule.workers],
                    [list(r) for r in schedule.stage_ranks], microbatches=schedule.microbatches,
                    steps=schedule.steps, options=dict(schedule.options))
