"""Training throughput of pipetrain's schedules on 2 workers against one process, same run.

    python benchmarks/train_speed.py [--model mlp] [--batch-size 64] [--steps 20] [--warmup 3]
                                     [--rounds 3] [--microbatches 4] [--schedules pipedream,flush,gpipe]
                                     [--no-ceiling] [--json]

Each configuration is one ``pipetrain train ... --json`` process tree (fresh processes,
``--threads 1`` per worker); samples/s is the CLI's figure over the timed steps (warm-up
excluded). Configurations are interleaved in rounds, the order rotated every round, and the
table reports medians and the ratio to single-process training of the same model measured in
the same rounds:

    single      --workers 1 (plain training, torch.optim)
    ceiling     two processes at once, each training one half of the model alone (no
                communication): what 2 workers can give on this machine at best (mlp only)
    pipedream   2 workers, config 1-1, 1F1B with weight stashing
    flush_mM    2 workers, PipeDream-Flush with M microbatches
    gpipe_mM    2 workers, GPipe with M microbatches

The default model is ``mlp``: 16 blocks of Linear(1024, 1024) + ReLU, batch 64.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from baselines.pipetrain_cli import default_cli, parse_json_output
from processes import run_group

from pipetrain.schedule import get_schedule

CLI = default_cli()


def _cmd(args: argparse.Namespace, extra: list[str]) -> list[str]:
    cmd = [CLI, "train", "--model", args.model, "--batch-size", str(args.batch_size), "--steps", str(args.steps),
           "--warmup-steps", str(args.warmup), "--json", "--log-every", "0", "--threads", "1", "--seed", "0"]
    for opt in args.option:
        cmd += ["--option", opt]
    return cmd + extra


def _run(cmds: list[list[str]], timeout: float) -> list[dict[str, Any] | None]:
    """Start the commands together; the JSON object each printed (None on failure)."""
    out: list[dict[str, Any] | None] = []
    for res in run_group(cmds, timeout):
        if res.returncode != 0:
            sys.stderr.write(f"failed ({res.error_line()})\n")
            out.append(None)
            continue
        out.append(parse_json_output(res.stdout))
    return out


def configurations(args: argparse.Namespace) -> dict[str, list[list[str]]]:
    m = str(args.microbatches)
    confs: dict[str, list[list[str]]] = {"single": [_cmd(args, ["--workers", "1"])]}
    if not args.no_ceiling and args.model == "mlp":
        depth = 16
        for opt in args.option:
            if opt.startswith("depth="):
                depth = int(opt.split("=", 1)[1])
        half = [o for o in args.option if not o.startswith("depth=")]
        sub = argparse.Namespace(**{**vars(args), "option": half + [f"depth={depth // 2}"]})
        confs["ceiling"] = [_cmd(sub, ["--workers", "1"]), _cmd(sub, ["--workers", "1"])]
    for s in args.schedules.split(","):
        if get_schedule(s).unit == "minibatch":  # whole minibatches: no microbatches to name
            confs[s] = [_cmd(args, ["--workers", "2", "--config", "1-1", "--schedule", s])]
        else:
            confs[f"{s}_m{m}"] = [_cmd(args, ["--workers", "2", "--config", "1-1", "--schedule", s,
                                              "--microbatches", m])]
    return confs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--option", action="append", default=[], help="model option key=value (repeatable)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--schedules", default="pipedream,flush,gpipe")
    ap.add_argument("--no-ceiling", action="store_true")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    confs = configurations(args)
    names = list(confs)
    figures: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    t0 = time.time()
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        this_round: dict[str, float] = {}
        for name in order:
            res = _run(confs[name], args.timeout)
            if any(x is None for x in res):
                continue
            # several processes at once (ceiling): the pipeline is as fast as its slowest stage
            this_round[name] = min(float(x["samples_per_second"]) for x in res if x is not None)
            figures[name].append(this_round[name])
        if "single" in this_round:
            for name, v in this_round.items():
                ratios[name].append(v / this_round["single"])
        print(f"round {r + 1}/{args.rounds} done ({time.time() - t0:.0f} s)", file=sys.stderr)
    rows = []
    for name in names:
        vals = figures[name]
        rows.append({"config": name, "samples_per_second": statistics.median(vals) if vals else None,
                     "ratio_to_single": statistics.median(ratios[name]) if ratios[name] else None,
                     "min": min(vals) if vals else None, "max": max(vals) if vals else None, "runs": len(vals)})
    if args.json:
        print(json.dumps({"model": args.model, "batch_size": args.batch_size, "microbatches": args.microbatches,
                          "rounds": args.rounds, "rows": rows}))
        return 0
    print(f"model {args.model} {' '.join(args.option)}, batch {args.batch_size}, {args.steps} timed steps, "
          f"{args.rounds} rounds (medians; ratio = median of per-round ratios to single)")
    print(f"{'config':<14} {'samples/s':>10} {'x single':>9} {'min':>9} {'max':>9}")
    for row in rows:
        if row["samples_per_second"] is None:
            print(f"{row['config']:<14} {'failed':>10}")
            continue
        print(f"{row['config']:<14} {row['samples_per_second']:>10.1f} {row['ratio_to_single']:>9.2f} "
              f"{row['min']:>9.1f} {row['max']:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
