"""Weight gradients of ``nn.Linear`` and ``nn.Embedding`` layers accumulated straight into
the stage's buffers.

A microbatched schedule adds the weight gradient of every unit into one buffer per parameter
(design.md's gradient accounting). Through autograd this costs, per layer and unit, a fresh
gradient tensor (``g^T x``, written once) and an ``add_`` into the buffer (read twice,
written once): on a CPU, where a 16-sample microbatch's weight-gradient GEMM is memory
bound, that traffic is a large share of the backward. Here the GEMM writes into the buffer
itself: ``acc = g^T x`` for the group's first unit (``torch.mm(..., out=acc)``) and
``acc += g^T x`` after it (``addmm_``, beta = 1), i.e. the sum of eq. "grad = sum over the
group's units" formed in place. The bias gradient is added the same way.

:class:`GradSink` holds a stage's accumulators (shared with :class:`StageRuntime`: the same
tensors, or views of a replicated stage's flat all-reduce buffer) and which of them the
current group has written. :func:`install` switches a stage module's exact ``nn.Linear``
children to :class:`AccumulatingLinear` (and an exported graph's ``aten.linear`` calls on the
stage's parameters to :class:`FusedLinearCall`), whose backward returns no weight gradient to
autograd: the executor must treat a parameter the sink wrote as having a gradient (and add
any other gradient autograd returns for it, e.g. a weight also read elsewhere).

An embedding's weight gradient is ``index_add`` of the output gradient's rows at the looked-up
indices. Through autograd every unit materialises it densely (``vocab x d``, a language
model's largest gradient) before adding it into the buffer; :class:`AccumulatingEmbedding`
and :class:`FusedEmbeddingCall` ``index_add_`` the rows into the buffer itself (zeroed by the
group's first unit), so no unit allocates a second table. ``padding_idx`` rows get no
gradient, as in ``F.embedding``; ``max_norm``, ``scale_grad_by_freq`` and ``sparse`` keep
autograd's path.

Split backwards (zero-bubble I and W, split_backward.py): the sink's ``phase`` says which
half runs. ``"input"``: the layer's backward computes only ``g w`` (the input gradient) and
marks itself done; ``"weight"``: only ``g^T x`` into the accumulator (and the bias), plus
the input gradient if the input pass never ran this layer; ``"full"`` (B): both.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["PHASE_AWARE", "GradSink", "AccumulatingEmbedding", "AccumulatingLinear", "FusedEmbeddingCall",
           "FusedLinearCall", "exclusive_writes", "install"]


class GradSink:
    """Per-stage accumulators written by backward passes (name -> tensor, written-this-group set)."""

    def __init__(self) -> None:
        self.buffers: dict[str, Tensor] = {}
        self.touched: set[str] = set()
        self.phase = "full"  # "full" (B) | "input" (I) | "weight" (W): see the module docstring
        #: a scalar every weight-gradient pass adds the sum of its output gradient to (None:
        #: off; the numerics guard switches it on). ``g^T x`` is finite when ``g`` and ``x``
        #: are (``x`` is checked by the forward's checks), so a finite probe stands for every
        #: accumulator this unit wrote, without reading them (runtime/guards/numerics.py).
        self.probe: Tensor | None = None
        self._left: dict[str, int] = {}  # armed: writes still to come in this backward, per name
        self._on_done: Callable[[str], None] | None = None

    def arm(self, writes: Mapping[str, int], on_done: Callable[[str], None]) -> None:
        """Call ``on_done(name)`` when the backward about to run has written ``name`` its
        ``writes[name]``-th time (its last write of the group: its all-reduce may start)."""
        self._left, self._on_done = dict(writes), on_done

    def disarm(self) -> None:
        self._left, self._on_done = {}, None

    def _wrote(self, name: str) -> None:
        left = self._left.get(name)
        if left is None:
            return
        if left <= 0:
            raise RuntimeError(f"gradient sink: {name} was written again after its last counted write (its "
                               f"all-reduce bucket had started); pass --bucket-mb 0")
        self._left[name] = left - 1
        if left == 1 and self._on_done is not None:
            self._on_done(name)

    def add(self, name: str, value: Tensor) -> None:
        acc = self.buffers[name]
        if name in self.touched:
            acc.add_(value)
        else:
            acc.copy_(value)
            self.touched.add(name)
        self._wrote(name)

    def add_rows(self, name: str, index: Tensor, rows: Tensor) -> None:
        """``acc[index[i]] += rows[i]`` in place (``index_add_``), the accumulator zeroed first
        by the group's first writer."""
        acc = self.buffers[name]
        if name not in self.touched:
            acc.zero_()
            self.touched.add(name)
        acc.index_add_(0, index, rows.to(acc.dtype))
        self._wrote(name)

    def add_mm(self, name: str, a: Tensor, b: Tensor) -> None:
        """``acc (+)= a @ b`` in place, the GEMM writing into the accumulator."""
        acc = self.buffers[name]
        if name in self.touched:
            acc.addmm_(a, b)
        else:
            torch.mm(a, b, out=acc)
            self.touched.add(name)
        self._wrote(name)


class _LinearAccumulate(torch.autograd.Function):
    """``F.linear`` whose backward adds the weight and bias gradients into a :class:`GradSink`."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, sink: GradSink,  # type: ignore[override]
                wname: str, bname: str | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.sink, ctx.wname, ctx.bname = sink, wname, bname
        ctx.set_materialize_grads(False)  # a split backward's gated pass sends None: nothing to do
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, g: Tensor | None) -> tuple[Tensor | None, None, None, None, None, None]:  # type: ignore[override]
        if g is None:
            return None, None, None, None, None, None
        x, w = ctx.saved_tensors
        sink: GradSink = ctx.sink
        phase = sink.phase
        if phase == "input":  # I: the input gradient only; W adds g^T x later
            ctx.input_done = True
            return (g.matmul(w) if ctx.needs_input_grad[0] else None), None, None, None, None, None
        done = phase == "weight" and getattr(ctx, "input_done", False)
        gx = g.matmul(w) if ctx.needs_input_grad[0] and not done else None
        g2 = g.reshape(-1, g.shape[-1])
        if ctx.needs_input_grad[1]:
            sink.add_mm(ctx.wname, g2.t(), x.reshape(-1, x.shape[-1]))
        gb = g2.sum(0) if ctx.bname is not None and ctx.needs_input_grad[2] else None
        if gb is not None:
            sink.add(ctx.bname, gb)
        if sink.probe is not None:
            sink.probe.add_(gb.sum() if gb is not None else g2.sum())
        return gx, None, None, None, None, None


class _EmbeddingAccumulate(torch.autograd.Function):
    """``F.embedding`` whose backward adds the weight gradient into a :class:`GradSink` (rows
    at the indices; none for ``padding_idx``)."""

    @staticmethod
    def forward(ctx: Any, weight: Tensor, index: Tensor, padding_idx: int | None,  # type: ignore[override]
                sink: GradSink, wname: str) -> Tensor:
        ctx.save_for_backward(index)
        ctx.sink, ctx.wname, ctx.padding_idx = sink, wname, padding_idx
        ctx.set_materialize_grads(False)
        return F.embedding(index, weight, padding_idx)

    @staticmethod
    def backward(ctx: Any, g: Tensor | None) -> tuple[None, None, None, None, None]:  # type: ignore[override]
        sink: GradSink = ctx.sink
        if g is None or sink.phase == "input" or not ctx.needs_input_grad[0]:
            return None, None, None, None, None  # I: an embedding has no input gradient
        (index,) = ctx.saved_tensors
        flat, rows = index.reshape(-1), g.reshape(-1, g.shape[-1])
        if ctx.padding_idx is not None:
            keep = flat != ctx.padding_idx
            flat, rows = flat[keep], rows[keep]
        sink.add_rows(ctx.wname, flat, rows)
        if sink.probe is not None:
            sink.probe.add_(rows.sum())
        return None, None, None, None, None


#: The autograd functions whose backward follows the sink's phase: in W ("weight") they
#: compute no input gradient (split_backward.py batches their weight passes).
PHASE_AWARE = (_LinearAccumulate, _EmbeddingAccumulate)


def _plain(x: Tensor, weight: Tensor) -> bool:
    """Whether a linear runs as plain ``F.linear``: no gradient to feed, or under autocast
    (``--precision bf16``: autocast casts its operands, and its weight gradient reaches the
    sink through the executor, ``StageRuntime.accumulate``)."""
    return (not torch.is_grad_enabled() or not (weight.requires_grad or x.requires_grad)
            or torch.is_autocast_enabled(x.device.type))


class AccumulatingLinear(nn.Linear):
    """An ``nn.Linear`` (same parameters, same forward) whose backward feeds a :class:`GradSink`."""

    _pt_sink: GradSink
    _pt_wname: str
    _pt_bname: str | None

    def feed(self, sink: GradSink, wname: str, bname: str | None) -> None:
        """Write the weight (``wname``) and bias (``bname``) gradients into ``sink``."""
        self._pt_sink, self._pt_wname, self._pt_bname = sink, wname, bname

    def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
        if _plain(x, self.weight):
            return F.linear(x, self.weight, self.bias)
        return _LinearAccumulate.apply(x, self.weight, self.bias, self._pt_sink, self._pt_wname, self._pt_bname)


def _padding(padding_idx: int | None, rows: int) -> int | None:
    """``padding_idx`` as ``F.embedding`` normalises it (``None`` or ``-1``: none)."""
    if padding_idx is None or padding_idx == -1:
        return None
    return padding_idx + rows if padding_idx < 0 else padding_idx


class AccumulatingEmbedding(nn.Embedding):
    """An ``nn.Embedding`` (same parameters, same forward) whose backward feeds a :class:`GradSink`."""

    _pt_sink: GradSink
    _pt_wname: str

    def feed(self, sink: GradSink, wname: str) -> None:
        """Write the weight gradient (``wname``) into ``sink``."""
        self._pt_sink, self._pt_wname = sink, wname

    def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
        if not (torch.is_grad_enabled() and self.weight.requires_grad):
            return F.embedding(x, self.weight, self.padding_idx)
        return cast(Tensor, _EmbeddingAccumulate.apply(self.weight, x, self.padding_idx, self._pt_sink,
                                                       self._pt_wname))


class FusedEmbeddingCall:
    """``aten.embedding(w, index, padding_idx)`` of an exported graph (``w`` read by
    ``get_attr``) whose backward feeds a :class:`GradSink`: :class:`AccumulatingEmbedding`'s
    call-function form."""

    __name__ = "embedding"

    def __init__(self, sink: GradSink, wname: str) -> None:
        self.sink, self.wname = sink, wname

    def __call__(self, weight: Tensor, index: Tensor, padding_idx: int = -1) -> Tensor:
        pad = _padding(padding_idx, weight.shape[0])
        if not (torch.is_grad_enabled() and weight.requires_grad):
            return F.embedding(index, weight, pad)
        return cast(Tensor, _EmbeddingAccumulate.apply(weight, index, pad, self.sink, self.wname))


class FusedLinearCall:
    """``aten.linear(x, w, b)`` of an exported graph (``w``, ``b`` read by ``get_attr``) whose
    backward feeds a :class:`GradSink`: the call-function form of :class:`AccumulatingLinear`,
    for captures that inline ``nn.Linear`` into aten ops (``torch.export``, e.g. Hugging Face
    models). ``__name__`` keeps the op's name for whatever names a node by its target."""

    __name__ = "linear"

    def __init__(self, sink: GradSink, wname: str, bname: str | None) -> None:
        self.sink, self.wname, self.bname = sink, wname, bname

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        if _plain(x, weight):
            return F.linear(x, weight, bias)
        return cast(Tensor, _LinearAccumulate.apply(x, weight, bias, self.sink, self.wname, self.bname))


_LINEAR_OPS = (torch.ops.aten.linear.default, F.linear)
_EMBEDDING_OPS = (torch.ops.aten.embedding.default,)


def _trainable(gm: torch.fx.GraphModule, name: str | None, param_names: set[str]) -> bool:
    if name is None:
        return True
    if name not in param_names:
        return False
    try:
        return bool(gm.get_parameter(name).requires_grad)
    except AttributeError:  # a buffer or a constant
        return False


def _install_calls(module: torch.fx.GraphModule, param_names: set[str], sink: GradSink) -> list[str]:
    """Switch the graph's ``aten.linear`` calls on this stage's trainable parameters to
    :class:`FusedLinearCall`; returns the parameter names now fed by the sink."""
    fed: list[str] = []
    for node in module.graph.nodes:
        if node.op == "call_function" and node.target in _EMBEDDING_OPS and not node.kwargs:
            fed += _install_embedding_call(module, node, param_names, sink)
            continue
        if node.op != "call_function" or node.target not in _LINEAR_OPS or node.kwargs:
            continue
        w = node.args[1] if len(node.args) > 1 else None
        b = node.args[2] if len(node.args) > 2 else None
        if not (isinstance(w, torch.fx.Node) and w.op == "get_attr"):
            continue
        if b is not None and not (isinstance(b, torch.fx.Node) and b.op == "get_attr"):
            continue
        wname = str(w.target)
        bname = str(b.target) if isinstance(b, torch.fx.Node) else None
        if not (_trainable(module, wname, param_names) and _trainable(module, bname, param_names)):
            continue
        node.target = FusedLinearCall(sink, wname, bname)
        fed += [wname] + ([bname] if bname else [])
    if fed:
        module.recompile()
    return fed


def _install_embedding_call(module: torch.fx.GraphModule, node: torch.fx.Node, param_names: set[str],
                            sink: GradSink) -> list[str]:
    """Switch one ``aten.embedding(w, index[, padding_idx])`` call (no ``scale_grad_by_freq``,
    no ``sparse``) on a trainable parameter of this stage to :class:`FusedEmbeddingCall`."""
    w = node.args[0]
    if len(node.args) > 3 and any(bool(a) for a in node.args[3:]):
        return []
    if not (isinstance(w, torch.fx.Node) and w.op == "get_attr" and _trainable(module, str(w.target), param_names)):
        return []
    node.target = FusedEmbeddingCall(sink, str(w.target))
    return [str(w.target)]


def _exact_embedding(sub: nn.Module) -> bool:
    return (type(sub) is nn.Embedding and sub.max_norm is None and not sub.scale_grad_by_freq
            and not sub.sparse)


def install(module: torch.fx.GraphModule, param_names: set[str], sink: GradSink) -> list[str]:
    """Switch the exact ``nn.Linear`` and ``nn.Embedding`` modules that ``module``'s graph
    calls to :class:`AccumulatingLinear` and :class:`AccumulatingEmbedding` feeding ``sink``
    (and the exported graph's calls, :func:`_install_calls`); returns the parameter names now
    fed by it.

    Only layers whose weight (and bias, if any) are trainable parameters of this stage are
    switched. The module objects change class in place (they carry no other state).
    """
    fed: list[str] = []
    for node in module.graph.nodes:
        if node.op != "call_module":
            continue
        target = str(node.target)
        sub = module.get_submodule(target)
        if _exact_embedding(sub):
            if f"{target}.weight" in param_names and sub.weight.requires_grad:
                sub.__class__ = AccumulatingEmbedding
                cast(AccumulatingEmbedding, sub).feed(sink, f"{target}.weight")
                fed.append(f"{target}.weight")
            continue
        if type(sub) is not nn.Linear:
            continue
        wname = f"{target}.weight"
        bname = f"{target}.bias" if sub.bias is not None else None
        if wname not in param_names or not sub.weight.requires_grad:
            continue
        if bname is not None and (bname not in param_names or not sub.bias.requires_grad):
            continue
        sub.__class__ = AccumulatingLinear
        cast(AccumulatingLinear, sub).feed(sink, wname, bname)
        fed += [wname] + ([bname] if bname else [])
    return fed + _install_calls(module, param_names, sink)


def _weight_positions(node: torch.fx.Node) -> range:
    """The argument positions of a fused call that its backward writes into the sink."""
    if isinstance(node.target, FusedLinearCall):
        return range(1, 3)
    return range(0, 1) if isinstance(node.target, FusedEmbeddingCall) else range(0)


def _weight_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The nodes a fused call reads as the weights it writes into the sink."""
    return [a for k, a in enumerate(node.args) if k in _weight_positions(node) and isinstance(a, torch.fx.Node)]


def _read_as_weight(attr: torch.fx.Node, user: torch.fx.Node) -> bool:
    """Whether ``user`` reads the ``get_attr`` node ``attr`` only as a fused call's weight."""
    where = [k for k, a in enumerate(user.args) if a is attr]
    return bool(where) and all(k in _weight_positions(user) for k in where) and attr not in user.kwargs.values()


def exclusive_writes(module: torch.fx.GraphModule, fed: Collection[str]) -> dict[str, tuple[int, int]]:
    """For each parameter in ``fed`` (names :func:`install` returned) that only fused layers
    read: how many times one unit's backward writes it into the sink (its call sites), and
    the graph position of its first call site (the backward writes it last there).

    A parameter also read any other way (by an unfused module, a tie with one, a
    ``get_attr`` with another user) is left out: its gradient is complete only once the
    whole backward has returned, when the executor adds autograd's part.
    """
    params = dict(module.named_parameters())
    wanted = {id(params[n]): n for n in fed if n in params}
    counts: dict[int, int] = {}
    first: dict[int, int] = {}
    other: set[int] = set()
    for i, node in enumerate(module.graph.nodes):
        written: list[Tensor] = []
        if node.op == "call_module":
            sub = module.get_submodule(str(node.target))
            if isinstance(sub, (AccumulatingLinear, AccumulatingEmbedding)):
                written = list(sub.parameters(recurse=False))
            else:
                other.update(id(p) for p in sub.parameters())
        elif node.op == "call_function":
            written = [params[str(a.target)] for a in _weight_args(node) if str(a.target) in params]
        elif (node.op == "get_attr" and str(node.target) in params
              and not all(_read_as_weight(node, u) for u in node.users)):
            other.add(id(params[str(node.target)]))
        for p in written:
            counts[id(p)] = counts.get(id(p), 0) + 1
            first.setdefault(id(p), i)
    return {n: (counts[t], first[t]) for t, n in wanted.items() if t in counts and t not in other}
