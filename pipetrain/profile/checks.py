"""The checks every profile reader applies to its nodes: finite, non-negative costs, and a DAG.

:func:`check_costs` rejects negative or non-finite times and sizes of one node;
:func:`topological_nodes` returns the nodes in a topological order (stable: nodes already in
topological order keep it) and rejects duplicate names, edges to unknown nodes and cycles,
each with a one-line :class:`~pipetrain.errors.ProfileError`.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import Any

from ..errors import ProfileError
from .types import NodeProfile

__all__ = ["check_costs", "topological_nodes"]


def check_costs(node: NodeProfile, where: str) -> None:
    """Reject negative or non-finite times and sizes of ``node`` (``where`` names the file)."""
    for attr in ("forward_time", "backward_time", "activation_bytes", "parameter_bytes"):
        v = getattr(node, attr)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or math.isnan(v) or math.isinf(v) or v < 0:
            raise ProfileError(
                f"{where}: node {node.name!r} has {attr}={v!r}; times and sizes must be finite numbers >= 0; "
                "fix the profile"
            )


def topological_nodes(nodes: list[NodeProfile], where: str,
                      key: Callable[[NodeProfile], Any] | None = None) -> list[NodeProfile]:
    """Return ``nodes`` in a topological order, checking names, edges and cycles.

    If ``nodes`` is already topological it is returned in the same order; otherwise Kahn's
    algorithm picks, among ready nodes, the smallest ``key`` (default: position in the list).
    Raises ProfileError for a duplicate name, an input naming an unknown node, or a cycle
    (naming one node on it).
    """
    pos: dict[str, int] = {}
    for i, n in enumerate(nodes):
        if n.name in pos:
            raise ProfileError(f"{where}: node name {n.name!r} appears twice; node names must be unique; rename one")
        pos[n.name] = i
    for n in nodes:
        for src in n.inputs:
            if src not in pos:
                raise ProfileError(
                    f"{where}: node {n.name!r} reads {src!r}, which is not a node of the profile; "
                    f"every edge must join two listed nodes; add node {src!r} or remove the edge"
                )
    if all(pos[src] < pos[n.name] for n in nodes for src in n.inputs):
        return list(nodes)
    keyf = key or (lambda nd: pos[nd.name])
    indeg = [len(set(n.inputs)) for n in nodes]
    succ: list[list[int]] = [[] for _ in nodes]
    for i, n in enumerate(nodes):
        for src in dict.fromkeys(n.inputs):
            succ[pos[src]].append(i)
    heap = [(keyf(nodes[i]), i) for i in range(len(nodes)) if indeg[i] == 0]
    heapq.heapify(heap)
    out: list[NodeProfile] = []
    while heap:
        _, i = heapq.heappop(heap)
        out.append(nodes[i])
        for s in succ[i]:
            indeg[s] -= 1
            if indeg[s] == 0:
                heapq.heappush(heap, (keyf(nodes[s]), s))
    if len(out) < len(nodes):
        left = {i for i in range(len(nodes)) if indeg[i] > 0}
        # Walk backwards along unfinished inputs until a node repeats: it lies on a cycle.
        i = min(left)
        seen: set[int] = set()
        while i not in seen:
            seen.add(i)
            i = next(pos[s] for s in nodes[i].inputs if pos[s] in left)
        raise ProfileError(
            f"{where}: the graph has a cycle through node {nodes[i].name!r}; a profile must be a DAG; "
            "remove the edge that closes the cycle"
        )
    return out
