"""Segments: contiguous runs of the captured graph, timed as a whole as a stage runs them.

A pipeline stage is a contiguous run of the graph's nodes (an ideal's difference, see
:mod:`pipetrain.plan.dag`) that the runtime executes as its own ``GraphModule``: forward on
the values crossing the cut into it, backward from the gradients of the values leaving it
(:mod:`pipetrain.stages.partition`). Timing every aten-level node alone does not add up to
that: each timed region carries the timer's and the autograd engine's start (tens of
microseconds against nodes of a few), and an isolated node finds its inputs hot in cache.

So the profiler times *segments*:

- **Cut candidates** (:func:`starts_group`): the nodes of one module call (consecutive nodes
  whose innermost module, from fx's ``nn_module_stack``, is the same: the ``t``, ``mm`` and
  ``view`` of one ``Linear`` in a ``torch.export`` graph; a leaf module's ``call_module``
  node alone) form one group; a cut the profile is made for falls between groups.
- **Segments** (:class:`SegmentBuilder`): consecutive groups are joined until the segment's
  estimated forward + backward reaches :data:`SEGMENT_SECONDS` (and closes at the next group
  boundary, or at ``MAX_SEGMENT_FACTOR`` times that inside one group), so the timer's cost is
  a small part of every timed region.
- **Timing** (:class:`Segment`): the segment's own ``GraphModule`` (its nodes copied,
  parameters read through the model's ``get_attr`` nodes, so their gradients accumulate as
  in training) runs forward on its inputs as recorded (``requires_grad`` where the real
  value needs a gradient) and backward from a fixed random gradient of each differentiable
  value read outside it. Inputs it writes in place are cloned before each run, outside
  the timed region, so repeats never compound.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

from ..errors import ProfileError
from ..graph.capture import inplace_writers
from .timing import Clock

__all__ = ["SEGMENT_SECONDS", "MAX_SEGMENT_FACTOR", "module_path", "starts_group", "SegmentBuilder", "Segment"]

#: Estimated forward + backward seconds at which a segment closes (at the next group boundary).
SEGMENT_SECONDS = 2e-3
#: A segment closes inside one group once its estimate is this many times :data:`SEGMENT_SECONDS`.
MAX_SEGMENT_FACTOR = 4.0


def module_path(node: torch.fx.Node) -> str | None:
    """The innermost module a node belongs to (``call_module``: its target), or None."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    for value in reversed(list(stack.values())):
        path = value[0] if isinstance(value, tuple) else str(value)
        if path and not str(path).startswith("_empty_nn_module_stack"):
            return str(path)
    return None


def starts_group(node: torch.fx.Node, previous: torch.fx.Node | None) -> bool:
    """Whether ``node`` begins a new cut candidate after ``previous`` (module docstring)."""
    if previous is None or node.op == "call_module" or previous.op == "call_module":
        return True
    return module_path(node) != module_path(previous)


class SegmentBuilder:
    """Collects nodes into the segment under construction and says when it is complete."""

    def __init__(self, seconds: float = SEGMENT_SECONDS, factor: float = MAX_SEGMENT_FACTOR) -> None:
        self.seconds, self.factor = seconds, factor
        self.nodes: list[torch.fx.Node] = []
        self.estimate = 0.0

    def add(self, node: torch.fx.Node, estimate: float) -> None:
        self.nodes.append(node)
        self.estimate += estimate

    def complete(self, following: torch.fx.Node | None) -> bool:
        """Whether the segment ends before ``following`` (None: the graph ends)."""
        if not self.nodes:
            return False
        if following is None or self.estimate >= self.factor * self.seconds:
            return True
        return self.estimate >= self.seconds and starts_group(following, self.nodes[-1])

    def take(self) -> list[torch.fx.Node]:
        nodes, self.nodes, self.estimate = self.nodes, [], 0.0
        return nodes


def _subgraph(gm: torch.fx.GraphModule, nodes: Sequence[torch.fx.Node]
              ) -> tuple[torch.fx.GraphModule, list[torch.fx.Node], list[torch.fx.Node]]:
    """The GraphModule of ``nodes``: (module, external inputs in order, outputs read outside)."""
    wanted = set(nodes)
    g = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    ins: list[torch.fx.Node] = []
    outs: list[torch.fx.Node] = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a in env:
                continue
            if a.op == "get_attr":
                env[a] = g.node_copy(a)
            else:
                env[a] = g.placeholder(a.name)
                ins.append(a)
        env[n] = g.node_copy(n, lambda a: env[a])
        if any(u not in wanted for u in n.users):  # read after the segment (or the model's output)
            outs.append(n)
    g.output(tuple(env[o] for o in outs))
    return torch.fx.GraphModule(gm, g), ins, outs


def _fresh(value: Any) -> Any:
    """A private copy of a recorded value (non-leaf when it needs a gradient), for an in-place write."""
    def copy(t: torch.Tensor) -> torch.Tensor:
        leaf = t.detach().clone().requires_grad_(t.requires_grad)
        return leaf.clone() if leaf.requires_grad else leaf

    return pytree.tree_map(lambda t: copy(t) if isinstance(t, torch.Tensor) else t, value)


class Segment:
    """One segment's ``GraphModule`` and a runner of its forward + backward (module docstring)."""

    def __init__(self, gm: torch.fx.GraphModule, nodes: Sequence[torch.fx.Node], clock: Clock) -> None:
        self.nodes = list(nodes)
        self.module, self.inputs, self.outputs = _subgraph(gm, self.nodes)
        inside = set(self.nodes)
        self.written = [any(w in inside for w in inplace_writers(a, gm)) for a in self.inputs]
        self.clock = clock
        self._grads: list[torch.Tensor] | None = None

    def _args(self, value_of: Callable[[str], Any]) -> list[Any]:
        return [_fresh(value_of(a.name)) if w else value_of(a.name) for a, w in zip(self.inputs, self.written)]

    def run(self, value_of: Callable[[str], Any]) -> tuple[float, float | None]:
        """One forward + backward on the recorded inputs: (forward seconds, backward seconds or
        None when nothing it sends out needs a gradient)."""
        args = self._args(value_of)
        t0 = self.clock.now()
        with torch.enable_grad():
            out = self.module(*args)
        t1 = self.clock.now()
        diff = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not diff:
            return t1 - t0, None
        if self._grads is None or len(self._grads) != len(diff):
            self._grads = [torch.randn_like(t) for t in diff]
        t2 = self.clock.now()
        try:
            torch.autograd.backward(diff, self._grads)
        except RuntimeError as e:
            first = (str(e).strip().splitlines() or [""])[0]
            raise ProfileError(f"the backward of nodes {self.nodes[0].name!r} to {self.nodes[-1].name!r} failed: "
                               f"{first}; a model must be differentiable to be trained; replace that operation"
                               ) from None
        return t1 - t0, self.clock.now() - t2
