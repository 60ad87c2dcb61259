"""The profiler's measurement: one pass over the graph, node by node, timing segments as they complete.

:func:`measure_graph` walks the captured graph in its (topological) order:

1. **Each node once** (:class:`_NodeRunner`): forward on detached copies of its recorded
   inputs under saved-tensor hooks (what it keeps for backward, :mod:`~pipetrain.profile.saved`),
   then backward from a random gradient of its differentiable outputs. Both are timed, less
   the timer's cost (:class:`~pipetrain.profile.timing.TimerCost`); a node under
   :data:`RERUN_BELOW` runs a second time (warm) when warm-up runs were asked for. These
   per-node times are *estimates*: they choose the segments and split a segment's time
   over its nodes.
2. **Each segment as a whole** (:mod:`~pipetrain.profile.segments`), as soon as its last
   node has run: ``warmup`` untimed runs (none when one run takes :data:`LONG_RUN`), then
   timed runs under a :class:`~pipetrain.profile.timing.RepeatBudget` of
   :data:`SEGMENT_BUDGET` seconds; its forward and backward are
   :func:`~pipetrain.profile.timing.robust_seconds` of them, less the timer's cost. Each
   node gets the segment's forward (backward) in proportion to its own estimate, so the
   nodes of a segment add up to the segment exactly. A node whose own run takes
   :data:`SEGMENT_BUDGET` or more is a segment of its own, and that run is its measurement
   (the timer's cost is nothing beside it; running it again would double the profile of a
   large model), unless its forward and backward differ by more than :data:`STALL_RATIO` or
   it has no backward (a stall may have landed in it: it runs once more and the faster of
   each counts); the segment before it is timed first.
3. **The whole model** (the check, :mod:`~pipetrain.profile.step_check`): every node as one
   segment, timed under :data:`CHECK_BUDGET` after one untimed run (unless ``warmup`` is 0),
   however long, each run starting without parameter gradients. The node pass never held a
   region this large at once: its first run grows the heap to the region's activations and
   gradients, and a run accumulating into the last one's gradients allocates again, neither
   of which a worker's steady step pays (a Hugging Face Llama with a 32000-token head,
   batch 8 x 128: its whole graph 3.8 s the first run and the second, 2.95 s after, the
   model's own warm step 2.9-3.2 s). When the whole model's
   activations exceed ``check_memory`` bytes (:data:`CHECK_MEMORY`), the check runs on the
   longest tail of the graph whose activations fit (:func:`check_start`), so it never
   holds more than that. When that region's forward + backward, as the pass measured it,
   exceeds ``check_seconds`` (:data:`CHECK_SECONDS`), the check runs on a shorter tail: the
   longest that fits, among a few starts chosen before the pass (:func:`check_candidates`),
   else the shortest of them; so the check of a large model costs a few seconds, not a
   step. The values entering each of those starts are kept through the pass, and those of
   the region not chosen are freed before the check runs.

So a profile costs about three forward + backward steps of the model, a few more for a small
one (whose regions are repeated up to ``warmup + repeats`` times) and about one for a large
one (each long node runs once, the check twice on a tail of ``check_seconds``).

Memory: a node's output is freed once every node that reads it has run and its segment is
timed (the model's outputs are kept for the loss), each run's autograd graph goes with its
backward, and the parameters' gradients are dropped after every segment, so steps 1 and 2
hold the values crossing the current cut plus one segment's saved tensors and gradients,
never every node's. Step 3 holds at most ``check_memory`` bytes of activations.

A weightless graph (its tensors on ``meta``: the launcher's capture) is timed the same way,
its tensors held on demand (:class:`~pipetrain.graph.held.HeldTensors`): a node's parameters
get storage when it first runs and go once its segment is timed and no later node reads
them, so steps 1 and 2 hold one segment's parameters; the check's region is chosen with its
parameters and their gradients counted beside its activations, within ``held_share``
(:data:`HELD_CHECK_SHARE`; the launcher's quick profile for W workers: 1/W) of the model's
tensor bytes (at least :data:`HELD_CHECK_FLOOR`), and its parameters stay held from their
first node to the check. Every timed run of a weightless graph starts with its held
weights' gradients dropped (as a step's first microbatch: assigned, not accumulated), so a
large weight never has two. So timing a weightless model holds that share, or its largest
segment's tensors and their gradients, whichever is more; never the whole model (unless one
node reads it all).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

from ..errors import ProfileError
from ..graph.capture import is_inplace_node, node_op_name
from ..graph.held import HeldTensors, ValueOf, let_go
from .progress import ProfileProgress
from .saved import SavedBytes
from .segments import Segment, SegmentBuilder
from .timing import Clock, RepeatBudget, TimerCost, robust_seconds

__all__ = ["Measured", "MeasureOptions", "measure_graph", "check_start", "held_check_limit", "split_time",
           "HELD_CHECK_SHARE", "HELD_CHECK_FLOOR", "RERUN_BELOW", "LONG_RUN",
           "SEGMENT_BUDGET", "CHECK_BUDGET", "CHECK_MEMORY", "CHECK_SECONDS", "CHECK_STARTS",
           "check_candidates"]

#: A node whose first run (forward + backward) is shorter than this runs again for its estimate.
RERUN_BELOW = 10e-3
#: A region taking this long (estimated) gets no warm-up run: the node pass warmed it.
LONG_RUN = 0.05
#: Seconds of timed runs after which a segment is not repeated again (at least one run); a
#: node whose own run takes this long is measured by that run.
SEGMENT_BUDGET = 0.1
#: A long first run whose forward and backward differ by more than this factor runs once more
#: (the faster of the two counts): one stalled run must not stand for the node.
STALL_RATIO = 20.0
#: The same for the whole-model check.
CHECK_BUDGET = 1.0
#: Activation bytes the whole-model check may hold (above: it checks the graph's tail).
CHECK_MEMORY = 1 << 30
#: Seconds of forward + backward (as the pass measured them) the check's region may take
#: (above: it checks a shorter tail)...
CHECK_SECONDS = 4.0
#: ...starting at one of at most this many nodes, spread over the memory-bounded region.
CHECK_STARTS = 8
#: Of a weightless model's tensor bytes, what its check may hold by default (parameters
#: and their gradients count twice their bytes, activations once; the launcher's quick
#: profile for W workers: 1/W, a stage's share)...
HELD_CHECK_SHARE = 0.5
#: ...but never less than this (a small model is checked whole).
HELD_CHECK_FLOOR = 128 << 20
#: The least estimate a node that ran counts with when a segment's time is split (seconds).
MIN_SHARE = 1e-7

Kept = tuple[int, list[str], bool]   # saved bytes, earlier nodes saved, own output saved


@dataclass
class Measured:
    """What :func:`measure_graph` found: per node (forward, backward) seconds and saved
    tensors; the checked region's (forward, backward) and its first node (None: the whole
    model); what the loss saves; the segment count; for a weightless graph, the most of its
    tensor bytes held at once (0 otherwise)."""

    times: dict[str, tuple[float, float]]
    kept: dict[str, Kept]
    step: tuple[float, float]
    step_from: str | None
    loss_saved: tuple[int, bool] | None
    segments: int
    held_bytes: int = 0


def check_start(compute: Sequence[torch.fx.Node], activation_bytes: Mapping[str, int], limit: float | None,
                tensor_bytes: Callable[[torch.fx.Node], int] | None = None) -> int:
    """Index of the first node the check runs: 0 (the whole model) when every node's
    activations (and ``tensor_bytes(node)``: what holding its parameters costs) together are
    at most ``limit`` (None: no limit), else the start of the longest tail that fits (at
    least the last node)."""
    if limit is None:
        return 0
    total, start = 0, len(compute)
    while start > 0:
        node = compute[start - 1]
        cost = activation_bytes.get(node.name, 0) + (tensor_bytes(node) if tensor_bytes is not None else 0)
        if total + cost > limit:
            break
        start -= 1
        total += cost
    return min(start, len(compute) - 1) if compute else 0


def check_candidates(compute: Sequence[torch.fx.Node], start: int,
                     count: int = CHECK_STARTS) -> list[tuple[int, frozenset[str]]]:
    """Where the check may start, from ``start`` on, each with the names of the values that
    enter the tail from before it (the graph's parameters and buffers, always kept, aside):
    ``start`` itself, then one node from each of ``count`` - 1 equal stretches of the rest,
    the one with the fewest values entering (the first of those), so the kept values stay
    few. Ordered from the longest tail to the shortest."""
    n = len(compute)
    if n == 0:
        return []

    def entering() -> Iterator[tuple[int, set[torch.fx.Node]]]:
        # compute[c:] reads the inputs of its nodes that are not in it; a node's inputs come
        # before it in the (topological) order, so walking back keeps that set exactly
        now: set[torch.fx.Node] = set()
        for c in range(n - 1, start - 1, -1):
            now.discard(compute[c])
            now.update(a for a in compute[c].all_input_nodes if a.op != "get_attr")
            yield c, now

    sizes = {c: len(values) for c, values in entering()}
    span = n - start
    parts = max(1, min(count, span))
    picks = {start}
    for k in range(1, parts):
        stretch = range(start + k * span // parts, start + (k + 1) * span // parts)
        picks.add(min(stretch, key=lambda c: (sizes[c], c)))
    found = [(c, frozenset(a.name for a in values)) for c, values in entering() if c in picks]
    return found[::-1]


def held_check_limit(limit: float | None, held: HeldTensors, share: float = HELD_CHECK_SHARE) -> float | None:
    """What the check may hold when the graph's tensors are held on demand: ``limit``, at
    most ``share`` of the model's tensor bytes (at least :data:`HELD_CHECK_FLOOR`)."""
    if limit is None or not held.weightless:
        return limit
    return min(limit, max(HELD_CHECK_FLOOR, share * held.total_bytes))


def _as_leaf(t: torch.Tensor) -> torch.Tensor:
    """A graph-free copy of a value that keeps whether it needs a gradient."""
    return t.detach().requires_grad_(t.requires_grad)


def leafify(value: Any) -> Any:
    return pytree.tree_map(lambda t: _as_leaf(t) if isinstance(t, torch.Tensor) else t, value)


def _fresh_clone(t: torch.Tensor) -> torch.Tensor:
    """An input for an in-place node: a private copy (non-leaf if it needs a gradient)."""
    leaf = t.detach().clone().requires_grad_(t.requires_grad)
    return leaf.clone() if leaf.requires_grad else leaf


class _Values:
    """The recorded value of every node still to be read (module docstring, memory)."""

    def __init__(self, gm: torch.fx.GraphModule, saved: SavedBytes) -> None:
        self.env: dict[str, Any] = {}
        self.saved = saved
        self.readers = {n.name: sum(1 for u in n.users if u.op != "output") for n in gm.graph.nodes}
        # the model's outputs (read by the loss) and its parameters and buffers are never freed
        self.pinned = {n.name for n in gm.graph.nodes
                       if n.op == "get_attr" or any(u.op == "output" for u in n.users)}
        self.dead: list[str] = []

    def put(self, node: torch.fx.Node, value: Any) -> None:
        self.env[node.name] = value
        if node.op != "get_attr":
            self.saved.register(node.name, value)
        if self.readers[node.name] == 0:
            self.dead.append(node.name)

    def __getitem__(self, name: str) -> Any:
        return self.env[name]

    def read_by(self, node: torch.fx.Node) -> None:
        """``node`` has run: inputs it was the last reader of become free."""
        for src in node.all_input_nodes:
            self.readers[src.name] -= 1
            if self.readers[src.name] == 0:
                self.dead.append(src.name)

    def unpin(self, names: set[str]) -> None:
        """Stop keeping ``names``: those no node still to run reads are freed."""
        self.pinned -= names
        for name in names:
            if self.readers[name] <= 0 and name in self.env:
                self.saved.release(self.env.pop(name))

    def release(self) -> None:
        """Free the values no node still to run reads (the model's outputs stay)."""
        for name in self.dead:
            if name in self.env and name not in self.pinned:
                self.saved.release(self.env.pop(name))
        self.dead = []


def _attributes_read(nodes: Sequence[torch.fx.Node]) -> set[str]:
    """The names of the ``get_attr`` nodes (parameters, buffers) ``nodes`` read."""
    return {a.name for n in nodes for a in n.all_input_nodes if a.op == "get_attr"}


def _unconfirmed(f: float, b: float | None) -> bool:
    """Whether one run of a node does not vouch for itself: it has no backward to compare its
    forward with, or the two differ by more than :data:`STALL_RATIO` (a real layer's backward
    takes 1-3x its forward)."""
    if b is None:
        return True
    if f <= 0 or b <= 0:
        return False
    return max(f, b) > STALL_RATIO * min(f, b)


class _NodeRunner:
    """Runs one node on its recorded inputs: estimates, saved bytes and its output."""

    def __init__(self, gm: torch.fx.GraphModule, clock: Clock, cost: TimerCost, rerun: bool,
                 fresh: Callable[[], None] = lambda: None) -> None:
        """``fresh``: called before a node runs again (a weightless graph's held tensors drop
        their gradients, so a run never holds two of a large weight's)."""
        self.gm, self.clock, self.cost, self.rerun, self.fresh = gm, clock, cost, rerun, fresh
        self.interp = torch.fx.Interpreter(gm)

    def _args(self, node: torch.fx.Node, values: _Values, inplace: bool) -> tuple[Any, Any]:
        prepare = _fresh_clone if inplace else _as_leaf

        def load(src: torch.fx.Node) -> Any:
            value = values[src.name]
            if src.op == "get_attr":
                return value  # parameters themselves: their gradients are part of backward
            return pytree.tree_map(lambda t: prepare(t) if isinstance(t, torch.Tensor) else t, value)

        return torch.fx.node.map_arg(node.args, load), torch.fx.node.map_arg(node.kwargs, load)

    def _once(self, node: torch.fx.Node, values: _Values, saved: SavedBytes | None
              ) -> tuple[float, float | None, Any, Kept | None]:
        args, kwargs = self._args(node, values, is_inplace_node(node, self.gm))
        call = getattr(self.interp, node.op)

        def forward() -> Any:
            with torch.enable_grad():
                return call(node.target, args, kwargs)

        t0 = self.clock.now()
        if saved is not None:
            out, nbytes, ins, own = saved.measure(forward)
            kept: Kept | None = (nbytes, ins, own)
        else:
            out, kept = forward(), None
        t1 = self.clock.now()
        diff = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not diff:
            return t1 - t0, None, out, kept
        grads = [torch.randn_like(t) for t in diff]
        t2 = self.clock.now()
        try:
            torch.autograd.backward(diff, grads)
        except RuntimeError as e:
            first = (str(e).strip().splitlines() or [""])[0]
            raise ProfileError(
                f"node {node.name!r} ({node_op_name(node, self.gm)}) has no usable backward: {first}; "
                "a model must be differentiable to be trained; replace that operation") from None
        return t1 - t0, self.clock.now() - t2, out, kept

    def run(self, node: torch.fx.Node, values: _Values, saved: SavedBytes) -> tuple[float, float | None, Any, Kept]:
        """(forward estimate, backward estimate or None without a gradient, output, saved)."""
        f, b, out, kept = self._once(node, values, saved)
        assert kept is not None
        if self.rerun and f + (b or 0.0) < RERUN_BELOW:
            self.fresh()
            f, b, _, _ = self._once(node, values, None)
        elif f + (b or 0.0) >= SEGMENT_BUDGET and _unconfirmed(f, b):
            # a long run whose two halves disagree by STALL_RATIO, or with no backward to
            # compare with: maybe a stall (page faults, a descheduled process), not the node;
            # run it again and keep the faster of each half
            self.fresh()
            f2, b2, _, _ = self._once(node, values, None)
            f, b = min(f, f2), (None if b is None or b2 is None else min(b, b2))
        fn, bn = self.cost.net(f, b)
        return fn, (bn if b is not None else None), out, kept


def _time_region(run: Callable[[], tuple[float, float | None]], budget: RepeatBudget, estimate: float,
                 cost: TimerCost) -> tuple[float, float]:
    """Robust (forward, backward) seconds of ``run`` under ``budget``, less the timer's cost."""
    for _ in range(budget.warmups(estimate)):
        run()
    fwd: list[float] = []
    bwd: list[float] = []
    total: list[float] = []
    while budget.more(total):
        f, b = run()
        fwd.append(f)
        bwd.append(b or 0.0)
        total.append(f + (b or 0.0))
    diff = any(b > 0 for b in bwd)
    return cost.net(robust_seconds(fwd), robust_seconds(bwd) if diff else None)


def _shares(weights: Sequence[float], fallback: Sequence[float]) -> list[float]:
    """``weights`` normalised to sum 1 (else ``fallback``'s, else equal shares)."""
    for w in (weights, fallback):
        total = math.fsum(w)
        if total > 0:
            return [x / total for x in w]
    return [1.0 / len(weights)] * len(weights) if weights else []


def split_time(names: Sequence[str], forward: float, backward: float,
           estimates: dict[str, tuple[float, float | None]]) -> dict[str, tuple[float, float]]:
    """A segment's seconds over its nodes in proportion to their estimates (module docstring, 2)."""
    fe = [max(estimates[n][0], MIN_SHARE) for n in names]
    be = [0.0 if estimates[n][1] is None else max(float(estimates[n][1] or 0.0), MIN_SHARE) for n in names]
    fs, bs = _shares(fe, fe), _shares(be, fe)
    return {n: (forward * f, backward * b) for n, f, b in zip(names, fs, bs)}


@dataclass(frozen=True)
class MeasureOptions:
    """Repeats of :func:`measure_graph`, what the check may hold (module docstring) and
    whether progress is shown."""

    warmup: int
    repeats: int
    progress: bool = False
    check_memory: float | None = CHECK_MEMORY
    held_share: float = HELD_CHECK_SHARE
    check_seconds: float | None = CHECK_SECONDS


class _GraphPass:
    """The walk of :func:`measure_graph`: nodes one by one, each segment timed once complete."""

    def __init__(self, gm: torch.fx.GraphModule, device: torch.device, options: MeasureOptions,
                 activation_bytes: Mapping[str, int], held: HeldTensors) -> None:
        self.gm, self.options, self.held = gm, options, held
        self.clock = Clock(device)
        self.cost = TimerCost.measure(self.clock, device)
        self.saved = SavedBytes(gm, held.storages)
        self.values = _Values(gm, self.saved)
        self.fresh: Callable[[], None] = held.zero_grad if held.weightless else (lambda: None)
        self.runner = _NodeRunner(gm, self.clock, self.cost, rerun=options.warmup > 0, fresh=self.fresh)
        self.budget = RepeatBudget(options.warmup, options.repeats, SEGMENT_BUDGET, LONG_RUN)
        self.compute = [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
        self.following = dict(zip(self.compute, [*self.compute[1:], None]))
        self.estimates: dict[str, tuple[float, float | None]] = {}
        self.times: dict[str, tuple[float, float]] = {}
        self.kept: dict[str, Kept] = {}
        self.builder = SegmentBuilder()
        self.segments = 0
        self.params = list(gm.parameters())
        seen: set[int] = set()
        limit = held_check_limit(options.check_memory, held, options.held_share)
        start = check_start(self.compute, activation_bytes, limit,
                            (lambda n: 2 * held.nbytes(n, seen)) if held.weightless else None)
        self.checked = self.compute[start:]  # the longest region; the check may take a tail of it
        if held.weightless:  # a tensor is held while its nodes run, and the check's until the check
            self.values.pinned -= {n.name for n in gm.graph.nodes if n.op == "get_attr"}
            held.pin(self.checked)
        self.values.pinned |= _attributes_read(self.checked)
        self.always = set(self.values.pinned)
        # where the check may start, longest tail first, and the seconds of each tail timed so far
        count = 1 if options.check_seconds is None else CHECK_STARTS
        self.starts = check_candidates(self.compute, start, count) if self.checked else []
        self.spent = [0.0] * len(self.starts)
        self.position = {n.name: i for i, n in enumerate(self.compute)}
        self.values.pinned |= {name for _, names in self.starts for name in names}

    def node(self, node: torch.fx.Node) -> None:
        """Run ``node`` alone (step 1); time its segment if it completes one (step 2)."""
        if self.held.weightless:
            self.held.hold(node)
            for src in node.all_input_nodes:
                if src.op == "get_attr" and src.name not in self.values.env:
                    self.values.put(src, self.runner.interp.fetch_attr(str(src.target)))
        f, b, out, self.kept[node.name] = self.runner.run(node, self.values, self.saved)
        self.estimates[node.name] = (f, b)
        self.values.put(node, leafify(out))
        self.values.read_by(node)
        self.held.done(node)
        if f + (b or 0.0) >= SEGMENT_BUDGET:  # measured by its own run (module docstring, 2)
            if self.builder.nodes:
                self._segment(self.builder.take())
            self.times[node.name] = (f, b or 0.0)
            self.segments += 1
            self._done([node.name])
            return
        self.builder.add(node, f + (b or 0.0))
        if self.builder.complete(self.following[node]):
            self._segment(self.builder.take())

    def _segment(self, nodes: list[torch.fx.Node]) -> None:
        segment = Segment(self.gm, nodes, self.clock)
        estimate = math.fsum(f + (b or 0.0) for f, b in (self.estimates[n.name] for n in nodes))
        sf, sb = _time_region(lambda: self._fresh_run(segment), self.budget, estimate, self.cost)
        let_go(segment.module, self.gm)
        self.times.update(split_time([n.name for n in nodes], sf, sb, self.estimates))
        self.segments += 1
        self._done([n.name for n in nodes])

    def _check_run(self, segment: Segment) -> tuple[float, float | None]:
        """One run of the check's region, its parameters without gradients (module docstring, 3)."""
        self._drop_grads()
        return segment.run(self.values.__getitem__)

    def _drop_grads(self) -> None:
        """Every parameter's gradient, held (a weightless graph's) or the graph's own."""
        self.held.zero_grad()
        for p in self.params:
            p.grad = None

    def _fresh_run(self, segment: Segment) -> tuple[float, float | None]:
        self.fresh()  # a weightless graph's held weights: one gradient each at a time
        return segment.run(self.values.__getitem__)

    def _done(self, timed: list[str]) -> None:
        """A segment (the nodes ``timed``) is measured: free what no later node reads, the
        values kept for a check that can no longer start there, and the gradients."""
        for name in timed:
            at, seconds = self.position[name], sum(self.times[name])
            self.spent = [t + seconds if c <= at else t for (c, _), t in zip(self.starts, self.spent)]
        limit = self.options.check_seconds
        drop = 0  # the tails already longer than the limit (the shortest is kept whatever it takes)
        while limit is not None and drop < len(self.starts) - 1 and self.spent[drop] > limit:
            drop += 1
        if drop:
            self._keep_starts(drop, len(self.starts) - 1)
        self.values.release()
        self.held.release()
        self._drop_grads()

    def run(self, inputs: Sequence[Any], loss: Callable[[SavedBytes, Any], tuple[int, bool] | None] | None,
            progress: ProfileProgress) -> Measured:
        feed = iter([leafify(x) for x in inputs])
        loss_saved = None
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                self.values.put(node, next(feed))
            elif node.op == "get_attr":
                if not self.held.weightless:  # else put when a node first reads it (:meth:`node`)
                    self.values.put(node, self.runner.interp.fetch_attr(str(node.target)))
            elif node.op == "output":
                if loss is not None:
                    loss_saved = loss(self.saved, torch.fx.node.map_arg(node.args[0], lambda n: self.values[n.name]))
            else:
                self.node(node)
                progress.advance()
        step = self._check()
        progress.advance()
        step_from = self.checked[0].name if self.checked and self.checked[0] is not self.compute[0] else None
        return Measured(self.times, self.kept, step, step_from, loss_saved, self.segments, self.held.peak_bytes)

    def _keep_starts(self, first: int, last: int) -> None:
        """Keep the check's starts ``first`` to ``last`` (included); let go of the others, of
        the values kept for them and, in a weightless graph, of the tensors held for nodes no
        tail left begins before."""
        kept = {name for _, names in self.starts[first:last + 1] for name in names}
        dropped = {name for _, names in self.starts for name in names} - kept - self.always
        self.starts, self.spent = self.starts[first:last + 1], self.spent[first:last + 1]
        self.values.unpin(dropped)
        if self.held.weightless and self.starts:  # the tensors only nodes before every tail left read
            first_node = self.starts[0][0]
            self.held.pin(self.compute[first_node:])
            before, tail = _attributes_read(self.compute[:first_node]), _attributes_read(self.compute[first_node:])
            gone = (before & self.always) - tail - kept
            self.always -= gone
            self.values.unpin(gone)

    def _check(self) -> tuple[float, float]:
        """The checked region as one segment: its (forward, backward) seconds (module docstring, 3)."""
        if not self.checked:
            return 0.0, 0.0
        # every node is timed: the first start left is the longest tail within check_seconds,
        # or the shortest (module docstring, 3)
        self.checked = self.compute[self.starts[0][0]:]
        self._keep_starts(0, 0)
        region = Segment(self.gm, self.checked, self.clock)
        budget = RepeatBudget(min(self.options.warmup, 1), self.options.repeats, CHECK_BUDGET, math.inf)
        estimate = math.fsum(sum(self.times.get(n.name, (0.0, 0.0))) for n in self.checked)
        try:
            return _time_region(lambda: self._check_run(region), budget, estimate, self.cost)
        finally:
            let_go(region.module, self.gm)


def measure_graph(gm: torch.fx.GraphModule, inputs: Sequence[Any], device: torch.device, options: MeasureOptions,
                  loss: Callable[[SavedBytes, Any], tuple[int, bool] | None] | None = None,
                  activation_bytes: Mapping[str, int] | None = None, values: ValueOf | None = None) -> Measured:
    """Measure every node of ``gm`` on ``inputs`` (module docstring). ``loss(saved, output)``
    measures what the loss saves, on the model's output; ``activation_bytes`` (per node)
    chooses the check's region (none given: the whole model). A weightless ``gm`` (its
    tensors on meta) is timed holding a few tensors at a time (module docstring, memory),
    with ``values(name)``'s values where it has them, else stand-ins; ``gm`` is left as it was."""
    with HeldTensors(gm, values, device) as held:
        walk = _GraphPass(gm, device, options, activation_bytes or {}, held)
        progress = ProfileProgress(len(walk.compute) + 1, enabled=options.progress)
        try:
            return walk.run(inputs, loss, progress)
        finally:
            progress.close()
