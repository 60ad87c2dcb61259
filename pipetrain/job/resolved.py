"""One resolved run: every decision about a training run, made once before any worker starts.

:class:`ResolvedRun` is a frozen value holding the configuration and what was decided from
it: the world size, the batch size, the microbatches, the plan (with the node list of every
stage, and a note saying where it came from), the schedule options, and the complete
schedule of every segment (an untimed warm-up, then the timed steps). It is computed by the
launcher (:func:`pipetrain.run.resolve_run`, which asks the planner), checked once
(:meth:`ResolvedRun.check`), pickled to every worker and recorded in the run's outputs
(``run.json`` beside the trace, and ``"run"`` in ``--json``). Workers, the single-process
path and the references (:mod:`pipetrain.runtime.reference`) execute it and decide nothing.

A one-process run (``world_size == 1``) trains the whole model with ``torch.optim``: it has
no plan and no schedule (``plan is None``, ``segments`` give the step counts only).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import RuntimeConfigError
from ..plan.types import Plan
from ..schedule.action import Schedule
from .config import TrainConfig
from .data import DataSpec

__all__ = ["Segment", "ResolvedRun"]


@dataclass(frozen=True)
class Segment:
    """``steps`` minibatches run as one schedule; ``timed`` segments are measured.

    A run is split into segments at every *boundary step*: the end of the warm-up, every
    evaluation point, every checkpoint point and the end (:func:`pipetrain.run.resolve.segment_plan`).
    Each segment is a complete schedule of its steps, so the pipeline drains at every boundary:
    PipeDream (and 2BW) run 1F1B within a segment and flush between segments, where every
    stage holds one version (the newest) and evaluation or a checkpoint sees one consistent
    model. The reference replay (:func:`pipetrain.runtime.reference.replay_config`) executes
    the same segments, so equality with it holds across boundaries. ``evaluate`` /
    ``checkpoint`` say which hooks run after the segment.

    Asynchronous schedules are not cut at evaluation points (a drain would change the
    algorithm): ``evals`` lists the steps inside the segment whose model is evaluated, each
    stage's weights after its update of that step, at the segment's end
    (:class:`pipetrain.runtime.worker.pipeline_eval.EvalSnapshots`).
    """

    kind: str                       # "warmup" (untimed, first) | "timed"
    steps: int
    schedule: Schedule | None = field(default=None, repr=False)   # None in one-process runs
    evaluate: bool = False          # evaluate on the eval split after this segment
    checkpoint: bool = False        # a checkpoint point after this segment (runtime.checkpoints.periodic)
    evals: tuple[int, ...] = ()     # steps (from the run's first) inside it evaluated at its end, without a drain

    @property
    def timed(self) -> bool:
        return self.kind == "timed"


@dataclass(frozen=True)
class ResolvedRun:
    """A training run with every decision made (module docstring).

    Invariants (:meth:`check`): ``batch_size % microbatches == 0``; the plan needs exactly
    ``world_size`` ranks and every segment's schedule has ``world_size`` workers and as
    many stages as the plan; the segments are the warm-up (if any) and then the timed steps.
    """

    config: TrainConfig
    world_size: int
    batch_size: int
    microbatches: int
    plan: Plan | None
    plan_note: str
    schedule_options: Mapping[str, Any]
    segments: tuple[Segment, ...]
    data: DataSpec | None = None    # real data (None: the model's synthetic batches)
    # the launcher's capture for workers that need not run the model's code (job.model.ShippedModel)
    model: Any = field(default=None, repr=False, compare=False)

    # -- derived --------------------------------------------------------------------------
    @property
    def spec(self) -> Any:
        """The schedule's :class:`~pipetrain.schedule.ScheduleSpec`."""
        return self.config.spec

    @property
    def in_process(self) -> bool:
        """One worker: plain training in this process (no plan, no schedule)."""
        return self.world_size == 1

    @property
    def unit_batch(self) -> int:
        """Samples per unit (microbatch, or minibatch for unit-minibatch schedules)."""
        return self.batch_size // self.microbatches

    @property
    def stage_nodes(self) -> list[list[str]]:
        """The node list of every stage of the plan (what the workers cut the graph into)."""
        return [list(s.nodes) for s in self.plan.stages] if self.plan is not None else []

    @property
    def recompute_stages(self) -> frozenset[int]:
        """The stages whose backward recomputes their forward: every stage with
        ``--recompute``, else those the plan marks ``"recompute": true``."""
        if self.plan is None:
            return frozenset()
        if self.config.performance.recompute:
            return frozenset(range(self.plan.num_stages))
        return frozenset(k for k, s in enumerate(self.plan.stages) if s.recompute)

    @property
    def schedule(self) -> Schedule:
        """The timed segment's schedule."""
        sched = self.segments[-1].schedule
        if sched is None:
            raise RuntimeConfigError("a one-process run has no schedule")
        return sched

    @property
    def schedules(self) -> list[Schedule]:
        """Every segment's schedule, in order."""
        return [s.schedule for s in self.segments if s.schedule is not None]

    @property
    def total_steps(self) -> int:
        return sum(s.steps for s in self.segments)

    @property
    def timed_segments(self) -> list[Segment]:
        """The timed segments, in order (one, unless evaluation or checkpoints split the run)."""
        return [s for s in self.segments if s.timed]

    # -- checks ---------------------------------------------------------------------------
    def check(self) -> None:
        """The invariants of the class docstring; a violation is a RuntimeConfigError."""
        cfg = self.config
        if self.batch_size % self.microbatches:
            m, b = self.microbatches, self.batch_size
            lower = max(d for d in range(1, m + 1) if b % d == 0)
            raise RuntimeConfigError(
                f"batch size {b} is not divisible by microbatches {m}: every microbatch must have the same size; "
                f"use --microbatches {lower} or --batch-size {(b // m + 1) * m}")
        kinds = [s.kind for s in self.segments]
        warm = 1 if cfg.training.warmup_steps else 0
        timed = [s.steps for s in self.segments if s.timed]
        if (kinds[:warm] != ["warmup"] * warm or not timed or len(timed) != len(kinds) - warm
                or sum(timed) != cfg.training.steps
                or (warm and self.segments[0].steps != cfg.training.warmup_steps)):
            raise RuntimeConfigError(f"segments {kinds} do not match warm-up {cfg.training.warmup_steps} and "
                                     f"steps {cfg.training.steps}")
        if self.in_process:
            if cfg.performance.recompute:
                raise RuntimeConfigError(
                    "--recompute recomputes the stages of a pipeline, but this run has 1 worker (trained in one "
                    "process, which keeps every activation); pass --workers 2 or more, or drop --recompute")
            return
        if self.plan is None:
            raise RuntimeConfigError(f"a run on {self.world_size} workers needs a plan")
        need = self.spec.ranks_needed(self.plan.replicas, self.schedule_options)
        if need != self.world_size:
            raise RuntimeConfigError(
                f"the plan ({self.plan.config}) needs {need} workers but the run has {self.world_size}; "
                f"pass --workers {need} or another plan")
        for seg in self.segments:
            sched = seg.schedule
            if sched is None or sched.num_workers != self.world_size or sched.num_stages != self.plan.num_stages:
                got = "none" if sched is None else f"{sched.num_workers} workers, {sched.num_stages} stages"
                raise RuntimeConfigError(
                    f"the {cfg.parallel.schedule} schedule of the {seg.kind} segment for plan {self.plan.config} has "
                    f"{got}, but the run has {self.world_size} workers and the plan {self.plan.num_stages} stages; "
                    f"pass --workers {need}")

    # -- outputs --------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """A JSON-friendly record of the run (``run.json``; ``"run"`` in ``--json``)."""
        return {
            "config": self.config.to_dict(), "world_size": self.world_size, "batch_size": self.batch_size,
            "microbatches": self.microbatches, "plan_note": self.plan_note,
            "plan": self.plan.to_dict() if self.plan is not None else None,
            "schedule_options": dict(self.schedule_options),
            "segments": [{"kind": s.kind, "steps": s.steps, "evaluate": s.evaluate, "checkpoint": s.checkpoint,
                          **({"evals": list(s.evals)} if s.evals else {}),
                          "actions": (sum(len(w) for w in s.schedule.workers) if s.schedule is not None else None)}
                         for s in self.segments],
            "data": self.data.to_json() if self.data is not None else None,
        }
