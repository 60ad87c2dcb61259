"""Schedules described as data: one :class:`ScheduleSpec` per schedule, looked up by name.

A spec answers everything a caller needs to know about a schedule without comparing its
name: whether it is synchronous, its unit (minibatch or microbatch), whether it flushes,
its default microbatches, how many model stages a plan must cut and how many ranks a plan
needs (virtual stages included), the options it accepts and their checks, its weight-version
rule, and how to build it. ``build_schedule(name, ...)`` is ``get_schedule(name).build(...)``.

Two kinds of stages appear below. *Model stages* are what a plan cuts (``Plan.stages``,
the ``replicas`` a builder takes). *Rank stages* are the pipeline depth in ranks: the same
as the model stages, except for ``interleaved``, where every rank holds ``virtual_stages``
model stages (``P`` rank stages, ``P * v`` model stages). Microbatch rules are stated on rank
stages: 1F1B fills a pipeline of ``P`` ranks, not of ``P * v`` chunks.

Every schedule a spec builds is complete (compute, transfers with peers, all-reduces,
steps): what the runtime, the validator and the simulator execute.
"""
from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ..errors import ScheduleError
from .action import Schedule
from .comm import insert_comm
from .dp import build_dp, check_one_stage
from .flush import build_flush
from .gpipe import build_gpipe
from .interleaved import build_interleaved, check_interleaved_microbatches, interleaved_ranks
from .layout import check_replicas, lcm
from .pipedream import build_pipedream
from .twobw import build_twobw, check_twobw_microbatches
from .zerobubble import build_zerobubble

#: ``builder(replicas, microbatches, steps, **options) -> Schedule`` (compute only).
Builder = Callable[..., Schedule]

#: Most microbatches :meth:`ScheduleSpec.default_microbatches` searches past its start.
_DEFAULT_SEARCH = 100_000


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_vertical_sync(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ScheduleError(f"option vertical_sync must be True or False (got {value!r}); pass vertical_sync=True")
    return value


def _check_stashing(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ScheduleError(f"option stashing must be True or False (got {value!r}); pass stashing=False for "
                            f"PipeDream without weight stashing")
    return value


def _check_virtual_stages(value: Any) -> int:
    if not _is_int(value) or int(value) < 1:
        raise ScheduleError(
            f"option virtual_stages (model chunks per rank) must be an integer >= 1 (got {value!r}); "
            f"use virtual_stages=2")
    return int(value)


#: option name -> check returning the normalised value (raises ScheduleError).
_OPTION_CHECKS: dict[str, Callable[[Any], Any]] = {
    "vertical_sync": _check_vertical_sync,
    "stashing": _check_stashing,
    "virtual_stages": _check_virtual_stages,
}


@dataclass(frozen=True, eq=False)
class ScheduleSpec:
    """What one schedule is; every caller asks this instead of comparing names.

    One instance per schedule (compared by identity): ``get_schedule("flush")``.

    Attributes:
        name: the registry name (``pipedream``, ``2bw``, ``flush``, ``gpipe``, ``dp``,
            ``interleaved``, ``zerobubble``).
        synchronous: every unit of minibatch ``t`` uses weight version ``t`` (the result
            equals one process's; global gradient clipping is possible).
        unit: ``"minibatch"`` (pipedream: whole minibatches flow, microbatches must be 1) or
            ``"microbatch"``.
        flushes: drains the pipeline before every optimizer step.
        options: builder options it accepts, e.g. ``("vertical_sync",)``.
        option_defaults: the value of every option when not given.
        version_rule: one line: which weight version F and B use.
        summary: one line for help texts and tables.
        builder: ``builder(replicas, microbatches, steps, **options)``, compute only.
        one_stage: runs one stage on all its replicas (dp: ``replicas=[N]``).
        replicates: stages may have more than one replica (interleaved: no).
        splits_backward: the backward is split into ``I`` and ``W`` (zerobubble).
        chunks_option: the option giving model stages per rank (interleaved:
            ``"virtual_stages"``), else ``None`` (one model stage per rank stage).
        memory_rule: the planner's memory rule (:mod:`pipetrain.plan.stage_memory`):
            ``"stash"`` (a weight copy per minibatch in flight), ``"two_versions"``,
            ``"one_f_one_b"`` (``min(m, depth)`` microbatches in flight), ``"all_forwards"``
            (all ``m`` in flight); ``None`` where the planner has none (dp is one stage;
            interleaved cuts ``virtual_stages`` stages per rank; ZB-H1's deferred ``W`` holds
            more than 1F1B).
        microbatch_rule: the schedule's own rule on ``(replicas per rank stage, microbatches)``
            beyond the common ones (2bw: multiples and depth; interleaved: groups of ``P``).
        auto: a candidate of the planner's automatic choice (``train --schedule auto``,
            :mod:`pipetrain.auto.choose`); gpipe (flush's time, more memory) and interleaved
            (no memory rule) are not.
    """

    name: str
    synchronous: bool
    unit: str
    flushes: bool
    options: tuple[str, ...]
    option_defaults: Mapping[str, Any]
    version_rule: str
    summary: str
    builder: Builder = field(repr=False, compare=False)
    one_stage: bool = False
    replicates: bool = True
    splits_backward: bool = False
    chunks_option: str | None = None
    memory_rule: str | None = None
    microbatch_rule: Callable[[Sequence[int], int], None] | None = field(default=None, repr=False, compare=False)
    auto: bool = False

    # -- options ----------------------------------------------------------------------
    def check_options(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """The options with defaults filled in; an unknown option or bad value raises ScheduleError.

        An option whose value is ``None`` counts as not given (so a CLI can pass every
        flag as it stands: ``{"virtual_stages": args.virtual_stages}``).
        """
        given = {k: v for k, v in options.items() if v is not None}
        unknown = sorted(set(given) - set(self.options))
        if unknown:
            raise ScheduleError(
                f"schedule {self.name!r} takes no option {', '.join(unknown)}; its options: "
                f"{', '.join(self.options) or 'none'}"
            )
        out = dict(self.option_defaults)
        for k, v in given.items():
            out[k] = _OPTION_CHECKS[k](v)
        return out

    def chunks_per_rank(self, options: Mapping[str, Any]) -> int:
        """Model stages every rank holds (``virtual_stages`` for interleaved, else 1)."""
        if self.chunks_option is None:
            return 1
        return int(self.check_options(options)[self.chunks_option])

    # -- stages and ranks -------------------------------------------------------------
    def model_stages(self, ranks_stages: int, options: Mapping[str, Any]) -> int:
        """Model stages a plan must cut for a pipeline ``ranks_stages`` ranks deep
        (``ranks_stages * virtual_stages`` for interleaved, else ``ranks_stages``)."""
        return ranks_stages * self.chunks_per_rank(options)

    def rank_replicas(self, model_replicas: Sequence[int], options: Mapping[str, Any]) -> list[int]:
        """Replicas per rank stage of a plan with these per-model-stage replicas.

        Equal to ``model_replicas`` except for interleaved (``[1]*(P*v) -> [1]*P``), whose
        shape rules are checked (all 1, a multiple of ``virtual_stages``, at least 2 ranks).
        """
        reps = check_replicas(model_replicas)
        v = self.chunks_per_rank(options)
        if self.chunks_option is not None:
            return [1] * interleaved_ranks(reps, v)
        if self.one_stage:
            check_one_stage(self.name, reps)
        return reps

    def ranks_needed(self, replicas: Sequence[int], options: Mapping[str, Any]) -> int:
        """Worker processes a plan with these per-model-stage ``replicas`` needs
        (the sum of replicas; ``len(replicas) // virtual_stages`` for interleaved)."""
        return sum(self.rank_replicas(replicas, options))

    # -- counts -----------------------------------------------------------------------
    def check_microbatches(self, microbatches: int, stages: int, replicas: Sequence[int] | None = None) -> None:
        """Raise ScheduleError unless ``microbatches`` suits a pipeline ``stages`` ranks deep.

        ``replicas`` (per rank stage, optional) adds the rules on replicated stages. Rules:
        every schedule needs an integer >= 1; pipedream (unit minibatch) needs exactly 1;
        microbatched schedules with replicated stages need one microbatch per replica;
        2bw needs ``>= stages`` (and multiples of replica counts); interleaved needs a
        multiple of ``stages`` (ranks).
        """
        m = microbatches
        if not _is_int(m) or m < 1:
            raise ScheduleError(f"microbatches must be an integer >= 1 (got {m!r}); use 1 or more")
        if self.unit == "minibatch":
            if m != 1:
                raise ScheduleError(
                    f"{self.name} moves whole minibatches (one unit per minibatch), so microbatches must be 1 "
                    f"(got {m}); pass the number of minibatches as steps, or use flush/2bw for microbatches"
                )
            return
        reps = list(replicas) if replicas is not None else [1] * stages
        rmax = max(reps, default=1)
        if m < rmax:
            raise ScheduleError(
                f"{self.name} routes the microbatches of a minibatch round-robin over a stage's replicas, so every "
                f"replica needs one: microbatches={m} < {rmax} replicas of a stage (replicas={reps}); "
                f"use microbatches >= {rmax}"
            )
        if self.microbatch_rule is not None:
            self.microbatch_rule(reps, m)

    def default_microbatches(self, stages: int, replicas: Sequence[int]) -> int:
        """The one default used by train, simulate, plan and the benchmarks.

        1 for unit ``minibatch``; otherwise the smallest ``m >= max(stages, max(replicas))``
        that :meth:`check_microbatches` accepts (``stages`` and ``replicas`` per rank stage),
        e.g. ``max(stages, max(replicas))`` rounded up to a multiple of every replica count
        for 2bw and of the ranks for interleaved.
        """
        if self.unit == "minibatch":
            return 1
        reps = list(replicas) or [1]
        start = max(stages, max(reps), 1)
        for m in range(start, start + _DEFAULT_SEARCH):
            try:
                self.check_microbatches(m, stages, reps)
            except ScheduleError:
                continue
            return m
        raise ScheduleError(  # not reached for valid replicas: lcm(replicas) * stages always passes
            f"{self.name}: no microbatch count in {start}..{start + _DEFAULT_SEARCH} suits stages={stages}, "
            f"replicas={reps}; pass microbatches explicitly")

    def steps_period(self, replicas: Sequence[int]) -> int:
        """Steps must be a multiple of this: ``lcm(replicas)`` for pipedream (a stage with ``r``
        replicas steps once per ``r`` minibatches), else 1."""
        return lcm(check_replicas(replicas)) if self.unit == "minibatch" else 1

    # -- building ---------------------------------------------------------------------
    def build(self, replicas: Sequence[int], microbatches: int = 1, steps: int = 1, **options: Any) -> Schedule:
        """The complete schedule (compute, transfers with peers, all-reduces, steps).

        Args:
            replicas: replica count per model stage, ranks laid out stage by stage
                (``[2,1,1]``); interleaved: ``[1] * (P * virtual_stages)``; dp: ``[N]``.
            microbatches: units per minibatch (1 for pipedream, whose unit is the minibatch).
            steps: minibatches (optimizer steps) the lists cover.
            options: see :attr:`options` (``None`` values count as not given).
        """
        opts = self.check_options(options)
        if not _is_int(microbatches) or microbatches < 1:
            raise ScheduleError(f"microbatches must be an integer >= 1 (got {microbatches!r}); use 1 or more")
        if not _is_int(steps) or steps < 1:
            raise ScheduleError(f"steps must be an integer >= 1 (got {steps!r}); use 1 or more")
        reps = self.rank_replicas(replicas, opts)
        self.check_microbatches(microbatches, len(reps), reps)
        return insert_comm(self.builder(list(replicas), microbatches, steps, **opts))


def _pipedream(replicas: Sequence[int], microbatches: int, steps: int, vertical_sync: bool = False,
               stashing: bool = True) -> Schedule:
    return build_pipedream(replicas, steps, vertical_sync=vertical_sync, stashing=stashing)


_SYNC_RULE = "every F and B of minibatch t use version t (the step after minibatch t makes t+1)"
_ONE_F_ONE_B = "one_f_one_b"

_SPECS: tuple[ScheduleSpec, ...] = (
    ScheduleSpec(
        "pipedream", synchronous=False, unit="minibatch", flushes=False,
        options=("vertical_sync", "stashing"),
        option_defaults=MappingProxyType({"vertical_sync": False, "stashing": True}),
        version_rule="F of minibatch u uses its stage's newest version when it runs; B uses the same, stashed "
                     "(vertical_sync: the version stage 0 used, mapped to each stage; stashing=False: B uses "
                     "the stage's newest version when it runs, recomputing the forward under it)",
        summary="PipeDream: asynchronous 1F1B on whole minibatches with weight stashing",
        builder=_pipedream, memory_rule="stash", auto=True),
    ScheduleSpec(
        "2bw", synchronous=False, unit="microbatch", flushes=False,
        options=(), option_defaults=MappingProxyType({}),
        version_rule="every F and B of minibatch t use version max(t-1, 0): two weight versions per stage",
        summary="PipeDream-2BW: 1F1B on microbatches without flushes, double-buffered weights",
        builder=build_twobw, memory_rule="two_versions", microbatch_rule=check_twobw_microbatches,
        auto=True),
    ScheduleSpec(
        "flush", synchronous=True, unit="microbatch", flushes=True,
        options=(), option_defaults=MappingProxyType({}), version_rule=_SYNC_RULE,
        summary="PipeDream-Flush: 1F1B within each minibatch, then a flush",
        builder=build_flush, memory_rule=_ONE_F_ONE_B, auto=True),
    ScheduleSpec(
        "gpipe", synchronous=True, unit="microbatch", flushes=True,
        options=(), option_defaults=MappingProxyType({}), version_rule=_SYNC_RULE,
        summary="GPipe: all forwards, then all backwards, then a flush",
        builder=build_gpipe, memory_rule="all_forwards"),
    ScheduleSpec(
        "dp", synchronous=True, unit="microbatch", flushes=True,
        options=(), option_defaults=MappingProxyType({}), version_rule=_SYNC_RULE,
        summary="data parallelism: one stage on N replicas, all-reduce before every step",
        builder=build_dp, one_stage=True, auto=True),
    ScheduleSpec(
        "interleaved", synchronous=True, unit="microbatch", flushes=True,
        options=("virtual_stages",), option_defaults=MappingProxyType({"virtual_stages": 2}),
        version_rule=_SYNC_RULE,
        summary="interleaved 1F1B (Megatron): virtual_stages model chunks per rank, then a flush",
        builder=build_interleaved, replicates=False, chunks_option="virtual_stages",
        microbatch_rule=lambda reps, m: check_interleaved_microbatches(len(reps), m)),
    ScheduleSpec(
        "zerobubble", synchronous=True, unit="microbatch", flushes=True,
        options=(), option_defaults=MappingProxyType({}), version_rule=_SYNC_RULE,
        summary="ZB-H1 zero bubble: 1F1B with the backward split into I and deferred W, then a flush",
        builder=build_zerobubble, splits_backward=True, auto=True),
)

#: name -> spec, in the order of :data:`SCHEDULE_NAMES`.
SCHEDULES: Mapping[str, ScheduleSpec] = MappingProxyType({s.name: s for s in _SPECS})

#: Every schedule name the registry knows.
SCHEDULE_NAMES: tuple[str, ...] = tuple(SCHEDULES)

#: Schedules that flush before every step (derived from the specs; kept for old callers).
FLUSHED_SCHEDULES = frozenset(s.name for s in _SPECS if s.flushes)


def get_schedule(name: str) -> ScheduleSpec:
    """The spec of schedule ``name``; an unknown name raises ScheduleError listing the valid ones."""
    try:
        return SCHEDULES[name]
    except (KeyError, TypeError):
        raise ScheduleError(f"unknown schedule {name!r}; valid names: {', '.join(SCHEDULE_NAMES)}") from None


def build_schedule(name: str, replicas: Sequence[int], microbatches: int = 1, steps: int = 1,
                   **options: Any) -> Schedule:
    """Build a complete schedule: ``get_schedule(name).build(replicas, microbatches, steps, **options)``.

    Args:
        name: one of :data:`SCHEDULE_NAMES`.
        replicas: replica count per stage, ranks laid out stage by stage (``[2,1,1]``).
            For ``interleaved``, one ``1`` per model chunk: ``P * virtual_stages`` entries.
            For ``dp``, ``[N]``.
        microbatches: units per minibatch (``1`` for ``pipedream``, whose unit is the minibatch).
        steps: minibatches (optimizer steps) the lists cover.
        options: ``vertical_sync`` and ``stashing`` (pipedream, defaults False and True),
            ``virtual_stages`` (interleaved, default 2).

    Example:
        >>> s = build_schedule("flush", [1, 1], microbatches=2)
        >>> [a.long for a in s.workers[1]]
        ['1RECV_F0<0', '1F0v0', '1B0v0', '1SEND_B0>0', '1RECV_F1<0', '1F1v0', '1B1v0', '1SEND_B1>0', '1STEP0']
    """
    return get_schedule(name).build(replicas, microbatches, steps, **options)
