"""What data loading costs a small real run: the default loader settings against loading in each
worker (``--loader-workers 0``), same run, interleaved rounds.

    python benchmarks/loader.py [--rounds 3] [--epochs 10] [--workers 2] [--no-explicit] [--json]

The run: scikit-learn's wine data set (178 samples, 13 features, 3 classes) from a user
factory (:func:`wine`: ``--data loader:wine``, the features standardised with the train
split's mean and deviation), an MLP (``--model mlp --option depth=2 --option width=64``),
Adam, batch 16, ``--epochs 10`` (an evaluation every epoch, so 10 segments), 2 workers on
pipedream ``1-1``. Each configuration is one ``pipetrain train ... --json`` process tree; the
figure is its wall time (start to exit: data loading, worker start-up and evaluations
included), and the table gives medians over the rounds and the ratio to ``--loader-workers 0``
of the same round:

    workers0    --loader-workers 0: every unit gathered in the worker that reads it
    default     no --loader-workers: what pipetrain decides (suggested_workers)
    workers2    --loader-workers 2: two background processes per reading worker, kept for
                the whole run (skip with --no-explicit)

The default passes when its ratio is at most ``--max-ratio`` (1.2); the exit status is 1
otherwise. docs/performance.md records measured figures.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch
from torch.utils.data import TensorDataset

FACTORY = "loader:wine"


def wine(seed: int = 0, eval_fraction: float = 0.2) -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's wine data as ``(train, eval)`` TensorDatasets: a seeded 80/20 split, the
    features standardised with the train split's mean and standard deviation."""
    from sklearn.datasets import load_wine

    x_np, y_np = load_wine(return_X_y=True)
    x = torch.tensor(x_np, dtype=torch.float32)
    y = torch.tensor(y_np, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_eval = int(round(eval_fraction * len(y)))
    train, held = order[n_eval:], order[:n_eval]
    mean, std = x[train].mean(0), x[train].std(0)
    x = (x - mean) / std
    return TensorDataset(x[train], y[train]), TensorDataset(x[held], y[held])


def _cmd(cli: str, args: argparse.Namespace, extra: list[str]) -> list[str]:
    return [cli, "train", "--model", "mlp", "--option", "depth=2", "--option", "width=64", "--data", FACTORY,
            "--workers", str(args.workers), "--schedule", args.schedule, "--config", "1-" * (args.workers - 1) + "1",
            "--epochs", str(args.epochs), "--batch-size", "16", "--optimizer", "adam", "--lr", "0.003",
            "--json", "--log-every", "0", "--threads", "1", "--seed", "0", *extra]


def configurations(cli: str, args: argparse.Namespace) -> dict[str, list[str]]:
    confs = {"workers0": _cmd(cli, args, ["--loader-workers", "0"]), "default": _cmd(cli, args, [])}
    if not args.no_explicit:
        confs["workers2"] = _cmd(cli, args, ["--loader-workers", "2"])
    return confs


def _measure(cmd: list[str], timeout: float) -> dict[str, Any] | None:
    """One run: its wall time and the figures its JSON gives (None on failure)."""
    from baselines.pipetrain_cli import parse_json_output
    from processes import run_group

    res = run_group([cmd], timeout)[0]
    out = parse_json_output(res.stdout) if res.returncode == 0 else None
    if out is None:
        sys.stderr.write(f"failed ({res.error_line()})\n")
        return None
    data = (out.get("run") or {}).get("data") or {}
    return {"wall_s": res.wall_s, "timed_s": out.get("seconds"), "accuracy": out.get("eval_accuracy"),
            "loader_workers": data.get("loader_workers")}


def main(argv: list[str] | None = None) -> int:
    from baselines.pipetrain_cli import default_cli

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--schedule", default="pipedream")
    ap.add_argument("--no-explicit", action="store_true", help="skip --loader-workers 2")
    ap.add_argument("--max-ratio", type=float, default=1.2, help="the default's bound against --loader-workers 0")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    confs = configurations(default_cli(), args)
    names = list(confs)
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    t0 = time.time()
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        this_round = {}
        for name in order:
            got = _measure(confs[name], args.timeout)
            if got is not None:
                this_round[name] = got
                runs[name].append(got)
        if "workers0" in this_round:
            for name, got in this_round.items():
                ratios[name].append(got["wall_s"] / this_round["workers0"]["wall_s"])
        print(f"round {r + 1}/{args.rounds} done ({time.time() - t0:.0f} s)", file=sys.stderr)
    rows = [_row(name, runs[name], ratios[name]) for name in names]
    default = next(row for row in rows if row["config"] == "default")
    ok = default["ratio_to_workers0"] is not None and default["ratio_to_workers0"] <= args.max_ratio
    if args.json:
        print(json.dumps({"epochs": args.epochs, "workers": args.workers, "rounds": args.rounds, "rows": rows,
                          "max_ratio": args.max_ratio, "default_within": ok}))
    else:
        _print_table(rows, args)
        print(f"default within {args.max_ratio}x of --loader-workers 0: {'yes' if ok else 'NO'}")
    return 0 if ok else 1


def _row(name: str, got: list[dict[str, Any]], ratios: list[float]) -> dict[str, Any]:
    def median(key: str) -> float | None:
        vals = [g[key] for g in got if g[key] is not None]
        return statistics.median(vals) if vals else None

    return {"config": name, "wall_s": median("wall_s"), "timed_s": median("timed_s"),
            "ratio_to_workers0": statistics.median(ratios) if ratios else None, "accuracy": median("accuracy"),
            "loader_workers": got[0]["loader_workers"] if got else None, "runs": len(got)}


def _print_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"wine, mlp depth 2 width 64, {args.epochs} epochs, {args.workers} workers, {args.schedule}, "
          f"medians of {args.rounds} rounds")
    print(f"{'config':<10} {'loader workers':>14} {'wall s':>8} {'timed s':>8} {'x workers0':>10} {'accuracy':>9}")
    for row in rows:
        def fmt(v: float | None, spec: str) -> str:
            return "-" if v is None else format(v, spec)

        print(f"{row['config']:<10} {fmt(row['loader_workers'], 'd'):>14} {fmt(row['wall_s'], '.1f'):>8} "
              f"{fmt(row['timed_s'], '.2f'):>8} {fmt(row['ratio_to_workers0'], '.2f'):>10} "
              f"{fmt(row['accuracy'], '.4f'):>9}")


if __name__ == "__main__":
    raise SystemExit(main())
