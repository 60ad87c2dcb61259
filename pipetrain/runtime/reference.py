"""Single-process references the pipeline is checked against (the test oracle).

:func:`replay_schedule` emulates what a schedule *means*, independently of the executor: for
each unit ``u`` in order it evaluates the whole original model (``torch.func.functional_call``)
with every stage ``s``'s weights at the version ``v_s(u)`` the schedule's F actions name,
takes the gradient of the unit's loss, adds each stage's part to that stage's current group,
and when a group is complete (all its units, over the stage's replicas, between two STEPs)
applies ``torch.optim`` (one optimizer per stage, on a master copy) to the newest version to
make the next one. This is design.md's rule written the simplest way; the distributed run
must give the same weights.

PipeDream without weight stashing (schedule option ``stashing=False``): a B action names a
newer version ``v_B`` than its F. Such a unit is evaluated stage by stage over the captured
graph (:class:`StageGraph`): once with the F versions (the values every stage sends on),
once with the B versions, each stage reading its own nodes from the B pass and other stages'
values with the F pass's value and the B pass's gradient path. That is
:mod:`pipetrain.runtime.engine.recompute`'s definition (recompute each stage's forward from its
stashed input under ``v_B``, back-propagate the gradient received from downstream), written
as one autograd graph.

:func:`replay_config` replays a resolved multi-worker run; :func:`single_config` trains its
model the plain way (:func:`~pipetrain.runtime.single.train_single_process`: the run's
microbatches of each minibatch, their mean gradient, ``torch.optim``), what synchronous
schedules must equal. Both draw random numbers as the pipeline does: every unit's random
nodes from the per-unit stream (:mod:`pipetrain.graph.random_ops`), through the captured graph
with its random nodes seeded when it has any.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import Tensor, nn
from torch.func import functional_call

from ..graph.random_ops import random_nodes, seeded_module, unit_stream
from ..job.config import LRSchedule, OptimizerConfig
from ..job.model import build_stages, load_bundle
from ..job.resolved import ResolvedRun
from ..job.segments import stage_step_count
from ..schedule.action import Op, Schedule
from .engine.recompute import BufferGuard
from .engine.units import UnitData
from .engine.whole_graph import unit_graph
from .single import SingleResult, make_torch_optimizer, train_single_process

__all__ = ["replay_schedule", "ReplayResult", "StageGraph", "replay_config", "single_config"]

Key = tuple[int, int]   # (stage, unit) or (stage, group)


@dataclass
class ReplayResult:
    """Final (newest) weights by original name, each unit's loss, and versions made per stage."""

    params: dict[str, Tensor]
    losses: dict[int, float] = field(default_factory=dict)
    steps: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class StageGraph:
    """The captured graph and the stage of each of its value nodes (``Partition.stage_of``):
    what :func:`replay_schedule` needs for units whose B version differs from their F's."""

    gm: torch.fx.GraphModule
    stage_of: Mapping[str, int]


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


class _ValueWithGradPath(torch.autograd.Function):
    """``forward(b, f) = f`` exactly; the gradient goes to ``b`` (f is a constant)."""

    @staticmethod
    def forward(ctx: Any, b: Tensor, f: Tensor) -> Tensor:  # type: ignore[override]
        return f.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad, None


def _crossing(b: Any, f: Any) -> Any:
    """A value read across a stage boundary: the F pass's value on the B pass's gradient path."""
    if isinstance(b, Tensor) and isinstance(f, Tensor):
        return _ValueWithGradPath.apply(b, f) if b.requires_grad else f
    if isinstance(b, (tuple, list)) and isinstance(f, (tuple, list)):
        return type(b)(_crossing(x, y) for x, y in zip(b, f))
    if isinstance(b, dict) and isinstance(f, dict):
        return {k: _crossing(b[k], f[k]) for k in b}
    return f


def _run_graph(gm: torch.fx.GraphModule, params: Mapping[str, Tensor], flat_inputs: Sequence[Any],
               read: Callable[[torch.fx.Node, torch.fx.Node, dict[torch.fx.Node, Any]], Any]
               ) -> tuple[dict[torch.fx.Node, Any], Any]:
    """Evaluate ``gm`` node by node with ``params`` bound by qualified name; ``read(node, arg,
    env)`` gives the value of ``arg`` as ``node`` sees it. Returns the values and the output."""
    env: dict[torch.fx.Node, Any] = {}
    inputs = iter(flat_inputs)
    for n in gm.graph.nodes:
        def arg(m: torch.fx.Node, n: torch.fx.Node = n) -> Any:
            return read(n, m, env)

        if n.op == "placeholder":
            env[n] = next(inputs)
        elif n.op == "get_attr":
            if n.target in params:
                env[n] = params[n.target]
            else:
                obj: Any = gm
                for part in str(n.target).split("."):
                    obj = getattr(obj, part)
                env[n] = obj
        elif n.op == "output":
            return env, torch.fx.node.map_arg(n.args[0], arg)
        else:
            args = torch.fx.node.map_arg(n.args, arg)
            kwargs = torch.fx.node.map_arg(n.kwargs, arg)
            if n.op == "call_function":
                env[n] = n.target(*args, **kwargs)  # type: ignore[operator]
            elif n.op == "call_method":
                env[n] = getattr(args[0], str(n.target))(*args[1:], **kwargs)
            else:  # call_module
                sub = gm.get_submodule(str(n.target))
                local = {k: params[f"{n.target}.{k}"] for k, _ in sub.named_parameters()
                         if f"{n.target}.{k}" in params}
                env[n] = functional_call(sub, local, tuple(args), dict(kwargs))
    raise ValueError("the captured graph has no output node")


def _two_version_loss(graph: StageGraph, loss_fn: Callable[[Any, Any], Tensor], params_f: Mapping[str, Tensor],
                      params_b: Mapping[str, Tensor], inputs: Sequence[Any], target: Any) -> tuple[Tensor, Tensor]:
    """``(loss of the F pass, loss whose gradient w.r.t. params_b is the no-stashing gradient)``
    (module docstring)."""
    gm, stage_of = graph.gm, graph.stage_of
    last = max(stage_of.values(), default=0)
    codegen = gm.graph._codegen
    flat = codegen.process_inputs(*inputs)
    with torch.no_grad():
        f_env, f_out = _run_graph(gm, params_f, flat, lambda n, m, env: env[m])
        loss_f = loss_fn(codegen.process_outputs(f_out), target)

    def read_b(n: torch.fx.Node, m: torch.fx.Node, env: dict[torch.fx.Node, Any]) -> Any:
        if m.op in ("placeholder", "get_attr"):
            return env[m]
        here = stage_of.get(n.name, last)  # the output node belongs to the last stage
        return env[m] if stage_of[m.name] == here else _crossing(env[m], f_env[m])

    snap = BufferGuard(gm)  # the B pass is a recompute: buffers as the F pass left them
    with torch.enable_grad():
        _, b_out = _run_graph(gm, params_b, flat, read_b)
        loss_b = loss_fn(codegen.process_outputs(b_out), target)
    snap.restore_changed()
    return loss_f, loss_b


class _Masters:
    """The newest weights of every stage (a master copy of every parameter) and one
    ``torch.optim`` optimizer per stage that has trainable parameters."""

    def __init__(self, model: nn.Module, param_stage: Mapping[str, int], opt: OptimizerConfig,
                 lr_schedule: LRSchedule, clip: float | None) -> None:
        named = dict(model.named_parameters())
        self.stages = sorted(set(param_stage.values()))
        self.names = {s: [n for n in named if param_stage.get(n) == s] for s in self.stages}
        self.master = {n: named[n].detach().clone().requires_grad_(named[n].requires_grad) for n in named}
        self.trainable = {s: [n for n in self.names[s] if self.master[n].requires_grad] for s in self.stages}
        self.optims = {s: make_torch_optimizer([self.master[n] for n in self.trainable[s]], opt)
                       for s in self.stages if self.trainable[s]}
        self.steps_done = {s: 0 for s in self.stages}
        self.totals: dict[int, int] = {}   # stage -> the learning-rate schedule's horizon
        self.base_lr, self.lr_schedule, self.clip = opt.lr, lr_schedule, clip

    def snapshot(self, s: int) -> dict[str, Tensor]:
        """Stage ``s``'s newest weights, as a version (a copy)."""
        return {n: self.master[n].detach().clone().requires_grad_(self.master[n].requires_grad)
                for n in self.names[s]}

    def step(self, s: int, grads: Mapping[str, Tensor], count: int, coef: float | None) -> dict[str, Tensor]:
        """One optimizer step of stage ``s`` on the mean of ``grads`` (summed over ``count``
        units), scaled by ``coef`` (``None``: clipped per stage when ``clip``); the new version."""
        mean = {n: g / count for n, g in grads.items()}
        if self.clip is not None and coef is None:
            norm = math.sqrt(sum(float(torch.linalg.vector_norm(g)) ** 2 for g in mean.values()))
            coef = min(1.0, self.clip / (norm + 1e-6))
        if coef is not None and coef < 1.0:
            mean = {n: g * coef for n, g in mean.items()}
        if s in self.optims:
            for n in self.trainable[s]:
                self.master[n].grad = mean.get(n)
            lr = self.lr_schedule.lr(self.base_lr, self.steps_done[s], max(1, self.totals[s]))
            for group in self.optims[s].param_groups:
                group["lr"] = lr
            self.optims[s].step()
        self.steps_done[s] += 1
        return self.snapshot(s)

    def final(self) -> dict[str, Tensor]:
        return {n: t.detach().clone() for n, t in self.master.items()}


@dataclass
class _Pass:
    """One segment's replay: the versions made so far, the version each unit's F and B name
    per stage, the stages' gradient groups and the gradients summed so far."""

    versions: dict[int, list[dict[str, Tensor]]]
    fwd: dict[Key, int]                      # (stage, unit) -> version of its F
    bwd: dict[Key, int]                      # (stage, unit) -> version of its B (or W)
    groups: dict[int, list[list[int]]]       # stage -> units of each group
    units: list[int]
    acc: dict[Key, dict[str, Tensor]] = field(default_factory=dict)    # (stage, group) -> summed gradients
    done: dict[Key, int] = field(default_factory=dict)                 # (stage, group) -> units added

    @property
    def group_of(self) -> dict[int, dict[int, int]]:
        return {s: {u: k for k, g in enumerate(gs) for u in g} for s, gs in self.groups.items()}

    def complete(self, s: int, k: int) -> bool:
        return self.done.get((s, k), 0) == len(self.groups[s][k])

    def step_stage(self, masters: _Masters, s: int, k: int, coef: float | None) -> None:
        """Apply stage ``s``'s group ``k`` to its newest version, making the next one."""
        grads = self.acc.pop((s, k), {})
        self.versions[s].append(masters.step(s, grads, len(self.groups[s][k]), coef))


def _unit_versions(schedule: Schedule) -> tuple[dict[Key, int], dict[Key, int]]:
    """The version every (stage, unit) F names, and every B (or W): the F's unless named."""
    fwd: dict[Key, int] = {}
    bwd: dict[Key, int] = {}
    for acts in schedule.workers:
        for a in acts:
            if a.op is Op.F:
                fwd[(a.stage, a.mb)] = a.version if a.version is not None else 0
            elif a.op in (Op.B, Op.W) and a.version is not None:
                bwd[(a.stage, a.mb)] = a.version
    for key, v in fwd.items():
        bwd.setdefault(key, v)
    return fwd, bwd


def _start_pass(schedule: Schedule, masters: _Masters, graph: StageGraph | None) -> _Pass:
    """A segment's replay, from the newest weights of the previous one."""
    stages = masters.stages
    fwd, bwd = _unit_versions(schedule)
    if graph is None and any(bwd[k] != fwd[k] for k in fwd):
        raise ValueError("the schedule's backwards use other versions than their forwards (stashing=False): "
                         "replay_schedule needs graph=StageGraph(captured.gm, partition.stage_of)")
    return _Pass(versions={s: [masters.snapshot(s)] for s in stages}, fwd=fwd, bwd=bwd,
                 groups={s: _groups(schedule, s) for s in stages}, units=sorted({u for (s, u) in fwd if s == 0}))


def _add_unit(model: nn.Module, loss_fn: Callable[[Any, Any], Tensor], masters: _Masters, p: _Pass, u: int,
              batch: tuple[Any, Any], graph: StageGraph | None, group_of: Mapping[int, Mapping[int, int]]) -> float:
    """Unit ``u``'s loss under its versions; its gradients added to each stage's group."""
    stages = masters.stages
    params: dict[str, Tensor] = {}
    used: dict[int, dict[str, Tensor]] = {}
    params_b: dict[str, Tensor] = {}
    for s in stages:
        for v in (p.fwd[(s, u)], p.bwd[(s, u)]):
            if v >= len(p.versions[s]):
                raise ValueError(f"unit {u} uses version {v} of stage {s} before it exists in unit order")
        params.update(p.versions[s][p.fwd[(s, u)]])
        used[s] = p.versions[s][p.bwd[(s, u)]]
        params_b.update(used[s])
    inputs, target = batch
    leaves = [(s, n, used[s][n]) for s in stages for n in masters.trainable[s]]
    if any(p.bwd[(s, u)] != p.fwd[(s, u)] for s in stages):
        assert graph is not None
        loss, loss_b = _two_version_loss(graph, loss_fn, params, params_b, inputs, target)
        with torch.enable_grad():
            grads = torch.autograd.grad(loss_b, [t for _, _, t in leaves], allow_unused=True)
    else:
        with torch.enable_grad():
            loss = loss_fn(functional_call(model, params, tuple(inputs)), target)
            grads = torch.autograd.grad(loss, [t for _, _, t in leaves], allow_unused=True)
    for (s, n, _), g in zip(leaves, grads):
        k = group_of[s][u]
        if g is not None:
            slot = p.acc.setdefault((s, k), {})
            slot[n] = slot[n] + g if n in slot else g.clone()
    for s in stages:
        k = group_of[s][u]
        p.done[(s, k)] = p.done.get((s, k), 0) + 1
    return float(loss.detach())


def _apply_complete(masters: _Masters, p: _Pass, global_clip: bool) -> None:
    """Apply every complete group, in order (newest version -> next). ``global_clip`` (and a
    clip): group ``k`` of every stage at once, clipped by their joint norm."""
    stages = masters.stages
    clip = masters.clip
    if not (global_clip and clip is not None):
        for s in stages:
            while len(p.versions[s]) - 1 < len(p.groups[s]) and p.complete(s, len(p.versions[s]) - 1):
                p.step_stage(masters, s, len(p.versions[s]) - 1, None)
        return
    while True:
        k = len(p.versions[stages[0]]) - 1
        if k >= len(p.groups[stages[0]]) or not all(k < len(p.groups[s]) and p.complete(s, k) for s in stages):
            return
        sq = 0.0
        for s in stages:
            for g in p.acc.get((s, k), {}).values():
                sq += float(torch.linalg.vector_norm(g / len(p.groups[s][k]))) ** 2
        coef = min(1.0, clip / (math.sqrt(sq) + 1e-6))
        for s in stages:
            p.step_stage(masters, s, k, coef)


def replay_schedule(model: nn.Module, loss_fn: Callable[[Any, Any], Tensor],
                    segments: Sequence[tuple[Schedule, UnitData]], param_stage: Mapping[str, int],
                    opt: OptimizerConfig, lr_schedule: LRSchedule | None = None, clip: float | None = None,
                    global_clip: bool = False, lr_totals: Mapping[int, int] | None = None,
                    graph: StageGraph | None = None, forward: nn.Module | None = None,
                    seed: int | None = None) -> ReplayResult:
    """Emulate the schedules' weight-version rule in one process (see the module docstring).

    Args:
        model: the original model (weights at version 0; buffers are used and updated).
        loss_fn: the unit loss (mean over the unit's samples).
        segments: the schedules run one after the other, each with its data (a segment
            starts from the newest weights of the previous one).
        param_stage: parameter name -> stage owning it.
        opt, lr_schedule: optimizer settings (``torch.optim``, one per stage).
        clip: max gradient norm; global over stages when ``global_clip``, else per stage.
        lr_totals: stage -> the learning-rate schedule's horizon (default: its optimizer
            steps over all segments).
        graph: the captured graph and its stages; needed only when some B's version differs
            from its F's (pipedream with ``stashing=False``).
        forward: what a unit's forward runs instead of ``model`` (same parameter names): the
            captured graph with its random nodes seeded (:mod:`pipetrain.graph.random_ops`).
        seed: the run's seed: unit ``u`` runs under the per-unit random stream of its global
            index ``step * m + u % m``, as in the pipeline (``None``: the global generator).

    Returns:
        The final weights, each unit's loss (units numbered per segment, offset so that they
        are unique: segment ``i``'s units follow segment ``i-1``'s), and steps per stage.
    """
    masters = _Masters(model, param_stage, opt, lr_schedule or LRSchedule(), clip)
    masters.totals = dict(lr_totals) if lr_totals is not None else {
        s: sum(stage_step_count(sch, s) for sch, _ in segments) for s in masters.stages}
    losses: dict[int, float] = {}
    unit_base = 0
    for schedule, data in segments:
        p = _start_pass(schedule, masters, graph)
        group_of = p.group_of
        for u in p.units:
            with _stream(seed, data, u):
                losses[unit_base + u] = _add_unit(forward if forward is not None else model, loss_fn, masters, p,
                                                  u, data.unit(u), graph, group_of)
            _apply_complete(masters, p, global_clip)
        unit_base += len(p.units)
    return ReplayResult(masters.final(), losses, masters.steps_done)


def _stream(seed: int | None, data: UnitData, u: int) -> AbstractContextManager[None]:
    """The per-unit random stream of the segment's unit ``u`` (nothing without a seed)."""
    if seed is None:
        return nullcontext()
    return unit_stream(seed, data.step_of(u) * data.m + u % data.m)


def replay_config(run: ResolvedRun) -> ReplayResult:
    """Replay a resolved multi-worker run in this process: the same model (seed), plan and
    schedules the workers execute, through :func:`replay_schedule` (the captured graph with
    its random nodes seeded, when it has any: the pipeline's dropout masks)."""
    cfg = run.config
    staged = build_stages(run, shipped=False)  # the model built and captured here, as one process does
    bundle, part = staged.bundle, staged.partition
    gm = staged.captured.gm
    seeded = seeded_module(gm) if random_nodes(gm) else None
    segments, offset = [], 0
    for seg in run.segments:
        assert seg.schedule is not None, "a one-process run has no schedule to replay"
        segments.append((seg.schedule, UnitData(bundle.make_batch, run.batch_size, run.microbatches,
                                                cfg.training.seed, offset)))
        offset += seg.steps
    return replay_schedule(bundle.model, bundle.loss_fn, segments, part.param_stage, cfg.optimizer,
                           cfg.training.lr_schedule, cfg.training.clip_grad_norm, global_clip=cfg.synchronous,
                           graph=StageGraph(seeded if seeded is not None else gm, part.stage_of), forward=seeded,
                           seed=cfg.training.seed)


def single_config(run: ResolvedRun) -> SingleResult:
    """Plain single-process training of a run's model on the same minibatches, cut into the
    run's microbatches, with the per-unit random stream: one worker with the same microbatches."""
    cfg = run.config
    bundle = load_bundle(cfg, run.batch_size)
    data = UnitData(bundle.make_batch, run.batch_size, 1, cfg.training.seed, 0)
    total = run.total_steps
    graph = unit_graph(bundle.model, bundle.example_inputs, run.microbatches)
    return train_single_process(bundle.model, bundle.loss_fn, data, total, cfg.optimizer, cfg.training.lr_schedule,
                                cfg.training.clip_grad_norm, lr_total=total, microbatches=run.microbatches,
                                seed=cfg.training.seed, graph=graph)
