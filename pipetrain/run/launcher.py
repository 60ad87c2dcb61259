"""``train(cfg)``: resolve the run once, then launch it (the library entry of ``pipetrain train``).

    CLI (TrainConfig) -> preflight: resolve_run (plan) + cheap checks -> ResolvedRun
        -> one process (runtime.single)            workers == 1
        -> launch_local: N worker processes        otherwise (torchrun's launcher API)
        -> this process is one worker               under an outer torchrun: rank 0 resolves
                                                    and broadcasts the ResolvedRun

Several machines: run on each ::

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        -m pipetrain train --model vgg16 --config 3-1 --schedule pipedream --steps 100
"""
from __future__ import annotations

import os
from typing import Any

from ..errors import RuntimeConfigError
from ..job.config import TrainConfig
from ..job.resolved import ResolvedRun
from ..job.result import RunResult
from ..runtime.process.failures import FailureRecord, WorkerFailure
from ..runtime.process.log import setup_logging

__all__ = ["train", "under_torchrun"]


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (or another elastic agent) as a worker."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def train(cfg: TrainConfig) -> RunResult | None:
    """Run one training run (module docstring); returns rank 0's :class:`RunResult`
    (``None`` on the other ranks under torchrun)."""
    if not cfg.output.quiet:
        setup_logging(cfg.output.progress_to_stderr)
    if under_torchrun():
        from ..runtime.worker.main import shutdown_process_group

        try:
            return _train_as_worker(cfg)
        finally:
            shutdown_process_group()  # never leave the group to static destruction (see there)
    from ..runtime import launch, single
    from . import checks

    run = checks.preflight(cfg)  # everything decidable before any process starts
    run = _check_checkpointing(run)
    if run.in_process:
        return single.train_one_process(run)
    return launch.launch_local([run], timeout=cfg.performance.timeout,
                               max_restarts=cfg.checkpoint.max_restarts)[0]


def _check_checkpointing(run: ResolvedRun) -> ResolvedRun:
    """``--checkpoint-dir``: a distributed run, and the latest checkpoint there (if any) is of
    this model; the run gets a segment boundary at its step (a checkpoint of another layout or
    ``--checkpoint-every``), so that the workers resume there (runtime/checkpoints/periodic.py)."""
    ck = run.config.checkpoint
    if ck.checkpoint_dir is None:
        return run
    if run.in_process:
        raise RuntimeConfigError(
            f"--checkpoint-dir {ck.checkpoint_dir} needs a pipeline run of 2 or more workers (one-process runs write "
            f"only --save); pass --workers 2 or more, or use --save/--resume")
    from ..checkpoint import latest_checkpoint, read_manifest
    from ..job.segments import check_boundary, cut_at

    latest = latest_checkpoint(ck.checkpoint_dir)
    if latest is not None:
        run = cut_at(run, read_manifest(latest).step)
    check_boundary(run, ck.checkpoint_dir)
    return run


def _train_as_worker(cfg: TrainConfig) -> RunResult | None:
    """Under torchrun: rank 0 resolves the run and broadcasts it (or its failure) to every rank."""
    import torch.distributed as dist

    from ..runtime.worker.main import init_distributed, run_rank

    world = int(os.environ["WORLD_SIZE"])
    if cfg.parallel.workers is not None and cfg.parallel.workers != world:
        raise RuntimeConfigError(
            f"--workers {cfg.parallel.workers} but torchrun started {world} processes; pass --workers {world} or "
            f"omit it")
    rank, world, _ = init_distributed(cfg)
    box: list[Any] = [None]
    error: BaseException | None = None
    if rank == 0:
        from .checks import check_output_paths
        from .resolve import resolve_run

        try:
            check_output_paths(cfg)
            # --checkpoint-dir: the latest checkpoint is of this model and a boundary of this run
            # (cut_at), decided once on rank 0 as the local launcher does, then broadcast
            box[0] = _check_checkpointing(resolve_run(cfg, world))
        except BaseException as e:  # every rank must hear of it, not wait at the broadcast
            error, box[0] = e, FailureRecord.of(0, e)
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], FailureRecord):
        if error is not None:
            raise error
        raise WorkerFailure.of(box[0])
    run: ResolvedRun = box[0]
    if cfg.checkpoint.max_restarts and rank == 0 and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) == 0:
        import logging

        logging.getLogger("pipetrain").warning(
            "--max-restarts %d is applied by the local launcher; under torchrun pass torchrun's own --max-restarts "
            "(the workers resume from --checkpoint-dir after a restart)", cfg.checkpoint.max_restarts)
    if run.in_process:  # torchrun with one process: plain training
        from ..runtime.single import train_one_process

        return train_one_process(run)
    return run_rank(run)
