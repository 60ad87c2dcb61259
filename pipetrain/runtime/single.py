"""``--workers 1``: plain training in this process (the reference every schedule is held to).

With one worker every schedule reduces to the same thing: one stage, one version, one
update per minibatch with the mean gradient of its ``--microbatches`` units (the minibatch
cut into m equal chunks, each unit's loss back-propagated; m = 1: the whole minibatch), as a
synchronous schedule computes it. Buffers the forward updates are updated once per unit, in
unit order; random operations draw from the per-unit stream (:class:`PlainStep`,
:mod:`pipetrain.graph.random_ops`), so this is the reference of every synchronous schedule
with the same microbatches. :func:`train_one_process` runs exactly that with ``torch.optim``
(no process group, no stage modules) on a one-process
:class:`~pipetrain.job.resolved.ResolvedRun`, segment by segment, on either

- the model's synthetic batches (minibatch ``t`` from the seed ``seed + t``, made before
  the timed window), resumable from ``--resume``; or
- real data (``--data``): the minibatches of a pipeline run (the
  :class:`~pipetrain.data.EpochSampler` of the seed, read through a
  :class:`~pipetrain.data.UnitLoader` of whole minibatches), the data's loss unless the
  model brings its own, and an evaluation of the whole eval split after every segment the
  resolved run marks ``evaluate`` (the pipeline's boundaries).

Either way it reports progress, logs and the target as the driving rank of a pipeline does
(:class:`~pipetrain.runtime.worker.monitor.TrainMonitor`), and returns the same
:class:`~pipetrain.job.result.RunResult`, and writes the same checkpoint format, as a
distributed run.

:func:`train_single_process` is the same plain training as a library function (a model,
its loss, the units, a number of steps): what the reference
:func:`~pipetrain.runtime.reference.single_config` runs.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor, nn

from ..errors import RuntimeConfigError
from ..graph.random_ops import unit_stream
from ..job.config import LRSchedule, OptimizerConfig, TrainConfig
from ..job.model import load_bundle
from ..job.resolved import ResolvedRun
from ..job.result import RunResult
from .checkpoints.export import (
    TrainerState,
    check_resumable,
    load_checkpoint,
    load_torch_optimizer_state,
    save_checkpoint,
    save_hf_whole,
    torch_optimizer_state,
)
from .engine.precision import autocast
from .engine.units import UnitData, split_batch
from .engine.whole_graph import unit_graph
from .process.log import progress
from .process.rss import peak_rss_life_mib, proc_status_mib, reset_peak_rss
from .process.setup import process_device, setup_process
from .process.user_code import model_failure
from .worker.monitor import TrainMonitor

if TYPE_CHECKING:
    from ..metrics import EvalAccumulator

__all__ = ["train_one_process", "train_single_process", "make_torch_optimizer", "evaluate_model", "PlainStep",
           "SingleResult"]

Batch = tuple[Sequence[Any], Any]


def make_torch_optimizer(params: Sequence[Tensor], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """The ``torch.optim`` optimizer matching ``cfg``."""
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, dampening=cfg.dampening,
                               nesterov=cfg.nesterov, weight_decay=cfg.weight_decay)
    cls = torch.optim.Adam if cfg.name == "adam" else torch.optim.AdamW
    return cls(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


class PlainStep:
    """One step of plain training: the minibatch's units, their backwards, clipping, ``torch.optim``.

    With ``microbatches`` m > 1 the minibatch is cut into m equal units (chunks along the
    batch dimension, as a pipeline cuts it); each unit's loss is back-propagated and the
    summed gradient divided by m, so the step uses the mean gradient and reports the mean
    loss of its units, exactly as a synchronous schedule does. With a ``seed``, unit ``j`` of
    step ``k`` runs under the per-unit random stream of unit ``k * m + j``
    (:mod:`pipetrain.graph.random_ops`).

    Args:
        model, loss_fn: what is trained, and a unit's mean loss.
        optimizer: the ``torch.optim`` optimizer of ``model``'s trainable parameters.
        base_lr, lr_schedule: the learning rate of step ``k`` is ``lr_schedule.lr(base_lr, k, horizon)``.
        clip: max 2-norm of the gradient over all trainable parameters (``None``: no clipping).
        horizon: the schedule's default horizon (the run's last step).
        microbatches: units per minibatch.
        seed: the run's seed, for the per-unit random stream (``None``: the global generator).
        graph: what the forward runs, when not ``model`` itself: the model's captured graph
            built as one stage, its random nodes seeded
            (:func:`~pipetrain.runtime.engine.whole_graph.unit_graph`), sharing the model's
            parameters and buffers.
    """

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any, Any], Tensor], optimizer: torch.optim.Optimizer,
                 base_lr: float, lr_schedule: LRSchedule, clip: float | None, horizon: int, microbatches: int = 1,
                 seed: int | None = None, graph: nn.Module | None = None, precision: str = "fp32") -> None:
        self.model, self.loss_fn, self.optimizer = model, loss_fn, optimizer
        self.precision = precision  # --precision: the forward under autocast (runtime/engine/precision.py)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.base_lr, self.lr_schedule, self.clip = base_lr, lr_schedule, clip
        self.horizon = max(1, horizon)
        self.microbatches = microbatches
        self.seed = seed if graph is not None else None  # only a seeded graph draws from the per-unit stream
        self.forward = graph if graph is not None else model

    def _stream(self, unit: int, inputs: Sequence[Any]) -> AbstractContextManager[None]:
        if self.seed is None:
            return nullcontext()
        return unit_stream(self.seed, unit, [x.device for x in inputs if isinstance(x, Tensor)])

    def __call__(self, batch: Batch, k: int) -> float:
        """Train on ``batch`` as optimizer step ``k`` (0-based over the run); returns its loss."""
        m = self.microbatches
        self.optimizer.zero_grad(set_to_none=True)
        units = split_batch((tuple(batch[0]), batch[1]), m) if m > 1 else [batch]
        total = 0.0
        for j, (inputs, target) in enumerate(units):
            device = next((x.device for x in inputs if isinstance(x, Tensor)), torch.device("cpu"))
            with self._stream(k * m + j, inputs), autocast(self.precision, device):
                loss = self.loss_fn(self.forward(*inputs), target)
            loss.backward()
            total += float(loss.detach())
        if m > 1:
            for p in self.params:
                if p.grad is not None:
                    p.grad.div_(m)
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        lr = self.lr_schedule.lr(self.base_lr, k, self.horizon)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.step()
        return total / m


class _Units(Protocol):
    """Whole minibatches by index (``unit(i)``: ``(inputs, target)``), e.g. a
    :class:`~pipetrain.runtime.engine.units.UnitData` of one unit per step."""

    def unit(self, unit: int) -> Batch: ...


def _run_steps(step: PlainStep, units: _Units, first: int, count: int,
              on_step: Callable[[int, float], None] | None = None,
              example_inputs: Sequence[Any] | None = None) -> list[float]:
    """Steps ``first .. first + count - 1`` on ``units.unit(0 .. count - 1)``: their losses.
    ``on_step(steps done, loss)`` after each (1-based, absolute). With the model's
    ``example_inputs``, an exception of the model's own code names its step and node
    (:func:`~pipetrain.runtime.process.user_code.model_failure`)."""
    losses: list[float] = []
    for i in range(count):
        batch = units.unit(i)
        try:
            value = step(batch, first + i)
        except Exception as e:
            found = None if example_inputs is None else model_failure(e, step.model, step.loss_fn, example_inputs,
                                                                       batch, first + i, i)
            if found is None:
                raise
            raise found from e
        losses.append(value)
        if on_step is not None:
            on_step(first + i + 1, value)
    return losses


@dataclass
class SingleResult:
    """Losses per step and final state of single-process training."""

    losses: list[float]
    state: dict[str, Tensor]
    optimizer: torch.optim.Optimizer
    seconds: float = 0.0


def train_single_process(model: nn.Module, loss_fn: Callable[[Any, Any], Tensor], data: UnitData, steps: int,
                         opt: OptimizerConfig, lr_schedule: LRSchedule | None = None, clip: float | None = None,
                         optimizer: torch.optim.Optimizer | None = None, start_step: int = 0,
                         lr_total: int | None = None, warmup_steps: int = 0, microbatches: int = 1,
                         seed: int | None = None, graph: nn.Module | None = None) -> SingleResult:
    """Plain training: per step the minibatch's ``microbatches`` units, their backwards, the
    mean gradient, ``torch.optim`` (:class:`PlainStep`, whose ``seed`` and ``graph`` these are).

    ``data`` must have ``units_per_step == 1`` (whole minibatches). ``start_step`` is the
    number of steps done before (resumed runs: the LR schedule continues from there).
    Steps before ``warmup_steps`` are excluded from :attr:`SingleResult.seconds`.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = optimizer or make_torch_optimizer(params, opt)
    horizon = lr_total if lr_total is not None else start_step + steps
    step = PlainStep(model, loss_fn, optimizer, opt.lr, lr_schedule or LRSchedule(), clip, horizon,
                     microbatches=microbatches, seed=seed, graph=graph)
    untimed = warmup_steps if warmup_steps < steps else 0
    model.train()
    losses = _run_steps(step, data, start_step, untimed)
    t0 = time.perf_counter()
    losses += _run_steps(step, _Shifted(data, untimed), start_step + untimed, steps - untimed)
    seconds = time.perf_counter() - t0
    return SingleResult(losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, optimizer, seconds)


@dataclass
class _Shifted:
    """``units`` from unit ``shift`` on: ``unit(i)`` is ``units.unit(shift + i)``."""

    units: _Units
    shift: int

    def unit(self, unit: int) -> Batch:
        return self.units.unit(self.shift + unit)

    def close(self) -> None:
        pass


class _SegmentUnits(_Units, Protocol):
    """The minibatches of one segment (``unit(i)``: the segment's ``i``-th), closed after it."""

    def close(self) -> None: ...


#: ``open(first step, steps)``: the minibatches of the segment of ``steps`` steps from ``first``.
_OpenSegment = Callable[[int, int], _SegmentUnits]
#: ``evaluate(steps done, training seconds)``: the evaluation at a boundary (the eval split, the model now).
_Evaluate = Callable[[int, float], Any]


def evaluate_model(model: nn.Module, dataset: Any, batch_size: int, task: str, loss_fn: Any,
                   device: torch.device, precision: str = "fp32") -> EvalAccumulator:
    """The :class:`~pipetrain.metrics.EvalAccumulator` of ``model`` over the whole ``dataset``
    (eval mode, no autograd, the forward under ``precision``'s autocast as in training; the
    model's training mode is restored)."""
    from ..data import EvalBatches
    from ..metrics import EvalAccumulator

    acc = EvalAccumulator(kind=task if task != "synthetic" else None)  # type: ignore[arg-type]
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            for b in EvalBatches(dataset, batch_size):
                inputs = tuple(x.to(device) for x in b.inputs)
                assert b.target is not None
                with autocast(precision, device):
                    out = model(*inputs)
                acc.update(out, b.target.to(device), loss_fn=loss_fn, count=b.count)
    finally:
        model.train(was)
    return acc


@dataclass
class _Trainee:
    """What one process trains: the model, its loss, its optimizer, where its minibatches come from."""

    model: nn.Module
    loss_fn: Callable[[Any, Any], Tensor]
    names: list[str]                         # trainable parameters, in the optimizer's order
    optimizer: torch.optim.Optimizer
    open_segment: _OpenSegment
    evaluate: _Evaluate | None = None        # real data: the eval split at the run's boundaries
    start: int = 0                           # steps done before (--resume)
    example_inputs: tuple[Any, ...] = ()     # the model's example batch (names the node of a failure)


@dataclass
class _Trained:
    """Where the segments left the run."""

    step: int                                # steps done (absolute)
    timed: int = 0                           # timed steps run (fewer when a target stopped the run)
    losses: list[float] = field(default_factory=list)           # timed steps
    warmup_losses: list[float] = field(default_factory=list)


def train_one_process(run: ResolvedRun) -> RunResult:
    """Train a one-process run in this process (module docstring); returns its result."""
    cfg = run.config
    if not run.in_process:
        raise RuntimeConfigError(f"train_one_process runs one-process runs, not one on {run.world_size} workers")
    if run.data is not None and cfg.checkpoint.resume:
        raise RuntimeConfigError("--resume with --data on one worker is not supported yet; resume on 2 or more "
                                 "workers, or train from the start")
    device = process_device(cfg)
    setup_process(cfg, device)
    trainee = _trainee(run, device)
    monitor = TrainMonitor(run, None, None, trainee.start)
    peak_reset = reset_peak_rss()
    rss_setup = proc_status_mib("VmRSS")
    trained = _train_segments(run, trainee, monitor)
    result = _result(run, trained, monitor.clock.elapsed(), device, trainee.start, peak_reset, rss_setup)
    result.add_evaluation(monitor.summary(trained.step), run.data)
    state = {k: v.detach().to("cpu", copy=True) for k, v in trainee.model.state_dict().items()}
    if cfg.checkpoint.save is not None:
        _save(cfg, cfg.checkpoint.save, state, trainee, trained.step)
        result.saved = cfg.checkpoint.save
    if cfg.checkpoint.save_hf is not None:
        save_hf_whole(cfg, state, list(state))
    if cfg.debug.return_state:
        result.state = state
    return result


def _trainee(run: ResolvedRun, device: torch.device) -> _Trainee:
    """The model from the seed on ``device``, its optimizer (restored by ``--resume``) and its data."""
    cfg = run.config
    bundle = load_bundle(cfg, run.batch_size)
    model = bundle.model.to(device)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    if run.data is not None:
        return _on_data(run, bundle, model, names, device)
    optimizer = make_torch_optimizer([p for p in model.parameters() if p.requires_grad], cfg.optimizer)
    start = _resume(cfg, model, names, optimizer)
    data = UnitData(bundle.make_batch, run.batch_size, 1, cfg.training.seed, start, device)
    data.prefetch(run.total_steps)  # data generation stays out of the timed window
    return _Trainee(model, bundle.loss_fn, names, optimizer, lambda first, _: _Shifted(data, first - start),
                    start=start, example_inputs=tuple(bundle.example_inputs))


def _on_data(run: ResolvedRun, bundle: Any, model: nn.Module, names: list[str], device: torch.device) -> _Trainee:
    """Real data (``--data``): the pipeline's minibatches, the data's loss unless the model
    brings its own, and the evaluation of the whole eval split."""
    from ..data import EpochSampler, UnitLoader, UnitWorkers, loss_for

    cfg, spec = run.config, run.data
    assert spec is not None
    own = not getattr(bundle, "default_loss", False)
    loss_fn = bundle.loss_fn if own else loss_for(spec.target_dtype)
    source = spec.load()
    optimizer = make_torch_optimizer([p for p in model.parameters() if p.requires_grad], cfg.optimizer)
    sampler = EpochSampler(source.num_train, run.batch_size, seed=spec.seed)

    # background workers (--loader-workers): started once, every segment's loader reads from them
    workers = UnitWorkers(source.train, sampler, 1, "both", spec.loader_workers) if spec.loader_workers else None

    def open_segment(first: int, steps: int) -> _SegmentUnits:
        return UnitLoader(source.train, sampler, 1, range(steps), part="both", step_offset=first, device=device,
                          workers=workers)

    def evaluate(step: int, seconds: float) -> Any:
        acc = evaluate_model(model, source.eval, spec.eval_batch_size, spec.task, loss_fn if own else None, device,
                             cfg.training.precision)
        return acc.result(step, step / spec.steps_per_epoch, step * run.batch_size, seconds)

    return _Trainee(model, loss_fn, names, optimizer, open_segment, evaluate,
                    example_inputs=tuple(bundle.example_inputs))


def _resume(cfg: TrainConfig, model: nn.Module, names: list[str], optimizer: torch.optim.Optimizer) -> int:
    """``--resume PATH``: the weights and optimizer state of a ``--save`` checkpoint; its step (0: none)."""
    path = cfg.checkpoint.resume
    if not path:
        return 0
    state, trainer = load_checkpoint(path)
    check_resumable(path, trainer, cfg)
    model.load_state_dict(state)
    load_torch_optimizer_state(optimizer, names, trainer.optimizer_state)
    return trainer.step


def _train_segments(run: ResolvedRun, trainee: _Trainee, monitor: TrainMonitor) -> _Trained:
    """Every segment of the run in order; the monitor's clock runs during the timed ones. After
    a segment marked ``evaluate`` the model is evaluated, and the run stops at its target."""
    cfg = run.config
    step = PlainStep(trainee.model, trainee.loss_fn, trainee.optimizer, cfg.optimizer.lr, cfg.training.lr_schedule,
                     cfg.training.clip_grad_norm, trainee.start + run.total_steps, microbatches=run.microbatches,
                     seed=cfg.training.seed, graph=unit_graph(trainee.model, trainee.example_inputs, run.microbatches),
                     precision=cfg.training.precision)
    every = 0 if cfg.output.quiet else cfg.output.log_every

    def on_step(done: int, loss: float) -> None:
        if monitor.wants_steps:
            monitor.on_step(done, loss)
        elif every and done % every == 0:
            progress.info("step %d: loss %.6f", done, loss)

    out = _Trained(trainee.start)
    trainee.model.train()
    for seg in run.segments:
        units = trainee.open_segment(out.step, seg.steps)
        if seg.timed:
            monitor.clock.start() if out.timed == 0 else monitor.clock.resume()
        losses = _run_steps(step, units, out.step, seg.steps, on_step, trainee.example_inputs)
        units.close()
        if seg.timed:
            monitor.clock.pause()
            out.timed += seg.steps
        (out.losses if seg.timed else out.warmup_losses).extend(losses)
        out.step += seg.steps
        evaluate = trainee.evaluate if seg.evaluate else None
        if evaluate is not None and monitor.on_eval(evaluate(out.step, monitor.clock.elapsed())):
            break  # the target is reached
    monitor.close(out.step)
    return out


def _result(run: ResolvedRun, trained: _Trained, seconds: float, device: torch.device, start: int,
            peak_reset: bool, rss_setup: float | None) -> RunResult:
    """The one process's :class:`RunResult`, right after training: ``seconds`` of timed
    training, memory since ``reset_peak_rss()`` (``peak_reset``: it took) when RSS was ``rss_setup``."""
    cfg = run.config
    b, steps, losses = run.batch_size, trained.timed, trained.losses
    peak = proc_status_mib("VmHWM") if peak_reset else None
    return RunResult(
        steps=steps, samples_per_second=b * steps / seconds if seconds > 0 else 0.0,
        final_loss=losses[-1] if losses else None, losses=losses, config="1", schedule=cfg.parallel.schedule,
        workers=1, batch_size=b, microbatches=run.microbatches, seconds=seconds, warmup_steps=cfg.training.warmup_steps,
        warmup_losses=trained.warmup_losses, start_step=start, plan_source=run.plan_note, stages=1,
        device=str(device), peak_rss_mib=[peak or peak_rss_life_mib()],
        peak_rss_scope="training" if peak_reset else "process", rss_setup_mib=[rss_setup],
        rss_end_mib=[proc_status_mib("VmRSS")], peak_rss_life_mib=[peak_rss_life_mib()], run=run.to_json())


def _save(cfg: TrainConfig, path: str, state: dict[str, Tensor], trainee: _Trainee, step: int) -> None:
    """``--save PATH``: the state_dict and a version-1 trainer sidecar (everything in it)."""
    names = trainee.names
    save_checkpoint(path, state, TrainerState(
        step, cfg.model.name, dict(cfg.model.options), cfg.to_dict()["optimizer"],
        torch_optimizer_state(trainee.optimizer, names), {n: step for n in names}))
