"""A candidate of the automatic choice as a short resolved run, rehearsed.

:class:`CandidateRehearsal` is the :class:`~pipetrain.auto.choose.Rehearse` the launcher
gives :func:`~pipetrain.auto.choose.choose`: it resolves a candidate (schedule, microbatches,
plan) into a :class:`~pipetrain.job.resolved.ResolvedRun` of a few minibatches, exactly as
:func:`~pipetrain.run.resolve.resolve_run` would resolve that configuration, and hands it to
:func:`pipetrain.runtime.rehearsal.rehearse`, which runs every rank's actions as its worker
does and measures each stage's compute. A model whose every value comes from files ships
its launcher's capture to the run, as ``resolve_run`` does (one capture per unit size for
every candidate and rank; a Hugging Face BERT's rank was built in 0.73 s by capturing again).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..auto.choose import Candidate
from ..job.config import TrainConfig
from ..job.resolved import ResolvedRun, Segment
from ..schedule.registry import get_schedule
from ..simulate.costs import MeasuredUnit

__all__ = ["CandidateRehearsal", "REHEARSAL_MAX_STEPS", "REHEARSAL_SECONDS", "REHEARSAL_UNITS", "rehearsal_steps"]

#: Units every rehearsed rank times at least (after its first minibatch, the warm-up)...
REHEARSAL_UNITS = 8
#: ...and minibatches for at least this many seconds, by the profile's prediction (the
#: median of a few short units moves 10-20% with the host's phase; small models time more)...
REHEARSAL_SECONDS = 0.5
#: ...in at most this many minibatches.
REHEARSAL_MAX_STEPS = 24


def rehearsal_steps(schedule: str, replicas: list[int], microbatches: int,
                    minibatch_seconds: float | None = None) -> int:
    """Minibatches of a rehearsal: one to warm up, then enough for :data:`REHEARSAL_UNITS`
    units on each rank (a replica runs ``1/replicas`` of its stage's units) and for
    :data:`REHEARSAL_SECONDS` at ``minibatch_seconds`` a minibatch (the profile's prediction,
    when known), at most :data:`REHEARSAL_MAX_STEPS`, rounded up to the schedule's steps period."""
    spec = get_schedule(schedule)
    units = 1 if spec.unit == "minibatch" else microbatches
    per_rank = units / max(1, max(replicas))
    need = math.ceil(REHEARSAL_UNITS / per_rank)
    if minibatch_seconds is not None and minibatch_seconds > 0:
        need = max(need, math.ceil(REHEARSAL_SECONDS / minibatch_seconds))
    steps = 1 + min(REHEARSAL_MAX_STEPS - 1, need)
    period = int(spec.steps_period(replicas))
    return -(-steps // period) * period


@dataclass
class CandidateRehearsal:
    """Rehearses the automatic choice's candidates of the run ``cfg`` on ``workers`` ranks
    with minibatches of ``batch`` samples."""

    cfg: TrainConfig
    workers: int
    batch: int
    #: the launcher's capture at the whole minibatch and its shipped model (``load_shipped``'s
    #: last two values), taken for a candidate whose unit is the whole minibatch instead of
    #: tracing the model again (a 6-layer Hugging Face Qwen2: 2 s)
    whole: tuple[Any, Any] | None = None
    #: what the rehearsal's measurements depend on besides the candidate (the cache's key)
    settings: Mapping[str, Any] = field(init=False)
    _captures: dict[int, tuple[Any, Any]] = field(init=False, default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        c = self.cfg
        self.settings = {"fused_grads": c.performance.fused_grads, "precision": c.training.precision,
                         "recompute": c.performance.recompute, "optimizer": c.optimizer.name,
                         "momentum": c.optimizer.momentum, "clip": c.training.clip_grad_norm,
                         "device": c.parallel.device, "units": REHEARSAL_UNITS, "seconds": REHEARSAL_SECONDS}
        if self.whole is not None:
            self._captures[self.batch] = self.whole

    def run_of(self, candidate: Candidate) -> ResolvedRun:
        """``candidate`` as a resolved run of :func:`rehearsal_steps` minibatches."""
        plan = candidate.plan
        if plan is None:
            raise ValueError(f"candidate {candidate.schedule} m={candidate.microbatches} has no plan to rehearse")
        replicas = list(plan.replicas)
        steps = rehearsal_steps(candidate.schedule, replicas, candidate.microbatches,
                                candidate.profile_predicted_time or candidate.predicted_time)
        cfg = self.cfg.replace(schedule=candidate.schedule, microbatches=candidate.microbatches, auto=False,
                               steps=steps, epochs=None, warmup_steps=0, eval_every=None, checkpoint_every=None,
                               target_accuracy=None, target_loss=None)
        steps = cfg.training.steps or steps  # as the config took it (the docs' fast mode caps steps)
        options = dict(cfg.parallel.schedule_options)  # the candidate schedule's own
        schedule = cfg.spec.build(replicas, candidate.microbatches, steps, **options)
        run = ResolvedRun(cfg, self.workers, self.batch, candidate.microbatches, plan, "rehearsal", options,
                          (Segment("timed", steps, schedule),))
        run.check()
        return replace(run, model=self._shipped(run.unit_batch, plan))

    def _shipped(self, unit: int, plan: Any) -> Any:
        """The launcher's capture at ``unit`` samples as the workers of ``plan`` take it, or
        ``None`` (a model initialised by its own code: each rank captures it)."""
        import torch

        from ..job.model import load_shipped
        from ..stages.partition import partition_graph

        if unit not in self._captures:
            with torch.random.fork_rng(devices=[]):
                _, captured, shipped = load_shipped(self.cfg, unit)
            self._captures[unit] = (captured, shipped)
        captured, shipped = self._captures[unit]
        if shipped is None or shipped.unit_batch != unit:
            return None
        return shipped.with_codecs(captured, partition_graph(captured.gm, [list(s.nodes) for s in plan.stages]))

    def __call__(self, candidate: Candidate) -> list[MeasuredUnit]:
        from ..runtime.rehearsal import rehearse

        return list(rehearse(self.run_of(candidate)).stages)
