"""Single-process references the pipeline is checked against.

:func:`replay_schedule` emulates what a schedule *means*, independently of the executor: for
each unit ``u`` in order it evaluates the whole original model (``torch.func.functional_call``)
with every stage ``s``'s weights at the version ``v_s(u)`` the schedule's F actions name,
takes the gradient of the unit's loss, adds each stage's part to that stage's current group,
and when a group is complete (all its units, over the stage's replicas, between two STEPs)
applies ``torch.optim`` (one optimizer per stage, on a master copy) to the newest version to
make the next one. This is design.md's rule written the simplest way; the distributed run
must give the same weights.

:func:`train_single_process` is plain training: the whole minibatch, one backward,
``torch.optim``. It is what ``--workers 1`` runs, and what synchronous schedules must equal.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call

from ..schedule.action import Op, Schedule
from .config import LRSchedule, OptimizerConfig
from .data import UnitData
from .model import load_bundle
from .resolved import ResolvedRun

__all__ = ["stage_step_count", "make_torch_optimizer", "replay_schedule", "train_single_process", "ReplayResult",
           "SingleResult", "replay_config", "single_config"]


def make_torch_optimizer(params: Sequence[Tensor], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """The ``torch.optim`` optimizer matching ``cfg``."""
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, dampening=cfg.dampening,
                               nesterov=cfg.nesterov, weight_decay=cfg.weight_decay)
    cls = torch.optim.Adam if cfg.name == "adam" else torch.optim.AdamW
    return cls(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


@dataclass
class ReplayResult:
    """Final (newest) weights by original name, each unit's loss, and versions made per stage."""

    params: dict[str, Tensor]
    losses: dict[int, float] = field(default_factory=dict)
    steps: dict[int, int] = field(default_factory=dict)


def stage_step_count(schedule: Schedule, stage: int) -> int:
    """Optimizer steps of ``stage`` in a schedule (counted on its first replica)."""
    rank = schedule.stage_ranks[stage][0]
    return sum(1 for a in schedule.workers[rank] if a.stage == stage and a.op is Op.STEP)


def _groups(schedule: Schedule, stage: int) -> list[list[int]]:
    """Units of each of the stage's gradient groups (between STEPs, over its replicas)."""
    groups: dict[int, list[int]] = {}
    uses_w = any(a.op is Op.W for acts in schedule.workers for a in acts)
    acc_op = Op.W if uses_w else Op.B
    for rank in schedule.stage_ranks[stage]:
        pending: list[int] = []
        for a in schedule.workers[rank]:
            if a.stage != stage:
                continue
            if a.op is acc_op:
                pending.append(a.mb)
            elif a.op is Op.STEP:
                groups.setdefault(a.mb, []).extend(pending)
                pending = []
        if pending:
            raise ValueError(f"stage {stage} has units after its last STEP on rank {rank}: {pending}")
    return [sorted(groups[k]) for k in sorted(groups)]


def replay_schedule(model: nn.Module, loss_fn: Callable[[Any, Any], Tensor],
                    segments: Sequence[tuple[Schedule, UnitData]], param_stage: Mapping[str, int],
                    opt: OptimizerConfig, lr_schedule: LRSchedule | None = None, clip: float | None = None,
                    global_clip: bool = False, lr_totals: Mapping[int, int] | None = None) -> ReplayResult:
    """Emulate the schedules' weight-version rule in one process (see the module docstring).

    Args:
        model: the original model (weights at version 0; buffers are used and updated).
        loss_fn: the unit loss (mean over the unit's samples).
        segments: the schedules run one after the other, each with its data (a segment
            starts from the newest weights of the previous one).
        param_stage: parameter name -> stage owning it.
        opt, lr_schedule: optimizer settings (``torch.optim``, one per stage).
        clip: max gradient norm; global over stages when ``global_clip``, else per stage.

    Returns:
        The final weights, each unit's loss (units numbered per segment, offset so that they
        are unique: segment ``i``'s units follow segment ``i-1``'s), and steps per stage.
    """
    lr_schedule = lr_schedule or LRSchedule()
    named = dict(model.named_parameters())
    stages = sorted(set(param_stage.values()))
    names = {s: [n for n in named if param_stage.get(n) == s] for s in stages}
    master = {n: named[n].detach().clone().requires_grad_(named[n].requires_grad) for n in named}
    trainable = {s: [n for n in names[s] if master[n].requires_grad] for s in stages}
    optims = {s: make_torch_optimizer([master[n] for n in trainable[s]], opt) for s in stages if trainable[s]}
    steps_done = {s: 0 for s in stages}
    totals = dict(lr_totals) if lr_totals is not None else {
        s: sum(stage_step_count(sch, s) for sch, _ in segments) for s in stages}
    losses: dict[int, float] = {}
    unit_base = 0

    def snapshot(s: int) -> dict[str, Tensor]:
        return {n: master[n].detach().clone().requires_grad_(master[n].requires_grad) for n in names[s]}

    for schedule, data in segments:
        versions = {s: [snapshot(s)] for s in stages}
        fwd: dict[tuple[int, int], int] = {}
        for acts in schedule.workers:
            for a in acts:
                if a.op is Op.F:
                    fwd[(a.stage, a.mb)] = a.version if a.version is not None else 0
        groups = {s: _groups(schedule, s) for s in stages}
        group_of = {s: {u: k for k, g in enumerate(groups[s]) for u in g} for s in stages}
        acc: dict[tuple[int, int], dict[str, Tensor]] = {}
        done: dict[tuple[int, int], int] = {}
        units = sorted({u for (s, u) in fwd if s == 0})

        def step_stage(s: int, k: int, coef: float | None) -> None:
            grads = acc.pop((s, k), {})
            count = len(groups[s][k])
            mean = {n: g / count for n, g in grads.items()}
            if clip is not None and coef is None:
                norm = math.sqrt(sum(float(torch.linalg.vector_norm(g)) ** 2 for g in mean.values()))
                coef = min(1.0, clip / (norm + 1e-6))
            if coef is not None and coef < 1.0:
                mean = {n: g * coef for n, g in mean.items()}
            if s in optims:
                for n in trainable[s]:
                    master[n].grad = mean.get(n)
                lr = lr_schedule.lr(opt.lr, steps_done[s], max(1, totals[s]))
                for group in optims[s].param_groups:
                    group["lr"] = lr
                optims[s].step()
            steps_done[s] += 1
            versions[s].append(snapshot(s))

        def complete(s: int, k: int) -> bool:
            return done.get((s, k), 0) == len(groups[s][k])

        for u in units:
            params: dict[str, Tensor] = {}
            used: dict[int, dict[str, Tensor]] = {}
            for s in stages:
                v = fwd[(s, u)]
                if v >= len(versions[s]):
                    raise ValueError(f"unit {u} uses version {v} of stage {s} before it exists in unit order")
                used[s] = versions[s][v]
                params.update(used[s])
            inputs, target = data.unit(u)
            with torch.enable_grad():
                loss = loss_fn(functional_call(model, params, tuple(inputs)), target)
                leaves = [(s, n, used[s][n]) for s in stages for n in trainable[s]]
                grads = torch.autograd.grad(loss, [t for _, _, t in leaves], allow_unused=True)
            losses[unit_base + u] = float(loss.detach())
            for (s, n, _), g in zip(leaves, grads):
                k = group_of[s][u]
                if g is not None:
                    slot = acc.setdefault((s, k), {})
                    slot[n] = slot[n] + g if n in slot else g.clone()
            for s in stages:
                k = group_of[s][u]
                done[(s, k)] = done.get((s, k), 0) + 1
            # Apply every complete group, in order (newest version -> next).
            if global_clip and clip is not None:
                while True:
                    k = len(versions[stages[0]]) - 1
                    if k >= len(groups[stages[0]]) or not all(k < len(groups[s]) and complete(s, k) for s in stages):
                        break
                    sq = 0.0
                    for s in stages:
                        for g in acc.get((s, k), {}).values():
                            sq += float(torch.linalg.vector_norm(g / len(groups[s][k]))) ** 2
                    coef = min(1.0, clip / (math.sqrt(sq) + 1e-6))
                    for s in stages:
                        step_stage(s, k, coef)
            else:
                for s in stages:
                    while len(versions[s]) - 1 < len(groups[s]) and complete(s, len(versions[s]) - 1):
                        step_stage(s, len(versions[s]) - 1, None)
        unit_base += len(units)
    return ReplayResult({n: t.detach().clone() for n, t in master.items()}, losses, steps_done)


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
                         lr_total: int | None = None, warmup_steps: int = 0) -> SingleResult:
    """Plain training: per step the whole minibatch, one backward, ``torch.optim``.

    ``data`` must have ``units_per_step == 1`` (whole minibatches). ``start_step`` is the
    number of steps done before (resumed runs: the LR schedule continues from there).
    Steps before ``warmup_steps`` are excluded from :attr:`SingleResult.seconds`.
    """
    import time

    lr_schedule = lr_schedule or LRSchedule()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = optimizer or make_torch_optimizer(params, opt)
    horizon = lr_total if lr_total is not None else start_step + steps
    losses: list[float] = []
    model.train()
    t0 = time.perf_counter()
    for i in range(steps):
        if i == warmup_steps:
            t0 = time.perf_counter()
        inputs, target = data.unit(i)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(*inputs), target)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        lr = lr_schedule.lr(opt.lr, start_step + i, max(1, horizon))
        for g in optimizer.param_groups:
            g["lr"] = lr
        optimizer.step()
        losses.append(float(loss.detach()))
    seconds = time.perf_counter() - t0
    return SingleResult(losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, optimizer, seconds)


def replay_config(run: ResolvedRun) -> ReplayResult:
    """Replay a resolved multi-worker run in this process: the same model (seed), plan and
    schedules the workers execute, through :func:`replay_schedule`."""
    from ..graph.capture import capture
    from .stage import partition_graph

    cfg = run.config
    bundle = load_bundle(cfg, run.unit_batch)
    captured = capture(bundle.model, bundle.example_inputs)
    part = partition_graph(captured.gm, run.stage_nodes)
    segments, offset = [], 0
    for seg in run.segments:
        assert seg.schedule is not None, "a one-process run has no schedule to replay"
        segments.append((seg.schedule, UnitData(bundle.make_batch, run.batch_size, run.microbatches,
                                                cfg.training.seed, offset)))
        offset += seg.steps
    return replay_schedule(bundle.model, bundle.loss_fn, segments, part.param_stage, cfg.optimizer,
                           cfg.training.lr_schedule, cfg.training.clip_grad_norm, global_clip=cfg.synchronous)


def single_config(run: ResolvedRun) -> SingleResult:
    """Plain single-process training of a run's model on the same minibatches."""
    cfg = run.config
    bundle = load_bundle(cfg, run.batch_size)
    data = UnitData(bundle.make_batch, run.batch_size, 1, cfg.training.seed, 0)
    total = run.total_steps
    return train_single_process(bundle.model, bundle.loss_fn, data, total, cfg.optimizer, cfg.training.lr_schedule,
                                cfg.training.clip_grad_norm, lr_total=total)
