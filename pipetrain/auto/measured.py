"""What the automatic choice measures, kept in the measurement cache between runs.

:func:`pipetrain.auto.choose.choose` measures four things before it predicts: the loopback
calibration (when no ``--calibration`` is given), one profile per unit size, each planned
stage's forward + backward as a whole, and each stage's optimizer step. All of them depend
only on the model, the settings and the machine, so :class:`AutoMeasurements` keeps them in
the :class:`~pipetrain.profile.cache.MeasurementCache` (kinds ``calibration``, ``profile``,
``stage-times``, ``optimizer-step`` and ``rehearsal``): a repeated ``train --schedule auto``
plans on them without profiling again (``--no-cache``: measure again). The plans made on
them are kept too (kind ``plan``, keyed by their inputs), so it does not solve again either.

A profile's key is the caller's model key (name and options), the captured graph's
fingerprint (:func:`~pipetrain.profile.cache.graph_fingerprint`: any change to the nodes,
their shapes or parameters is a miss), the unit size, the optimizer, the threads and the
repeats; stage times add the stages' node lists to it. Without a cache, or without a model
key (a library caller that cannot say what the model is), everything is measured.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..cluster.calibration import Calibration
    from ..graph.capture import CapturedModel
    from ..plan.api import PlanOptions
    from ..plan.types import Plan
    from ..profile.cache import MeasurementCache
    from ..profile.types import Profile
    from ..simulate.costs import MeasuredUnit

__all__ = ["AutoMeasurements", "STEP_TIMED", "REHEARSAL_TIMED"]


class AutoMeasurements:
    """The choice's measurements through ``cache`` (module docstring).

    Args:
        cache: the measurement cache, or None (measure everything).
        model: what identifies the model for the cache (e.g. ``{"model": "gpt", "options": {...}}``);
            None: nothing is cached but the calibration.
        settings: the other things the measurements depend on (optimizer, threads, repeats...).
    """

    def __init__(self, cache: MeasurementCache | None, model: Mapping[str, Any] | None,
                 settings: Mapping[str, Any]) -> None:
        self.cache = cache
        self.model = dict(model) if model is not None else None
        self.settings = dict(settings)
        self._plans: dict[str, Plan] = {}  # by key: a plan is solved once per choice, cache or not

    def calibration(self, workers: int, measure: Callable[[], Calibration]) -> Calibration:
        """The loopback calibration at ``workers`` ranks (measured by ``measure`` on a miss)."""
        from ..cluster.calibration import ALLREDUCE_TIMED, FIT_STATISTIC, Calibration

        if self.cache is None:
            return measure()
        # the compute probe's threads; the fits' statistic (a calibration fitted otherwise: measured again)
        key = {"ranks": workers, "threads": self.settings.get("threads"), "fit": FIT_STATISTIC,
               "allreduce": ALLREDUCE_TIMED}
        cal, _ = self.cache.fetch("calibration", key, measure, lambda c: c.to_dict(),
                                  lambda d: Calibration.from_dict(d, "the measurement cache"))
        return cal

    def profile_key(self, captured: CapturedModel, samples: int) -> dict[str, Any] | None:
        """The cache key of the profile of ``captured`` at ``samples`` samples (None: not cached)."""
        from ..profile.cache import graph_fingerprint

        if self.cache is None or self.model is None:
            return None
        return {"model": self.model, "graph": graph_fingerprint(captured.graph), "samples": samples, **self.settings}

    def profile(self, key: Mapping[str, Any] | None, make: Callable[[], Profile]) -> Profile:
        """The profile under ``key`` (``make()`` on a miss, or when ``key`` is None)."""
        from ..profile.cache import cached_profile

        if key is None or self.cache is None:
            return make()
        profile, _ = cached_profile(self.cache, key, make)
        return profile

    def stage_seconds(self, key: Mapping[str, Any] | None, stages: Sequence[Sequence[str]],
                      make: Callable[[], list[float]]) -> list[float]:
        """Seconds of ``stages`` as a whole, of the model whose profile key is ``key``."""
        if key is None or self.cache is None:
            return make()
        seconds, _ = self.cache.fetch("stage-times", {"profile": dict(key), "stages": [list(s) for s in stages]},
                                      make, list, _floats(len(stages)))
        return seconds

    def rehearsal(self, key: Mapping[str, Any] | None, what: Mapping[str, Any], stages: int,
                  make: Callable[[], list[MeasuredUnit]]) -> list[MeasuredUnit]:
        """Each of ``stages`` stages' compute as a candidate's workers run it (``make()`` on a
        miss), of the model whose profile key is ``key``; ``what``: the candidate (schedule,
        microbatches, stages, replicas) and the rehearsal's settings."""
        from ..simulate.costs import MeasuredUnit

        def measure() -> list[MeasuredUnit]:
            units = make()
            if len(units) != stages:
                raise ValueError(f"the rehearsal measured {len(units)} stages of the plan's {stages}")
            return units

        if key is None or self.cache is None:
            return measure()
        units, _ = self.cache.fetch("rehearsal", {"profile": dict(key), **what, "timed": REHEARSAL_TIMED}, measure,
                                    lambda us: [u.to_dict() for u in us],
                                    lambda v: [MeasuredUnit.from_dict(u) for u in _list(v, stages)])
        return units

    def plan(self, profile: Profile, workers: int, cal: Calibration, options: PlanOptions,
             make: Callable[[], Plan]) -> Plan:
        """The plan the dynamic program makes of ``profile`` on ``workers`` ranks at ``cal``'s
        costs under ``options`` (``make()`` on a miss). Not a measurement: a function of those
        inputs alone, kept because a choice solves about two programs per candidate, each
        0.3-0.5 s on a 400-node graph (a Hugging Face decoder of 6 layers: 20 solves, half
        of a repeated choice's 10 s). The key holds every input (the profile by a digest of
        its JSON), so a plan is reused only for the same profile, costs and options. Within
        one choice a plan is solved once for a key, with or without a cache; each call
        returns its own copy."""
        import copy
        from dataclasses import asdict

        from ..plan.types import Plan
        from ..profile.io import profile_to_dict

        digest = hashlib.sha256(json.dumps(profile_to_dict(profile), sort_keys=True).encode()).hexdigest()
        key = {"profile": digest, "workers": workers, "calibration": cal.to_dict(), "options": asdict(options)}
        known = json.dumps(key, sort_keys=True, default=str)
        if known not in self._plans:
            if self.cache is None or self.model is None:
                self._plans[known] = make()
            else:
                self._plans[known], _ = self.cache.fetch("plan", key, make, lambda p: p.to_dict(),
                                                         lambda d: Plan.from_dict(d, "the measurement cache"),
                                                         measured=False)
        return copy.deepcopy(self._plans[known])

    def step_seconds(self, shapes: Sequence[Sequence[int]], make: Callable[[], float]) -> float:
        """Seconds of one STEP over parameters of ``shapes`` (what :data:`STEP_TIMED` names)."""
        if self.cache is None:
            return make()
        value, _ = self.cache.fetch("optimizer-step", {"shapes": [list(s) for s in shapes], "timed": STEP_TIMED,
                                                       **self.settings},
                                    make, float, _float)
        return value


#: What a rehearsal times (part of its cache key): a cached rehearsal timed otherwise is run again.
REHEARSAL_TIMED = "F, B, I, W and STEP medians of each stage's units after its first minibatch, executor and hooks"

#: What one timed STEP holds (``auto.choose._StepTimer``), part of its cache key: a cached
#: time of a STEP timed otherwise is measured again.
STEP_TIMED = "mean, guard on gradients, optimizer, guard on weights (fused norms)"


def _float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
        raise ValueError(f"not a time: {v!r}")
    return float(v)


def _list(v: Any, n: int) -> list[Any]:
    if not isinstance(v, list) or len(v) != n:
        raise ValueError(f"not {n} entries: {v!r}")
    return v


def _floats(n: int) -> Callable[[Any], list[float]]:
    def load(v: Any) -> list[float]:
        if not isinstance(v, list) or len(v) != n:
            raise ValueError(f"not {n} times: {v!r}")
        return [_float(x) for x in v]

    return load
