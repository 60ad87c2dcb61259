"""One rank of a calibration: gloo ping-pong and all-reduce timings (run as a script).

Started by :func:`pipetrain.cluster.measure.calibrate` as ``python PATH/gloo_probe.py
--rank R --world N --master HOST:PORT``, or forked from a server that has imported torch
(:func:`forked_rank`). It imports only the standard library and torch (not the pipetrain
package), so it starts fast. Rank 0 prints one JSON line
``{"samples": [{"kind", "bytes", "seconds", "reps", "median_seconds", "mean_seconds"}, ...],
"compute": {"alone_seconds", "together_seconds"}}``.

Measurements (rank 0 decides sizes and repetitions and tells the others before each size):

- point to point, ranks 0 and 1: a ping-pong of one float32 tensor of S bytes (rank 0 sends,
  rank 1 receives and sends the same size back); one message takes half the round trip;
  ranks >= 2 wait at a barrier meanwhile;
- all-reduce (sum) of S bytes over every rank as a run issues it: after a barrier, every
  rank computes for ``BURST_SECONDS`` (the compute probe's step, below) and then all-reduces,
  timed on rank 0 from its own arrival. A run's all-reduce follows its backward: its buffer
  out of cache and the ranks arriving as their compute ends, not together. Measured on the
  2-core loopback: after 12-25 ms of compute an all-reduce of 3.3 / 8.6 / 11 MB took 4.4 /
  9.4 / 11.8 ms (medians), started together after a barrier 3.5 / 7.4 / 9.1;
- compute (:func:`compute_slowdown`): a small training step (two linear layers, forward and
  backward, at the workers' threads) timed on rank 0 while the other ranks wait, then on
  every rank at once; the ratio (the mean of the ranks' medians together over rank 0's median
  alone) is how much slower a worker computes while every rank of the host computes, through
  the cores, caches and memory bandwidth they share. Rounds alternate (alone, together, ...),
  so a change of the machine's load lands in both.

Sizes are 4 bytes, then 4 KiB growing 4x (16 KiB, 64 KiB, ...) until one message takes longer
than ``--max-message-seconds`` (or 16 MiB). Each size gets one untimed round, then 3-40 timed
ones (about ``TIME_PER_SIZE`` seconds of traffic, of compute bursts and traffic for the
all-reduce); the fastest, the median and the mean are kept. Four calibrations of each kind,
interleaved, at 4 ranks on the 2-core loopback: with the bursts outside the budget (137-193
all-reduces, 9.6-11.5 s a calibration) the fitted all-reduce of 1 MiB took 6.8-8.3 ms and
of 8 MiB 18.0-23.7; with them inside (52-60, 7.2-7.8 s) 6.4-7.8 and 19.0-21.8 ms.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

MAX_BYTES = 16 * 1024 * 1024
TIME_PER_SIZE = 0.15  # seconds of traffic spent on one size
#: Timed repetitions of a size at most: the calibration fits their mean, and the small
#: collectives' times here are heavy-tailed (module docstring of ``cluster.calibration``).
MAX_REPS = 40


def sizes() -> list[int]:
    """Message sizes in bytes, in the order they are tried."""
    s, out = 4, []
    while s <= MAX_BYTES:
        out.append(s)
        s = 4096 if s == 4 else s * 4
    return out


def reps_for(expected_seconds: float) -> int:
    """Timed repetitions of a size whose one operation is expected to take this long."""
    return int(min(MAX_REPS, max(3, TIME_PER_SIZE / max(expected_seconds, 1e-6))))


def _sample(kind: str, nbytes: int, times: list[float]) -> dict[str, Any]:
    """The fastest, the median and the mean of ``times`` (the calibration fits the means: what
    a run's transfers take on average, the CPU scheduler's delays on shared cores included)."""
    ts = sorted(times)
    return {"kind": kind, "bytes": nbytes, "seconds": ts[0], "reps": len(ts), "median_seconds": ts[len(ts) // 2],
            "mean_seconds": sum(ts) / len(ts)}


COMPUTE_SECONDS = 0.25  # seconds of the compute probe per phase and round
#: Seconds of the compute probe each rank runs before every timed all-reduce (module docstring).
BURST_SECONDS = 0.01
COMPUTE_ROUNDS = 2


def _compute_step() -> Any:
    """One forward + backward of ``gelu(x W1) W2`` (128 x 256 -> 1024 -> 256), a transformer
    MLP block's shapes: matrix products and elementwise work, like a training step."""
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 256, generator=g)
    w1 = torch.randn(256, 1024, generator=g).mul_(0.05).requires_grad_()
    w2 = torch.randn(1024, 256, generator=g).mul_(0.05).requires_grad_()

    def step() -> float:
        t0 = time.perf_counter()
        y = torch.nn.functional.gelu(x @ w1) @ w2
        torch.autograd.grad(y.square().mean(), (w1, w2))
        return time.perf_counter() - t0

    return step


def _timed(step: Any, seconds: float) -> float:
    """The median seconds of ``step`` run repeatedly for about ``seconds``."""
    step()
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 3:
        times.append(step())
    times.sort()
    return times[len(times) // 2]


def compute_slowdown(rank: int, world: int, seconds: float = COMPUTE_SECONDS,
                     rounds: int = COMPUTE_ROUNDS) -> dict[str, float]:
    """Rank 0's median step alone and the ranks' mean median together (module docstring);
    every rank calls it (collectives)."""
    import torch
    import torch.distributed as dist

    step = _compute_step()
    alone: list[float] = []
    together: list[float] = []
    for _ in range(rounds):
        dist.barrier()
        if rank == 0:
            alone.append(_timed(step, seconds))
        dist.barrier()
        mine = torch.tensor([_timed(step, seconds)], dtype=torch.float64)
        dist.all_reduce(mine)
        together.append(float(mine[0]) / world)
    if rank != 0:
        return {}
    alone.sort()
    together.sort()
    return {"alone_seconds": alone[len(alone) // 2], "together_seconds": together[len(together) // 2]}


def measure(rank: int, world: int, master: str, max_message_seconds: float = 0.1,
            timeout: float = 60.0, threads: int = 1) -> tuple[list[dict[str, Any]], dict[str, float]] | None:
    """Run one rank; rank 0 returns the samples (dicts with kind, bytes, seconds, reps) and
    the compute probe (:func:`compute_slowdown`, at ``threads`` torch threads per rank)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{master}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout))
    samples: list[dict[str, Any]] = []
    try:
        ctrl = torch.zeros(2, dtype=torch.int64)
        if rank == 0:
            expected = 1e-4
            for nbytes in sizes():
                reps = reps_for(2 * expected)
                ctrl[0], ctrl[1] = nbytes, reps
                dist.send(ctrl, 1)
                buf = torch.ones(nbytes // 4)
                dist.send(buf, 1)  # untimed round: buffers, TCP window
                dist.recv(buf, 1)
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    dist.send(buf, 1)
                    dist.recv(buf, 1)
                    times.append((time.perf_counter() - t0) / 2)
                samples.append(_sample("p2p", nbytes, times))
                if min(times) > max_message_seconds:
                    break
                expected = 4 * min(times)
            ctrl[0] = 0
            dist.send(ctrl, 1)
        elif rank == 1:
            while True:
                dist.recv(ctrl, 0)
                nbytes, reps = int(ctrl[0]), int(ctrl[1])
                if nbytes == 0:
                    break
                buf = torch.empty(nbytes // 4)
                for _ in range(reps + 1):
                    dist.recv(buf, 0)
                    dist.send(buf, 0)
        dist.barrier()
        expected = 1e-4
        burst = _compute_step()
        for nbytes in sizes():
            ctrl[0], ctrl[1] = nbytes, reps_for(expected + BURST_SECONDS)  # the budget holds the bursts
            dist.broadcast(ctrl, 0)  # rank 0's choice for everyone
            nbytes, reps = int(ctrl[0]), int(ctrl[1])
            buf = torch.ones(nbytes // 4)
            dist.all_reduce(buf)  # untimed round
            times = []
            for _ in range(reps):
                dist.barrier()
                end = time.perf_counter() + BURST_SECONDS
                while time.perf_counter() < end:
                    burst()
                t0 = time.perf_counter()
                dist.all_reduce(buf)
                times.append(time.perf_counter() - t0)
            stop = torch.tensor([1 if min(times) > max_message_seconds else 0])
            dist.broadcast(stop, 0)  # rank 0's times decide for everyone
            if rank == 0:
                samples.append(_sample("allreduce", nbytes, times))
            if int(stop[0]):
                break
            expected = 4 * min(times)
        torch.set_num_threads(max(1, threads))
        compute = compute_slowdown(rank, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return (samples, compute) if rank == 0 else None


def _result_line(samples: list[dict[str, Any]], compute: dict[str, float]) -> str:
    return json.dumps({"samples": samples, "compute": compute})


def forked_rank(rank: int, world: int, master: str, max_message_seconds: float, timeout: float, threads: int,
                log_path: str, out_path: str) -> None:
    """One rank on loopback in a process forked from a server that has imported torch (the
    ``multiprocessing`` context :func:`~pipetrain.cluster.measure.calibrate` is given): what
    the script prints goes to ``log_path``, rank 0's JSON line to ``out_path``; it exits 1 on
    any error (the traceback in the log), without tearing the forked interpreter down."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update({"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})  # as the script's environment
    code = 0
    try:
        out = measure(rank, world, master, max_message_seconds, timeout, threads)
        if out is not None:
            with open(out_path, "w") as f:
                f.write(_result_line(*out) + "\n")
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one rank of a pipetrain calibration (started by pipetrain calibrate)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master", required=True, help="HOST:PORT of rank 0's store")
    p.add_argument("--max-message-seconds", type=float, default=0.1)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank for the compute probe")
    a = p.parse_args(argv)
    out = measure(a.rank, a.world, a.master, a.max_message_seconds, a.timeout, a.threads)
    if out is not None:
        samples, compute = out
        print(_result_line(samples, compute), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
