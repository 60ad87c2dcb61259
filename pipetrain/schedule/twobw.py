"""PipeDream-2BW: 1F1B without flushes and double-buffered weights (Narayanan et al., ICML'21).

Microbatches are numbered globally (minibatch ``t`` holds units ``t*m .. t*m+m-1``) and
flow in one 1F1B order across minibatch boundaries: no flush. Each replica steps after the
last backward it runs of every minibatch (replicated stages all-reduce first).

Weight versions (2BW's update rule, W(t+1) = W(t) - lr * grad f(W(t-1))): every forward and
backward of minibatch ``t`` uses version ``max(t-1, 0)`` at every stage. A stage then holds
at most two versions: ``t-1`` (used by minibatch ``t`` in flight) and ``t`` (created by the
step after minibatch ``t-1``, used by minibatch ``t+1``). Version ``t-1`` exists in time
when ``m >= P``: the first forward of minibatch ``t`` follows, in 1F1B, the backward of the
unit ``depth`` places before it, which lies in minibatch ``t-1`` or later.
"""
from __future__ import annotations

from collections.abc import Sequence

from ..errors import ScheduleError
from .action import Action, Op, Schedule
from .layout import check_replicas, check_sync_counts, one_f_one_b, stage_ranks_of, warmup_depth


def check_twobw_microbatches(replicas: Sequence[int], microbatches: int) -> None:
    """2BW's rules on the microbatches of a minibatch (raise :class:`ScheduleError`).

    ``m >= P`` so that two weight versions suffice; ``m`` a multiple of every stage's replica
    count (each replica runs the same share of every minibatch); and ``m >= r * (depth - 1)``
    at a replicated stage so that version ``t-1`` exists when minibatch ``t`` starts.
    """
    reps = list(replicas)
    m = microbatches
    if m < len(reps):
        raise ScheduleError(
            f"2bw needs microbatches >= stages so that two weight versions suffice: microbatches={m} < "
            f"{len(reps)} stages; use microbatches={len(reps)} or more"
        )
    for k, r in enumerate(reps):
        if m % r:
            # Uneven minibatches across replicas let one replica's all-reduce of minibatch t
            # wait on a replica already busy with t+1's warm-up: a deadlock.
            raise ScheduleError(
                f"2bw needs microbatches to be a multiple of every stage's replica count so each replica "
                f"runs the same share of every minibatch: microbatches={m}, stage {k} has {r} replicas; "
                f"use microbatches={(m // r + 1) * r}"
            )
        # The replica's first forward of minibatch t comes `depth` units after the backward
        # it follows; that backward must lie past minibatch t-2 (whose step makes version t-1).
        need = r * (warmup_depth(reps, k) - 1)
        if m < need:
            raise ScheduleError(
                f"2bw with replicas={reps}: stage {k} keeps {warmup_depth(reps, k)} units in flight per replica, "
                f"which needs microbatches >= {need} for version t-1 to exist when minibatch t starts (got {m}); "
                f"use microbatches={need}"
            )


def build_twobw(replicas: Sequence[int], microbatches: int, steps: int) -> Schedule:
    """Compute-only PipeDream-2BW schedule over ``steps`` minibatches of ``microbatches`` units."""
    reps = check_replicas(replicas)
    check_sync_counts("2bw", reps, microbatches, steps)
    m = microbatches
    check_twobw_microbatches(reps, m)
    stage_ranks = stage_ranks_of(reps)
    workers: list[list[Action]] = [[] for _ in range(sum(reps))]
    for k, ranks in enumerate(stage_ranks):
        r = reps[k]
        depth = warmup_depth(reps, k)
        for j, rank in enumerate(ranks):
            units = [u for u in range(steps * m) if (u % m) % r == j]
            # The last unit of each minibatch on this replica: its backward is followed by the step.
            last_of = {max(u for u in units if u // m == t) for t in range(steps)}
            out = workers[rank]
            for kind, u in one_f_one_b(units, depth):
                v = max(u // m - 1, 0)
                out.append(Action(k, Op.F if kind == "F" else Op.B, u, version=v))
                if kind == "B" and u in last_of:
                    out.append(Action(k, Op.STEP, u // m))
    return Schedule("2bw", workers, stage_ranks, microbatches=m, steps=steps, options={})
