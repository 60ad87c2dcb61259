"""Data parallelism against the planner's pipeline on emulated hosts behind slow links.

    python benchmarks/cluster.py [--json] [--hosts 2] [--bandwidth 50Mbit] [--steps 24]
                                 [--warmup-steps 12] [--batch-size 32] [--configs dp,planner,straight]

Needs root (network namespaces: ``pipetrain.cluster``). What it does:

1. profiles the model here (one thread), at the minibatch and at every unit size a run uses
   (per-node times do not scale linearly with the unit size on a CPU);
2. makes an emulated cluster of ``--hosts`` hosts with ``--bandwidth`` links (tbf) and
   calibrates it (``pipetrain.cluster.measure``: point-to-point and all-reduce fits);
3. trains, one torchrun agent per host, each configuration for ``--steps`` timed steps
   after ``--warmup-steps``:

       dp        --schedule dp (one stage on every host, all-reduce every minibatch)
       planner   no --plan: the planner on a quick profile and the calibration
                 (``train --calibration FILE``, schedule pipedream)
       straight  --config 1-1[-1-1] (one stage per host, split by estimated compute; pipedream)

4. predicts each run's time per minibatch by simulating its schedule on its resolved plan
   with the calibrated costs (:func:`pipetrain.simulate.calibrated.predict_run`) and the profile
   whose node times are scaled, stage by stage, to the stage's forward + backward measured
   here as a whole, alone (:mod:`pipetrain.auto.stage_timing`), plus each stage's optimizer
   step timed here; and its bytes per sample from the plan (:mod:`pipetrain.plan.traffic`).
   Also reported: the prediction with every rank timing its stage at the same time on this
   machine's shared cores (``_concurrent``: the emulated hosts share 2 cores; an upper bound,
   since a run's ranks are not all computing all the time) and from the per-node profile as is
   (``_node_profile``).

Measured time per minibatch: ``batch / samples_per_second_steady`` (steady state, the
simulator's definition). Measured bytes per sample: the sum over ranks of ``bytes_sent``
(every kind, timed steps only) divided by the samples of the timed steps; per kind from
``train --json``'s ``bytes_per_sample``.

The JSON object (``--json``) has ``bandwidth_bits_per_second``, ``hosts``,
``dp_samples_per_second``, ``planner_samples_per_second``, ``planner_config``,
``speedup_over_dp``, ``dp_bytes_per_sample``, ``planner_bytes_per_sample``,
``prediction_error`` (largest relative error of predicted against measured time per
minibatch over the configurations run), ``runs`` (each configuration's figures) and
``calibration``.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cluster_runs import MODEL, ModelSetup, run_config

CONFIGS = ("dp", "planner", "straight")


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", default="2", help="emulated hosts; a list runs each, e.g. 2,4 (default 2)")
    p.add_argument("--bandwidth", default="50Mbit", help="per-link rate (tbf), e.g. 50Mbit (default)")
    # multiples of 12: pipedream steps a stage with r replicas once per r minibatches, so the
    # steps must be multiples of every replica count the planner may choose (1..4)
    p.add_argument("--steps", type=int, default=24, help="timed steps per run (default 24)")
    p.add_argument("--warmup-steps", type=int, default=12, help="untimed steps first (default 12)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per minibatch (default 32)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"which to run (default {','.join(CONFIGS)})")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run (default 300)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--output", help="also write the JSON object here")
    return p.parse_args(argv)


def _summary(hosts: int, bandwidth_bits: int | None, runs: dict[str, dict[str, Any]], cal: dict[str, Any],
             seconds: float) -> dict[str, Any]:
    dp, pl = runs.get("dp", {}), runs.get("planner", {})
    errors = [abs(r["prediction_error"]) for r in runs.values() if r.get("prediction_error") is not None]
    errors_conc = [abs(r["prediction_error_concurrent"]) for r in runs.values()
                   if r.get("prediction_error_concurrent") is not None]
    fastest = max((r["samples_per_second"] or 0.0, n) for n, r in runs.items()) if runs else (0.0, None)
    sp = pl.get("samples_per_second")
    out = {
        "bandwidth_bits_per_second": bandwidth_bits, "hosts": hosts, "model": MODEL,
        "dp_samples_per_second": dp.get("samples_per_second"),
        "planner_samples_per_second": sp,
        "straight_samples_per_second": runs.get("straight", {}).get("samples_per_second"),
        "planner_config": pl.get("config"),
        "speedup_over_dp": (sp / dp["samples_per_second"]) if sp and dp.get("samples_per_second") else None,
        "dp_bytes_per_sample": dp.get("bytes_per_sample"),
        "planner_bytes_per_sample": pl.get("bytes_per_sample"),
        "planner_bytes_fraction_of_dp": (pl["bytes_per_sample"] / dp["bytes_per_sample"])
        if pl.get("bytes_per_sample") and dp.get("bytes_per_sample") else None,
        "prediction_error": max(errors) if errors else None,
        "prediction_error_concurrent": max(errors_conc) if errors_conc else None,
        "fastest_config": fastest[1],
        "planner_within_10_percent_of_fastest": (sp / fastest[0] >= 0.9) if sp and fastest[0] else None,
        "bytes_source": "bytes_sent totals over ranks (every kind, timed steps only) / samples of the timed steps",
        "calibration": cal, "runs": runs, "seconds": seconds,
    }
    return out


def main(argv: list[str] | None = None) -> int:
    from pipetrain.cluster import EmulatedCluster
    from pipetrain.cluster.measure import calibrate
    from pipetrain.cluster.names import parse_rate
    from pipetrain.cluster.netns import unavailable_reason
    from pipetrain.plan.calibrated import calibration_summary

    a = _args(argv)
    why = unavailable_reason()
    if why:
        print(json.dumps({"error": f"emulated cluster unavailable: {why}"}) if a.json else f"skipped: {why}")
        return 3
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        print(f"unknown configuration(s) {bad}; choose from {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    setup = ModelSetup(a.batch_size)
    results = []
    for hosts in [int(h) for h in str(a.hosts).split(",") if h.strip()]:
        runs: dict[str, dict[str, Any]] = {}
        with tempfile.TemporaryDirectory(prefix="pipetrain-bench-") as tmp, EmulatedCluster(hosts, a.bandwidth) as c:
            cal = calibrate(c, timeout=120)
            cal_path = Path(tmp) / "calibration.json"
            cal.save(cal_path)
            log(f"{hosts} hosts at {a.bandwidth}: p2p {cal.p2p.bandwidth_bits_per_second / 1e6:.1f} Mbit/s, "
                f"latency {cal.p2p.latency_seconds * 1e6:.0f} us; all-reduce bus "
                f"{cal.allreduce_bus_bandwidth * 8 / 1e6:.1f} Mbit/s")
            for name in configs:
                runs[name] = run_config(c, name, hosts, setup, cal, cal_path, a.steps, a.warmup_steps, a.timeout)
                r = runs[name]
                log(f"  {name:<9} {r.get('config')!s:<10} measured {fmt(r.get('time_per_minibatch'))} "
                    f"predicted {fmt(r.get('predicted_time_per_minibatch'))} "
                    f"samples/s {r.get('samples_per_second') or 0:.1f} "
                    f"bytes/sample {r.get('bytes_per_sample') or 0:.0f}"
                    + (f"  ERROR {r['error']}" if r.get("error") else ""))
            bits = int(parse_rate(a.bandwidth)) if a.bandwidth else None
            results.append(_summary(hosts, bits, runs, calibration_summary(cal), time.monotonic() - t0))
    out = results[0] if len(results) == 1 else {**results[0], "by_hosts": results}
    if len(results) > 1:  # the top level is the first host count's; the error is the largest of all
        errs = [r["prediction_error"] for r in results if r.get("prediction_error") is not None]
        out["prediction_error"] = max(errs) if errs else None
    out["seconds"] = time.monotonic() - t0
    if a.output:
        Path(a.output).write_text(json.dumps(out, indent=1) + "\n")
    if a.json:
        print(json.dumps(out))
    else:
        for r in results:
            print(f"{r['hosts']} hosts @ {r['bandwidth_bits_per_second'] / 1e6:g} Mbit/s: "
                  f"planner {r['planner_config']} "
                  f"{r['planner_samples_per_second'] or 0:.1f} samples/s vs dp {r['dp_samples_per_second'] or 0:.1f} "
                  f"({r['speedup_over_dp'] or 0:.2f}x); bytes/sample {r['planner_bytes_per_sample'] or 0:.0f} vs "
                  f"{r['dp_bytes_per_sample'] or 0:.0f}; prediction error {r['prediction_error'] or 0:.1%}")
    return 0


def fmt(t: float | None) -> str:
    return "-" if t is None else f"{t * 1e3:8.1f} ms"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
