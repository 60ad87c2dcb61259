"""Where a resolved run's segments end, which of those ends are checkpoints, and where a run resumes.

A run is split into segments at every boundary step (:class:`~pipetrain.job.resolved.Segment`);
the pipeline drains at each one, so a checkpoint written there holds the newest weights only
and a run can continue from it. These functions reason about a
:class:`~pipetrain.job.resolved.ResolvedRun` alone: the launcher uses them before any worker
starts (:func:`check_boundary`, :func:`cut_at`), every worker to skip what a checkpoint
already holds (:func:`segments_done`) and to count the optimizer steps of its stages
(:func:`stage_step_count`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..checkpoint import CheckpointError, check_model, latest_checkpoint, read_manifest
from ..schedule.action import Op, Schedule
from .config import TrainConfig
from .resolved import ResolvedRun

__all__ = ["check_boundary", "check_optimizer", "checkpoint_due", "checkpoint_steps", "cut_at", "inner_checkpoints",
           "inner_point", "resumes_inside", "same_layout", "segments_done", "stage_step_count"]


def stage_step_count(schedule: Schedule, stage: int) -> int:
    """Optimizer steps of ``stage`` in a schedule (counted on its first replica)."""
    rank = schedule.stage_ranks[stage][0]
    return sum(1 for a in schedule.workers[rank] if a.stage == stage and a.op is Op.STEP)


def checkpoint_due(every: int | None, step: int, total: int) -> bool:
    """Whether a boundary at ``step`` (minibatches done) is a checkpoint: a multiple of
    ``every`` or the run's last step (``total``)."""
    return step > 0 and (step == total or (every is not None and step % every == 0))


def checkpoint_steps(run: ResolvedRun) -> list[int]:
    """The segment ends of ``run`` at which a checkpoint is written (the boundaries it can resume at)."""
    cfg = run.config
    out, at = [], 0
    for seg in run.segments:
        at += seg.steps
        if checkpoint_due(cfg.checkpoint.checkpoint_every, at, run.total_steps):
            out.append(at)
    return out


def segments_done(segment_steps: Sequence[int], resumed: int) -> int:
    """How many leading segments a run resumed at step ``resumed`` skips.

    ``resumed`` must be a segment boundary (0, or the end of a segment); otherwise the
    checkpoint cannot be continued by these segments (a CheckpointError says which steps can).
    """
    at = 0
    for i, n in enumerate(segment_steps):
        if at == resumed:
            return i
        if at > resumed:
            break
        at += n
    if at == resumed:
        return len(segment_steps)
    if resumed > at:
        raise CheckpointError(
            f"the checkpoint to resume is at step {resumed}, past this run's last step {at}: that run went further; "
            f"pass more --steps to continue it, or another --checkpoint-dir to start afresh")
    ends = [sum(segment_steps[:i + 1]) for i in range(len(segment_steps))]
    raise CheckpointError(
        f"the checkpoint to resume is at step {resumed}, which is not a segment boundary of this run (boundaries: "
        f"{', '.join(map(str, ends))}); resume with --warmup-steps/--checkpoint-every placing a boundary at step "
        f"{resumed}, or with another --checkpoint-dir")


def check_optimizer(man: Any, cfg: TrainConfig) -> None:
    """A checkpoint (its :class:`~pipetrain.checkpoint.Manifest`) continues only a run with the
    optimizer it was trained with; otherwise a one-line CheckpointError."""
    saved = (man.info.get("optimizer") or {}).get("name")
    if saved is not None and saved != cfg.optimizer.name:
        raise CheckpointError(
            f"checkpoint {str(man.path)!r} was trained with optimizer {saved}, not {cfg.optimizer.name}; resume with "
            f"--optimizer {saved} or another --checkpoint-dir")


def check_boundary(run: ResolvedRun, root: str | Path) -> int:
    """Launcher side, before workers start: the step of the latest checkpoint in ``root``
    (0: none), checked to be of this model and optimizer and a boundary of ``run``
    (:func:`segments_done`; :func:`cut_at` makes it one first)."""
    path = latest_checkpoint(root)
    if path is None:
        return 0
    man = read_manifest(path)
    cfg = run.config
    check_model(man, cfg.model.name, dict(cfg.model.options))
    check_optimizer(man, cfg)
    segments_done([s.steps for s in run.segments], man.step)
    return man.step


def inner_checkpoints(run: ResolvedRun, seg: Any, end: int) -> list[int]:
    """The checkpoint steps inside ``seg`` (a :class:`~pipetrain.job.resolved.Segment` ending
    at step ``end``) of an asynchronous schedule, which the segment does not end at: there a
    checkpoint is a consistent cut written without a drain (runtime/checkpoints/periodic.py)."""
    ck = run.config.checkpoint
    if run.config.synchronous or ck.checkpoint_dir is None or not ck.checkpoint_every or not seg.timed:
        return []
    return [t for t in range(end - seg.steps + 1, end) if t % ck.checkpoint_every == 0]


def same_layout(info: dict[str, Any], world_size: int, run: ResolvedRun) -> bool:
    """A checkpoint's manifest ``info`` (saved by ``world_size`` workers) is of ``run``'s layout:
    the same workers, the same stages (node lists) and the same schedule."""
    plan, saved = run.plan, info.get("plan") or {}
    return (world_size == run.world_size and plan is not None
            and saved.get("stages") == [list(s.nodes) for s in plan.stages]
            and info.get("schedule") == run.config.parallel.schedule)


def inner_point(run: ResolvedRun, step: int) -> tuple[int, int] | None:
    """``(segment, minibatches of it done)`` when ``step`` is one of ``run``'s checkpoint
    points inside a segment (:func:`inner_checkpoints`); None otherwise."""
    at = 0
    for i, seg in enumerate(run.segments):
        if at < step < at + seg.steps:
            return (i, step - at) if step in inner_checkpoints(run, seg, at + seg.steps) else None
        at += seg.steps
    return None


def resumes_inside(run: ResolvedRun, info: dict[str, Any], world_size: int, step: int) -> bool:
    """A checkpoint cut inside a segment without a drain (``"drained": false``) that ``run``
    resumes from its own versions: same layout, and ``step`` is one of ``run``'s own inner
    checkpoint points. Any other checkpoint is resumed as if drained at ``step``
    (:func:`cut_at`)."""
    return (info.get("drained") is False and same_layout(info, world_size, run)
            and inner_point(run, step) is not None)


def cut_at(run: ResolvedRun, step: int) -> ResolvedRun:
    """``run`` with a segment boundary at ``step`` (the step a checkpoint of another run, e.g.
    under another layout or ``--checkpoint-every``, was saved at), so that it can resume there.

    The segment holding ``step`` is split into two of the same kind, each with its own
    schedule (built as :func:`pipetrain.run.resolve.resolve_run` builds them); the first part
    neither evaluates nor checkpoints. A step outside the run, or already a boundary, returns
    ``run`` unchanged. Raises CheckpointError when the schedule cannot stop there (pipedream
    steps a stage with r replicas once per r minibatches).
    """
    at = 0
    segs = list(run.segments)
    for i, seg in enumerate(segs):
        if at < step < at + seg.steps:
            if run.plan is None:
                return run
            first, rest = step - at, at + seg.steps - step
            a, b = _build(run, step, first), _build(run, step, rest)
            segs[i:i + 1] = [dataclasses.replace(seg, steps=first, schedule=a, evaluate=False, checkpoint=False),
                             dataclasses.replace(seg, steps=rest, schedule=b)]
            out = dataclasses.replace(run, segments=tuple(segs))
            out.check()
            return out
        at += seg.steps
    return run


def _build(run: ResolvedRun, step: int, steps: int) -> Schedule:
    """The run's schedule of ``steps`` minibatches; a builder's refusal as a CheckpointError
    (the checkpoint to resume is at ``step``)."""
    assert run.plan is not None
    try:
        return run.spec.build(run.plan.replicas, run.microbatches, steps, **dict(run.schedule_options))  # type: ignore[no-any-return]
    except Exception as e:  # noqa: BLE001 - the builder's own message, as one line
        raise CheckpointError(
            f"the checkpoint to resume is at step {step}, where the {run.config.parallel.schedule} schedule of "
            f"this run cannot stop ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); resume "
            f"with a plan or schedule that can, or with another --checkpoint-dir") from None
