"""``ddp``: ``DistributedDataParallel`` on the whole model, each rank half of the batch.

Gradients are averaged with gloo all-reduce (buckets overlap with backward), so both ranks
step on the full batch's mean gradient, like ``single``.
"""
from __future__ import annotations

from typing import Any

from bench_models import BenchModel
from timing import timed_loop

from baselines.common import LR, barrier, begin_training_phase, fixed_batch


def run_ddp(spec: dict[str, Any], bm: BenchModel) -> dict[str, Any]:
    """One DDP replica on samples ``rank::world`` of the fixed minibatch."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    rank, world = spec["rank"], spec["world"]
    model = DistributedDataParallel(bm.layers)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    inputs, target = fixed_batch(bm, spec["seed"])
    share = bm.batch_size // world
    sl = slice(rank * share, (rank + 1) * share)
    x = tuple(a[sl] for a in inputs)
    y = target[sl]
    mem = begin_training_phase(bm)  # the DDP wrapper keeps the model
    last: list[float] = [float("nan")]

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = bm.loss_fn(model(*x), y)
        loss.backward()
        opt.step()
        last[0] = float(loss.detach())

    elapsed, times = timed_loop(step, spec["warmup"], spec["steps"], sync=barrier)
    return {"elapsed_s": elapsed, "step_times": times, "loss": last[0], "samples_per_rank": share, **mem}
