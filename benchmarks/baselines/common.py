"""What every measured configuration shares: the learning rate, the fixed minibatch, the
barrier, and the start of the training phase (the point the peak-RSS count starts from)."""
from __future__ import annotations

from typing import Any

from bench_models import BenchModel
from rss import current_rss_mib, release_memory, reset_peak_rss

LR = 0.01  # SGD learning rate of every configuration (the value does not change the speed)


def begin_training_phase(bm: BenchModel) -> dict[str, Any]:
    """Drop the whole model (the caller keeps its own stage), reset the peak-RSS count.

    Returns ``rss_setup_mib`` (RSS once set up: its stage's weights, the data, torch) and
    whether the peak could be reset (``peak_reset``; if not, the peak includes the build).
    """
    bm.layers = bm.model = None
    release_memory()
    return {"rss_setup_mib": current_rss_mib(), "peak_reset": reset_peak_rss()}


def barrier() -> None:
    """A gloo barrier (bounded by the group's timeout)."""
    import torch.distributed as dist

    dist.barrier()


def fixed_batch(bm: BenchModel, seed: int) -> tuple[tuple[Any, ...], Any]:
    """The one minibatch every step reuses (data generation stays out of the timing)."""
    import torch

    return bm.make_batch(bm.batch_size, torch.Generator().manual_seed(seed + 1))
