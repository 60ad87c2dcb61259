"""PipeDream: asynchronous 1F1B with weight stashing (Narayanan et al., SOSP'19).

Whole minibatches flow through the pipeline (unit = minibatch, numbered 0..steps-1); there
is no flush. Each replica admits its warm-up depth of minibatches (NOAM = ceil(workers /
replicas of the input stage) at the input stage), then alternates one backward and one
forward, and drains at the end. In time, with 4 stages, forward = backward time and no
transfer time (``F`` forward, ``B`` backward, unit number)::

    rank 0 | F0 F1 F2 F3          B0 F4 B1 F5 B2 F6 ...
    rank 1 |    F0 F1 F2       B0 F3 B1 F4 B2 F5 ...
    rank 2 |       F0 F1    B0 F2 B1 F3 B2 F4 ...
    rank 3 |          F0 B0 F1 B1 F2 B2 F3 B3 ...

Updates: a stage with one replica steps after every backward; a stage with ``r`` replicas
steps once per group of ``r`` consecutive minibatches (one per replica), after an
all-reduce that averages their gradients, so ``steps`` must be a multiple of ``r``.

Weight versions (design.md): a forward uses the newest version of its stage at the time it
runs, i.e. the number of that stage's STEPs already in its list; its backward uses the same
(stashed) version. With ``vertical_sync`` stage ``s`` uses for minibatch ``u`` the newest
version that includes only minibatches already in the version ``v0`` stage 0 used for ``u``:
version ``k`` of a stage with ``r_s`` replicas holds minibatches ``0 .. k*r_s-1``, so
``k = min(newest, floor(v0 * r_0 / r_s))``.

Without weight stashing (``stashing=False``, PipeDream section 3.3's ablation) a backward
names the newest version of its stage at the time it runs (the number of STEPs before it in
the list) instead of its forward's: it computes with the newest weights. The runtime then
recomputes the stage's forward from the unit's stashed stage input under that version and
backpropagates through the recomputation (docs/schedules.md); the forward's version is
unchanged. The last stage, whose backward follows its forward, sees no difference.
"""
from __future__ import annotations

from collections.abc import Sequence

from ..errors import ScheduleError
from .action import Action, Op, Schedule
from .layout import check_replicas, lcm, one_f_one_b, stage_ranks_of, warmup_depth


def build_pipedream(replicas: Sequence[int], steps: int, vertical_sync: bool = False,
                    stashing: bool = True) -> Schedule:
    """Compute-only PipeDream schedule (F, B, STEP with versions) over ``steps`` minibatches.

    Args:
        replicas: replica count per stage, e.g. ``[2, 1, 1]``.
        steps: minibatches to run; a multiple of every stage's replica count.
        vertical_sync: use stage 0's version for every stage (see module docstring).
        stashing: a B uses its F's (stashed) version; ``False``: the stage's newest version
            when the B runs (see module docstring).

    Example:
        >>> s = build_pipedream([1, 1], steps=3, stashing=False)
        >>> [a.long for a in s.workers[0]]
        ['0F0v0', '0F1v0', '0B0v0', '0STEP0', '0F2v1', '0B1v1', '0STEP1', '0B2v2', '0STEP2']
    """
    reps = check_replicas(replicas)
    if steps < 1:
        raise ScheduleError(f"pipedream needs steps >= 1 minibatches (got {steps}); pass steps=1 or more")
    period = lcm(reps)
    if steps % period:
        bad = next(k for k, r in enumerate(reps) if steps % r)
        fix = (steps // period + 1) * period
        raise ScheduleError(
            f"pipedream steps a stage with r replicas once per r minibatches, so steps must be a multiple of "
            f"every replica count: steps={steps} but stage {bad} has {reps[bad]} replicas (replicas={reps}); "
            f"use steps={fix}"
        )
    stage_ranks = stage_ranks_of(reps)
    workers: list[list[Action]] = [[] for _ in range(sum(reps))]
    # (stage, unit) -> version of its forward; filled stage by stage so that stage 0's
    # versions are known when vertical sync needs them.
    fwd_version: dict[tuple[int, int], int] = {}
    for k, ranks in enumerate(stage_ranks):
        r = reps[k]
        depth = warmup_depth(reps, k)
        for j, rank in enumerate(ranks):
            units = list(range(j, steps, r))
            steps_done = 0
            out = workers[rank]
            for kind, u in one_f_one_b(units, depth):
                if kind == "F":
                    v = steps_done
                    if vertical_sync and k > 0:
                        v = min(steps_done, fwd_version[(0, u)] * reps[0] // r)
                    fwd_version[(k, u)] = v
                    out.append(Action(k, Op.F, u, version=v))
                else:
                    out.append(Action(k, Op.B, u, version=fwd_version[(k, u)] if stashing else steps_done))
                    # r == 1: step after every backward; r > 1: step g after this replica's
                    # minibatch of group g = {g*r .. g*r+r-1}.
                    out.append(Action(k, Op.STEP, u // r))
                    steps_done += 1
    return Schedule("pipedream", workers, stage_ranks, microbatches=1, steps=steps,
                    options={"vertical_sync": bool(vertical_sync), "stashing": bool(stashing)})
