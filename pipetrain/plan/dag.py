"""The model as a DAG of costed nodes, and the planner's states: downward-closed node sets.

A pipeline partition of a DAG is a chain of *ideals* (downward-closed node sets, PipeDream's
"antichain" states) ``{} = I_0 < I_1 < ... < I_P = V``; stage ``k`` is ``I_k - I_{k-1}``.
Every edge then goes from a stage to the same or a later one. Model inputs (kind ``input``)
belong to stage 0, so every non-empty state contains all of them, and the ideal made of the
inputs alone is not a state (a stage must hold a layer).

Per state the quantities the cost models need are prefix sums, so a stage's totals are
differences ``q[I] - q[I']``:

- ``compute``: forward + backward seconds of the non-input nodes; ``backward`` likewise;
- ``params``: parameter bytes; ``act``: activation bytes (inputs included, for memory);
- ``cut``: bytes leaving the ideal, i.e. outputs of its nodes (model inputs included) read by a node
  outside it (each output counted once) -- ``X_k`` of the cost model.

State-space control (:func:`build_states`): all ideals are enumerated when there are at
most ``max_states`` of them (exact). Otherwise the states are the prefixes of four
topological orders (the profile's order, a breadth-first "lockstep" order, a branch-first
depth-first order, and an order by earliest start under unlimited parallelism); every
prefix of a topological order is an ideal, and a boundary between fork-join regions (an
articulation cut) is a prefix of every order, so the states always include the cuts
between modules plus cuts through branches that keep them balanced or finish one first.
:func:`coarsen` then thins any state list to a budget by keeping, in each bucket of equal
cumulative compute, the state with the cheapest cut.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import PlanError
from ..profile.types import Profile


@dataclass
class Dag:
    """Node arrays of a profile in topological order (index = position in ``profile.nodes``)."""

    names: list[str]
    preds: list[list[int]]
    succs: list[list[int]]
    compute: np.ndarray      # seconds, 0 for input nodes
    backward: np.ndarray     # seconds, 0 for input nodes
    params: np.ndarray       # bytes
    act: np.ndarray          # bytes of the node's output (inputs included)
    out_bytes: np.ndarray    # bytes the node sends when cut off its readers (inputs included)
    is_input: np.ndarray     # bool

    @property
    def n(self) -> int:
        return len(self.names)

    @staticmethod
    def from_profile(profile: Profile) -> Dag:
        """Build the arrays (in a topological order); PlanError if the graph has a cycle."""
        from ..errors import ProfileError
        from ..profile.checks import topological_nodes

        try:
            ordered = topological_nodes(profile.nodes, f"profile {profile.model!r}")
        except ProfileError as e:
            raise PlanError(f"cannot plan: {e}") from None
        if ordered != profile.nodes:
            profile = Profile(profile.model, profile.batch_size, ordered, profile.device, profile.optimizer,
                              profile.optimizer_state_bytes_per_parameter_byte)
        index = {nd.name: i for i, nd in enumerate(profile.nodes)}
        preds: list[list[int]] = []
        succs: list[list[int]] = [[] for _ in profile.nodes]
        for i, nd in enumerate(profile.nodes):
            ps = [index[s] for s in dict.fromkeys(nd.inputs)]
            for j in ps:
                succs[j].append(i)
            preds.append(ps)
        inp = np.array([nd.is_input for nd in profile.nodes], dtype=bool)
        fwd = np.array([nd.forward_time for nd in profile.nodes], dtype=float)
        bwd = np.array([nd.backward_time for nd in profile.nodes], dtype=float)
        fwd[inp] = 0.0
        bwd[inp] = 0.0
        act = np.array([nd.activation_bytes for nd in profile.nodes], dtype=float)
        out = act.copy()  # model inputs too: the runtime relays an input read after stage 0 (docs/traffic.md)
        return Dag(
            names=[nd.name for nd in profile.nodes], preds=preds, succs=succs,
            compute=fwd + bwd, backward=bwd,
            params=np.array([nd.parameter_bytes for nd in profile.nodes], dtype=float),
            act=act, out_bytes=out, is_input=inp,
        )

    def is_chain(self) -> bool:
        """True if every non-input node's predecessors lie before it in a single line."""
        return all(all(p == i - 1 or self.is_input[p] for p in ps) for i, ps in enumerate(self.preds))


@dataclass
class States:
    """A list of ideals sorted by size, with prefix quantities and the containment relation.

    ``masks[s]`` is the boolean membership of state ``s``; ``sub[a, b]`` is True when state
    ``a`` is a strict subset of state ``b`` (then ``a < b``). State 0 is the empty set and
    the last state is the whole graph.
    """

    masks: np.ndarray
    compute: np.ndarray
    backward: np.ndarray
    params: np.ndarray
    act: np.ndarray
    cut: np.ndarray
    sub: np.ndarray
    exact: bool
    total_ideals: int | None  # number of ideals when enumerated, None if over the limit
    mode: str = "exact"
    notes: list[str] = field(default_factory=list)

    @property
    def k(self) -> int:
        return len(self.masks)

    def stage_nodes(self, a: int, b: int) -> np.ndarray:
        """Node indices of the stage ``state b - state a``."""
        return np.nonzero(self.masks[b] & ~self.masks[a])[0]


def _enumerate_ideals(dag: Dag, base: int, limit: int) -> list[int] | None:
    """All ideals (as int bitmasks) that contain ``base``, or None if more than ``limit``."""
    n = dag.n
    pred_mask = [sum(1 << p for p in ps) for ps in dag.preds]

    def ready(ideal: int) -> list[int]:
        return [v for v in range(n) if not (ideal >> v) & 1 and (pred_mask[v] & ~ideal) == 0]

    seen = {base: None}
    frontier = [(base, ready(base))]
    while frontier:
        nxt = []
        for ideal, cands in frontier:
            for v in cands:
                new = ideal | (1 << v)
                if new in seen:
                    continue
                seen[new] = None
                if len(seen) > limit:
                    return None
                c2 = [u for u in cands if u != v]
                for w in dag.succs[v]:
                    if (pred_mask[w] & ~new) == 0 and not (new >> w) & 1:
                        c2.append(w)
                nxt.append((new, c2))
        frontier = nxt
    return list(seen)


def topological_orders(dag: Dag) -> list[list[int]]:
    """Four topological orders (inputs first) whose prefixes serve as states for wide DAGs."""
    n = dag.n
    inputs = [i for i in range(n) if dag.is_input[i]]
    # longest-path depth and earliest start time (unlimited parallelism)
    depth = [0] * n
    start = [0.0] * n
    for i in range(n):
        for p in dag.preds[i]:
            depth[i] = max(depth[i], depth[p] + 1)
            start[i] = max(start[i], start[p] + float(dag.compute[p]))

    def kahn(key: Callable[[int], Any], lifo: bool = False) -> list[int]:
        """Kahn's algorithm taking the smallest key, or the latest enabled node if ``lifo``."""
        indeg = [len(ps) for ps in dag.preds]
        heap = [(0 if lifo else key(i), i) for i in range(n) if indeg[i] == 0]
        heapq.heapify(heap)
        out: list[int] = []
        counter = 0
        while heap:
            _, i = heapq.heappop(heap)
            out.append(i)
            for s in dag.succs[i]:
                indeg[s] -= 1
                if indeg[s] == 0:
                    counter += 1
                    heapq.heappush(heap, (-counter if lifo else key(s), s))
        return out

    orders = [list(range(n)), kahn(lambda i: (depth[i], i)), kahn(lambda i: i, lifo=True),
              kahn(lambda i: (start[i], i))]
    out = []
    for o in orders:
        rest = [i for i in o if not dag.is_input[i]]
        out.append(inputs + rest)
    return out


def build_states(dag: Dag, max_states: int = 4096) -> States:
    """The planner's states: all ideals if at most ``max_states``, else prefixes of four orders."""
    n = dag.n
    inputs = [i for i in range(n) if dag.is_input[i]]
    base = sum(1 << i for i in inputs)
    if n == len(inputs):
        raise PlanError("the profile has no layers (only input nodes); profile a model with at least one layer")
    ideals = _enumerate_ideals(dag, base, max_states + 1) if n <= 4096 else None
    masks: np.ndarray
    if ideals is not None:
        ideals = [m for m in ideals if m != base]
        exact, total, mode = True, len(ideals) + 1, "exact"
        masks = np.zeros((len(ideals) + 1, n), dtype=bool)
        nbytes = (n + 7) // 8
        for row, m in enumerate(ideals, start=1):
            bits = np.frombuffer(m.to_bytes(nbytes, "little"), dtype=np.uint8)
            masks[row] = np.unpackbits(bits, bitorder="little")[:n]
    else:
        exact, total, mode = False, None, "orders"
        rows: dict[bytes, np.ndarray] = {}
        for order in topological_orders(dag):
            cur = np.zeros(n, dtype=bool)
            for pos, v in enumerate(order):
                cur = cur.copy()
                cur[v] = True
                if pos + 1 <= len(inputs):
                    continue
                rows.setdefault(cur.tobytes(), cur)
        masks = np.zeros((len(rows) + 1, n), dtype=bool)
        masks[1:] = np.array(list(rows.values()))
    return _finish(dag, masks, exact, total, mode)


def _finish(dag: Dag, masks: np.ndarray, exact: bool, total: int | None, mode: str) -> States:
    sizes = masks.sum(axis=1)
    cmp = masks.astype(float) @ dag.compute
    order = np.lexsort((cmp, sizes))
    masks = masks[order]
    m = masks.astype(np.float64)
    # node v is cut off by ideal I if v is in I and one of its readers is not
    eu = np.array([u for u, ss in enumerate(dag.succs) for _ in ss], dtype=int)
    ev = np.array([v for ss in dag.succs for v in ss], dtype=int)
    readers_outside = np.zeros((dag.n, len(masks)), dtype=np.int32)
    if len(eu):
        np.add.at(readers_outside, eu, (~masks[:, ev]).T.astype(np.int32))
    cut = ((readers_outside.T > 0) & masks).astype(float) @ dag.out_bytes
    # a < b (strict subset): every node of a is in b, and a is smaller
    m32 = masks.astype(np.float32)
    sizes = masks.sum(axis=1)
    common = m32 @ m32.T  # [a, b] = |a & b|
    sub = (common == sizes[:, None].astype(np.float32)) & (sizes[:, None] < sizes[None, :])
    return States(
        masks=masks, compute=m @ dag.compute, backward=m @ dag.backward, params=m @ dag.params,
        act=m @ dag.act, cut=cut, sub=sub, exact=exact, total_ideals=total, mode=mode,
    )


def coarsen(dag: Dag, states: States, budget: int) -> States:
    """Keep at most ``budget`` states: the empty and full sets plus, in each of ``budget - 2``
    buckets of equal cumulative compute, the state with the smallest cut (then least compute).

    The result is exact on the kept cut points; ``states`` is returned unchanged if small.
    """
    k = states.k
    if k <= budget:
        return states
    budget = max(budget, 3)
    total = states.compute[-1] if states.compute[-1] > 0 else 1.0
    inner = np.arange(1, k - 1)
    frac = states.compute[inner] / total
    # size breaks ties between zero-compute states
    frac = frac + 1e-12 * (states.masks[inner].sum(axis=1) / dag.n)
    nb = budget - 2
    bucket = np.minimum((frac * nb).astype(int), nb - 1)
    keep = [0]
    for b in range(nb):
        idx = inner[bucket == b]
        if len(idx):
            best = idx[np.lexsort((states.compute[idx], states.cut[idx]))[0]]
            keep.append(int(best))
    keep.append(k - 1)
    keep = sorted(set(keep))
    sel = np.array(keep)
    out = States(
        masks=states.masks[sel], compute=states.compute[sel], backward=states.backward[sel],
        params=states.params[sel], act=states.act[sel], cut=states.cut[sel],
        sub=states.sub[np.ix_(sel, sel)], exact=False, total_ideals=states.total_ideals,
        mode=states.mode + "+coarsened", notes=list(states.notes),
    )
    out.notes.append(f"coarsened from {k} to {len(sel)} states (cheapest cut per compute bucket)")
    return out
