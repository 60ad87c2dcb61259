"""The headline figures of one model (``--preset headline``): ceilings as bounds, ``auto``,
``dp``, zero-bubble, pipetrain against PyTorch, and the predictions' errors (see
docs/performance.md).

Every ratio is the median over rounds of per-round ratios (:func:`paired_ratio`), as for
the other headline figures.

Which ceiling bounds a configuration (:func:`bound_of`): the ceiling run at the same unit
size, i.e. the pipeline ceiling with ``m`` units of ``batch / m`` samples per stage
(``ceiling`` for whole-minibatch units: pipedream, ``ceiling_m{m}`` for ``m`` microbatches),
or for data parallelism (``ddp``, ``pipetrain_dp``, an ``auto`` that chose one stage) the
``ceiling_dp`` run; a configuration whose unit size no ceiling ran at is bounded by the best
pipeline ceiling over the unit sizes run.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from timing import Measurement, median_or_none

PIPELINE_SCHEDULES = ("pipedream", "2bw", "flush", "gpipe", "zerobubble", "interleaved")


def paired_ratio(runs: dict[str, list[Measurement]], a: str | None, b: str | None) -> float | None:
    """Median over rounds of samples/s(a) / samples/s(b), using rounds where both ran."""
    if a is None or b is None or a not in runs or b not in runs:
        return None
    ratios = [x.samples_per_second / y.samples_per_second  # type: ignore[operator]
              for x, y in zip(runs[a], runs[b])
              if x.samples_per_second and y.samples_per_second]
    return median_or_none(ratios)


def chosen_of(ms: list[Measurement]) -> dict[str, Any]:
    """What a pipetrain configuration trained (its last successful run's choice)."""
    for m in reversed(ms):
        if m.status == "ok" and m.extra.get("chosen"):
            return dict(m.extra["chosen"])
    return {}


def bound_of(cfg: Any, chosen: dict[str, Any], ran: set[str], best_ceiling: str | None) -> str | None:
    """The ceiling configuration that bounds ``cfg`` (module docstring); None for ``single``
    and the ceilings themselves."""
    from pipetrain.schedule import get_schedule

    if cfg.kind in ("single", "ceiling") or cfg.world != 2:
        return None
    if cfg.kind == "ddp":
        name = "ceiling_dp"
    elif cfg.kind == "torch_pipe":
        name = f"ceiling_m{cfg.microbatches}"
    else:
        sched = chosen.get("schedule") or cfg.schedule
        m = int(chosen.get("microbatches") or cfg.microbatches or 1)
        stages = chosen.get("stages")
        try:
            spec = get_schedule(sched)
        except Exception:  # noqa: BLE001 - unknown to this pipetrain: no unit size to match
            return best_ceiling
        if spec.one_stage or stages == 1:
            name = "ceiling_dp"
        else:
            units = 1 if spec.unit == "minibatch" else m
            name = "ceiling" if units == 1 else f"ceiling_m{units}"
    return name if name in ran else best_ceiling


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    """``|predicted - measured| / measured``."""
    if predicted is None or not measured:
        return None
    return abs(predicted - measured) / measured


def memory_error(predicted: Iterable[float] | None, measured: Iterable[float] | None) -> float | None:
    """The largest relative error of a per-worker memory prediction."""
    if not predicted or not measured:
        return None
    errs = [abs(p - m) / m for p, m in zip(predicted, measured) if m and m > 0]
    return max(errs) if errs else None


def best_of(names: Iterable[str], medians: dict[str, float | None]) -> str | None:
    """The name with the highest median samples/s."""
    ok = [n for n in names if medians.get(n)]
    return max(ok, key=lambda n: medians[n] or 0.0) if ok else None


def headline_fields(runs: dict[str, list[Measurement]], cfgs: list[Any], medians: dict[str, float | None],
                   configs: dict[str, dict[str, Any]], microbatches: list[int], prim: int,
                   torch_best: str | None, steady: dict[str, list[Measurement]] | None = None) -> dict[str, Any]:
    """The per-model headline figures; also writes each configuration's ``ceiling``,
    ``vs_ceiling`` into ``configs``. ``steady``: the runs with pipetrain's steady-state rates
    (its one fill and drain per run left out; PyTorch's as measured)."""
    by_name = {c.name: c for c in cfgs}
    ran = {c.name for c in cfgs if c.kind == "ceiling" and medians.get(c.name)}
    pipeline_ceilings = [n for n in ran if n != "ceiling_dp"]
    best_ceiling = best_of(pipeline_ceilings, medians)
    worst = None
    for name, c in configs.items():
        cfg = by_name[name]
        bound = bound_of(cfg, chosen_of(runs.get(name, [])), ran, best_ceiling)
        c["ceiling"] = bound
        c["vs_ceiling"] = paired_ratio(runs, name, bound)
        if c["vs_ceiling"] is not None and (worst is None or c["vs_ceiling"] > configs[worst]["vs_ceiling"]):
            worst = name
    trained = [c.name for c in cfgs if c.kind != "ceiling" and c.name != "pipetrain_auto"]
    best = best_of(trained, medians)
    auto = configs.get("pipetrain_auto", {})
    pipelines = [c.name for c in cfgs if c.kind == "pipetrain" and c.schedule in PIPELINE_SCHEDULES]
    best_pipe = best_of(pipelines, medians)
    mem_errors = {n: c.get("memory_prediction_error") for n, c in configs.items()
                  if by_name[n].kind == "pipetrain" and c.get("memory_prediction_error") is not None}
    zb = {str(m): paired_ratio(runs, f"pipetrain_zerobubble_m{m}", f"pipetrain_flush_m{m}") for m in microbatches}
    zb_pred = {}
    for m in microbatches:
        f = configs.get(f"pipetrain_flush_m{m}", {}).get("predicted_time_per_minibatch_s")
        z = configs.get(f"pipetrain_zerobubble_m{m}", {}).get("predicted_time_per_minibatch_s")
        zb_pred[str(m)] = f / z if f and z else None
    return {
        "auto_vs_best": paired_ratio(runs, "pipetrain_auto", best),
        "auto_best_other": best,
        "auto_chosen": {k: v for k, v in chosen_of(runs.get("pipetrain_auto", [])).items() if k != "plan"},
        "auto_prediction_error": auto.get("prediction_error"),
        "auto_prediction_source": auto.get("prediction_source"),
        "dp_vs_ddp": paired_ratio(runs, "pipetrain_dp", "ddp"),
        "zerobubble_vs_flush": zb.get(str(prim)),
        "zerobubble_vs_flush_by_m": zb,
        "zerobubble_vs_flush_predicted_by_m": zb_pred,
        "pipetrain_best_pipeline": best_pipe,
        "pipetrain_best_pipeline_vs_torch_best": paired_ratio(runs, best_pipe, torch_best),
        "pipetrain_best_pipeline_steady_vs_torch_best": paired_ratio(steady, best_pipe, torch_best)
        if steady is not None else None,
        "max_vs_ceiling": configs[worst]["vs_ceiling"] if worst else None,
        "max_vs_ceiling_config": worst,
        "ceiling_best": best_ceiling,
        "memory_prediction_error": max(mem_errors.values()) if mem_errors else None,
        "memory_prediction_error_by_config": mem_errors,
        "time_prediction_error_by_config": {n: c.get("prediction_error") for n, c in configs.items()
                                            if by_name[n].kind == "pipetrain"},
    }
