"""Capture a live ``nn.Module`` as a :class:`LayerGraph` plus an executable fx ``GraphModule``.

Two tracers are tried in order:

1. ``torch.fx.symbolic_trace``: keeps ``torch.nn`` modules as leaves, so a layer of the graph
   is a whole ``Conv2d`` / ``Linear`` / ``LSTM`` call (what PipeDream profiles);
2. ``torch.export.export(model, args, strict=False)`` + ``ep.module()``: an unlifted
   GraphModule of ATen ops that read parameters through ``get_attr`` nodes. It handles models
   fx cannot trace (Hugging Face models, code that inspects shapes). The batch dimension is
   exported as dynamic (``Dim.AUTO``) when possible, so the graph runs on any micro-batch size.

Then a shape-propagation pass runs the GraphModule on the example inputs and records every
node's output :class:`TensorMeta` (tuples, lists and dicts of tensors are flattened;
non-tensor outputs such as sizes record no bytes).

A tracer's graph is accepted only if it gives the model's output (same seed) and leaves the
model's buffers as the model's own forward does. ``torch.fx`` runs an update of a buffer
made under ``torch.no_grad()`` (``self.count += 1``, ``self.mean = ...``) on the real
buffer while tracing and keeps its result as a constant; such a trace is rejected (the
buffers are restored, bindings included) and ``torch.export`` records the update instead
(in place, or as a ``copy_`` write-back at the graph's end). :func:`buffer_updates` lists the
buffers a graph writes; :mod:`pipetrain.stages.partition` keeps each on one stage. Hugging
Face models are captured with ``use_cache`` off on every config they hold (GPT-2's, and an
encoder-decoder's decoder stack's own copy), so no cache object is part of the output.

Correspondence between the two views (the runtime relies on it):

* every LayerGraph node name is the name of a node of ``CapturedModel.gm`` (placeholders,
  ``call_module``, ``call_function``, ``call_method``);
* the gm nodes that are *not* LayerGraph nodes are ``get_attr`` nodes (folded into the nodes
  that read them, see ``CapturedModel.folded_attributes``) and the ``output`` node;
* parameter and buffer bytes are counted exactly once over the graph: at the leaf module that
  owns them, or at the first node (topological order) that reads them through ``get_attr``.
  Tensors read by several nodes (tied weights) are listed in ``shared_parameters``; tensors
  no node reads are counted at the first non-input node and listed in ``unused_parameters``.
  So ``graph.parameter_bytes == model_parameter_bytes(model)`` always.
"""
from __future__ import annotations

import contextlib
import hashlib
import inspect
import io
import logging
import operator
import os
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.utils import _pytree as pytree

from ..errors import CaptureError
from .held import on_meta
from .types import LayerGraph, LayerNode, TensorMeta

__all__ = [
    "CapturedModel", "SharedParameter", "capture", "model_parameter_bytes", "tensor_metas",
    "node_op_name", "is_inplace_node", "inplace_writers", "buffer_updates", "BufferUpdate",
    "rebatched", "structure_digest", "batch_size_of",
]

_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_DIR = os.path.dirname(os.path.abspath(__file__))

# Ops that only check invariants (they return None and feed nothing). They are removed from
# the captured graph: they are not layers and would only clutter the planner's cut points.
_ASSERT_OP_NAMES = {
    "_assert", "_assert_is_none", "_assert_tensor_metadata", "_assert_scalar", "_assert_async",
    "sym_constrain_range", "sym_constrain_range_for_size", "_functional_assert_scalar",
    "_functional_assert_async",
}
_INPLACE_OPERATORS = {
    operator.iadd, operator.iand, operator.ifloordiv, operator.ilshift, operator.imod,
    operator.imul, operator.imatmul, operator.ior, operator.ipow, operator.irshift,
    operator.isub, operator.itruediv, operator.ixor, operator.setitem,
}
# Ops whose result may alias their first argument: an in-place op on such a result mutates
# the argument too (how writes to a received tensor or a buffer are found).
_VIEW_OPS = {
    "view", "view_as", "reshape", "flatten", "unflatten", "transpose", "permute", "unsqueeze",
    "squeeze", "expand", "expand_as", "narrow", "select", "t", "getitem", "chunk", "split",
    "unbind", "as_strided", "slice", "alias", "movedim", "swapaxes", "diagonal", "contiguous",
    "detach", "view_as_real", "view_as_complex", "_unsafe_view", "split_with_sizes",
}
# Loggers that print diagnostics while a tracer fails; we report the failure ourselves.
_NOISY_LOGGERS = (
    "torch.fx.experimental.symbolic_shapes", "torch._export", "torch.export",
    "torch._dynamo", "torch._subclasses.fake_tensor",
)


@dataclass
class SharedParameter:
    """A parameter or buffer read by several graph nodes (tied weights).

    Its bytes are counted once, at ``nodes[0]``. A pipeline cut between two of ``nodes``
    puts the tensor on two stages: the runtime keeps a copy on each and sums their
    gradients at every step (:mod:`pipetrain.stages.tied`; synchronous schedules only).

    Attributes:
        names: qualified names (``lm_head.weight``) under which the model holds the tensor.
        nodes: LayerGraph node names that read it, in topological order (two or more).
        nbytes: the tensor's size in bytes.
    """

    names: list[str]
    nodes: list[str]
    nbytes: int


@dataclass
class CapturedModel:
    """A model captured as a layer graph plus its executable GraphModule.

    Attributes:
        graph: the torch-free :class:`LayerGraph` (node names equal ``gm`` node names).
        gm: the executable ``torch.fx.GraphModule``; calling it like the model gives the
            model's output (for ``method == "export"`` with the model's output structure).
        method: ``"fx"`` (``torch.fx.symbolic_trace``) or ``"export"`` (``torch.export``).
        input_names: names of the placeholder nodes, in the order of the model's inputs.
        output_names: names of the nodes whose values form the model's output.
        shared_parameters: tensors read by more than one node (see :class:`SharedParameter`).
        node_parameters: for each node with parameter bytes, the qualified names of the
            parameters/buffers counted at that node.
        folded_attributes: for each ``get_attr`` node of ``gm``, the LayerGraph nodes that
            read it (a stage that runs one of them needs that attribute).
        unused_parameters: qualified names of model parameters/buffers no node reads (their
            bytes are counted at the first non-input node).
        tensor_values: for a capture on ``meta`` (weightless), the known initial value of a
            tensor by its name in ``gm`` (files, buffers kept at the build) or ``None``: what
            timing the graph holds its tensors with (:mod:`pipetrain.graph.held`).
    """

    graph: LayerGraph
    gm: torch.fx.GraphModule
    method: str
    input_names: list[str]
    output_names: list[str]
    shared_parameters: list[SharedParameter] = field(default_factory=list)
    node_parameters: dict[str, list[str]] = field(default_factory=dict)
    folded_attributes: dict[str, list[str]] = field(default_factory=dict)
    unused_parameters: list[str] = field(default_factory=list)
    tensor_values: Callable[[str], torch.Tensor | None] | None = field(default=None, repr=False, compare=False)
    #: the captured model's :func:`structure_digest` (what :func:`rebatched` compares)
    structure: str = ""


# --------------------------------------------------------------------------- small helpers


def _as_tuple(example_inputs: Any) -> tuple[Any, ...]:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, list):
        return tuple(example_inputs)
    if isinstance(example_inputs, tuple):
        return example_inputs
    raise CaptureError(
        f"example_inputs must be a Tensor or a tuple of model inputs, got {type(example_inputs).__name__}; "
        "pass the positional arguments of the model's forward as a tuple"
    )


def tensor_metas(value: Any) -> list[TensorMeta]:
    """Metadata of every tensor in ``value`` (nested tuples/lists/dicts flattened)."""
    return [
        TensorMeta(tuple(int(d) for d in t.shape), str(t.dtype).replace("torch.", ""))
        for t in pytree.tree_leaves(value)
        if isinstance(t, torch.Tensor)
    ]


def _describe_inputs(inputs: Sequence[Any]) -> str:
    parts = []
    for x in inputs:
        if isinstance(x, torch.Tensor):
            parts.append(f"{list(x.shape)} {str(x.dtype).replace('torch.', '')}")
        else:
            parts.append(type(x).__name__)
    return ", ".join(parts) or "no inputs"


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _named_tensors(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every (qualified name, tensor) of parameters and buffers, aliases included."""
    yield from module.named_parameters(prefix=prefix, remove_duplicate=False)
    yield from module.named_buffers(prefix=prefix, remove_duplicate=False)


def model_parameter_bytes(model: nn.Module) -> int:
    """Exact bytes of a model's parameters and buffers (each tensor counted once)."""
    seen: dict[int, torch.Tensor] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        seen.setdefault(id(t), t)
    return sum(_tensor_bytes(t) for t in seen.values())


def _first_line(exc: BaseException, limit: int = 240) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0].strip() if text else ""
    line = f"{type(exc).__name__}: {line}" if line else type(exc).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _user_location(exc: BaseException) -> str | None:
    """``file:line in func: `code``` of the innermost frame outside torch and this package."""
    frames = [
        f for f in traceback.extract_tb(exc.__traceback__)
        if not f.filename.startswith(_TORCH_DIR)
        and not os.path.abspath(f.filename).startswith(_THIS_DIR)
        and not f.filename.startswith("<")
        and "/contextlib.py" not in f.filename
    ]
    if not frames:
        return None
    f = frames[-1]
    code = (f.line or "").strip()
    where = f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}"
    return f"{where}: `{code}`" if code else where


def _failing_module(exc: BaseException, model: nn.Module) -> str | None:
    """``decoder.block.0 (T5Block)``: the innermost submodule of ``model`` whose method was
    running when ``exc`` was raised (``None``: only the model's own forward, or none)."""
    names = {id(m): name for name, m in model.named_modules()}
    found = None
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        name = names.get(id(owner)) if owner is not None else None
        if name:
            found = f"{name} ({type(owner).__name__})"
        tb = tb.tb_next
    return found


def _describe_failure(exc: BaseException, model: nn.Module) -> str:
    """The exception's own first line, the user code line and the submodule it came from."""
    parts = [_first_line(exc)]
    loc = _user_location(exc)
    if loc:
        parts.append(f"at {loc}")
    module = _failing_module(exc, model)
    if module:
        parts.append(f"in module {module}")
    return f"{parts[0]} ({', '.join(parts[1:])})" if len(parts) > 1 else parts[0]


def _cached_configs(model: nn.Module) -> list[Any]:
    """The distinct ``config`` objects of ``model`` and its submodules with ``use_cache=True``."""
    found: dict[int, Any] = {}
    for m in model.modules():
        config = getattr(m, "config", None)
        if getattr(config, "use_cache", None) is True:
            found.setdefault(id(config), config)
    return list(found.values())


@contextlib.contextmanager
def _no_kv_cache(model: nn.Module) -> Iterator[None]:
    """Capture a Hugging Face model without its key/value cache.

    A stock ``transformers`` model (``config.use_cache=True``, the default) returns a cache
    (``DynamicCache``; ``EncoderDecoderCache`` for T5 and BART) beside the logits: a
    generation aid that training never reads, which ``torch.export`` cannot flatten and
    which would otherwise cross every pipeline cut. ``use_cache`` is off while capturing
    (and restored afterwards) on every config the model holds: an encoder-decoder model's
    decoder stack keeps its own copy of the config, which its forward reads. The graph's
    output is then the ``ModelOutput`` without the cache.
    """
    configs = _cached_configs(model)
    for config in configs:
        config.use_cache = False
    try:
        yield
    finally:
        for config in configs:
            config.use_cache = True


@contextlib.contextmanager
def _quiet_tracing() -> Iterator[None]:
    """Silence the diagnostics torch prints to stderr while a trace fails."""
    saved = {}
    for name in _NOISY_LOGGERS:
        lg = logging.getLogger(name)
        saved[name] = lg.level
        lg.setLevel(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


# A tensor's in-place write counter (torch's ``Tensor._version``): it moves with every in-place
# op, on the ``meta`` device too, where there are no values to compare.
_write_count = operator.attrgetter("_version")


class BufferSnapshot:
    """A model's buffers as they are now: which tensor each name is bound to, and its value.

    Passes that run the model for measurement (shape propagation, profiling, a tracer that
    executes ``forward``) would otherwise leave batch-norm statistics advanced, or a buffer
    that ``forward`` assigns (``self.mean = ...``) bound to a new tensor or to a tracer's
    proxy. :meth:`restore` puts back every binding and value.
    """

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._saved = [(name, b, b.detach().clone()) for name, b in model.named_buffers(remove_duplicate=False)]
        self._versions = [_write_count(b) for _, b, _ in self._saved]

    def changed(self) -> list[str]:
        """Names of the buffers bound to another object, written in place (their version
        counter moved: this works on the ``meta`` device too), or holding another value."""
        now = dict(self._model.named_buffers(remove_duplicate=False))
        out = []
        for (name, b, v), version in zip(self._saved, self._versions):
            cur = now.get(name)
            if cur is not b or _write_count(b) != version or (not b.is_meta and not torch.equal(b, v)):
                out.append(name)
        return out

    def values(self) -> dict[str, torch.Tensor]:
        """Every buffer's current value (a copy), by qualified name."""
        return {n: b.detach().clone() for n, b in self._model.named_buffers(remove_duplicate=False)
                if isinstance(b, torch.Tensor)}

    def restore(self) -> None:
        now = dict(self._model.named_buffers(remove_duplicate=False))
        with torch.no_grad():
            for name, b, v in self._saved:
                if now.get(name) is not b:
                    owner, _, leaf = name.rpartition(".")
                    setattr(self._model.get_submodule(owner) if owner else self._model, leaf, b)
                b.copy_(v)
        self._versions = [_write_count(b) for _, b, _ in self._saved]


@contextlib.contextmanager
def preserved_state(model: nn.Module, devices: Sequence[torch.device] = ()) -> Iterator[BufferSnapshot]:
    """Run a block that executes ``model`` without changing its buffers or the global RNG.

    Shape propagation and profiling run the model; batch norm would otherwise update its
    running statistics and dropout would advance the user's random stream. The yielded
    snapshot can also be restored in between passes.
    """
    snap = BufferSnapshot(model)
    cuda_devices = sorted({d.index or 0 for d in devices if d.type == "cuda"})
    with torch.random.fork_rng(devices=cuda_devices, enabled=True):
        try:
            yield snap
        finally:
            snap.restore()


# --------------------------------------------------------------------------- node naming


def node_op_name(node: torch.fx.Node, gm: torch.fx.GraphModule | None = None) -> str:
    """Short human description of a node: a module's one-line repr or a function's name."""
    if node.op == "placeholder":
        return "Input"
    if node.op == "call_module" and gm is not None:
        mod = gm.get_submodule(str(node.target))
        extra = mod.extra_repr().replace("\n", " ")
        return f"{type(mod).__name__}({extra})"
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_function":
        t = node.target
        if isinstance(t, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
            return str(t)  # aten.addmm.default
        return getattr(t, "__name__", str(t))
    return str(node.target)


def _function_target(node: torch.fx.Node) -> str:
    t = node.target
    if node.op == "call_method":
        return f"Tensor.{t}"
    if isinstance(t, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return str(t)
    try:
        return torch.fx.node._get_qualified_name(t)  # type: ignore[arg-type]
    except Exception:  # lambdas and other unnamed callables
        return getattr(t, "__name__", str(t))


def is_inplace_node(node: torch.fx.Node, gm: torch.fx.GraphModule | None = None) -> bool:
    """Whether a node mutates one of its inputs (``relu_``, ``+=``, ``ReLU(inplace=True)``...)."""
    if node.op == "call_module":
        return gm is not None and bool(getattr(gm.get_submodule(str(node.target)), "inplace", False))
    if node.kwargs.get("inplace") is True:
        return True
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.startswith("_")
    if node.op == "call_function":
        t = node.target
        if t in _INPLACE_OPERATORS:
            return True
        if isinstance(t, torch._ops.OpOverload):
            return bool(t._schema.is_mutable)
        name = getattr(t, "__name__", "")
        return name.endswith("_") and not name.startswith("_")
    return False


def _op_name(n: torch.fx.Node) -> str:
    t = n.target
    if isinstance(t, str):
        return t.rsplit(".", 1)[-1]
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name.split("::")[-1]
    return getattr(t, "__name__", "")


def _is_view_op(n: torch.fx.Node) -> bool:
    return _op_name(n) in _VIEW_OPS or n.target is operator.getitem


def _subgraph_writes(hop: torch.fx.Node, value: torch.fx.Node, gm: torch.fx.GraphModule) -> bool:
    """Whether the higher-order op ``hop`` (export's ``wrap_with_set_grad_enabled``...) writes
    ``value`` in place inside its subgraph. Its operands are the arguments after the subgraph;
    when they do not line up with the subgraph's inputs, any operand counts as written."""
    args = list(hop.args)
    subs = [(i, getattr(gm, str(a.target), None)) for i, a in enumerate(args)
            if isinstance(a, torch.fx.Node) and a.op == "get_attr"]
    sub_at, sub = next(((i, m) for i, m in subs if isinstance(m, torch.fx.GraphModule)), (None, None))
    if sub_at is None or sub is None:
        return True
    operands = args[sub_at + 1:]
    inputs = [n for n in sub.graph.nodes if n.op == "placeholder"]
    if len(operands) != len(inputs):
        return True
    return any(a is value and inplace_writers(ph, sub) for a, ph in zip(operands, inputs))


def _writes(u: torch.fx.Node, v: torch.fx.Node, gm: torch.fx.GraphModule) -> bool:
    """Whether node ``u`` writes its input ``v`` in place (an in-place op on it, or a
    higher-order op whose subgraph does)."""
    if u.args and u.args[0] is v and is_inplace_node(u, gm):
        return True
    return isinstance(u.target, torch._ops.HigherOrderOperator) and _subgraph_writes(u, v, gm)


def inplace_writers(value: torch.fx.Node, gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The nodes that write ``value`` (a node's result) in place, directly or through a view
    of it: in-place ops on it (``add_``, ``copy_``, ``+=``) and higher-order ops whose subgraph
    does (export's ``torch.no_grad()`` blocks)."""
    out: list[torch.fx.Node] = []
    frontier, seen = [value], {value}
    while frontier:
        v = frontier.pop()
        for u in v.users:
            if u.op == "output" or u in out:
                continue
            if _writes(u, v, gm):
                out.append(u)
            elif _is_view_op(u) and u not in seen:
                seen.add(u)
                frontier.append(u)
    return out


@dataclass
class BufferUpdate:
    """A buffer the graph updates: a forward's running statistic or counter, written in place
    or by assignment (which ``torch.export`` writes back with ``copy_`` at the graph's end).

    A node that reads the buffer's memory and is not on :attr:`write_path` must read a copy
    taken where it reads it (:mod:`pipetrain.stages.partition` inserts them): autograd may
    have saved what it read, and a later write (this forward's write-back, the next unit's
    update) would change it.

    Attributes:
        name: its qualified name (the ``get_attr`` target).
        reads: the ``get_attr`` nodes of it, in graph order.
        writers: the nodes that write it, in graph order.
        write_path: the writers and the views of the buffer they write through: the nodes
            that must take the buffer itself.
        aliases: the nodes whose value may be the buffer's memory when only ``write_path``
            takes the buffer itself (the reads, the path's views, in-place results, and the
            elements of higher-order ops on the path).
    """

    name: str
    reads: list[torch.fx.Node]
    writers: list[torch.fx.Node]
    write_path: set[torch.fx.Node] = field(default_factory=set)
    aliases: set[torch.fx.Node] = field(default_factory=set)


def _is_buffer(gm: torch.fx.GraphModule, target: str) -> bool:
    try:
        gm.get_buffer(target)
    except AttributeError:
        return False
    return True


def _add_write_path(value: torch.fx.Node, gm: torch.fx.GraphModule, path: set[torch.fx.Node]) -> bool:
    """Add to ``path`` the nodes that write ``value`` in place and the views of it they write
    through; whether there is any."""
    hit = False
    for u in value.users:
        if _writes(u, value, gm) or (_is_view_op(u) and _add_write_path(u, gm, path)):
            path.add(u)
            hit = True
    return hit


def _aliases(reads: Sequence[torch.fx.Node], path: set[torch.fx.Node]) -> set[torch.fx.Node]:
    out = set(reads)
    frontier = list(reads)
    while frontier:
        a = frontier.pop()
        for u in a.users:
            if u not in path:
                continue
            hop = isinstance(u.target, torch._ops.HigherOrderOperator)
            for v in ([g for g in u.users if g.target is operator.getitem] if hop else [u]):
                if v not in out:
                    out.add(v)
                    frontier.append(v)
    return out


def buffer_updates(gm: torch.fx.GraphModule) -> list[BufferUpdate]:
    """The buffers ``gm`` writes through ``get_attr`` nodes, in the order of their first read.
    Buffers of ``call_module`` layers (batch norm) are updated inside their layer, not listed."""
    reads: dict[str, list[torch.fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr" and _is_buffer(gm, str(n.target)):
            reads.setdefault(str(n.target), []).append(n)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    out = []
    for target, attrs in reads.items():
        writers = sorted({w for a in attrs for w in inplace_writers(a, gm)}, key=order.__getitem__)
        if not writers:
            continue
        path: set[torch.fx.Node] = set()
        for a in attrs:
            _add_write_path(a, gm, path)
        out.append(BufferUpdate(target, attrs, writers, path, _aliases(attrs, path)))
    return out


def _is_assert_node(node: torch.fx.Node) -> bool:
    if node.op == "call_module":
        return str(node.target) == "_guards_fn"
    if node.op != "call_function":
        return False
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name.split("::")[-1] in _ASSERT_OP_NAMES
    return getattr(t, "__name__", "") in _ASSERT_OP_NAMES


# --------------------------------------------------------------------------- tracers


def _trace_fx(model: nn.Module, n_inputs: int) -> torch.fx.GraphModule:
    """``symbolic_trace`` with the forward's unused defaulted arguments fixed to their defaults."""
    concrete: dict[str, Any] = {}
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for p in positional[n_inputs:]:
        if p.default is not inspect.Parameter.empty:
            concrete[p.name] = p.default
    for p in params:
        if p.kind == p.KEYWORD_ONLY and p.default is not inspect.Parameter.empty:
            concrete[p.name] = p.default
    gm = torch.fx.symbolic_trace(model, concrete_args=concrete or None)
    if concrete:
        _strip_asserts(gm)
        _drop_dead_nodes(gm)
        # Placeholders of the fixed arguments are now unused: drop them so that the
        # graph's inputs are exactly the example inputs.
        phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for n in phs[n_inputs:]:
            if not n.users:
                gm.graph.erase_node(n)
        gm.recompile()
    return gm


def _trace_export(model: nn.Module, inputs: tuple[Any, ...], dynamic_batch: bool) -> torch.fx.GraphModule:
    from torch.export import Dim

    dynamic_shapes = None
    if dynamic_batch:
        dynamic_shapes = tuple(
            {0: Dim.AUTO} if isinstance(x, torch.Tensor) and x.dim() > 0 else None for x in inputs
        )
    ep = torch.export.export(model, inputs, strict=False, dynamic_shapes=dynamic_shapes)
    return ep.module(check_guards=False)  # type: ignore[return-value]


def _strip_asserts(gm: torch.fx.GraphModule) -> None:
    for node in reversed(list(gm.graph.nodes)):
        if _is_assert_node(node) and not node.users:
            target = node.target
            gm.graph.erase_node(node)
            if node.op == "call_module" and hasattr(gm, str(target)):
                delattr(gm, str(target))


def _drop_dead_nodes(gm: torch.fx.GraphModule) -> None:
    """Remove pure function/method nodes whose value nobody uses (e.g. an export leftover).

    Conservative, unlike ``Graph.eliminate_dead_code``: module calls, in-place and impure
    ops are kept.
    """
    changed = True
    while changed:
        changed = False
        for node in reversed(list(gm.graph.nodes)):
            if node.users or node.op not in ("call_function", "call_method", "get_attr"):
                continue
            if is_inplace_node(node, gm):
                continue
            if node.op == "call_function" and node.is_impure():
                continue
            gm.graph.erase_node(node)
            changed = True


def _clean(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    _strip_asserts(gm)
    _drop_dead_nodes(gm)
    gm.graph.lint()
    gm.recompile()
    return gm


# --------------------------------------------------------------------------- shape propagation


class _MetaRecorder(torch.fx.Interpreter):
    """Runs the graph on real inputs and records each node's output tensor metadata."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.metas: dict[str, list[TensorMeta]] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        if n.op not in ("get_attr", "output"):
            self.metas[n.name] = tensor_metas(out)
        return out


def _propagate(gm: torch.fx.GraphModule, inputs: tuple[Any, ...], seed: int) -> tuple[dict[str, list[TensorMeta]], Any]:
    rec = _MetaRecorder(gm)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = rec.run(*inputs)
    return rec.metas, out


def _eager(model: nn.Module, inputs: tuple[Any, ...], seed: int) -> Any:
    torch.manual_seed(seed)
    with torch.no_grad():
        return model(*inputs)


def _same_output(a: Any, b: Any, values: bool = True) -> bool:
    """The same tensors by shape and dtype, and (``values``) by value."""
    la = [t for t in pytree.tree_leaves(a) if isinstance(t, torch.Tensor)]
    lb = [t for t in pytree.tree_leaves(b) if isinstance(t, torch.Tensor)]
    if len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if not values:
            continue
        if x.is_floating_point() or x.is_complex():
            if not torch.allclose(x, y, rtol=1e-4, atol=1e-5, equal_nan=True):
                return False
        elif not torch.equal(x, y):
            return False
    return True


# --------------------------------------------------------------------------- graph building


class _ParameterReads:
    """Which layer nodes read each model parameter or buffer, in topological order.

    A tensor's identity is the model's own tensor of that qualified name (export may hold
    its own objects; fx shares the model's).
    """

    def __init__(self, model: nn.Module, gm: torch.fx.GraphModule) -> None:
        self.model_by_name = dict(_named_tensors(model))
        self.names_of: dict[int, list[str]] = {}
        for name, t in self.model_by_name.items():
            self.names_of.setdefault(id(t), []).append(name)
        self.readers: dict[int, list[str]] = {}      # tensor id -> layer nodes reading it (topo order)
        self.tensors: dict[int, torch.Tensor] = {}
        self.folded: dict[str, list[str]] = {}       # get_attr node -> layer nodes reading it
        self.attr_tensor: dict[str, tuple[str, torch.Tensor] | None] = {}
        for n in gm.graph.nodes:
            if n.op == "get_attr":
                self.folded[n.name] = []
                self.attr_tensor[n.name] = _attribute_tensor(gm, str(n.target))

    def read(self, node_name: str, qualname: str, t: torch.Tensor) -> None:
        c = self.model_by_name.get(qualname, t)
        if id(c) not in self.names_of:
            return  # not one of the model's parameters/buffers (a lifted constant)
        self.tensors[id(c)] = c
        lst = self.readers.setdefault(id(c), [])
        if node_name not in lst:
            lst.append(node_name)

    def read_module(self, node_name: str, module: nn.Module, target: str) -> None:
        for qn, t in _named_tensors(module, prefix=target):
            self.read(node_name, qn, t)

    def read_attribute(self, node_name: str, attr_node: str) -> None:
        self.folded[attr_node].append(node_name)
        info = self.attr_tensor.get(attr_node)
        if info is not None:
            self.read(node_name, info[0], info[1])


def _attribute_tensor(gm: torch.fx.GraphModule, target: str) -> tuple[str, torch.Tensor] | None:
    """``(qualified name, tensor)`` of the parameter or buffer ``target``; None for anything else."""
    val: torch.Tensor | None
    try:
        val = gm.get_parameter(target)
    except AttributeError:
        try:
            val = gm.get_buffer(target)
        except AttributeError:
            val = None  # a constant or a submodule: not a model parameter
    return (target, val) if isinstance(val, torch.Tensor) else None


def _layer_node(n: torch.fx.Node, gm: torch.fx.GraphModule, metas: dict[str, list[TensorMeta]],
                reads: _ParameterReads) -> LayerNode:
    """The LayerNode of gm node ``n`` (not ``get_attr``/``output``), noting what it reads."""
    if n.op == "placeholder":
        kind, target = "input", str(n.target)
    elif n.op == "call_module":
        kind, target = "module", str(n.target)
        reads.read_module(n.name, gm.get_submodule(target), target)
    else:
        kind, target = "function", _function_target(n)
    inputs: list[str] = []
    for src in n.all_input_nodes:
        if src.op == "get_attr":
            reads.read_attribute(n.name, src.name)
        else:
            inputs.append(src.name)
    return LayerNode(
        name=n.name, op=node_op_name(n, gm), kind=kind, inputs=inputs,
        outputs=list(metas.get(n.name, [])), parameter_bytes=0, target=target,
    )


def _charge_read_tensors(nodes: list[LayerNode], reads: _ParameterReads,
                         node_params: dict[str, list[str]]) -> list[SharedParameter]:
    """Count each read tensor at its first reader; returns those read by several nodes."""
    by_name = {ln.name: ln for ln in nodes}
    shared: list[SharedParameter] = []
    for tid, rs in reads.readers.items():
        t = reads.tensors[tid]
        owner = by_name[rs[0]]
        owner.parameter_bytes += _tensor_bytes(t)
        node_params.setdefault(owner.name, []).extend(reads.names_of[tid][:1])
        if len(rs) > 1 and _tensor_bytes(t) > 0:
            shared.append(SharedParameter(list(reads.names_of[tid]), list(rs), _tensor_bytes(t)))
    return shared


def _charge_unused_tensors(nodes: list[LayerNode], reads: _ParameterReads,
                           node_params: dict[str, list[str]]) -> list[str]:
    """Count the tensors no node reads at the first compute node; returns their names.

    They still belong to the model (and to its optimizer state), so byte totals stay exact.
    """
    unused: list[str] = []
    seen_ids: set[int] = set()
    holder = next((ln for ln in nodes if not ln.is_input), nodes[0] if nodes else None)
    for name, t in reads.model_by_name.items():
        if id(t) in reads.readers or id(t) in seen_ids:
            continue
        seen_ids.add(id(t))
        unused.append(name)
        if holder is not None:
            holder.parameter_bytes += _tensor_bytes(t)
            node_params.setdefault(holder.name, []).append(name)
    return unused


def _build(model: nn.Module, gm: torch.fx.GraphModule, method: str,
           metas: dict[str, list[TensorMeta]]) -> CapturedModel:
    """Turn a cleaned GraphModule and its metas into a CapturedModel (bytes counted once)."""
    reads = _ParameterReads(model, gm)
    gm_nodes = list(gm.graph.nodes)
    nodes = [_layer_node(n, gm, metas, reads) for n in gm_nodes if n.op not in ("get_attr", "output")]
    node_params: dict[str, list[str]] = {}
    shared = _charge_read_tensors(nodes, reads, node_params)
    unused = _charge_unused_tensors(nodes, reads, node_params)
    output_node = next(n for n in reversed(gm_nodes) if n.op == "output")
    outputs = [s.name for s in output_node.all_input_nodes if s.op != "get_attr"]
    input_names = [n.name for n in gm_nodes if n.op == "placeholder"]
    graph = LayerGraph(nodes=nodes, outputs=outputs)
    return CapturedModel(
        graph=graph, gm=gm, method=method, input_names=input_names, output_names=list(outputs),
        shared_parameters=shared, node_parameters=node_params, folded_attributes=reads.folded,
        unused_parameters=unused,
    )


# --------------------------------------------------------------------------- entry point

_CONTROL_FLOW_FIX = (
    "fix: remove data-dependent Python control flow (branches on tensor values, .item(), "
    ".tolist()) from forward, wrap the model as an nn.Sequential of traceable blocks, or pass "
    "a (model, example_batch) factory that builds a traceable model with explicit split points"
)
_TRACE_FIX = (
    "fix: change the operation or output type these errors name so that torch.export can trace it "
    "(forward must return tensors, or tuples, lists, dicts or a ModelOutput of them), or pass a "
    "(model, example_batch) factory whose forward is traceable"
)
# What tracers say when forward branches on a tensor's value (the cause _CONTROL_FLOW_FIX addresses).
_DATA_DEPENDENT_MARKERS = (
    "cannot be used as inputs to control flow", "data-dependent", "data dependent",
)


def _fix_for(failures: Sequence[str]) -> str:
    """The fix for the tracers' failures: the control-flow advice only when a tracer met
    data-dependent control flow."""
    text = " ".join(failures).lower()
    return _CONTROL_FLOW_FIX if any(m in text for m in _DATA_DEPENDENT_MARKERS) else _TRACE_FIX


class _EagerReference:
    """What a traced graph must reproduce: the model's own output on the example batch (same
    seed) and the buffers that run leaves. Computed once, on first use; the model's buffers
    are restored after it."""

    def __init__(self, model: nn.Module, inputs: tuple[Any, ...], seed: int, snapshot: BufferSnapshot) -> None:
        self.model, self.inputs, self.seed, self.snapshot = model, inputs, seed, snapshot
        self.output: Any = None
        self.buffers: dict[str, torch.Tensor] = {}
        self.changed: list[str] = []
        self._done = False

    def run(self) -> _EagerReference:
        """Run the model once (no-op afterwards); a model that raises is the user's error."""
        if self._done:
            return self
        try:
            self.output = _eager(self.model, self.inputs, self.seed)
        except Exception as e:  # noqa: BLE001 - any model failure is a user error here
            raise CaptureError(
                f"model {type(self.model).__name__} raised on the example batch (inputs: "
                f"{_describe_inputs(self.inputs)}): {_first_line(e)}; check that the example batch matches "
                f"what the model's forward expects") from None
        self.buffers, self.changed = self.snapshot.values(), self.snapshot.changed()
        self.snapshot.restore()
        self._done = True
        return self

    def buffer_mismatch(self, after: dict[str, torch.Tensor]) -> str | None:
        """A buffer the graph run (``after``: its buffers afterwards) leaves other than the
        model's forward does (one the forward updates that the graph lacks, or another value)."""
        for name in self.changed:
            if name not in after or not _same_output(after[name], self.buffers[name]):
                return name
        for name, value in after.items():
            if name in self.buffers and not _same_output(value, self.buffers[name]):
                return name
        return None


def _attempt(model: nn.Module, method: str, trace: Callable[[], torch.fx.GraphModule], inputs: tuple[Any, ...],
             seed: int, snapshot: BufferSnapshot, ref: _EagerReference,
             validate: bool) -> tuple[torch.fx.GraphModule, dict[str, list[TensorMeta]]] | str:
    """One tracer: its cleaned graph and node metas, or why it failed (one line)."""
    try:
        with _quiet_tracing():
            raw = trace()
        moved = snapshot.changed()
        gm = _clean(raw)
    except Exception as e:  # noqa: BLE001 - tracer errors are reported, not raised
        snapshot.restore()
        return f"torch.{method}: {_describe_failure(e, model)}"
    if moved:  # the tracer executed the update instead of recording it: the graph holds its result
        snapshot.restore()
        return (f"torch.{method}: tracing ran forward's update of buffer {moved[0]!r} instead of recording it "
                f"(the graph would hold its value as a constant)")
    graph_state = BufferSnapshot(gm)
    try:
        metas, out = _propagate(gm, inputs, seed)
    except Exception as e:  # noqa: BLE001
        graph_state.restore()
        snapshot.restore()
        ref.run()  # a wrong example batch raises the clearer error
        return f"torch.{method} graph failed to run: {_describe_failure(e, model)}"
    after = graph_state.values()
    graph_state.restore()
    snapshot.restore()
    if validate:
        if not _same_output(out, ref.run().output):
            return f"torch.{method}: the traced graph's output differs from the model's"
        bad = ref.buffer_mismatch(after)
        if bad is not None:
            return f"torch.{method}: the traced graph leaves buffer {bad!r} other than the model's forward does"
    return gm, metas


def capture(model: nn.Module, example_inputs: tuple[Any, ...] | torch.Tensor, *,
            validate: bool = True, trace_at: tuple[Any, ...] | torch.Tensor | None = None) -> CapturedModel:
    """Capture ``model`` as a layer graph, trying ``torch.fx`` and then ``torch.export``.

    Args:
        model: the module (its current train/eval mode is what gets captured).
        example_inputs: one example minibatch: the positional arguments of ``forward``.
        validate: also run the model eagerly on the example and check that the captured
            graph gives the same output (same random seed) and leaves the buffers as the
            model does (a forward that updates a running statistic); a tracer whose graph
            differs is treated as failed.
        trace_at: a smaller example of the same inputs (a batch of 2). The model is traced and
            checked there, then the graph is taken to ``example_inputs`` by shape on
            ``meta`` (:func:`rebatched` with ``values=False``); it is traced at
            ``example_inputs`` only where that does not hold. Checking a graph costs two
            forwards of its example: at VGG-16's batch of 32 on a 2-core CPU, 15 s.

    Returns:
        A :class:`CapturedModel`; the model's buffers and the global RNG are left unchanged.

    Raises:
        CaptureError: the example batch makes the model itself fail, or neither tracer can
            capture it (the message gives each tracer's own error, the line of code and the
            submodule it came from).

    Example:
        >>> cm = capture(nn.Sequential(nn.Linear(4, 8), nn.ReLU()), torch.randn(2, 4))
        >>> [n.name for n in cm.graph]
        ['input_1', '_0', '_1']
    """
    if not isinstance(model, nn.Module):
        raise CaptureError(f"capture needs an nn.Module, got {type(model).__name__}; pass the model object")
    inputs = _as_tuple(example_inputs)
    if trace_at is not None and validate:
        taken = _traced_at(model, _as_tuple(trace_at), inputs)
        if taken is not None:
            return taken
    devices = [x.device for x in inputs if isinstance(x, torch.Tensor)]
    seed = 0x5EED
    failures: list[str] = []
    attempts: list[tuple[str, Callable[[], torch.fx.GraphModule]]] = [
        ("fx", lambda: _trace_fx(model, len(inputs))),
        ("export", lambda: _trace_export(model, inputs, dynamic_batch=True)),
        ("export", lambda: _trace_export(model, inputs, dynamic_batch=False)),
    ]
    with _no_kv_cache(model), preserved_state(model, devices) as snapshot:
        ref = _EagerReference(model, inputs, seed, snapshot)
        if validate:
            ref.run()
        for method, trace in attempts:
            if method == "export" and any(f.startswith("torch.export") for f in failures):
                # the dynamic-batch export failed: keep only the static attempt's error
                failures = [f for f in failures if not f.startswith("torch.export")]
            result = _attempt(model, method, trace, inputs, seed, snapshot, ref, validate)
            if isinstance(result, str):
                failures.append(result)
                continue
            gm, metas = result
            return replace(_build(model, gm, method, metas), structure=structure_digest(model))
        ref.run()  # wrong example batch: report that rather than the tracers' errors
    raise CaptureError(f"cannot capture model {type(model).__name__} as a graph: {'; '.join(failures)}; "
                       f"{_fix_for(failures)}")


#: ``capture(..., trace_at=)`` takes the graph by shape only where checking it at the whole
#: batch (two forwards) would take longer than this (seconds): the first run on ``meta`` in a
#: process imports torch's meta kernels, about 2 s, and a small model is checked sooner.
TRACE_AT_WORTH = 2.0


@contextlib.contextmanager
def tensors_on_meta(*modules: nn.Module) -> Iterator[None]:
    """Every parameter and buffer of ``modules`` bound to an empty one on ``meta`` (the same
    shape, dtype and ``requires_grad``) inside the block, the tensors themselves bound again
    after it, untouched: a forward there computes shapes only, without memory."""
    bound: list[tuple[nn.Module, str, torch.Tensor]] = []
    try:
        for module in modules:
            for owner in module.modules():
                for name, p in list(owner.named_parameters(recurse=False)):
                    bound.append((owner, name, p))
                    setattr(owner, name, on_meta(p))
                for name, b in list(owner.named_buffers(recurse=False)):
                    bound.append((owner, name, b))
                    setattr(owner, name, on_meta(b))
        yield
    finally:
        for owner, name, t in reversed(bound):
            setattr(owner, name, t)


def _traced_at(model: nn.Module, small: tuple[Any, ...], inputs: tuple[Any, ...]) -> CapturedModel | None:
    """``model`` traced and checked at ``small``, its graph taken to ``inputs`` by shape; None
    where either fails, or where checking at ``inputs`` (two forwards, estimated from one at
    ``small`` scaled by the batch) costs less than :data:`TRACE_AT_WORTH` (the caller traces
    at ``inputs``, whose errors are the user's)."""
    devices = [x.device for x in small if isinstance(x, torch.Tensor)]
    with _no_kv_cache(model), preserved_state(model, devices):
        start = time.perf_counter()
        try:
            _eager(model, small, 0)
        except Exception:  # noqa: BLE001 - a model that does not run at the small batch
            return None
        forward = time.perf_counter() - start
    if 2 * forward * (batch_size_of(inputs) or 1) / max(1, batch_size_of(small) or 1) < TRACE_AT_WORTH:
        return None
    try:
        first = capture(model, small)
    except CaptureError:
        return None
    return rebatched(first, model, inputs, values=False)


def batch_size_of(inputs: tuple[Any, ...]) -> int | None:
    """The batch of a model's inputs: the first dimension of the first tensor that has one
    (None: no such tensor)."""
    return next((int(x.shape[0]) for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 0), None)


# --------------------------------------------------------------------------- the same graph at another batch


def structure_digest(model: nn.Module) -> str:
    """A digest of what a graph of ``model`` depends on besides its inputs: the modules' repr
    and every parameter's and buffer's name, shape and dtype (a factory that sizes its model
    by the batch changes it)."""
    parts = [repr(model)]
    parts += [f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in _named_tensors(model)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _batch_fits(gm: torch.fx.GraphModule, inputs: tuple[Any, ...]) -> bool:
    """Whether every input's shape is one the graph was traced for: an fx graph records no
    example shape; a ``torch.export`` graph's placeholder holds each dimension as a number,
    or as a symbol with the range of values its guards proved (``VR[2, int_oo]`` for a batch
    exported with ``Dim.AUTO``: 0 and 1 are specialised, so a batch of 1 is captured again)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        return False
    for ph, x in zip(placeholders, inputs):
        val = ph.meta.get("val")
        if not isinstance(x, torch.Tensor) or not isinstance(val, torch.Tensor):
            continue
        if val.dim() != x.dim():
            return False
        for traced, size in zip(val.shape, x.shape):
            if isinstance(traced, int):
                if traced != size:
                    return False
                continue
            bounds = traced.node.shape_env.bound_sympy(traced.node.expr)  # a symbol's range, a constant's value
            if not bool(bounds.lower <= size) or not bool(size <= bounds.upper):
                return False
    return True


_UNCHECKED = object()


def rebatched(captured: CapturedModel, model: nn.Module,
              example_inputs: tuple[Any, ...] | torch.Tensor, *, values: bool = True) -> CapturedModel | None:
    """``captured`` at another example batch without tracing again, or ``None`` where that is
    not known to hold (then :func:`capture` it).

    It holds when ``model`` has the structure the graph was captured from
    (:func:`structure_digest`), every input's shape lies in what the tracer proved the graph
    valid for (an fx graph is symbolic; a ``torch.export`` graph's batch symbol has a range)
    and the graph run on ``example_inputs`` gives the model's own output shapes (its values
    too when the model has them, as :func:`capture` checks; an export graph is taken on its
    guards alone where the model cannot run on ``meta``). The result shares ``gm`` and
    every batch-free field; its layer graph's tensor metas are the new batch's. The model's
    buffers, the graph's and the global RNG are left unchanged.

    ``values=False`` runs both with the model's and the graph's tensors and the inputs on
    ``meta`` (:func:`tensors_on_meta`) and compares shapes and dtypes: nothing is computed,
    for a capture whose values :func:`capture` checked at a smaller batch (its ``trace_at``).
    A graph holding a tensor that is neither parameter nor buffer does not run there, and is
    traced again.
    """
    inputs = _as_tuple(example_inputs)
    if not captured.structure or captured.structure != structure_digest(model) or not _batch_fits(captured.gm, inputs):
        return None
    devices = [x.device for x in inputs if isinstance(x, torch.Tensor)]
    seed = 0x5EED
    if not values:
        inputs = tuple(x.to("meta") if isinstance(x, torch.Tensor) else x for x in inputs)
    with contextlib.nullcontext() if values else tensors_on_meta(model, captured.gm), \
            _no_kv_cache(model), preserved_state(model, devices):
        graph_state = BufferSnapshot(captured.gm)
        try:
            metas, out = _propagate(captured.gm, inputs, seed)
        except Exception:  # noqa: BLE001 - a graph that does not run here is captured again
            return None
        finally:
            graph_state.restore()
        try:
            ref = _eager(model, inputs, seed)
        except Exception:  # noqa: BLE001
            # on meta a model may ask a tensor's value (a data-dependent branch); an export
            # graph's guards already hold for every batch in its range, an fx graph has none
            ref = _UNCHECKED if captured.method == "export" else None
    if ref is None:
        return None
    on_meta = any(t.is_meta for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
    if ref is not _UNCHECKED and not _same_output(out, ref, values=not on_meta):
        return None
    nodes = [replace(n, outputs=list(metas.get(n.name, []))) for n in captured.graph.nodes]
    return replace(captured, graph=LayerGraph(nodes=nodes, outputs=list(captured.graph.outputs)))
