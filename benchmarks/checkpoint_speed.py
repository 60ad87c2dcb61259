"""Checkpoint save time: every rank writes its own part (DCP) vs. gather to rank 0 and torch.save.

Usage: ``python benchmarks/checkpoint_speed.py [--model gnmt] [--workers 4] [--repeats 2]``

Each of ``--workers`` gloo ranks on 127.0.0.1 builds the model from the same seed and keeps
a contiguous run of its parameters of about equal bytes (as a pipeline's stages would).
Timed on rank 0 between two barriers (so the slowest rank counts), best of ``--repeats``:

- ``parallel``: :func:`pipetrain.checkpoint.save_checkpoint_dir` (each rank writes its file,
  rank 0 the manifest, then the rename);
- ``gather``: today's ``--save`` path: ``gather_object`` of every rank's tensors to rank 0,
  then one ``torch.save`` of the whole state dict (atomic: temporary file, rename).

Both with and without fsync (``--sync``: DCP's ``sync_files`` / ``os.fsync`` on the file).
Prints one JSON object; the ratio is gather time over parallel time.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipetrain.checkpoint import RankState, load_for_rank, save_checkpoint_dir
from pipetrain.models import get_model


def _split_by_bytes(sizes: list[int], parts: int) -> list[tuple[int, int]]:
    """Contiguous ranges of about ``sum / parts`` bytes each (non-empty while there are enough items)."""
    total, bounds, acc = sum(sizes), [0], 0
    for i, s in enumerate(sizes):
        acc += s
        items_left, cuts_left = len(sizes) - (i + 1), parts - len(bounds)
        if cuts_left > 0 and items_left > 0 and (acc >= total * len(bounds) / parts or items_left == cuts_left):
            bounds.append(i + 1)
    while len(bounds) < parts:
        bounds.append(bounds[-1])
    bounds.append(len(sizes))
    return [(bounds[r], bounds[r + 1]) for r in range(parts)]


def _gather_save(mine: dict[str, torch.Tensor], rank: int, world: int, out: Path, sync: bool) -> None:
    gathered: list[Any] = [None] * world if rank == 0 else []
    dist.gather_object(mine, gathered if rank == 0 else None, dst=0)
    if rank == 0:
        full: dict[str, torch.Tensor] = {}
        for g in gathered:
            full.update(g)
        tmp = out.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            torch.save(full, f)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, out)


def _worker(rank: int, world: int, port: int, model: str, repeats: int, sync: bool, root: str, result: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    torch.manual_seed(0)
    sd = get_model(model).model.state_dict()
    names = list(sd)
    lo, hi = _split_by_bytes([t.nbytes for t in sd.values()], world)[rank]
    mine = {n: sd[n].detach().clone() for n in names[lo:hi]}
    shapes = {n: tuple(sd[n].shape) for n in names}
    del sd
    times: dict[str, list[float]] = {"parallel": [], "gather": [], "parallel_load": []}
    for rep in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        path = save_checkpoint_dir(Path(root) / "dcp", rep + 1, rank_state=RankState(model=mine),
                                   manifest_info={"model": model}, keep=1, sync_files=sync)
        dist.barrier()
        times["parallel"].append(time.perf_counter() - t0)
        # load under another split (every world-th parameter), each rank its own part
        dist.barrier()
        t0 = time.perf_counter()
        load_for_rank(path, {n: shapes[n] for n in names[rank::world]})
        dist.barrier()
        times["parallel_load"].append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        _gather_save(mine, rank, world, Path(root) / "gathered.pt", sync)
        dist.barrier()
        times["gather"].append(time.perf_counter() - t0)
    if rank == 0:
        Path(result).write_text(json.dumps({"times": times, "bytes": sum(t.nbytes for t in mine.values())}))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gnmt", help="built-in model name (default gnmt, the largest: 194M params)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2, help="runs of each; the best is reported")
    ap.add_argument("--no-sync", action="store_true", help="skip fsync on both paths (page cache only)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory, removed after)")
    args = ap.parse_args(argv)
    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpt_speed_"))
    root.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    result = root / "result.json"
    try:
        mp.start_processes(_worker, args=(args.workers, port, args.model, args.repeats, not args.no_sync, str(root),
                                          str(result)), nprocs=args.workers, start_method="spawn")
        raw = json.loads(result.read_text())
        torch.manual_seed(0)
        total = sum(t.nbytes for t in get_model(args.model).model.state_dict().values())
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    best = {k: min(v) for k, v in raw["times"].items()}
    print(json.dumps({
        "model": args.model, "workers": args.workers, "state_mib": round(total / 2**20, 1),
        "fsync": not args.no_sync, "repeats": args.repeats,
        "parallel_save_s": round(best["parallel"], 3), "gather_save_s": round(best["gather"], 3),
        "ratio_gather_over_parallel": round(best["gather"] / best["parallel"], 2),
        "parallel_load_s": round(best["parallel_load"], 3),
        "all_s": {k: [round(x, 3) for x in v] for k, v in raw["times"].items()},
        "cpu_count": os.cpu_count(),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
