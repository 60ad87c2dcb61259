"""Start-up of a run: seconds from the launch to the end of the first step, for 1, 2 and 4 workers.

Each run is a fresh ``pipetrain train --model MODEL --steps 1 --log-every 1`` process tree;
its start-up is the time from the launch to the ``step 1:`` progress line, its wall time the
time to its exit. ``--pythonpath DIR`` adds a second checkout (the code before a change, e.g.
``git archive``): the two are measured in the same run, interleaved round by round, and the
table gives medians and each worker count's ratio to one worker of the same checkout.

    python benchmarks/startup.py                              # this checkout, 3 rounds
    python benchmarks/startup.py --pythonpath ../before --rounds 5 --json out.json
    python benchmarks/startup.py --schedule auto              # the automatic choice (its cache warm)

Multi-worker runs name ``--config 1-1...`` and ``--schedule flush`` (``--schedule auto``:
that alone, so the launcher chooses; one warm-up run first fills the measurement cache).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

from stage_memory import measure


def command(model: str, workers: int, schedule: str) -> list[str]:
    cmd = [sys.executable, "-m", "pipetrain", "train", "--model", model, "--workers", str(workers), "--steps", "1",
           "--log-every", "1"]
    if workers > 1:  # auto named: a 1-step run that names no schedule is not left to the planner
        cmd += ["--schedule", "auto"] if schedule == "auto" else ["--config", "-".join(["1"] * workers),
                                                                  "--schedule", schedule]
    return cmd


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--workers", default="1,2,4", help="comma-separated worker counts (default 1,2,4)")
    ap.add_argument("--schedule", default="flush", help="flush (default), or auto: the launcher chooses")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pythonpath", default=None, help="also measure this checkout (the code before)")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    workers = [int(w) for w in args.workers.split(",") if w]
    checkouts: list[str | None] = [None] + ([args.pythonpath] if args.pythonpath else [])
    label = {where: f"--pythonpath {where}" if where else "this checkout" for where in checkouts}
    if args.schedule == "auto":  # fill the measurement cache once per checkout
        for where in checkouts:
            measure(command(args.model, max(workers), "auto"), where, 0.05)
    runs: dict[tuple[str | None, int], list[dict[str, Any]]] = {}
    for _ in range(args.rounds):
        for where in checkouts:
            for w in workers:
                runs.setdefault((where, w), []).append(measure(command(args.model, w, args.schedule), where, 0.05))
    rows = []
    print(f"{'checkout':<32} {'workers':>7} {'to step 1 (s)':>13} {'wall (s)':>9} {'x 1 worker':>10}")
    for where in checkouts:
        base = statistics.median(r["first_step_seconds"] for r in runs[(where, min(workers))])
        for w in workers:
            first = statistics.median(r["first_step_seconds"] for r in runs[(where, w)])
            wall = statistics.median(r["seconds"] for r in runs[(where, w)])
            print(f"{label[where]:<32} {w:>7} {first:>13.2f} {wall:>9.2f} {first / base:>10.2f}")
            rows.append({"checkout": label[where], "workers": w, "first_step_seconds": first, "seconds": wall,
                         "vs_one_worker": first / base,
                         "rounds": [[r["first_step_seconds"], r["seconds"]] for r in runs[(where, w)]]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "schedule": args.schedule, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
