"""``--workers 1`` on real data: plain training in this process, evaluated at the same boundaries.

The one-process counterpart of a pipeline run on ``--data``: the same minibatches (the
:class:`~pipetrain.data.EpochSampler` of the seed, read through a
:class:`~pipetrain.data.UnitLoader` of whole minibatches), the same loss (the data's unless
the model brings its own), ``torch.optim``, and an evaluation of the whole eval split after
every segment that the resolved run marks ``evaluate`` (the pipeline's boundaries), with the
same progress, logs and target as the driving rank of a pipeline
(:class:`~pipetrain.runtime.monitor.TrainMonitor`).
"""
from __future__ import annotations

import torch

from ..errors import RuntimeConfigError
from .checkpoint import TrainerState, save_checkpoint, torch_optimizer_state
from .log import setup_logging
from .memory import peak_rss_life_mib, proc_status_mib, reset_peak_rss, tune_malloc
from .model import load_bundle
from .monitor import TrainMonitor
from .reference import make_torch_optimizer
from .resolved import ResolvedRun
from .result import RunResult

__all__ = ["train_one_process_data", "evaluate_model"]


def evaluate_model(model: torch.nn.Module, dataset: object, batch_size: int, task: str, loss_fn: object,
                   device: torch.device) -> object:
    """The :class:`~pipetrain.metrics.EvalAccumulator` of ``model`` over the whole ``dataset``
    (eval mode, no autograd; the model's training mode is restored)."""
    from ..data import EvalBatches
    from ..metrics import EvalAccumulator

    acc = EvalAccumulator(kind=task if task != "synthetic" else None)  # type: ignore[arg-type]
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            for b in EvalBatches(dataset, batch_size):  # type: ignore[arg-type]
                inputs = tuple(x.to(device) for x in b.inputs)
                assert b.target is not None
                acc.update(model(*inputs), b.target.to(device), loss_fn=loss_fn, count=b.count)  # type: ignore[arg-type]
    finally:
        model.train(was)
    return acc


def train_one_process_data(run: ResolvedRun) -> RunResult:
    """Train a one-process run on real data (module docstring); returns its result."""
    from ..data import EpochSampler, UnitLoader, loss_for

    cfg, spec = run.config, run.data
    if spec is None or not run.in_process:
        raise RuntimeConfigError("train_one_process_data runs one-process runs on real data (--data)")
    if cfg.checkpoint.resume:
        raise RuntimeConfigError("--resume with --data on one worker is not supported yet; resume on 2 or more "
                                 "workers, or train from the start")
    if cfg.performance.threads is not None and cfg.parallel.device == "cpu":
        torch.set_num_threads(cfg.performance.threads)
    if cfg.performance.tune_malloc:
        tune_malloc()
    if not cfg.output.quiet:
        setup_logging(cfg.output.progress_to_stderr)
    device = torch.device("cuda" if cfg.parallel.device == "cuda" else "cpu")
    bundle = load_bundle(cfg, run.batch_size)
    model = bundle.model.to(device)
    own = not getattr(bundle, "default_loss", False)
    loss_fn = bundle.loss_fn if own else loss_for(spec.target_dtype)
    source = spec.load()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_torch_optimizer(params, cfg.optimizer)
    sampler = EpochSampler(source.num_train, run.batch_size, seed=spec.seed)
    monitor = TrainMonitor(run, None, None, 0)
    clip, sched, horizon = cfg.training.clip_grad_norm, cfg.training.lr_schedule, max(1, run.total_steps)
    losses: list[float] = []
    warm_losses: list[float] = []
    step, timed = 0, 0
    peak_reset = reset_peak_rss()
    rss_setup = proc_status_mib("VmRSS")
    model.train()
    for seg in run.segments:
        loader = UnitLoader(source.train, sampler, 1, range(seg.steps), part="both", step_offset=step,
                            num_workers=spec.loader_workers, device=device)
        if seg.timed:
            monitor.clock.start() if timed == 0 else monitor.clock.resume()
        for i in range(seg.steps):
            inputs, target = loader.unit(i)
            assert target is not None  # part="both"
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(*inputs), target)
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(params, clip)
            for g in optimizer.param_groups:
                g["lr"] = sched.lr(cfg.optimizer.lr, step + i, horizon)
            optimizer.step()
            value = float(loss.detach())
            (losses if seg.timed else warm_losses).append(value)
            if monitor.wants_steps:
                monitor.on_step(step + i + 1, value)
        loader.close()
        if seg.timed:
            monitor.clock.pause()
            timed += seg.steps
        step += seg.steps
        if seg.evaluate:
            acc = evaluate_model(model, source.eval, spec.eval_batch_size, spec.task, loss_fn if own else None,
                                 device)
            result = acc.result(step, step / spec.steps_per_epoch, step * run.batch_size,  # type: ignore[attr-defined]
                                monitor.clock.elapsed())
            if monitor.on_eval(result):
                break
    monitor.close(step)
    seconds = monitor.clock.elapsed()
    peak = proc_status_mib("VmHWM") if peak_reset else None
    result = RunResult(
        steps=timed, samples_per_second=run.batch_size * timed / seconds if seconds > 0 else 0.0,
        final_loss=losses[-1] if losses else None, losses=losses, config="1", schedule=cfg.parallel.schedule,
        workers=1, batch_size=run.batch_size, microbatches=1, seconds=seconds, warmup_steps=cfg.training.warmup_steps,
        warmup_losses=warm_losses, start_step=0, plan_source=run.plan_note, stages=1, device=str(device),
        peak_rss_mib=[peak or peak_rss_life_mib()], peak_rss_scope="training" if peak_reset else "process",
        rss_setup_mib=[rss_setup], rss_end_mib=[proc_status_mib("VmRSS")], peak_rss_life_mib=[peak_rss_life_mib()],
        run=run.to_json())
    result.add_evaluation(monitor.summary(step), spec)
    state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    if cfg.checkpoint.save is not None:
        save_checkpoint(cfg.checkpoint.save, state, TrainerState(
            step, cfg.model.name, dict(cfg.model.options), cfg.to_dict()["optimizer"],
            torch_optimizer_state(optimizer, names), {n: step for n in names}))
        result.saved = cfg.checkpoint.save
    if cfg.debug.return_state:
        result.state = state
    return result
