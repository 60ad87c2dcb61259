"""The distributed runtime: execute a resolved run's action lists on torch.distributed workers.

The runtime decides nothing: it receives a :class:`~pipetrain.job.resolved.ResolvedRun`
(made by :func:`pipetrain.run.resolve_run`, which plans) and executes it. On every worker
(one process per rank, gloo on CPU, NCCL on CUDA)::

    ResolvedRun -> process setup (process/setup.py)
           -> model (weightless) -> capture -> cut into the plan's stages -> this rank's tensors
              materialised (job.model.build_stages)
           -> Executor (engine/executor.py) runs this rank's actions of every segment
                 F/B/I/W  -> StageRuntime (engine/stage_runtime.py): WeightVersions (engine/versions.py),
                             FunctionalOptimizer (engine/optim.py)
                 SEND/RECV/ALLREDUCE -> Comm (engine/comm.py), the only module touching the wire
           -> checkpoints at drained boundaries (checkpoints/periodic.py), --save (checkpoints/export.py)
           -> RankReport (job/result.py) gathered to rank 0 -> RunResult

Entry points: :func:`launch_local` (local worker processes), :func:`run_rank` (one worker),
:func:`train_one_process` (one process), :func:`train_single_process` (plain training of a
model), :func:`replay_config` / :func:`replay_schedule` / :func:`single_config` (the
single-process references of a resolved run). Configuration in, result out is
:func:`pipetrain.run.train`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..exports import lazy_exports

if TYPE_CHECKING:  # the names below are imported on first use (PEP 562)
    from .engine.optim import FunctionalOptimizer
    from .engine.versions import WeightVersions
    from .launch import launch_local
    from .process.failures import FailureRecord, WorkerFailure
    from .reference import replay_config, replay_schedule, single_config
    from .single import train_one_process, train_single_process
    from .worker.main import run_rank

#: Each public name and the submodule it is imported from, on first use: importing the
#: package imports none of them (the command line starts its fork server first).
_LAZY = {
    "FunctionalOptimizer": "engine.optim",
    "WeightVersions": "engine.versions",
    "launch_local": "launch",
    "FailureRecord": "process.failures",
    "WorkerFailure": "process.failures",
    "replay_config": "reference",
    "replay_schedule": "reference",
    "single_config": "reference",
    "train_one_process": "single",
    "train_single_process": "single",
    "run_rank": "worker.main",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)

__all__ = [
    "FailureRecord", "FunctionalOptimizer", "WeightVersions", "WorkerFailure", "launch_local", "replay_config",
    "replay_schedule", "run_rank", "single_config", "train_one_process", "train_single_process",
]
