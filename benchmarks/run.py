"""Throughput of pipetrain's schedules against PyTorch baselines, measured side by side.

    python benchmarks/run.py [--json] [--rounds R] [--steps S] [--models mlp,lm] [--quick]

Every configuration of every model runs once per round, in an order rotated each round, and
the figures are medians over rounds: on a shared, noisy machine a configuration measured in
the same minutes as the others is the only fair comparison, and the medians of paired
per-round ratios cancel slow drifts of the machine's load. Each configuration is a fresh
process tree (one process per worker, ``torch.set_num_threads(1)``, gloo on 127.0.0.1 with
a free port, a deadline after which it is killed); warm-up steps are excluded and ``S``
timed steps give samples/s = batch * S / (timed wall time of the slowest worker).

Configurations (per model; ``m`` = microbatches, default 2, 4, 8):
  single                 the whole model in one process
  ceiling                2 processes, each trains only its stage alone (no communication)
  torch_gpipe_m{m}       torch.distributed.pipelining ScheduleGPipe, 2 stages
  torch_1f1b_m{m}        torch.distributed.pipelining Schedule1F1B, 2 stages
  ddp                    DistributedDataParallel, 2 processes, half the batch each
  pipetrain_pipedream    pipetrain 1F1B + weight stashing, 2 workers (config 1-1)
  pipetrain_2bw_m{m}, pipetrain_flush_m{m}, pipetrain_gpipe_m{m}   pipetrain, 2 workers
  (--four-workers adds *_w4 variants on 4 workers: 4 stages on this 2-core machine)

See docs/performance.md for the method and how to read the figures.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from baselines import pipetrain_cli
from bench_models import BATCH_SIZES, balanced_cuts, build_bench_model, child_times, split_point
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


def build_configs(microbatches: list[int], four_workers: bool, quick: bool = False) -> list[Config]:
    """The configurations of one model, in their round-1 order (``quick``: without 2bw)."""
    cfgs = [Config("single", "single", 1), Config("ceiling", "ceiling", 2)]
    for m in microbatches:
        cfgs += [Config(f"torch_gpipe_m{m}", "torch_pipe", 2, "gpipe", m),
                 Config(f"torch_1f1b_m{m}", "torch_pipe", 2, "1f1b", m)]
    cfgs.append(Config("ddp", "ddp", 2))
    cfgs.append(Config("pipetrain_pipedream", "pipetrain", 2, "pipedream", 1, "1-1"))
    for m in microbatches:
        for sched in (("flush", "gpipe") if quick else ("2bw", "flush", "gpipe")):
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
    return pipetrain_cli.run_pipetrain(
        args.pipetrain, facts.pipetrain_spec, cfg.schedule, cfg.world, cfg.pipetrain_config or None,
        BATCH_SIZES[model], cfg.microbatches, args.steps_for[model], args.warmup,
        args.seed, args.timeout, facts.cut_names.get(cfg.world))


# --------------------------------------------------------------------------- summarising
def paired_ratio(runs: dict[str, list[Measurement]], a: str, b: str) -> float | None:
    """Median over rounds of samples/s(a) / samples/s(b), using rounds where both ran."""
    if a not in runs or b not in runs:
        return None
    ratios = [x.samples_per_second / y.samples_per_second  # type: ignore[operator]
              for x, y in zip(runs[a], runs[b])
              if x.samples_per_second and y.samples_per_second]
    return median_or_none(ratios)


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
    out["model"] = facts.report
    return out


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
        print(f"  {'config':<26}{'samples/s':>11}{'min-max':>17}{'vs single':>11}{'mem MiB/worker':>18}"
              f"{'sim MiB':>12}  status")
        for name, c in r["configs"].items():
            rng = (f"{fmt(c['samples_per_second_min'])}-{fmt(c['samples_per_second_max'])}"
                   if c["samples_per_second_min"] is not None else "-")
            above = c["peak_above_setup_mib_per_worker"]
            rss = ("/".join(f"{x:.0f}" for x in above) if above else
                   "/".join(f"{x:.0f}" for x in c["peak_rss_mib_per_worker"]) + "*"
                   if c["peak_rss_mib_per_worker"] else "-")
            sim = "/".join(f"{x:.0f}" for x in c["predicted_peak_mib_per_worker"] or []) or "-"
            err = (c["errors"] or [""])[0]
            why = "ok" if c["status"] == "ok" else f"{c['status']}: {err[:90]}"
            print(f"  {name:<26}{fmt(c['samples_per_second_median']):>11}{rng:>17}"
                  f"{fmt(c['ratio_vs_single'], '.2f'):>11}{rss:>18}{sim:>12}  {why}")
        print("  mem: peak RSS of each worker's training phase above its RSS once set up (stage built, peak reset)"
              " (* = absolute peaks, when a run\n       reports no set-up RSS); sim: pipetrain.simulate's model-state peak for the harness's cut")
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


# --------------------------------------------------------------------------- main
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--rounds", type=int, default=None, help="rounds of every configuration (default 5; --quick 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default: mlp 20, lm 5; --quick: 3, 1)")
    p.add_argument("--warmup", type=int, default=None, help="untimed warm-up steps per run (default 3; --quick 1)")
    p.add_argument("--models", default="mlp,lm", help="comma-separated: mlp, lm (default both)")
    p.add_argument("--microbatches", default=None, help="comma-separated m for the microbatched schedules (default 2,4,8; --quick 4)")
    p.add_argument("--configs", default="*", help="comma-separated glob patterns of configuration names to run (single is always run)")
    p.add_argument("--four-workers", action="store_true", help="also run ceiling and pipetrain on 4 workers (4 stages)")
    p.add_argument("--split", choices=("layers", "balanced"), default="layers",
                   help="stage cut of the harness's pipelines: equal numbers of layers (default), or "
                        "the cut that balances forward+backward time measured per layer before round 1")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 round, 3 timed steps (lm 1), 1 warm-up, m=4, no 2bw, no memory prediction (under 2 minutes on a quiet machine)")
    p.add_argument("--timeout", type=float, default=None, help="seconds before a run's processes are killed (default 240; --quick 90)")
    p.add_argument("--seed", type=int, default=0, help="weights and data seed (same in every process)")
    p.add_argument("--pipetrain", default=pipetrain_cli.default_cli(), help="the pipetrain command (default: next to this python)")
    a = p.parse_args(argv)
    q = a.quick
    a.rounds = a.rounds or (1 if q else 5)
    quick_steps, full_steps = {"mlp": 3, "lm": 1}, {"mlp": 20, "lm": 5}
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
            p.error(f"--microbatches {m}: each m must be >= 2 and divide the batch sizes {sorted(set(BATCH_SIZES.values()))}")
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


def main(argv: list[str]) -> int:
    if argv[:1] == ["_worker"]:  # a measured process (see baselines/worker.py)
        from baselines import worker
        return worker.main(argv[1:])
    args = parse_args(argv)
    t_start = time.monotonic()
    load_start = os.getloadavg()
    cfgs = [c for c in build_configs(args.microbatches, args.four_workers, args.quick)
            if c.name == "single" or any(fnmatch.fnmatch(c.name, g) for g in args.configs.split(","))]
    facts = {m: prepare_model(m, cfgs, args) for m in args.models}
    runs: dict[str, dict[str, list[Measurement]]] = {m: {} for m in args.models}
    for rnd in range(args.rounds):
        for model in args.models:
            k = rnd % len(cfgs)
            for cfg in cfgs[k:] + cfgs[:k]:  # rotate: no configuration always runs first
                t = time.monotonic()
                m = measure(cfg, model, facts[model], args)
                m.extra["run_wall_s"] = time.monotonic() - t  # launch to exit, startup included
                runs[model].setdefault(cfg.name, []).append(m)
                log(f"[round {rnd + 1}/{args.rounds}] {model:<4}{cfg.name:<26}"
                    + (f"{m.samples_per_second:9.1f} samples/s" if m.samples_per_second
                       else f"{m.status}: {m.error}") + f"   ({m.extra['run_wall_s']:.1f} s)")
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
