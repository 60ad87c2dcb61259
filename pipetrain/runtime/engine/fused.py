"""Weight gradients of ``nn.Linear`` layers accumulated straight into the stage's buffers.

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

Split backwards (zero-bubble I and W, split_backward.py): the sink's ``phase`` says which
half runs. ``"input"``: the layer's backward computes only ``g w`` (the input gradient) and
marks itself done; ``"weight"``: only ``g^T x`` into the accumulator (and the bias), plus
the input gradient if the input pass never ran this layer; ``"full"`` (B): both.
"""
from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["GradSink", "AccumulatingLinear", "install"]


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

    def add(self, name: str, value: Tensor) -> None:
        acc = self.buffers[name]
        if name in self.touched:
            acc.add_(value)
        else:
            acc.copy_(value)
            self.touched.add(name)

    def add_mm(self, name: str, a: Tensor, b: Tensor) -> None:
        """``acc (+)= a @ b`` in place, the GEMM writing into the accumulator."""
        acc = self.buffers[name]
        if name in self.touched:
            acc.addmm_(a, b)
        else:
            torch.mm(a, b, out=acc)
            self.touched.add(name)


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


def install(module: torch.fx.GraphModule, param_names: set[str], sink: GradSink) -> list[str]:
    """Switch the exact ``nn.Linear`` modules that ``module``'s graph calls to
    :class:`AccumulatingLinear` feeding ``sink``; returns the parameter names now fed by it.

    Only layers whose weight (and bias, if any) are trainable parameters of this stage are
    switched. The module objects change class in place (they carry no other state).
    """
    fed: list[str] = []
    for node in module.graph.nodes:
        if node.op != "call_module":
            continue
        target = str(node.target)
        sub = module.get_submodule(target)
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
