"""Throughput of pipetrain's schedules against PyTorch baselines, measured side by side.

    python benchmarks/run.py [--json] [--rounds R] [--steps S] [--models mlp,lm] [--quick]

Every configuration of every model runs once per round, in an order rotated each round, and
the figures are medians over rounds: on a shared, noisy machine a configuration measured in
the same minutes as the others is the only fair comparison, and the medians of paired
per-round ratios cancel slow drifts of the machine's load. Each configuration is a fresh
process tree (one process per worker, ``torch.set_num_threads(1)``, gloo on 127.0.0.1 with
a free port, a deadline after which it is killed); warm-up steps are excluded and ``S``
timed steps give samples/s = batch * S / (timed wall time of the slowest worker). Every
framework's 2-stage pipelines share one cut: by default the one that balances the per-layer
forward+backward times measured before round 1 (``--split layers``: equal layer counts).

Configurations (per model; ``m`` = microbatches, default 2, 4, 8):
  single                 the whole model in one process
  ceiling, ceiling_m{m}  2 processes, each trains only its stage alone (no communication), on
                         the whole batch / in m units of batch/m: the bound of the pipelines
                         with that unit size
  ceiling_dp             2 processes, each trains the whole model on half the batch alone:
                         the bound of ddp and pipetrain_dp
  torch_gpipe_m{m}       torch.distributed.pipelining ScheduleGPipe, 2 stages
  torch_1f1b_m{m}        torch.distributed.pipelining Schedule1F1B, 2 stages
  ddp                    DistributedDataParallel, 2 processes, half the batch each
  pipetrain_dp           pipetrain's data parallelism (--schedule dp --config 2, m=2)
  pipetrain_auto         pipetrain train --workers 2 --schedule auto: the planner's choice
  pipetrain_pipedream    pipetrain 1F1B + weight stashing, 2 workers (config 1-1)
  pipetrain_2bw_m{m}, pipetrain_flush_m{m}, pipetrain_gpipe_m{m}, pipetrain_zerobubble_m{m}
                         pipetrain, 2 workers
  (--four-workers adds *_w4 variants on 4 workers: 4 stages on this 2-core machine)

The headline measurement (both models, 3 interleaved rounds, about 20 minutes on 2 quiet
cores): ``python benchmarks/run.py --preset headline --json > bench.json``.

See docs/performance.md for the method and how to read the figures.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from baselines import pipetrain_cli
from bench_models import BATCH_SIZES, balanced_cuts, build_bench_model, child_times, split_point
from headline import headline_fields, memory_error, paired_ratio
from predict_memory import measured_tensor_peak
from predict_time import RoundPredictions, cli_prediction, measured_time, paired_error
from processes import free_port, run_group
from rss import release_memory
from timing import Measurement, median_or_none


@dataclass(frozen=True)
class Config:
    """One configuration: how many workers, which runner, which schedule."""

    name: str
    kind: str  # single | ceiling | torch_pipe | ddp | pipetrain
    world: int
    schedule: str = ""
    microbatches: int = 1
    pipetrain_config: str = ""  # pipetrain's --config (replicas per stage, e.g. 1-1)


#: ``Config.schedule`` of the configuration that leaves every choice to pipetrain.
AUTO = "auto"


def build_configs(microbatches: list[int], four_workers: bool, quick: bool = False) -> list[Config]:
    """The configurations of one model, in their round-1 order (``quick``: without 2bw)."""
    cfgs = [Config("single", "single", 1), Config("ceiling", "ceiling", 2)]
    cfgs += [Config(f"ceiling_m{m}", "ceiling", 2, "", m) for m in microbatches]
    cfgs.append(Config("ceiling_dp", "ceiling", 2, "dp", 1))
    for m in microbatches:
        cfgs += [Config(f"torch_gpipe_m{m}", "torch_pipe", 2, "gpipe", m),
                 Config(f"torch_1f1b_m{m}", "torch_pipe", 2, "1f1b", m)]
    cfgs.append(Config("ddp", "ddp", 2))
    cfgs.append(Config("pipetrain_dp", "pipetrain", 2, "dp", 2, "2"))
    cfgs.append(Config("pipetrain_auto", "pipetrain", 2, AUTO, 0))
    cfgs.append(Config("pipetrain_pipedream", "pipetrain", 2, "pipedream", 1, "1-1"))
    for m in microbatches:
        for sched in (("flush", "gpipe", "zerobubble") if quick else ("2bw", "flush", "gpipe", "zerobubble")):
            cfgs.append(Config(f"pipetrain_{sched}_m{m}", "pipetrain", 2, sched, m, "1-1"))
    if four_workers:
        m4 = max([m for m in microbatches if m >= 4] or [4])
        cfgs += [Config("ceiling_w4", "ceiling", 4),
                 Config("pipetrain_pipedream_w4", "pipetrain", 4, "pipedream", 1, "1-1-1-1"),
                 Config(f"pipetrain_2bw_m{m4}_w4", "pipetrain", 4, "2bw", m4, "1-1-1-1"),
                 Config(f"pipetrain_flush_m{m4}_w4", "pipetrain", 4, "flush", m4, "1-1-1-1"),
                 Config(f"pipetrain_gpipe_m{m4}_w4", "pipetrain", 4, "gpipe", m4, "1-1-1-1")]
    return cfgs


def log(msg: str) -> None:
    """Progress on stderr (stdout carries the table or the JSON object)."""
    sys.stderr.write(msg + "\n")
    sys.stderr.flush()


# --------------------------------------------------------------------------- measuring
def measure_harness(cfg: Config, model: str, args: argparse.Namespace,
                    cuts: list[int] | None) -> Measurement:
    """Launch the ``cfg.world`` harness workers of ``cfg`` at once and combine their results."""
    steps = args.steps_for[model]
    for attempt in range(2):  # a second try only when the port was taken in between
        port = free_port()
        specs = [dict(kind=cfg.kind, model=model, rank=r, world=cfg.world, port=port,
                      steps=steps, warmup=args.warmup, seed=args.seed, cuts=cuts,
                      schedule=cfg.schedule, microbatches=cfg.microbatches,
                      timeout_s=args.timeout) for r in range(cfg.world)]
        cmds = [[sys.executable, os.path.abspath(__file__), "_worker", json.dumps(s)] for s in specs]
        results = run_group(cmds, args.timeout)
        payloads = [r.result_json() for r in results]
        if all(r.returncode == 0 for r in results) and all(p is not None for p in payloads):
            break
        errors = [r.error_line() for r in results if r.returncode != 0 or r.timed_out]
        if attempt == 0 and any("address already in use" in e.lower() for e in errors):
            continue
        # The first rank that failed by itself (the others were killed after it).
        first = next((r for r in results if r.returncode not in (0, None)), None) or results[0]
        return Measurement(None, "failed", first.error_line(), [r.peak_rss_mib for r in results])
    elapsed = max(p["elapsed_s"] for p in payloads)  # type: ignore[index]
    batch = payloads[0]["batch_size"]  # type: ignore[index]
    extra: dict[str, Any] = {
        "loss": payloads[-1]["loss"],  # type: ignore[index]
        "step_time_s": [statistics.median(p["step_times"]) for p in payloads],  # type: ignore[index]
        "rss_import_mib": [p["rss_import_mib"] for p in payloads],  # type: ignore[index]
        "rss_setup_mib": [p.get("rss_setup_mib") for p in payloads],  # type: ignore[union-attr]
        "peak_reset": all(p.get("peak_reset") for p in payloads),  # type: ignore[union-attr]
    }
    if "trained" in payloads[0]:  # type: ignore[operator]
        extra["trained_per_worker"] = [p.get("trained") for p in payloads]  # type: ignore[union-attr]
    if "static_stage" in payloads[0]:  # type: ignore[operator]
        extra["static_stage"] = all(p["static_stage"] for p in payloads)  # type: ignore[index]
    return Measurement(batch * steps / elapsed, "ok", "",
                       [p["rss_peak_mib"] for p in payloads], extra)  # type: ignore[index]


def measure(cfg: Config, model: str, facts: ModelFacts, args: argparse.Namespace) -> Measurement:
    """One run of ``cfg`` on ``model``."""
    if cfg.kind != "pipetrain":
        return measure_harness(cfg, model, args, facts.cuts.get(cfg.world) if cfg.kind != "ddp" else None)
    auto = cfg.schedule == AUTO
    one_stage = cfg.pipetrain_config.isdigit()  # dp: one stage on every worker, nothing to cut
    return pipetrain_cli.run_pipetrain(
        args.pipetrain, facts.pipetrain_spec, None if auto else cfg.schedule, cfg.world,
        cfg.pipetrain_config or None, BATCH_SIZES[model], cfg.microbatches, args.steps_for[model], args.warmup,
        # auto profiles and plans before it trains (outside its timed window): a longer deadline
        args.seed, args.timeout * (2 if auto else 1), None if auto or one_stage else facts.cut_names.get(cfg.world))


# --------------------------------------------------------------------------- summarising
def summarise(model: str, runs: dict[str, list[Measurement]], cfgs: list[Config],
              microbatches: list[int], facts: ModelFacts) -> dict[str, Any]:
    """The per-model JSON object: headline ratios, raw medians and every configuration."""
    configs: dict[str, Any] = {}
    medians: dict[str, float | None] = {}
    for cfg in cfgs:
        ms = runs.get(cfg.name, [])
        ok = [m.samples_per_second for m in ms if m.samples_per_second]
        med = median_or_none(ok)  # type: ignore[arg-type]
        medians[cfg.name] = med
        failures = [m for m in ms if m.status != "ok"]
        status = "ok" if ok else (failures[-1].status if failures else "not run")
        good = [m for m in ms if m.status == "ok"] or ms  # memory of failed runs only if none ran
        rss = [max(col) for col in zip(*[m.peak_rss_mib for m in good if m.peak_rss_mib])]
        base = next((m.extra.get("rss_import_mib") for m in reversed(good) if m.extra.get("rss_import_mib")), None)
        # Training-phase growth: peak (counted from the set-up point) minus RSS at that point.
        # Harness workers and pipetrain (since --cut/VmHWM reset) both report it the same way.
        above_setup = [max(col) for col in zip(*[
            [p - b for p, b in zip(m.peak_rss_mib, m.extra["rss_setup_mib"])]
            for m in good if m.peak_rss_mib and isinstance(m.extra.get("rss_setup_mib"), list)
            and all(isinstance(b, (int, float)) for b in m.extra["rss_setup_mib"])
            and len(m.extra["rss_setup_mib"]) == len(m.peak_rss_mib)])] or None
        configs[cfg.name] = {
            "workers": cfg.world, "schedule": cfg.schedule or cfg.kind,
            "microbatches": cfg.microbatches, "status": status,
            "samples_per_second_median": med,
            "samples_per_second_min": min(ok) if ok else None,
            "samples_per_second_max": max(ok) if ok else None,
            "samples_per_second_rounds": [m.samples_per_second for m in ms],
            "samples_per_second_steady_rounds": [m.extra.get("samples_per_second_steady") for m in ms]
            if cfg.kind == "pipetrain" else None,
            "ratio_vs_single": paired_ratio(runs, cfg.name, "single"),
            "peak_rss_mib_per_worker": rss,
            "rss_after_import_mib_per_worker": base,
            "peak_above_import_mib_per_worker": [r - b for r, b in zip(rss, base)] if base else None,
            "peak_above_setup_mib_per_worker": above_setup,
            "predicted_peak_mib_per_worker": facts.predicted.get(cfg.name),
            "errors": sorted({m.error for m in failures if m.error}),
            "details": ms[-1].extra if ms else {},
        }
        if cfg.kind == "pipetrain":
            configs[cfg.name].update(_predictions(cfg, ms, facts, above_setup))
    prim = 4 if 4 in microbatches else max(microbatches)
    steady = {name: [Measurement(m.extra.get("samples_per_second_steady") or None, m.status, m.error,
                                        m.peak_rss_mib, m.extra) for m in ms]
              for name, ms in runs.items() if name.startswith("pipetrain_")}
    steady.update({name: ms for name, ms in runs.items() if not name.startswith("pipetrain_")})
    torch_names = [c.name for c in cfgs if c.kind == "torch_pipe" and medians.get(c.name)]
    best = max(torch_names, key=lambda n: medians[n] or 0.0) if torch_names else None
    out: dict[str, Any] = {
        "pipetrain_pipedream_vs_single": paired_ratio(runs, "pipetrain_pipedream", "single"),
        "pipetrain_pipedream_vs_ceiling": paired_ratio(runs, "pipetrain_pipedream", "ceiling"),
        "pipetrain_flush_vs_torch_1f1b": paired_ratio(runs, f"pipetrain_flush_m{prim}", f"torch_1f1b_m{prim}"),
        "pipetrain_gpipe_vs_torch_gpipe": paired_ratio(runs, f"pipetrain_gpipe_m{prim}", f"torch_gpipe_m{prim}"),
        "pipetrain_pipedream_vs_torch_best": paired_ratio(runs, "pipetrain_pipedream", best) if best else None,
        # The same ratios for pipetrain's steady-state rate (between its first and last timed
        # STEP: the pipeline's one-time fill and drain left out, see docs/performance.md).
        "pipetrain_pipedream_steady_vs_single": paired_ratio(steady, "pipetrain_pipedream", "single"),
        "pipetrain_pipedream_steady_vs_ceiling": paired_ratio(steady, "pipetrain_pipedream", "ceiling"),
        "pipetrain_pipedream_steady_vs_torch_best": paired_ratio(steady, "pipetrain_pipedream", best) if best else None,
        "ceiling_vs_single": paired_ratio(runs, "ceiling", "single"),
        "ddp_vs_single": paired_ratio(runs, "ddp", "single"),
        "torch_best_vs_single": paired_ratio(runs, best, "single") if best else None,
        "torch_best": best,
        "compared_at_microbatches": prim,
        "pipetrain_flush_vs_torch_1f1b_by_m": {
            str(m): paired_ratio(runs, f"pipetrain_flush_m{m}", f"torch_1f1b_m{m}") for m in microbatches},
        "pipetrain_gpipe_vs_torch_gpipe_by_m": {
            str(m): paired_ratio(runs, f"pipetrain_gpipe_m{m}", f"torch_gpipe_m{m}") for m in microbatches},
        "medians": medians,
        "configs": configs,
    }
    out.update(headline_fields(runs, cfgs, medians, configs, microbatches, prim, best, steady))
    out["model"] = facts.report
    return out


def _predictions(cfg: Config, ms: list[Measurement], facts: ModelFacts,
                 measured_mib: list[float] | None) -> dict[str, Any]:
    """A pipetrain configuration's predicted and measured time per minibatch and memory."""
    ok = [m for m in ms if m.status == "ok"]
    batch = facts.report["batch_size"]
    times = [measured_time(m.extra, m.samples_per_second, batch) if m.status == "ok" else None for m in ms]
    measured = median_or_none([t for t in times if t])
    # Each round's prediction was made right after that round's run (predict_round): the
    # error is the median of the rounds' predicted / measured, as the other ratios are paired.
    sims = facts.time_predicted.get(cfg.name, [])
    rounds = [s["time_per_minibatch_s"] if s else None for s in sims]
    predicted = median_or_none([p for p in rounds if p])
    sim = next((s for s in reversed(sims) if s), None)
    source = sim.get("source", "benchmark simulator (measured profile at the unit size)") if sim else None
    # Memory (docs/performance.md, "Memory"): the tensor peak each worker measured
    # (``tensor_peak_mib`` of pipetrain's --json) against predict_memory.py's prediction of the
    # same accounting for the run's own plan and schedule. Runs without a tensor peak
    # fall back to the peak RSS (above the post-import RSS, else above the set-up RSS) and the
    # harness's simulation (baselines/predict.py).
    mem_pred = facts.memory_predicted.get(cfg.name)
    pred_src = "predict_memory.py (profile with saved bytes, the run's plan and schedule)" if mem_pred else None
    if mem_pred is None:
        mem_pred, pred_src = facts.predicted.get(cfg.name), "baselines/predict.py (harness cut)"
    mem_meas, mem_src = measured_mib, "peak RSS above set-up"
    mem_run = facts.memory_runs.get(cfg.name)
    for m in ([mem_run] if mem_run is not None and mem_run.status == "ok" else []) + list(reversed(ok)):
        tensor = measured_tensor_peak(m.extra)
        if tensor is not None:
            mem_meas, mem_src = tensor, ("pipetrain --json tensor_peak_mib (its --measure-memory run)"
                                         if m is mem_run else "pipetrain --json tensor_peak_mib")
            break
        base = m.extra.get("rss_import_mib")
        if isinstance(base, list) and len(base) == len(m.peak_rss_mib):
            mem_meas, mem_src = [p - b for p, b in zip(m.peak_rss_mib, base)], "peak RSS above post-import RSS"
            break
    return {"predicted_time_per_minibatch_s": predicted, "measured_time_per_minibatch_s": measured,
            "predicted_time_per_minibatch_s_rounds": rounds, "measured_time_per_minibatch_s_rounds": times,
            "prediction_error": paired_error(rounds, times), "prediction_source": source,
            "simulation": sim, "memory_predicted_mib_per_worker": mem_pred,
            "memory_measured_mib_per_worker": mem_meas, "memory_measured_source": mem_src,
            "memory_predicted_source": pred_src,
            "tensor_peak_by_kind_per_worker": next((m.extra.get("tensor_peak_by_kind") for m in reversed(ok)
                                                    if m.extra.get("tensor_peak_by_kind")), None),
            "memory_prediction_error": memory_error(mem_pred, mem_meas)}


def fmt(x: float | None, spec: str = ".1f") -> str:
    """A number, or ``-`` for none."""
    return "-" if x is None else format(x, spec)


def print_table(report: dict[str, Any]) -> None:
    """The human-readable form: one table per model, then the headline ratios."""
    meta = report["meta"]
    steps = ", ".join(f"{k} {v}" for k, v in meta["steps"].items())
    print(f"pipetrain benchmark: {meta['rounds']} round(s), timed steps per run: {steps} "
          f"(+{meta['warmup']} warm-up), torch {meta['torch']}, {meta['cpu_count']} CPUs, "
          f"load {meta['loadavg_start'][0]:.2f} -> {meta['loadavg_end'][0]:.2f}, {meta['wall_s']:.0f} s")
    for model in meta["models"]:
        r = report[model]
        m = r.get("model", {})
        print(f"\n{model}: batch {m.get('batch_size')}, {m.get('num_parameters', 0) / 1e6:.1f} M parameters "
              f"(pipetrain.models {m.get('pipetrain_model_spec')}), {m.get('split')} split: stages begin at children "
              f"{m.get('stage_cuts', {}).get('2')} of {m.get('children')}")
        print(f"  {'config':<26}{'samples/s':>11}{'min-max':>17}{'vs single':>11}{'vs ceil':>9}"
              f"{'pred/meas ms':>15}{'mem MiB/worker':>18}{'tensor MiB pred|meas':>24}  status")
        for name, c in r["configs"].items():
            rng = (f"{fmt(c['samples_per_second_min'])}-{fmt(c['samples_per_second_max'])}"
                   if c["samples_per_second_min"] is not None else "-")
            above = c["peak_above_setup_mib_per_worker"]
            rss = ("/".join(f"{x:.0f}" for x in above) if above else
                   "/".join(f"{x:.0f}" for x in c["peak_rss_mib_per_worker"]) + "*"
                   if c["peak_rss_mib_per_worker"] else "-")
            sim = "/".join(f"{x:.0f}" for x in (c.get("memory_predicted_mib_per_worker")
                                                  or c["predicted_peak_mib_per_worker"] or [])) or "-"
            if str(c.get("memory_measured_source", "")).endswith("tensor_peak_mib"):
                sim += "|" + "/".join(f"{x:.0f}" for x in c["memory_measured_mib_per_worker"])
            pt, mt = c.get("predicted_time_per_minibatch_s"), c.get("measured_time_per_minibatch_s")
            times = f"{fmt(pt and pt * 1e3, '.0f')}/{fmt(mt and mt * 1e3, '.0f')}" if pt or mt else "-"
            err = (c["errors"] or [""])[0]
            why = "ok" if c["status"] == "ok" else f"{c['status']}: {err[:90]}"
            print(f"  {name:<26}{fmt(c['samples_per_second_median']):>11}{rng:>17}"
                  f"{fmt(c['ratio_vs_single'], '.2f'):>11}{fmt(c.get('vs_ceiling'), '.2f'):>9}{times:>15}"
                  f"{rss:>18}{sim:>24}  {why}")
        print("  mem: peak RSS of each worker's training phase above its RSS once set up (stage built, peak reset)"
              " (* = absolute peaks, when a run\n       reports no set-up RSS); tensor: predicted | measured peak"
              " of the tensors held (predict_memory.py | pipetrain's\n       tensor_peak_mib; docs/performance.md"
              " \"Memory\")\n  vs ceil: against the ceiling at the same unit"
              " size (docs/performance.md); pred/meas ms: simulated / measured steady time per minibatch")
        print("  ratios (median of per-round ratios):")
        for key in ("ceiling_vs_single", "ddp_vs_single", "torch_best_vs_single",
                    "pipetrain_pipedream_vs_single", "pipetrain_pipedream_vs_ceiling",
                    "pipetrain_pipedream_vs_torch_best", "pipetrain_pipedream_steady_vs_ceiling",
                    "pipetrain_pipedream_steady_vs_torch_best", "pipetrain_flush_vs_torch_1f1b",
                    "pipetrain_gpipe_vs_torch_gpipe"):
            note = ""
            if key.endswith("torch_best") or key == "torch_best_vs_single":
                note = f" (torch best: {r['torch_best']})"
            elif key.startswith("pipetrain_flush") or key.startswith("pipetrain_gpipe"):
                note = f" (m={r['compared_at_microbatches']})"
            print(f"    {key:<36}{fmt(r[key], '.2f'):>6}{note}")
        print("  headline:")
        zb_predicted = r["zerobubble_vs_flush_predicted_by_m"]
        notes = {"auto_vs_best": f" (auto chose {r.get('auto_chosen')}; best other: {r.get('auto_best_other')})",
                 "pipetrain_best_pipeline_vs_torch_best": f" ({r.get('pipetrain_best_pipeline')} vs {r['torch_best']})",
                 "max_vs_ceiling": f" ({r.get('max_vs_ceiling_config')})",
                 "zerobubble_vs_flush": f" (m={r['compared_at_microbatches']}; simulator says "
                                        f"{fmt(zb_predicted.get(str(r['compared_at_microbatches'])), '.2f')})"}
        for key in ("auto_vs_best", "auto_prediction_error", "dp_vs_ddp", "zerobubble_vs_flush",
                    "pipetrain_best_pipeline_vs_torch_best", "pipetrain_best_pipeline_steady_vs_torch_best",
                    "max_vs_ceiling", "memory_prediction_error"):
            print(f"    {key:<44}{fmt(r.get(key), '.2f'):>6}{notes.get(key, '')}")


# --------------------------------------------------------------------------- main
#: Named measurements (``--preset``). headline: both models, 3 interleaved rounds, every
#: framework on the balanced cut (per-layer times measured before round 1); PyTorch at m = 2, 4,
#: 8 (1F1B not at 8: slower than at 4 on both models), pipetrain's
#: pipelines at m = 4 (flush and zerobubble also at 8), ceilings at the unit sizes of 1, 4 and 8
#: (m = 2 is held to the best of them): 19 configurations per model.
PRESETS: dict[str, dict[str, Any]] = {
    "headline": {"rounds": 3, "microbatches": "2,4,8", "split": "balanced", "warmup": 2,
                "skip": "pipetrain_*_m2,ceiling_m2,torch_1f1b_m8,pipetrain_2bw_m8,pipetrain_gpipe_m*"},
}
#: Timed steps per model of a preset (``--steps`` overrides). Even counts: a replicated
#: pipedream plan (what ``auto`` may choose) needs steps and warm-up steps that are multiples
#: of its replica counts. The ``lm`` runs 12: an asynchronous pipeline (pipedream, 2bw) fills
#: and drains once per run, not per minibatch, and at 6 steps that one fill and drain (about
#: one microbatch's forward and backward, 230 ms of 4.6 s for 2bw m=4) cost it 5% of the
#: window; a synchronous schedule's per-minibatch flush is in every step at any count.
PRESET_STEPS: dict[str, dict[str, int]] = {"headline": {"mlp": 20, "lm": 12}}
#: The cut every framework's pipelines share. A pipeline runs at the pace of its slowest
#: stage, so on an unbalanced cut every schedule is bound by the heavy stage and the ratios
#: between schedules measure the cut more than the schedules (docs/performance.md, "Stage
#: balance"). Balanced is the cut a planner makes: PipeDream balances its stages (SOSP'19,
#: section 3.1); ``--split layers`` keeps equal layer counts.
DEFAULT_SPLIT = "balanced"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--rounds", type=int, default=None, help="rounds of every configuration (default 5; --quick 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default: mlp 20, lm 5; --quick: 3, 1)")
    p.add_argument("--warmup", type=int, default=None, help="untimed warm-up steps per run (default 3; --quick 1)")
    p.add_argument("--models", default="mlp,lm", help="comma-separated: mlp, lm (default both)")
    p.add_argument("--microbatches", default=None,
                   help="comma-separated m for the microbatched schedules (default 2,4,8; --quick 4)")
    p.add_argument("--configs", default="*",
                   help="comma-separated glob patterns of configuration names to run (single is always run)")
    p.add_argument("--skip", default="", help="comma-separated glob patterns of configuration names to leave out")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="a named measurement; explicit options override it (headline: "
                        + ", ".join(f"--{k} {v}" for k, v in PRESETS["headline"].items()) + ")")
    p.add_argument("--four-workers", action="store_true", help="also run ceiling and pipetrain on 4 workers (4 stages)")
    p.add_argument("--split", choices=("layers", "balanced"), default=None,
                   help="stage cut every framework's pipelines share: the cut that balances forward+backward "
                        "time measured per layer before round 1 (default), or equal numbers of layers")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1 round, 3 timed steps (lm 1), 1 warm-up, m=4, no 2bw, no memory prediction "
                        "(under 2 minutes on a quiet machine)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds before a run's processes are killed (default 240; --quick 90)")
    p.add_argument("--seed", type=int, default=0, help="weights and data seed (same in every process)")
    p.add_argument("--pipetrain", default=pipetrain_cli.default_cli(),
                   help="the pipetrain command (default: next to this python)")
    a = p.parse_args(argv)
    for k, v in PRESETS.get(a.preset or "", {}).items():
        if getattr(a, k) in (None, "", "*"):
            setattr(a, k, v)
    q = a.quick
    full_steps = PRESET_STEPS.get(a.preset or "", {"mlp": 20, "lm": 5})
    a.split = a.split or DEFAULT_SPLIT
    a.rounds = a.rounds or (1 if q else 5)
    quick_steps = {"mlp": 3, "lm": 1}
    a.steps_for = {m: a.steps or (quick_steps if q else full_steps)[m] for m in BATCH_SIZES}
    a.warmup = a.warmup if a.warmup is not None else (1 if q else 3)
    a.timeout = a.timeout or (90.0 if q else 240.0)
    a.microbatches = [int(x) for x in (a.microbatches or ("4" if q else "2,4,8")).split(",")]
    a.models = [x.strip() for x in a.models.split(",") if x.strip()]
    for m in a.models:
        if m not in BATCH_SIZES:
            p.error(f"unknown model {m!r}; choose from {sorted(BATCH_SIZES)}")
    for m in a.microbatches:
        if m < 2 or any(b % m for b in BATCH_SIZES.values()):
            p.error(f"--microbatches {m}: each m must be >= 2 and divide the batch sizes "
                    f"{sorted(set(BATCH_SIZES.values()))}")
    if not os.path.exists(a.pipetrain):
        p.error(f"--pipetrain {a.pipetrain} does not exist; install the package (make install) or pass the CLI's path")
    if a.rounds < 1 or min(a.steps_for.values()) < 1 or a.warmup < 0:
        p.error("--rounds and --steps must be >= 1, --warmup >= 0")
    return a


@dataclass
class ModelFacts:
    """What the orchestrator keeps of a benchmark model (the model itself is dropped)."""

    pipetrain_spec: str  # pipetrain train --model
    cuts: dict[int, list[int]]  # worker count -> child indices where stages 1.. begin
    predicted: dict[str, list[float] | None]  # config -> simulator's peak MiB per worker
    report: dict[str, Any]  # the "model" entry of the JSON report
    cut_names: dict[int, list[str]] = field(default_factory=dict)  # worker count -> pipetrain --cut names
    # config -> each round's prediction (None where it has none), made right after that round's run
    time_predicted: dict[str, list[dict[str, Any] | None]] = field(default_factory=dict)
    memory_predicted: dict[str, list[float]] = field(default_factory=dict)   # config -> tensor peak MiB per worker
    memory_runs: dict[str, Measurement] = field(default_factory=dict)  # config -> its --measure-memory run


#: (steps, warm-up steps) of a 2-worker --measure-memory run: every schedule's tensor peak is
#: reached within 4 minibatches (pipedream's, its stashed versions at their most, in the 4th;
#: measured on the lm: the same peaks as 5 + 3 to 0.1 MiB, pipedream's 415 MiB after 3 in all).
MEMORY_STEPS = (3, 1)


def measure_memory_runs(model: str, cfgs: list[Config], runs: dict[str, list[Measurement]], facts: ModelFacts,
                        args: argparse.Namespace) -> None:
    """After the rounds: one more run of every pipetrain configuration, with ``--measure-memory``
    (the tensor ledger), for its measured tensor peak per worker. The timed rounds run without
    the ledger, whose hooks slow some schedules (measured on the lm: zerobubble m=4 by 40%,
    flush m=4 by 3.5%). ``auto`` is re-run on the plan, schedule and microbatches its timed
    runs chose (``--plan``), so that the memory measured is that configuration's. On 2
    workers these runs are :data:`MEMORY_STEPS` long: the peak is reached by then."""
    from headline import chosen_of

    for cfg in cfgs:
        if cfg.kind != "pipetrain":
            continue
        chosen = chosen_of(runs.get(cfg.name, []))
        if not chosen:
            continue
        one_stage = cfg.pipetrain_config.isdigit()
        schedule, m, config = cfg.schedule, cfg.microbatches, cfg.pipetrain_config or None
        cut = None if one_stage else facts.cut_names.get(cfg.world)
        plan_path = None
        if cfg.schedule == AUTO:
            schedule, m, config, cut = chosen["schedule"], int(chosen["microbatches"] or 1), None, None
            plan_path = Path(tempfile.mkdtemp(prefix="pt-bench-")) / "plan.json"
            plan_path.write_text(json.dumps(chosen["plan"]))
        t = time.monotonic()
        steps, warmup = args.steps_for[model], args.warmup
        if cfg.world == 2:
            steps, warmup = min(steps, MEMORY_STEPS[0]), min(warmup, MEMORY_STEPS[1])
        got = pipetrain_cli.run_pipetrain(
            args.pipetrain, facts.pipetrain_spec, schedule, cfg.world, config, BATCH_SIZES[model], m,
            steps, warmup, args.seed, args.timeout, cut, measure_memory=True,
            plan=str(plan_path) if plan_path else None)
        facts.memory_runs[cfg.name] = got
        what = (f"tensor peak {measured_tensor_peak(got.extra)} MiB" if got.status == "ok"
                else f"{got.status}: {got.error}")
        log(f"[memory] {model:<4}{cfg.name:<26}{what}   ({time.monotonic() - t:.1f} s)")


def predict_round(model: str, cfg: Config, m: Measurement, facts: ModelFacts, predictions: RoundPredictions,
                  args: argparse.Namespace) -> str:
    """Right after a pipetrain run: its time per minibatch as predicted now, appended to
    ``facts.time_predicted`` (one entry per run, ``None`` for none). ``auto``'s is the figure
    its own launcher printed (``pipetrain train --json``), made right before it trained; any
    other run's, its plan and schedule rehearsed here (predict_time.py). A failed prediction
    is logged, never loses the measurement. Returns what to log."""
    got: dict[str, Any] | None = None
    chosen = m.extra.get("chosen") if m.status == "ok" else None
    t = time.monotonic()
    own = cli_prediction(m.extra) if cfg.schedule == AUTO and chosen else None
    if own is not None:
        got = {"time_per_minibatch_s": own, "source": "pipetrain train --json"}
    elif chosen:
        try:
            got = predictions.predict(model, dict(chosen), args.steps_for[model])
        except Exception as e:  # noqa: BLE001 - a prediction failure must not lose the measurement
            log(f"{model} {cfg.name}: no time prediction ({type(e).__name__}: {e})")
    facts.time_predicted.setdefault(cfg.name, []).append(got)
    measured = measured_time(m.extra, m.samples_per_second, BATCH_SIZES[model]) if m.status == "ok" else None
    if got is None or not measured:
        return ""
    p = got["time_per_minibatch_s"]
    return (f"; predicted {p * 1e3:.1f} ms, measured {measured * 1e3:.1f} ({p / measured - 1:+.0%};"
            f" {time.monotonic() - t:.1f} s)")


def predict_memory_runs(model: str, cfgs: list[Config], runs: dict[str, list[Measurement]], facts: ModelFacts,
                        args: argparse.Namespace) -> None:
    """After the last round, for every pipetrain run: the tensor peak per worker, predicted from
    a profile of the model with what autograd saves (predict_memory.py), for the run's own
    plan and schedule. A failed prediction is logged, never loses the measurements."""
    from headline import chosen_of
    from predict_memory import MemoryPredictor

    try:
        predictor = MemoryPredictor(build_bench_model(model, seed=args.seed), args.seed)
    except Exception as e:  # noqa: BLE001 - a prediction failure must not lose the measurements
        log(f"{model}: no memory predictions ({type(e).__name__}: {e})")
        return
    for cfg in cfgs:
        if cfg.kind != "pipetrain":
            continue
        chosen = chosen_of(runs.get(cfg.name, []))
        try:
            got = predictor.predict(chosen, args.steps_for[model]) if chosen else None
        except Exception as e:  # noqa: BLE001
            log(f"{model} {cfg.name}: no memory prediction ({type(e).__name__}: {e})")
            got = None
        if got is not None:
            facts.memory_predicted[cfg.name] = got
    del predictor
    release_memory()


def prepare_model(model: str, cfgs: list[Config], args: argparse.Namespace) -> ModelFacts:
    """Build ``model`` once (as the workers will), fix its stage cuts, predict memory, drop it.

    ``--split layers``: equal numbers of layers per stage; ``--split balanced``: the cut
    balancing per-layer forward+backward times measured here. This is the only tensor work
    of the orchestrator and it happens before the first round.
    """
    worlds = sorted({c.world for c in cfgs if c.world > 1})
    bm = build_bench_model(model, seed=args.seed)
    times = None
    if args.split == "balanced":
        times = child_times(bm, seed=args.seed)
        cuts = {w: balanced_cuts(times, w) for w in worlds}
    else:
        cuts = {w: split_point(bm.layers, w) for w in worlds}
    predicted: dict[str, list[float] | None] = {}
    if 2 in cuts and not args.quick:  # a few seconds per model: left out of smoke runs
        from baselines import predict

        cache: dict[int, Any] = {}  # stage costs per unit count, shared by the schedules
        predicted = {c.name: predict.predict(bm, cuts[2], c.kind, c.schedule, c.microbatches, cache=cache)
                     for c in cfgs if c.world == 2 and c.kind in ("torch_pipe", "pipetrain")}
    cut_names = {w: bm.cut_names(c) for w, c in cuts.items()}
    first = {str(w): [bm.child_modules[0][0], *names] for w, names in cut_names.items()}
    report = {"batch_size": bm.batch_size, "num_parameters": bm.num_parameters(),
              "pipetrain_cut": {str(w): ",".join(n) for w, n in cut_names.items()},
              "stage_first_modules": first,
              "pipetrain_model_spec": bm.pipetrain_spec, "children": len(list(bm.layers)),
              "child_types": [type(c).__name__ for c in bm.layers], "split": args.split,
              "stage_cuts": {str(w): c for w, c in cuts.items()},
              **({"child_times_s": times} if times else {})}
    facts = ModelFacts(bm.pipetrain_spec, cuts, predicted, report, cut_names)
    del bm
    release_memory()
    return facts


def select_configs(args: argparse.Namespace) -> list[Config]:
    """The configurations ``--configs`` names and ``--skip`` does not (``single`` always)."""
    skip = [g for g in args.skip.split(",") if g]
    return [c for c in build_configs(args.microbatches, args.four_workers, args.quick)
            if c.name == "single" or (any(fnmatch.fnmatch(c.name, g) for g in args.configs.split(","))
                                      and not any(fnmatch.fnmatch(c.name, g) for g in skip))]


def main(argv: list[str]) -> int:
    if argv[:1] == ["_worker"]:  # a measured process (see baselines/worker.py)
        from baselines import worker
        return worker.main(argv[1:])
    args = parse_args(argv)
    t_start = time.monotonic()
    load_start = os.getloadavg()
    cfgs = select_configs(args)
    facts = {m: prepare_model(m, cfgs, args) for m in args.models}
    runs: dict[str, dict[str, list[Measurement]]] = {m: {} for m in args.models}
    predictions = RoundPredictions(lambda name: build_bench_model(name, seed=args.seed), args.seed,
                                   repeats=1 if args.quick else 3)
    for rnd in range(args.rounds):
        predictions.new_round()
        for model in args.models:
            k = rnd % len(cfgs)
            for cfg in cfgs[k:] + cfgs[:k]:  # rotate: no configuration always runs first
                t = time.monotonic()
                m = measure(cfg, model, facts[model], args)
                m.extra["run_wall_s"] = time.monotonic() - t  # launch to exit, startup included
                runs[model].setdefault(cfg.name, []).append(m)
                predicted = predict_round(model, cfg, m, facts[model], predictions, args) \
                    if cfg.kind == "pipetrain" else ""
                log(f"[round {rnd + 1}/{args.rounds}] {model:<4}{cfg.name:<26}"
                    + (f"{m.samples_per_second:9.1f} samples/s" if m.samples_per_second
                       else f"{m.status}: {m.error}") + f"   ({m.extra['run_wall_s']:.1f} s){predicted}")
    predictions.close()
    release_memory()
    for model in args.models:
        measure_memory_runs(model, cfgs, runs[model], facts[model], args)
    for model in args.models:
        log(f"{model}: predicting the tensor memory of every pipetrain run")
        predict_memory_runs(model, cfgs, runs[model], facts[model], args)
    report: dict[str, Any] = {
        m: summarise(m, runs[m], cfgs, args.microbatches, facts[m])
        for m in args.models}
    try:
        from importlib.metadata import version
        torch_version = version("torch")
    except Exception:
        torch_version = "?"
    report["meta"] = {
        "models": args.models, "rounds": args.rounds, "steps": {m: args.steps_for[m] for m in args.models},
        "warmup": args.warmup, "split": args.split,
        "microbatches": args.microbatches, "seed": args.seed, "torch": torch_version,
        "cpu_count": os.cpu_count(), "loadavg_start": list(load_start),
        "loadavg_end": list(os.getloadavg()), "wall_s": time.monotonic() - t_start,
        "threads_per_process": 1, "pipetrain_cli": args.pipetrain,
        "configs": [asdict(c) for c in cfgs],
    }
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
