"""``--workers 1``: plain training in this process (the reference every schedule is held to).

With one worker every schedule reduces to the same thing: one stage, one version, one
update per minibatch of the whole batch's mean loss. This path runs exactly that with
``torch.optim`` (no process group, no stage modules) on a one-process
:class:`~pipetrain.runtime.resolved.ResolvedRun`, and reports the same
:class:`~pipetrain.runtime.result.RunResult`, and the same checkpoint format, as a
distributed run.
"""
from __future__ import annotations

import torch

from ..errors import RuntimeConfigError
from .checkpoint import (
    TrainerState,
    check_resumable,
    load_checkpoint,
    load_torch_optimizer_state,
    save_checkpoint,
    torch_optimizer_state,
)
from .data import UnitData
from .log import progress, setup_logging
from .memory import peak_rss_life_mib, proc_status_mib, reset_peak_rss, tune_malloc
from .model import load_bundle
from .reference import make_torch_optimizer, train_single_process
from .resolved import ResolvedRun
from .result import RunResult

__all__ = ["train_one_process"]


def train_one_process(run: ResolvedRun) -> RunResult:
    """Train a one-process run in this process; returns its result (``pipetrain train --json``)."""
    cfg = run.config
    if not run.in_process:
        raise RuntimeConfigError(f"train_one_process runs one-process runs, not one on {run.world_size} workers")
    if run.data is not None:  # --data: real data, evaluated at the run's boundaries (single_data.py)
        from .single_data import train_one_process_data

        return train_one_process_data(run)
    if cfg.performance.threads is not None and cfg.parallel.device == "cpu":
        torch.set_num_threads(cfg.performance.threads)
    if cfg.performance.tune_malloc:
        tune_malloc()
    if not cfg.output.quiet:
        setup_logging(cfg.output.progress_to_stderr)
    device = torch.device("cuda" if cfg.parallel.device == "cuda" else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeConfigError("--device cuda but CUDA is not available on this machine; use --device cpu")
    batch_size = run.batch_size
    bundle = load_bundle(cfg, batch_size)
    model = bundle.model.to(device)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    optimizer = make_torch_optimizer([p for p in model.parameters() if p.requires_grad], cfg.optimizer)
    start = 0
    if cfg.checkpoint.resume:
        path = cfg.checkpoint.resume
        state, trainer = load_checkpoint(path)
        check_resumable(path, trainer, cfg)
        model.load_state_dict(state)
        load_torch_optimizer_state(optimizer, names, trainer.optimizer_state)
        start = trainer.step
    warmup, steps = cfg.training.warmup_steps, cfg.training.steps
    total = run.total_steps
    data = UnitData(bundle.make_batch, batch_size, 1, cfg.training.seed, start, device)
    data.prefetch(total)  # data generation stays out of the timed window
    peak_reset = reset_peak_rss()
    rss_setup = proc_status_mib("VmRSS")
    res = train_single_process(model, bundle.loss_fn, data, total, cfg.optimizer, cfg.training.lr_schedule,
                               cfg.training.clip_grad_norm, optimizer=optimizer, start_step=start,
                               lr_total=start + total, warmup_steps=warmup)
    losses = res.losses[warmup:]
    every = cfg.output.log_every
    if not cfg.output.quiet and every:
        for i, loss in enumerate(res.losses):
            if (start + i + 1) % every == 0:
                progress.info("step %d: loss %.6f", start + i + 1, loss)
    peak = proc_status_mib("VmHWM") if peak_reset else None
    result = RunResult(
        steps=steps, samples_per_second=batch_size * steps / res.seconds if res.seconds > 0 else 0.0,
        final_loss=losses[-1] if losses else None, losses=losses, config="1", schedule=cfg.parallel.schedule,
        workers=1, batch_size=batch_size, microbatches=1, seconds=res.seconds, warmup_steps=warmup,
        warmup_losses=res.losses[:warmup], start_step=start, plan_source=run.plan_note, stages=1,
        device=str(device), peak_rss_mib=[peak or peak_rss_life_mib()],
        peak_rss_scope="training" if peak_reset else "process", rss_setup_mib=[rss_setup],
        rss_end_mib=[proc_status_mib("VmRSS")], peak_rss_life_mib=[peak_rss_life_mib()], run=run.to_json())
    if cfg.checkpoint.save is not None:
        steps_done = start + total
        save_checkpoint(cfg.checkpoint.save, res.state, TrainerState(
            steps_done, cfg.model.name, dict(cfg.model.options), cfg.to_dict()["optimizer"],
            torch_optimizer_state(optimizer, names), {n: steps_done for n in names}))
        result.saved = cfg.checkpoint.save
    if cfg.debug.return_state:
        result.state = res.state
    return result
