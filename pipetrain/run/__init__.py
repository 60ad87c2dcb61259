"""The launcher side of a training run: resolve it once, check it, launch it.

    train(cfg: TrainConfig) -> RunResult | None            run.launcher
    resolve_run(cfg, world=None) -> ResolvedRun             run.resolve (asks pipetrain.plan)
    preflight(cfg, world=None) -> ResolvedRun               run.checks (resolve + cheap checks)

The runtime (:mod:`pipetrain.runtime`) executes a :class:`~pipetrain.job.resolved.ResolvedRun`
and decides nothing; this package is the only one that plans.
"""
from __future__ import annotations

from .checks import check_model_batch, check_output_paths, preflight
from .launcher import train, under_torchrun
from .resolve import implied_workers, resolve_batch_size, resolve_run

__all__ = ["check_model_batch", "check_output_paths", "implied_workers", "preflight", "resolve_batch_size",
           "resolve_run", "train", "under_torchrun"]
