"""Stage modules, built in memory from the captured fx graph and a plan's node lists.

Given the captured ``GraphModule`` and, per stage, the names of its nodes, each stage becomes
its own ``GraphModule`` (a new ``fx.Graph`` copying the stage's nodes; no source files):

- its placeholders are the values that cross the cut into it (stage 0: the model's inputs);
- its output is the tuple of values that cross the cut out of it (the last stage: the model's
  output, in the model's output structure).

Relay (design.md): stage ``k`` sends to stage ``k+1`` *every* value produced in stages ``<= k``
that stages ``> k`` read, so a skip connection from stage 0 to stage 2 travels 0 -> 1 -> 2,
passing straight from stage 1's input to its output. Stages only talk to neighbours::

    stage 0: x -> a -> b        cut 0 carries {b, x}      (x is read by stage 2)
    stage 1: b -> c             cut 1 carries {c, x}      (x passes through)
    stage 2: c, x -> out

``get_attr`` nodes go with the nodes that read them (copied into every such stage).
Parameter names inside a stage module are the original model's qualified names, which is
what checkpoints use.

Tied parameters (one tensor under several names, e.g. GPT-2's token embedding and LM head)
are listed in :attr:`Partition.tied`. A tensor read by several stages is held by each of them
as its own copy (:func:`build_stage_modules` gives every holder but the first a clone, so two
holders in one process never share storage); :mod:`pipetrain.stages.tied` sums their
gradients at each STEP. Every name of a tensor maps to its first holder in
:attr:`Partition.param_stage`, and :attr:`StageModule.aliases` lists the other names of the
tensors a stage holds, so state dicts keep every name the model has.
"""
from __future__ import annotations

import copy
import functools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from ..errors import RuntimeConfigError
from ..graph.capture import BufferUpdate, CapturedModel, buffer_updates, inplace_writers, preserved_state
from ..graph.random_ops import draw_from_stream, insert_seeding, is_random_node
from .boundary import BoundaryCodec, ValueCodec
from .tied import TiedParameter

__all__ = ["Partition", "StageModule", "StateBuffer", "partition_graph", "build_stage_modules", "boundary_codecs",
           "whole_graph_stage"]

_VALUE_OPS = ("placeholder", "call_module", "call_function", "call_method")


# --------------------------------------------------------------------------- partition


@dataclass(frozen=True)
class StateBuffer:
    """A buffer the forward updates (a running statistic, a counter): state of one stage.

    The stage that reads it first holds it and runs every update of it, so its forward of
    each unit sees the updates of the units before it, in unit order, as one worker's forward
    does; it is saved with that stage's weights. Every other reader of its memory (later
    stages across the cuts too) reads a copy taken where it reads it.

    Attributes:
        name: its qualified name in the model.
        stage: the stage holding it.
        reads: the ``get_attr`` nodes of it.
        writers: the nodes updating it (all on ``stage``).
        write_path: the nodes that take the buffer itself (its writers and the views they
            write through); ``aliases``: the nodes whose value may be its memory
            (:class:`~pipetrain.graph.capture.BufferUpdate`).
    """

    name: str
    stage: int
    reads: tuple[str, ...]
    writers: tuple[str, ...]
    write_path: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()


@dataclass
class Partition:
    """Nodes of the captured graph assigned to stages, and what crosses each cut.

    Attributes:
        stage_of: value node name -> stage (placeholders always on stage 0; the ``get_attr``
            nodes of a :class:`StateBuffer` on its stage).
        stage_nodes: per stage, its value nodes in graph order.
        boundaries: ``boundaries[c]`` are the values crossing cut ``c`` (stage ``c`` -> ``c+1``),
            in graph order (relay included).
        attr_stages: ``get_attr`` node name -> stages that read it.
        param_stage: parameter qualified name (every name of a tied tensor) -> the stage
            owning it (the first stage that reads it).
        tied: tensors held under several names or read by several stages, in the order of
            their first reader (the same on every rank).
        state: the buffers the forward updates, each held by one stage.
    """

    stage_of: dict[str, int]
    stage_nodes: list[list[str]]
    boundaries: list[list[str]]
    attr_stages: dict[str, list[int]]
    param_stage: dict[str, int] = field(default_factory=dict)
    tied: list[TiedParameter] = field(default_factory=list)
    state: list[StateBuffer] = field(default_factory=list)

    @property
    def num_stages(self) -> int:
        return len(self.stage_nodes)


def _value_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op in _VALUE_OPS]


def _assign(values: Sequence[torch.fx.Node], stage_nodes: Sequence[Sequence[str]]) -> dict[str, int]:
    """Value node name -> the plan's stage for it (placeholders: stage 0)."""
    by_name = {n.name: n for n in values}
    stage_of: dict[str, int] = {}
    for k, names in enumerate(stage_nodes):
        for name in names:
            if name not in by_name:
                known = ", ".join(list(by_name)[:6])
                raise RuntimeConfigError(
                    f"the plan's stage {k} lists node {name!r}, which the captured model has no node of "
                    f"(nodes are like: {known}, ...); the plan was made for another model or other model "
                    f"options: re-run `pipetrain plan` for this model")
            if name in stage_of and stage_of[name] != k:
                raise RuntimeConfigError(
                    f"the plan puts node {name!r} in stages {stage_of[name]} and {k}; each node belongs to one stage")
            stage_of[name] = k
    for n in values:
        if n.op == "placeholder":
            stage_of[n.name] = 0  # model inputs live with the first stage
    missing = [n.name for n in values if n.name not in stage_of]
    if missing:
        raise RuntimeConfigError(
            f"the plan places no stage for {len(missing)} node(s) of the model (first: {missing[0]!r}); "
            f"the plan was made for another model or other options: re-run `pipetrain plan`")
    return stage_of


def _check_order(values: Sequence[torch.fx.Node], stage_of: dict[str, int]) -> None:
    """Producers must not come after consumers."""
    for n in values:
        for src in n.all_input_nodes:
            if src.op in _VALUE_OPS and stage_of[src.name] > stage_of[n.name]:
                raise RuntimeConfigError(
                    f"node {n.name!r} (stage {stage_of[n.name]}) reads {src.name!r} from the later stage "
                    f"{stage_of[src.name]}; stages must be contiguous in the graph's order: move {src.name!r} "
                    f"to stage {stage_of[n.name]} or earlier")


def _user_stage(u: torch.fx.Node, stage_of: dict[str, int], last: int) -> int:
    return last if u.op == "output" else stage_of[u.name]


def _state_buffer(update: BufferUpdate, stage_of: dict[str, int], last: int) -> StateBuffer:
    """Where an updated buffer lives: the stage of its first reader. A write-back (``copy_``
    with no users, export's form of ``self.x = ...``) on a later stage moves to that stage
    when the new value is computed there already (``stage_of`` is updated); any other
    write on another stage cannot keep one worker's order of updates.

    Raises:
        RuntimeConfigError: the buffer is written on a later stage than it is first read.
    """
    users = [u for a in update.reads for u in a.users]
    first = min(users, key=lambda u: _user_stage(u, stage_of, last))
    owner = _user_stage(first, stage_of, last)
    for w in update.writers:
        if stage_of[w.name] == owner:
            continue
        sources = [a for a in w.all_input_nodes if a.op != "get_attr"]
        movable = not w.users and w.args[0] in update.reads and all(stage_of[a.name] <= owner for a in sources)
        if not movable:
            raise RuntimeConfigError(
                f"buffer {update.name!r} is read on stage {owner} (node {first.name!r}) and updated on stage "
                f"{stage_of[w.name]} (node {w.name!r}); a buffer the forward updates belongs to one stage, whose "
                f"forward of each unit must see the updates of the units before it: choose cuts (--cut, or the "
                f"plan's node lists) that keep nodes {first.name!r} to {w.name!r} in one stage")
        stage_of[w.name] = owner
    return StateBuffer(update.name, owner, tuple(a.name for a in update.reads), tuple(w.name for w in update.writers),
                       tuple(sorted(n.name for n in update.write_path)), tuple(sorted(n.name for n in update.aliases)))


def partition_graph(gm: torch.fx.GraphModule, stage_nodes: Sequence[Sequence[str]]) -> Partition:
    """Assign ``gm``'s nodes to stages and compute the relay boundaries.

    Raises:
        RuntimeConfigError: a name the graph lacks, a node in two stages or in none, a node
            placed before one of its inputs, or a buffer the forward updates on a later stage
            than it reads it.
    """
    S = len(stage_nodes)
    if S < 1:
        raise RuntimeConfigError("a plan needs at least one stage")
    values = _value_nodes(gm)
    stage_of = _assign(values, stage_nodes)
    _check_order(values, stage_of)
    last = S - 1
    state = [_state_buffer(u, stage_of, last) for u in buffer_updates(gm)]
    by_name = {n.name: n for n in gm.graph.nodes}
    stateful = [by_name[r] for b in state for r in b.reads]
    for b in state:  # a state buffer is read where it lives; later stages receive the value
        stage_of.update({r: b.stage for r in b.reads})
    boundaries: list[list[str]] = [[] for _ in range(max(0, S - 1))]
    crossing = set(values) | set(stateful)
    for n in gm.graph.nodes:
        if n not in crossing:
            continue
        p = stage_of[n.name]
        far = max((_user_stage(u, stage_of, last) for u in n.users), default=p)
        for c in range(p, far):
            boundaries[c].append(n.name)
    attr_stages: dict[str, list[int]] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            attr_stages[n.name] = ([stage_of[n.name]] if n in stateful
                                   else sorted({_user_stage(u, stage_of, last) for u in n.users}))
    part = Partition(stage_of, [[n.name for n in values if stage_of[n.name] == k] for k in range(S)],
                     boundaries, attr_stages, state=state)
    part.param_stage, part.tied = _owned_parameters(gm, part)
    return part


def _owned_parameters(gm: torch.fx.GraphModule, part: Partition) -> tuple[dict[str, int], list[TiedParameter]]:
    """Parameter qualified name -> owning (first reading) stage, and the tied tensors.

    A tensor's identity is the object: ``named_parameters(remove_duplicate=False)`` lists a
    tied tensor under each of its names; call_module nodes read their module's parameters,
    get_attr nodes their target.
    """
    names_of: dict[int, list[str]] = {}
    tensor: dict[int, torch.Tensor] = {}
    for qn, p in gm.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(qn)
        tensor[id(p)] = p
    stages_of: dict[int, set[int]] = {}   # insertion order: the tensors' first readers, graph order

    def claim(p: torch.Tensor, k: int) -> None:
        stages_of.setdefault(id(p), set()).add(k)
        tensor.setdefault(id(p), p)

    for n in gm.graph.nodes:
        if n.op == "call_module":
            for _, p in gm.get_submodule(str(n.target)).named_parameters(remove_duplicate=False):
                claim(p, part.stage_of[n.name])
        elif n.op == "get_attr":
            try:
                p = gm.get_parameter(str(n.target))
            except AttributeError:
                continue
            for k in part.attr_stages[n.name]:
                claim(p, k)
    out: dict[str, int] = {}
    tied: list[TiedParameter] = []
    for tid, ks in stages_of.items():
        names = names_of.get(tid, [])
        for qn in names:
            out[qn] = min(ks)
        if len(names) > 1 or len(ks) > 1:
            tied.append(TiedParameter(tuple(names), tuple(sorted(ks)), bool(tensor[tid].requires_grad)))
    return out, tied


# --------------------------------------------------------------------------- example run


class _Recorder(torch.fx.Interpreter):
    """Runs the graph once and builds a codec for every value that crosses a cut."""

    def __init__(self, gm: torch.fx.GraphModule, wanted: set[str]) -> None:
        super().__init__(gm)
        self.wanted = wanted
        self.codecs: dict[str, ValueCodec] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        if n.name in self.wanted:
            self.codecs[n.name] = ValueCodec(out)
        return out


def boundary_codecs(gm: torch.fx.GraphModule, part: Partition, unit_inputs: Sequence[Any]) -> list[BoundaryCodec]:
    """Run ``gm`` once on one unit's inputs (grad enabled) and describe every cut's wires.

    The run leaves buffers (batch-norm statistics) and the random state as they were.
    """
    wanted = {name for b in part.boundaries for name in b}
    rec = _Recorder(gm, wanted)
    with preserved_state(gm), torch.enable_grad():
        rec.run(*unit_inputs)
    return [BoundaryCodec(names, [rec.codecs[n] for n in names]) for names in part.boundaries]


# --------------------------------------------------------------------------- stage modules


@dataclass
class StageModule:
    """One stage: its GraphModule and what it receives and sends.

    ``module(*inputs)`` takes the decoded values of ``in_codec`` (stage 0: the model's inputs)
    and returns the tuple of values of ``out_codec`` (the last stage: the model's output,
    restructured by :meth:`finish_output`).
    """

    index: int
    num_stages: int
    module: torch.fx.GraphModule
    in_codec: BoundaryCodec | None
    out_codec: BoundaryCodec | None
    param_names: list[str]
    buffer_names: list[str]
    out_spec: Any = None  # torch.export graphs: pytree spec of the model's output
    ties: tuple[TiedParameter, ...] = ()       # every tie of the partition (the same on every rank)
    tie_names: dict[str, str] = field(default_factory=dict)     # tie.names[0] -> this stage's name of it
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)  # a held name -> its other model names
    random_nodes: tuple[str, ...] = ()  # its nodes that draw from the per-unit random stream (graph/random_ops.py)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def finish_output(self, out: Any) -> Any:
        """The model's output structure from the last stage's graph output."""
        if self.out_spec is None:
            return out
        from torch.utils import _pytree as pytree

        return pytree.tree_unflatten(list(out), self.out_spec)


def _mutated_placeholders(graph: torch.fx.Graph, gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Placeholders that an in-place op mutates, directly or through a view."""
    return [ph for ph in graph.nodes if ph.op == "placeholder" and inplace_writers(ph, gm)]


def _copy_stage_nodes(g: torch.fx.Graph, gm: torch.fx.GraphModule, part: Partition, k: int,
                      env: dict[torch.fx.Node, torch.fx.Node]) -> dict[torch.fx.Node, torch.fx.Node]:
    """Copy stage ``k``'s nodes of ``gm`` into ``g`` in graph order (``env``: original node ->
    copy, filled in; ``get_attr`` nodes go with their readers). A node reading a state
    buffer's memory that is not one of its writers (or a view they write through) reads a
    copy taken where the value is read, and so does a later stage: autograd may save what it
    read, and the stage's later writes (its write-back, the next unit's update) would change
    it. Returns those copies (original node -> copy)."""
    aliases = {a for b in part.state for a in b.aliases}
    takes_buffer = {w for b in part.state for w in b.write_path}
    copies: dict[torch.fx.Node, torch.fx.Node] = {}

    def read(user: torch.fx.Node) -> Callable[[torch.fx.Node], torch.fx.Node]:
        if user.name in takes_buffer:
            return lambda a: env[a]
        return lambda a: copies.get(a, env[a])

    for n in gm.graph.nodes:
        if n.op == "get_attr" and k in part.attr_stages[n.name]:
            env[n] = g.node_copy(n)
        elif n.op in ("call_module", "call_function", "call_method") and part.stage_of[n.name] == k:
            env[n] = g.node_copy(n, read(n))
        else:
            continue
        if n.name in aliases and any(u.name not in takes_buffer for u in n.users):
            copies[n] = g.call_method("clone", (env[n],))
    return copies


def _build_graph(gm: torch.fx.GraphModule, part: Partition, k: int) -> torch.fx.Graph:
    S = part.num_stages
    g = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    nodes = list(gm.graph.nodes)
    by_name = {n.name: n for n in nodes}
    if k == 0:
        for n in nodes:
            if n.op == "placeholder":
                env[n] = g.placeholder(n.name)
    else:
        for name in part.boundaries[k - 1]:
            env[by_name[name]] = g.placeholder(name)
    copies = _copy_stage_nodes(g, gm, part, k, env)
    if k < S - 1:
        g.output(tuple(copies.get(by_name[name], env[by_name[name]]) for name in part.boundaries[k]))
    else:
        out = next(n for n in nodes if n.op == "output")
        g.output(torch.fx.node.map_arg(out.args[0], lambda a: copies.get(a, env[a])))
    # A stage must not mutate the tensors it receives (they are receive buffers, may be
    # relayed on, and are leaves that require grad): clone those an in-place op writes.
    for ph in _mutated_placeholders(g, gm):
        with g.inserting_after(ph):
            c = g.call_method("clone", (ph,))
        # Every use but the clone itself now reads the clone (``c is not u``).
        ph.replace_all_uses_with(c, delete_user_cb=functools.partial(operator.is_not, c))
    # Random nodes draw from the per-unit stream, keyed by their name in the captured graph
    # (graph/random_ops.py): the same masks on every layout.
    insert_seeding(g, gm, {env[n]: n.name for n in nodes if n in env and n.op != "get_attr"
                           and part.stage_of.get(n.name) == k and is_random_node(n, gm)})
    g.lint()
    return g


def build_stage_modules(captured: CapturedModel, part: Partition, codecs: Sequence[BoundaryCodec],
                        stages: Sequence[int]) -> dict[int, StageModule]:
    """The :class:`StageModule` of each stage in ``stages`` (sharing ``captured.gm``'s modules)."""
    gm = captured.gm
    out_spec = None
    codegen = getattr(gm.graph, "_codegen", None)
    info = getattr(codegen, "pytree_info", None)
    if info is not None and info.out_spec is not None:
        out_spec = info.out_spec
    S = part.num_stages
    result: dict[int, StageModule] = {}
    for k in stages:
        graph = _build_graph(gm, part, k)
        mod = torch.fx.GraphModule(gm, graph, class_name=f"Stage{k}")
        mod.train(gm.training)
        tie_names: dict[str, str] = {}
        aliases: dict[str, tuple[str, ...]] = {}
        held = {id(p): n for n, p in mod.named_parameters()}
        for tie in part.tied:
            if k not in tie.stages:
                continue
            original = gm.get_parameter(tie.names[0])
            name = held[id(original)]
            tie_names[tie.names[0]] = name
            aliases[name] = tuple(n for n in tie.names if n != name)
            if k != tie.stages[0]:  # every holder but the first gets its own copy
                _own_copy(mod, gm, original)
        params = [n for n, _ in mod.named_parameters()]
        buffers = [n for n, _ in mod.named_buffers()]
        result[k] = StageModule(
            index=k, num_stages=S, module=mod,
            in_codec=codecs[k - 1] if k > 0 else None,
            out_codec=codecs[k] if k < S - 1 else None,
            param_names=params, buffer_names=buffers,
            out_spec=out_spec if k == S - 1 else None,
            ties=tuple(part.tied), tie_names=tie_names, aliases=aliases,
            random_nodes=tuple(str(n.args[0]) for n in graph.nodes if n.target is draw_from_stream))
    return result


def _own_copy(mod: torch.fx.GraphModule, gm: torch.fx.GraphModule, original: torch.Tensor) -> None:
    """Give stage module ``mod`` its own clone of the tied parameter ``original``, under every
    name ``mod`` holds it by, without touching ``gm`` or other stages: a submodule shared with
    ``gm`` (a call_module target) is replaced by a shallow copy before its parameter is set."""
    clone = torch.nn.Parameter(original.detach().clone(), requires_grad=original.requires_grad)
    names = [n for n, p in mod.named_parameters(remove_duplicate=False) if p is original]
    for qn in names:
        *path, leaf = qn.split(".")
        cur: torch.nn.Module = mod
        src: torch.nn.Module | None = gm
        for part_name in path:
            child = cur._modules[part_name]
            src_child = src._modules.get(part_name) if src is not None else None
            if child is not None and child is src_child:  # shared with gm: copy before writing
                child = copy.copy(child)
                child._parameters = dict(child._parameters)
                child._buffers = dict(child._buffers)
                child._modules = dict(child._modules)
                cur._modules[part_name] = child
            assert child is not None
            cur, src = child, src_child
        cur._parameters[leaf] = clone


def whole_graph_stage(captured: CapturedModel) -> StageModule:
    """The whole captured graph as one stage, built as every stage is: its random nodes draw
    from the per-unit stream and state buffers are read through copies. What one worker runs
    when the model draws random numbers (:mod:`pipetrain.runtime.single`); it shares the
    model's parameters and buffers."""
    part = partition_graph(captured.gm, [[n.name for n in _value_nodes(captured.gm)]])
    return build_stage_modules(captured, part, [], [0])[0]
