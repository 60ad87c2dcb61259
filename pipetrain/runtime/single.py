"""``--workers 1``: plain training in this process (the reference every schedule is held to).

With one worker every schedule reduces to the same thing: one stage, one version, one
update per minibatch of the whole batch's mean loss. This path runs exactly that with
``torch.optim`` (no process group, no stage modules) and reports the same summary, and the
same checkpoint format, as a distributed run.
"""
from __future__ import annotations

import resource
import sys
from typing import Any

import torch

from ..errors import RuntimeConfigError
from .checkpoint import TrainerState, load_checkpoint, load_torch_optimizer_state, save_checkpoint, torch_optimizer_state
from .config import TrainConfig
from .data import UnitData
from .reference import make_torch_optimizer, train_single_process
from .resolve import load_bundle, resolve_batch_size

__all__ = ["train_one_process"]


def train_one_process(cfg: TrainConfig) -> dict[str, Any]:
    """Train ``cfg`` in this process; returns the run summary (see ``pipetrain train --json``)."""
    if cfg.threads is not None and cfg.device == "cpu":
        torch.set_num_threads(cfg.threads)
    if cfg.tune_malloc:
        from .worker import tune_malloc

        tune_malloc()
    device = torch.device("cuda" if cfg.device == "cuda" else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeConfigError("--device cuda but CUDA is not available on this machine; use --device cpu")
    batch_size = resolve_batch_size(cfg)
    cfg.check_counts(batch_size)
    bundle = load_bundle(cfg, batch_size)
    from .preflight import check_model_batch

    check_model_batch(cfg, bundle, batch_size)
    model = bundle.model.to(device)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    optimizer = make_torch_optimizer([p for p in model.parameters() if p.requires_grad], cfg.optimizer)
    start = 0
    if cfg.resume:
        state, trainer = load_checkpoint(cfg.resume)
        if trainer.model != cfg.model or trainer.model_options != dict(cfg.model_options):
            raise RuntimeConfigError(
                f"checkpoint {cfg.resume} is for model {trainer.model} {trainer.model_options}; resume with the same "
                f"--model and --option values")
        model.load_state_dict(state)
        load_torch_optimizer_state(optimizer, names, trainer.optimizer_state)
        start = trainer.step
    total = cfg.warmup_steps + cfg.steps
    data = UnitData(bundle.make_batch, batch_size, 1, cfg.seed, start, device)
    data.prefetch(total)  # data generation stays out of the timed window
    from .worker import _proc_status_mib, reset_peak_rss

    peak_reset = reset_peak_rss()
    rss_setup = _proc_status_mib("VmRSS")
    res = train_single_process(model, bundle.loss_fn, data, total, cfg.optimizer, cfg.lr_schedule,
                               cfg.clip_grad_norm, optimizer=optimizer, start_step=start,
                               lr_total=start + total, warmup_steps=cfg.warmup_steps)
    losses = res.losses[cfg.warmup_steps:]
    if not cfg.quiet and cfg.log_every:
        stream = sys.stderr if cfg.log_to_stderr else sys.stdout
        for i, loss in enumerate(res.losses):
            if (start + i + 1) % cfg.log_every == 0:
                print(f"step {start + i + 1}: loss {loss:.6f}", file=stream)
    result: dict[str, Any] = {
        "steps": cfg.steps, "samples_per_second": batch_size * cfg.steps / res.seconds if res.seconds > 0 else 0.0,
        "final_loss": losses[-1] if losses else None, "losses": losses, "config": "1", "schedule": cfg.schedule,
        "workers": 1, "batch_size": batch_size, "microbatches": 1, "seconds": res.seconds,
        "warmup_steps": cfg.warmup_steps, "warmup_losses": res.losses[:cfg.warmup_steps], "start_step": start,
        "plan_source": "one process (plain training with torch.optim)", "stages": 1, "device": str(device),
        "peak_rss_mib": [(_proc_status_mib("VmHWM") if peak_reset else None)
                         or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0],
        "peak_rss_scope": "training" if peak_reset else "process",
        "rss_setup_mib": [rss_setup], "rss_end_mib": [_proc_status_mib("VmRSS")],
        "peak_rss_life_mib": [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0],
    }
    if cfg.save is not None:
        steps_done = start + total
        save_checkpoint(cfg.save, res.state, TrainerState(
            steps_done, cfg.model, dict(cfg.model_options), cfg.to_dict()["optimizer"],
            torch_optimizer_state(optimizer, names), {n: steps_done for n in names}))
        result["saved"] = cfg.save
    if cfg.return_state:
        result["state"] = res.state
    return result
