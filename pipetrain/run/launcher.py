"""``train(cfg)``: resolve the run once, then launch it (the library entry of ``pipetrain train``).

    CLI (TrainConfig) -> preflight: resolve_run (plan) + cheap checks -> ResolvedRun
        -> one process (runtime.single)            workers == 1
        -> launch_local: N worker processes        otherwise (torchrun's launcher API)
        -> this process is one worker               under an outer torchrun: rank 0 resolves
                                                    and broadcasts the ResolvedRun

``--checkpoint-dir``: the checkpoint to resume is chosen here, once, before any worker starts
(:func:`~pipetrain.checkpoint.resume_point`: a damaged latest one with no valid older one stops
the run; ``--restart`` first moves the directory's checkpoints aside). Ctrl-C (SIGINT) or
SIGTERM stops every worker; the partial checkpoints they leave are removed and
:class:`~pipetrain.runtime.process.signals.RunInterrupted` names the last complete checkpoint.

Several machines: run on each ::

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        -m pipetrain train --model vgg16 --config 3-1 --schedule pipedream --steps 100
"""
from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import Any

from ..errors import RuntimeConfigError
from ..job.config import TrainConfig
from ..job.resolved import ResolvedRun
from ..job.result import RunResult
from ..runtime.process.failures import FailureRecord, WorkerFailure
from ..runtime.process.faults import first_attempt
from ..runtime.process.log import setup_logging
from ..runtime.process.signals import RunInterrupted

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
        try:
            return single.train_one_process(run)
        except KeyboardInterrupt:
            raise RunInterrupted(signal.SIGINT, "stopped by SIGINT; no checkpoint was written (one-process runs "
                                 "write only --save, at the end)") from None
    try:
        return launch.launch_local([run], timeout=cfg.performance.timeout,
                                   max_restarts=cfg.checkpoint.max_restarts)[0]
    except RunInterrupted as e:  # every worker has exited: what they left half written goes
        raise RunInterrupted(e.signum, _after_interrupt(cfg, e.signum)) from None


def _after_interrupt(cfg: TrainConfig, signum: int) -> str:
    """Remove the partial checkpoints of an interrupted run; the line that says what is left."""
    from ..checkpoint import latest_checkpoint, remove_partial
    from ..runtime.checkpoints.export import parts_dir

    ck = cfg.checkpoint
    removed = 0
    if ck.save is not None:
        removed += len(remove_partial(parts_dir(ck.save))) + _remove_partial_files(Path(ck.save))
    head = f"stopped by {signal.Signals(signum).name}: every worker has exited"
    if ck.checkpoint_dir is None:
        gone = f", {removed} partial checkpoint(s) removed" if removed else ""
        return f"{head}{gone}; no checkpoint was kept (pass --checkpoint-dir DIR to keep some)"
    removed += len(remove_partial(ck.checkpoint_dir))
    gone = f", {removed} partial checkpoint(s) removed" if removed else ""
    latest = latest_checkpoint(ck.checkpoint_dir)
    if latest is None:
        return f"{head}{gone}; {ck.checkpoint_dir} holds no complete checkpoint: the same command starts from step 0"
    return f"{head}{gone}; the last complete checkpoint is {latest}: the same command resumes from it"


def _remove_partial_files(save: Path) -> int:
    """The temporary files a ``--save PATH`` left half written next to PATH (``PATH.XXXX.tmp``,
    ``PATH.trainer.XXXX.tmp``): removed; returns how many."""
    from ..checkpoint.retention import TMP_SUFFIX

    if not save.parent.is_dir():
        return 0
    n = 0
    for f in save.parent.glob(f"{save.name}.*{TMP_SUFFIX}"):
        if f.is_file():
            f.unlink(missing_ok=True)
            n += 1
    return n


def _check_checkpointing(run: ResolvedRun) -> ResolvedRun:
    """``--checkpoint-dir``: a distributed run, and the checkpoint to resume there (if any,
    :func:`~pipetrain.checkpoint.resume_point`) is of this model; the run gets a segment
    boundary at its step (a checkpoint of another layout or ``--checkpoint-every``), so that
    the workers resume there (runtime/checkpoints/periodic.py). ``--restart``: the directory's
    checkpoints are moved aside first (once: a restarted elastic attempt resumes from the
    run's own)."""
    ck = run.config.checkpoint
    if ck.checkpoint_dir is None:
        return run
    if run.in_process:
        raise RuntimeConfigError(
            f"--checkpoint-dir {ck.checkpoint_dir} needs a pipeline run of 2 or more workers (one-process runs write "
            f"only --save); pass --workers 2 or more, or use --save/--resume")
    from ..checkpoint import read_manifest, resume_point, set_aside
    from ..job.segments import check_boundary, cut_at, resumes_inside

    if ck.restart and first_attempt():
        moved = set_aside(ck.checkpoint_dir)
        if moved is not None:
            logging.getLogger("pipetrain").warning("--restart: the checkpoints of %s are moved into %s; training "
                                                   "starts from step 0", ck.checkpoint_dir, moved)
    latest = resume_point(ck.checkpoint_dir)
    if latest is not None:
        man = read_manifest(latest)
        if resumes_inside(run, man.info, man.world_size, man.step):
            return run  # an asynchronous cut of this layout: the workers resume its versions where it was cut
        run = cut_at(run, man.step)
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
