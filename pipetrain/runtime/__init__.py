"""The distributed runtime: run a schedule's action lists on torch.distributed workers.

Data flow on every worker (one process per rank, gloo on CPU, NCCL on CUDA)::

    config -> model (seeded) -> capture -> plan -> stage modules (stage.py)
           -> schedule (pipetrain.schedule) -> Executor (executor.py)
                 F/B/I/W  -> StageRuntime: WeightVersions (versions.py), FunctionalOptimizer (optim.py)
                 SEND/RECV/ALLREDUCE -> Comm (comm.py), the only module touching the wire

Entry points: :func:`train` (what ``pipetrain train`` calls), :func:`launch_local`,
:func:`run_rank` (one worker), :func:`replay_schedule` / :func:`train_single_process`
(the single-process references), :func:`split_by_config` (balanced plans).
"""
from __future__ import annotations

from .config import LRSchedule, OptimizerConfig, TrainConfig
from .launch import WorkerFailure, launch_local, train
from .optim import FunctionalOptimizer
from .reference import replay_config, replay_schedule, single_config, train_single_process
from .stage import StageModule, build_stage_modules, partition_graph, split_by_config
from .versions import WeightVersions
from .worker import run_rank

__all__ = [
    "FunctionalOptimizer", "LRSchedule", "OptimizerConfig", "StageModule", "TrainConfig", "WeightVersions",
    "WorkerFailure", "build_stage_modules", "launch_local", "partition_graph", "replay_config", "replay_schedule",
    "run_rank", "single_config", "split_by_config", "train", "train_single_process",
]
