"""The distributed runtime: execute a resolved run's action lists on torch.distributed workers.

The runtime decides nothing: it receives a :class:`ResolvedRun` (made by
:func:`pipetrain.run.resolve_run`, which plans) and executes it. On every worker (one
process per rank, gloo on CPU, NCCL on CUDA)::

    ResolvedRun -> model (seeded) -> capture -> cut into the plan's stage node lists (stage.py)
           -> Executor (executor.py) runs this rank's actions of every segment
                 F/B/I/W  -> StageRuntime: WeightVersions (versions.py), FunctionalOptimizer (optim.py)
                 SEND/RECV/ALLREDUCE -> Comm (comm.py), the only module touching the wire
           -> RankReport (result.py) gathered to rank 0 -> RunResult

Entry points: :func:`launch_local` (local worker processes), :func:`run_rank` (one worker),
:func:`train_one_process` (one process), :func:`replay_config` / :func:`single_config`
(the single-process references of a resolved run). :func:`train` (configuration in,
result out) is :func:`pipetrain.run.train`.
"""
from __future__ import annotations

from typing import Any

from .config import LRSchedule, OptimizerConfig, TrainConfig
from .failures import FailureRecord, WorkerFailure
from .launch import launch_local
from .optim import FunctionalOptimizer
from .reference import replay_config, replay_schedule, single_config, train_single_process
from .resolved import ResolvedRun, Segment
from .result import RankReport, RunResult
from .single import train_one_process
from .stage import StageModule, build_stage_modules, partition_graph
from .versions import WeightVersions
from .worker import run_rank

__all__ = [
    "FailureRecord", "FunctionalOptimizer", "LRSchedule", "OptimizerConfig", "RankReport", "ResolvedRun",
    "RunResult", "Segment", "StageModule", "TrainConfig", "WeightVersions", "WorkerFailure", "build_stage_modules",
    "launch_local", "partition_graph", "replay_config", "replay_schedule", "run_rank", "single_config", "train",
    "train_one_process", "train_single_process",
]


def train(cfg: TrainConfig) -> Any:
    """:func:`pipetrain.run.train` (kept here for ``pipetrain.runtime.train`` callers)."""
    from ..run.launcher import train as run_train

    return run_train(cfg)
