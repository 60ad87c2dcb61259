"""The backward split into an input-gradient pass (I) and a weight-gradient pass (W), with no
work done twice (zero-bubble schedules, Qi et al., ICLR'24).

For one unit's autograd graph (roots: the stage's outputs or loss; leaves: the received
inputs that require grad, and the weights), let ``N_in`` be the nodes on a path from a root
to an input leaf. The two passes::

    I   autograd.grad(roots -> inputs): runs exactly the nodes of N_in, each computing only
        the gradients its input path needs (built-in nodes skip outputs the pass does not
        need; AccumulatingLinear skips its weight GEMM, see fused.py). A pre-hook on every
        *frontier* node (a node of N_in with an edge leaving N_in towards a weight) keeps
        the gradient that reaches it.
    W   for each group of weights sharing frontier nodes: autograd.grad(frontier edges ->
        weights) with the kept gradients, i.e. it starts where I stopped and runs only the
        nodes between the frontier and the weights (AccumulatingLinear: only ``g^T x``
        into the accumulator, its input gradient already done).

So I + W execute every backward node once, as one plain backward (B) would; the forward is
never re-run and I touches no weight gradient. This is what torch.distributed.pipelining's
``stage_backward_input`` / ``stage_backward_weight`` do (``_backward.py``), written for this
executor: one breadth-first pass finds the frontier for all weights at once, and roots that
do not reach an input (a stage output computed from weights alone) start W directly with
their output gradient.

Invariant of a frontier node's kept gradient: it is the *total* gradient reaching that node
(everything in N_in is done when I ends). W therefore clamps a frontier node's incoming
gradient to the kept one, so that a path from one frontier node to another inside the same W
call is not counted twice. A stage with no input that requires grad (the first stage) has an
empty N_in: I does nothing and W is the whole backward.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from .fused import PHASE_AWARE, GradSink

__all__ = ["WeightWork", "backward_input", "backward_weight", "phase_aware"]


def _node_of(t: Tensor) -> Node | None:
    """The autograd node of ``t``: its grad_fn, or a leaf's gradient accumulator."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    fn = t.view_as(t).grad_fn  # a leaf's accumulator exists once a graph refers to it
    return fn.next_functions[0][0] if fn is not None else None


@dataclass
class _Group:
    """Weights sharing frontier nodes, and the gradients that start W for them."""

    params: list[int] = field(default_factory=list)       # positions in the weight list
    frontier: list[Node] = field(default_factory=list)    # hooked nodes of N_in
    roots: list[tuple[Tensor, Tensor]] = field(default_factory=list)  # (output, its gradient) outside N_in


@dataclass
class WeightWork:
    """What I keeps for W: the weights, their groups and the kept gradients (node -> tuple)."""

    params: list[Tensor]
    groups: list[_Group]
    gated: list[Node] = field(default_factory=list)  # frontier nodes and the N_in nodes they feed
    kept: dict[Node, tuple[Tensor | None, ...]] = field(default_factory=dict)
    done: bool = False


def _reverse_edges(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """child -> the nodes whose backward feeds it (the graph read from the leaves up)."""
    rev: dict[Node, list[Node]] = {}
    seen = set(roots)
    q = deque(roots)
    while q:
        n = q.popleft()
        for child, _ in n.next_functions:
            if child is None:
                continue
            rev.setdefault(child, []).append(n)
            if child not in seen:
                seen.add(child)
                q.append(child)
    return rev


def _upward(starts: Sequence[Node], rev: dict[Node, list[Node]], stop: set[Node]) -> dict[Node, Node]:
    """Nodes reachable from ``starts`` towards the roots, not entering ``stop``; node -> the
    start it was first reached from. Nodes of ``stop`` met on the way are recorded too."""
    origin: dict[Node, Node] = {}
    q: deque[Node] = deque()
    for s in starts:
        if s not in origin:
            origin[s] = s
            q.append(s)
    while q:
        n = q.popleft()
        if n in stop:
            continue
        for parent in rev.get(n, ()):
            if parent not in origin:
                origin[parent] = origin[n]
                q.append(parent)
    return origin


def _groups(outs: Sequence[Tensor], gouts: Sequence[Tensor], inputs: Sequence[Tensor],
            params: Sequence[Tensor]) -> tuple[list[_Group], set[Node], list[Node]]:
    """The weight groups of one unit's graph, the frontier nodes to hook during I, and the
    nodes to gate during W (the frontier and the nodes of N_in it feeds)."""
    roots = [n for n in (_node_of(o) for o in outs) if n is not None]
    rev = _reverse_edges(roots)
    in_nodes = [n for n in (_node_of(x) for x in inputs) if n is not None]
    n_in = set(_upward(in_nodes, rev, set()))
    pnodes = [_node_of(p) for p in params]
    # Union-find over weights: two weights whose upward regions meet share frontier nodes.
    parent: dict[Node, Node] = {}

    def find(x: Node) -> Node:
        while parent[x] is not x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    region: dict[Node, Node] = {}  # node outside N_in (or a frontier node) -> the weight node owning it
    frontier_of: dict[Node, set[Node]] = {}
    q: deque[Node] = deque()
    for pn in pnodes:
        if pn is not None and pn not in parent:
            parent[pn] = pn
            region[pn] = pn
            q.append(pn)
    while q:
        n = q.popleft()
        if n in n_in:
            continue
        for up in rev.get(n, ()):
            owner = find(region[n])
            if up in n_in:
                frontier_of.setdefault(up, set()).add(owner)
                continue
            prev = region.get(up)
            if prev is None:
                region[up] = owner
                q.append(up)
            else:
                a, b = find(prev), owner
                if a is not b:
                    parent[b] = a
    # Frontier nodes shared by several weights merge their groups.
    for owners in frontier_of.values():
        first = find(next(iter(owners)))
        for owner in owners:
            top = find(owner)
            if top is not first:
                parent[top] = first
    groups: dict[Node, _Group] = {}
    for i, pn in enumerate(pnodes):
        if pn is not None:
            groups.setdefault(find(pn), _Group()).params.append(i)
    for node, owners in frontier_of.items():
        groups[find(next(iter(owners)))].frontier.append(node)
    for o, g in zip(outs, gouts):
        r = _node_of(o)
        if r is not None and r not in n_in and r in region:
            groups[find(region[r])].roots.append((o, g))
    frontier = set(frontier_of)
    gated = set(frontier)
    for node in frontier:
        gated.update(c for c, _ in node.next_functions if c is not None and c in n_in)
    return list(groups.values()), frontier, list(gated)


def backward_input(outs: Sequence[Tensor], gouts: Sequence[Tensor] | None, inputs: Sequence[Tensor],
                   params: Sequence[Tensor], sink: GradSink | None = None) -> tuple[list[Tensor | None], WeightWork]:
    """I: the gradients of ``outs`` (with output gradients ``gouts``; None: the scalar loss)
    with respect to ``inputs``, and what :func:`backward_weight` needs for ``params``.

    No weight gradient is computed and no accumulator is written (the graph is retained).
    """
    outs = list(outs)
    gs = [torch.ones_like(o) for o in outs] if gouts is None else list(gouts)
    if not outs or not inputs:  # nothing to send back (a first stage): W is the whole backward
        whole = _Group(list(range(len(params))), [], list(zip(outs, gs)))
        return [None] * len(inputs), WeightWork(list(params), [whole] if outs else [])
    groups, frontier, gated = _groups(outs, gs, inputs, params)
    work = WeightWork(list(params), groups, gated)
    kept = work.kept

    def keep(node: Node) -> Any:
        def hook(grad_outputs: tuple[Tensor | None, ...]) -> None:
            kept[node] = tuple(grad_outputs)
        return hook

    handles = [n.register_prehook(keep(n)) for n in frontier]
    if sink is not None:
        sink.phase = "input"
    try:
        grads = torch.autograd.grad(outs, list(inputs), grad_outputs=gs, retain_graph=True, allow_unused=True)
    finally:
        if sink is not None:
            sink.phase = "full"
        for h in handles:
            h.remove()
    return list(grads), work


def phase_aware(node: Node) -> bool:
    """Whether ``node`` is a sink layer's backward, which computes no input gradient in W."""
    return getattr(node, "_forward_cls", None) in PHASE_AWARE


def backward_weight(work: WeightWork, sink: GradSink | None = None) -> list[Tensor | None]:
    """W: the gradients of the weights given to :func:`backward_input` (aligned with them;
    None for a weight with none, or one whose gradient the sink received)."""
    if work.done:
        raise RuntimeError("backward_weight ran twice for one unit")
    work.done = True
    out: list[Tensor | None] = [None] * len(work.params)
    kept = work.kept
    current: set[Node] = set()

    # During W a node of N_in passes on only what I kept for it, and only as a source of the
    # current group: everything inside N_in was done by I (module docstring).
    def gate(node: Node) -> Any:
        def hook(grad_outputs: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
            if node in current:
                return kept[node]
            return tuple(None for _ in grad_outputs)
        return hook

    handles = [n.register_prehook(gate(n)) for n in work.gated]
    if sink is not None:
        sink.phase = "weight"
    try:
        # The groups whose frontier nodes all skip their input gradient in the weight phase
        # (the sink's layers, fused.py) share one pass; each other group has its own, since
        # a plain node (a linear's AddmmBackward) reached from another group's frontier
        # would compute an input gradient nobody needs (a GEMM a plain backward does not run).
        aware = [all(phase_aware(n) for n in g.frontier) for g in work.groups]
        batches = [[g for g, a in zip(work.groups, aware) if a]] + [[g] for g, a in zip(work.groups, aware) if not a]
        for batch in batches:
            edges: list[GradientEdge] = []
            grads: list[Tensor] = []
            wanted: list[int] = []
            current.clear()
            for g in batch:
                for node in g.frontier:
                    k = kept.get(node)
                    if k is None:  # the pass to the inputs never reached it: no gradient flows here
                        continue
                    current.add(node)
                    for i, t in enumerate(k):
                        if t is not None:
                            edges.append(GradientEdge(node, i))
                            grads.append(t)
                for o, go in g.roots:
                    edges.append(get_gradient_edge(o))
                    grads.append(go)
                wanted += g.params
            if not edges or not wanted:
                continue
            res = torch.autograd.grad(edges, [work.params[i] for i in wanted], grad_outputs=grads,
                                      retain_graph=True, allow_unused=True)
            for i, r in zip(wanted, res):
                out[i] = r
    finally:
        if sink is not None:
            sink.phase = "full"
        for h in handles:
            h.remove()
        kept.clear()
        work.groups = []
        work.gated = []
    return out
