"""What every training process sets up first: its device, torch's threads, the allocator, logging.

Every worker of a pipeline (:mod:`pipetrain.runtime.worker.main`) and the one process of
``--workers 1`` (:mod:`pipetrain.runtime.single`) call :func:`process_device` and then
:func:`setup_process`, so both train under the same settings.
"""
from __future__ import annotations

import torch

from ...errors import RuntimeConfigError
from ...job.config import TrainConfig
from .log import setup_logging
from .rss import tune_malloc

__all__ = ["process_device", "setup_process"]


def process_device(cfg: TrainConfig, local_rank: int | None = None) -> torch.device:
    """This process's device: the CPU, or a CUDA device (checked to exist).

    ``local_rank``: the GPU of this worker on its machine, made the current CUDA device;
    ``None``: the current CUDA device (one process).
    """
    if cfg.parallel.device != "cuda":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeConfigError("--device cuda but CUDA is not available on this machine; use --device cpu")
    if local_rank is None:
        return torch.device("cuda")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def setup_process(cfg: TrainConfig, device: torch.device) -> None:
    """torch's threads (``--threads``, on the CPU), glibc's malloc thresholds (unless
    ``--no-malloc-tuning``, :func:`~pipetrain.runtime.process.rss.tune_malloc`) and the
    progress lines (unless quiet: on stderr when stdout carries ``--json``)."""
    if cfg.performance.threads is not None and device.type == "cpu":
        torch.set_num_threads(cfg.performance.threads)
    if cfg.performance.tune_malloc:
        tune_malloc()
    if not cfg.output.quiet:
        setup_logging(cfg.output.progress_to_stderr)
