"""Single-process references the pipeline is checked against.

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
:mod:`pipetrain.runtime.recompute`'s definition (recompute each stage's forward from its
stashed input under ``v_B``, back-propagate the gradient received from downstream), written
as one autograd graph.

:func:`train_single_process` is plain training: the whole minibatch, one backward,
``torch.optim``. It is what ``--workers 1`` runs, and what synchronous schedules must equal.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch import Tensor, nn
from torch.func import functional_call

from ..schedule.action import Op, Schedule
from .config import LRSchedule, OptimizerConfig
from .data import UnitData
from .model import load_bundle
from .recompute import BufferGuard
from .resolved import ResolvedRun

__all__ = ["stage_step_count", "make_torch_optimizer", "replay_schedule", "train_single_process", "ReplayResult",
           "SingleResult", "StageGraph", "replay_config", "single_config"]


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


@dataclass(frozen=True)
class StageGraph:
    """The captured graph and the stage of each of its value nodes (``Partition.stage_of``):
    what :func:`replay_schedule` needs for units whose B version differs from their F's."""

    gm: torch.fx.GraphModule
    stage_of: Mapping[str, int]


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


def replay_schedule(model: nn.Module, loss_fn: Callable[[Any, Any], Tensor],
                    segments: Sequence[tuple[Schedule, UnitData]], param_stage: Mapping[str, int],
                    opt: OptimizerConfig, lr_schedule: LRSchedule | None = None, clip: float | None = None,
                    global_clip: bool = False, lr_totals: Mapping[int, int] | None = None,
                    graph: StageGraph | None = None) -> ReplayResult:
    """Emulate the schedules' weight-version rule in one process (see the module docstring).

    Args:
        model: the original model (weights at version 0; buffers are used and updated).
        loss_fn: the unit loss (mean over the unit's samples).
        segments: the schedules run one after the other, each with its data (a segment
            starts from the newest weights of the previous one).
        param_stage: parameter name -> stage owning it.
        opt, lr_schedule: optimizer settings (``torch.optim``, one per stage).
        clip: max gradient norm; global over stages when ``global_clip``, else per stage.
        graph: the captured graph and its stages; needed only when some B's version differs
            from its F's (pipedream with ``stashing=False``).

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
        bwd: dict[tuple[int, int], int] = {}
        for acts in schedule.workers:
            for a in acts:
                if a.op is Op.F:
                    fwd[(a.stage, a.mb)] = a.version if a.version is not None else 0
                elif a.op in (Op.B, Op.W) and a.version is not None:
                    bwd[(a.stage, a.mb)] = a.version
        for key, v in fwd.items():
            bwd.setdefault(key, v)
        if graph is None and any(bwd[k] != fwd[k] for k in fwd):
            raise ValueError("the schedule's backwards use other versions than their forwards (stashing=False): "
                             "replay_schedule needs graph=StageGraph(captured.gm, partition.stage_of)")
        groups = {s: _groups(schedule, s) for s in stages}
        group_of = {s: {u: k for k, g in enumerate(groups[s]) for u in g} for s in stages}
        acc: dict[tuple[int, int], dict[str, Tensor]] = {}
        done: dict[tuple[int, int], int] = {}
        units = sorted({u for (s, u) in fwd if s == 0})

        # The loop's per-segment state is bound as defaults (both helpers run only within
        # their own segment's iteration, so this is what they would see anyway).
        def step_stage(s: int, k: int, coef: float | None, *, groups: dict[int, list[list[int]]] = groups,
                       acc: dict[tuple[int, int], dict[str, Tensor]] = acc,
                       versions: dict[int, list[dict[str, Tensor]]] = versions) -> None:
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

        def complete(s: int, k: int, *, groups: dict[int, list[list[int]]] = groups,
                     done: dict[tuple[int, int], int] = done) -> bool:
            return done.get((s, k), 0) == len(groups[s][k])

        for u in units:
            params: dict[str, Tensor] = {}
            used: dict[int, dict[str, Tensor]] = {}
            params_b: dict[str, Tensor] = {}
            for s in stages:
                for v in (fwd[(s, u)], bwd[(s, u)]):
                    if v >= len(versions[s]):
                        raise ValueError(f"unit {u} uses version {v} of stage {s} before it exists in unit order")
                params.update(versions[s][fwd[(s, u)]])
                used[s] = versions[s][bwd[(s, u)]]
                params_b.update(used[s])
            inputs, target = data.unit(u)
            leaves = [(s, n, used[s][n]) for s in stages for n in trainable[s]]
            if any(bwd[(s, u)] != fwd[(s, u)] for s in stages):
                assert graph is not None
                loss, loss_b = _two_version_loss(graph, loss_fn, params, params_b, inputs, target)
                with torch.enable_grad():
                    grads = torch.autograd.grad(loss_b, [t for _, _, t in leaves], allow_unused=True)
            else:
                with torch.enable_grad():
                    loss = loss_fn(functional_call(model, params, tuple(inputs)), target)
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
                           cfg.training.lr_schedule, cfg.training.clip_grad_norm, global_clip=cfg.synchronous,
                           graph=StageGraph(captured.gm, part.stage_of))


def single_config(run: ResolvedRun) -> SingleResult:
    """Plain single-process training of a run's model on the same minibatches."""
    cfg = run.config
    bundle = load_bundle(cfg, run.batch_size)
    data = UnitData(bundle.make_batch, run.batch_size, 1, cfg.training.seed, 0)
    total = run.total_steps
    return train_single_process(bundle.model, bundle.loss_fn, data, total, cfg.optimizer, cfg.training.lr_schedule,
                                cfg.training.clip_grad_norm, lr_total=total)
