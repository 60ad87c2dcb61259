"""Stage times measured as a whole, and a per-node profile corrected by them.

A per-node profile times every layer on its own (warm caches, its own allocations); a stage
runs its layers one after the other, and on a CPU its forward + backward is not the sum of
its layers' times (measured here: the convolutions of a small VGG take 1.8x their per-node
sum as one stage, its fully connected layers 1.2x). The planner balances stages by those sums,
so the error moves the best cut. :func:`stage_seconds` times a stage's own subgraph as the
runtime runs it; :func:`refine_profile` scales each stage's nodes so that they add up to the
stage's measured time (the forward/backward split within a stage stays the profile's), and
:func:`refined_plan` re-plans on the corrected profile until the stages stop changing.
"""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from typing import Any

from ..graph.held import HeldTensors, ValueOf, let_go
from ..plan.types import Plan
from ..profile.types import Profile

__all__ = ["node_values", "crossing", "stage_function", "stage_seconds", "refine_profile", "refined_plan",
           "PIECE_SHARE", "PIECE_FLOOR"]

#: Of a weightless model's tensor bytes, the most one timed piece of a stage holds...
PIECE_SHARE = 0.125
#: ...but never less than this (a small model's stage is timed whole).
PIECE_FLOOR = 128 << 20


def node_values(gm: Any, inputs: Sequence[Any], held: HeldTensors | None = None,
                keep: Collection[str] | None = None) -> dict[str, Any]:
    """Every node's output for ``inputs`` (one forward of the whole graph, no gradient; only
    ``keep``'s when given, so the forward holds no more than what crosses those cuts). A
    weightless ``gm`` runs with ``held`` giving each node's tensors storage while it runs
    (:mod:`pipetrain.graph.held`); its parameters are then not among the values."""
    import torch

    values: dict[str, Any] = {}
    lazy = held is not None and held.weightless

    class Keep(torch.fx.Interpreter):
        def run_node(self, n: Any) -> Any:
            if lazy and n.op not in ("placeholder", "get_attr", "output"):
                assert held is not None
                held.hold(n)
                for a in n.all_input_nodes:
                    if a.op == "get_attr":
                        self.env[a] = self.fetch_attr(str(a.target))
            out = super().run_node(n)
            if not (lazy and n.op == "get_attr") and (keep is None or n.name in keep):
                values[n.name] = out
            if lazy:
                assert held is not None
                held.done(n)
                held.release()
            return out

    with torch.no_grad():
        Keep(gm).run(*inputs)
    return values


def stage_function(gm: Any, nodes: Sequence[str], values: dict[str, Any]) -> _Timed:
    """A function that runs one forward + backward of the stage made of ``nodes`` (its own
    ``torch.fx`` subgraph; inputs as received, requiring grad when floating point and not a
    model input; the output's gradient all ones) and returns its seconds. The parameters it
    reads are ``values``' (a get_attr node's) or, where ``values`` has none, ``gm``'s own."""
    import torch

    wanted = set(nodes)
    inputs = {n.name for n in gm.graph.nodes if n.op == "placeholder"}
    g = torch.fx.Graph()
    env: dict[str, Any] = {}
    ins: list[str] = []
    outs: list[Any] = []
    for n in gm.graph.nodes:
        if n.name not in wanted or n.op in ("placeholder", "output"):
            continue
        for a in n.all_input_nodes:
            if a.name not in env:
                if a.op == "get_attr" and a.name not in values:
                    env[a.name] = g.node_copy(a)
                else:
                    env[a.name] = g.placeholder(a.name)
                    ins.append(a.name)
        env[n.name] = g.node_copy(n, lambda a: env[a.name])
        if any(u.name not in wanted for u in n.users):  # read outside the stage (or the model's output)
            outs.append(env[n.name])
    if not outs:
        return _Timed(None)
    g.output(tuple(outs))
    sub = torch.fx.GraphModule(gm, g)

    def once() -> float:
        args = [values[a].detach().requires_grad_(bool(getattr(values[a], "is_floating_point", lambda: False)())
                                                  and a not in inputs) if isinstance(values[a], torch.Tensor)
                else values[a] for a in ins]
        t = time.perf_counter()
        res = [o for o in sub(*args) if isinstance(o, torch.Tensor) and o.requires_grad]
        if res:
            torch.autograd.backward(res, [torch.ones_like(o) for o in res])
        return time.perf_counter() - t

    return _Timed(sub, once)


class _Timed:
    """A stage's timing function (:func:`stage_function`) and the module it runs."""

    def __init__(self, module: Any, run: Callable[[], float] | None = None) -> None:
        self.module, self.run = module, run

    def __call__(self) -> float:
        return self.run() if self.run is not None else 0.0


def crossing(gm: Any, parts: Sequence[Sequence[str]]) -> set[str]:
    """The nodes whose values some part reads from outside it, and the model inputs it reads
    (its inputs as a subgraph, :func:`stage_function`)."""
    by_name = {n.name: n for n in gm.graph.nodes}
    out: set[str] = set()
    for part in parts:
        inside = set(part)
        out |= {a.name for name in part for a in by_name[name].all_input_nodes
                if a.name not in inside or a.op == "placeholder"}
    return out


def _pieces(gm: Any, nodes: Sequence[str], held: HeldTensors) -> list[list[str]]:
    """``nodes`` in consecutive pieces holding at most :data:`PIECE_SHARE` of a weightless
    model's tensor bytes each (at least one node): a stage as large as the model is timed
    piece by piece, never holding the whole model."""
    if not held.weightless:
        return [list(nodes)]
    cap = max(PIECE_FLOOR, PIECE_SHARE * held.total_bytes)
    by_name = {n.name: n for n in gm.graph.nodes}
    pieces: list[list[str]] = [[]]
    seen: set[int] = set()
    size = 0
    for name in nodes:
        own = held.sizes(by_name[name])
        extra = sum(b for k, b in own.items() if k not in seen)
        if pieces[-1] and size + extra > cap:  # a new piece: every tensor of the node is new to it
            pieces.append([])
            seen, size, extra = set(), 0, sum(own.values())
        size += extra
        seen.update(own)
        pieces[-1].append(name)
    return pieces


def _timed(gm: Any, nodes: Sequence[str], values: dict[str, Any], repeats: int, held: HeldTensors) -> float:
    """Median seconds of ``nodes`` run as one subgraph, its tensors held meanwhile."""
    by_name = {n.name: n for n in gm.graph.nodes}
    for name in nodes:
        held.hold(by_name[name])
    once = stage_function(gm, nodes, values)
    try:
        once()
        return statistics.median(once() for _ in range(max(1, repeats)))
    finally:
        if once.module is not None:
            let_go(once.module, gm)
        held.release()


def stage_seconds(gm: Any, inputs: Sequence[Any], stages: Sequence[Sequence[str]], repeats: int = 3,
                  values: dict[str, Any] | None = None, held: HeldTensors | None = None,
                  tensor_values: ValueOf | None = None) -> list[float]:
    """Median forward + backward seconds of each stage run as a whole, on ``inputs``. A
    weightless ``gm`` holds one stage's tensors at a time (a stage above
    :data:`PIECE_SHARE` of the model's bytes: piece by piece, the pieces' times summed), with
    ``tensor_values``' known values or stand-ins (:class:`~pipetrain.graph.held.HeldTensors`)."""
    if held is None:
        with HeldTensors(gm, tensor_values) as own:
            return stage_seconds(gm, inputs, stages, repeats, values, own)
    pieces = [_pieces(gm, nodes, held) for nodes in stages]
    vals = values if values is not None else node_values(gm, inputs, held,
                                                         crossing(gm, [p for ps in pieces for p in ps]))
    return [math.fsum(_timed(gm, piece, vals, repeats, held) for piece in ps) for ps in pieces]


def refine_profile(profile: Profile, stages: Sequence[Sequence[str]], seconds: Sequence[float]) -> Profile:
    """``profile`` with the nodes of each stage scaled so that they add up to its measured seconds."""
    factor: dict[str, float] = {}
    for nodes, secs in zip(stages, seconds):
        summed = sum(profile[n].compute_time for n in nodes if not profile[n].is_input)
        f = secs / summed if summed > 0 and secs > 0 else 1.0
        for n in nodes:
            factor[n] = f
    refined = [replace(n, forward_time=n.forward_time * factor.get(n.name, 1.0),
                       backward_time=n.backward_time * factor.get(n.name, 1.0)) for n in profile.nodes]
    return replace(profile, nodes=refined)


def refined_plan(profile: Profile, gm: Any, inputs: Sequence[Any], plan_fn: Callable[[Profile], Plan],
                 rounds: int = 2, repeats: int = 3, tensor_values: ValueOf | None = None) -> tuple[Plan, Profile]:
    """Plan, time the plan's stages as a whole, correct the profile, re-plan; at most ``rounds``
    corrections, stopping when the stages do not change. Returns the last plan and profile.
    A weightless ``gm`` is timed holding one stage's tensors at a time (``tensor_values``:
    their known values, :func:`stage_seconds`)."""
    with HeldTensors(gm, tensor_values) as held:
        return _refined(profile, gm, inputs, plan_fn, rounds, repeats, held)


def _refined(profile: Profile, gm: Any, inputs: Sequence[Any], plan_fn: Callable[[Profile], Plan],
             rounds: int, repeats: int, held: HeldTensors) -> tuple[Plan, Profile]:
    prof = profile
    chosen = plan_fn(prof)
    for _ in range(max(0, rounds)):
        lists = [list(s.nodes) for s in chosen.stages]
        if len(lists) < 2:
            break
        prof = refine_profile(prof, lists, stage_seconds(gm, inputs, lists, repeats, None, held))
        again = plan_fn(prof)
        if [list(s.nodes) for s in again.stages] == lists and again.replicas == chosen.replicas:
            chosen = again
            break
        chosen = again
    return chosen, prof
