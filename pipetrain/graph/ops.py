"""Operators pipetrain adds to torch (namespace ``pipetrain``), for graphs a capture could
not otherwise hold; a rebuilt graph (:mod:`pipetrain.graph.portable`) finds them by importing
this module.

``pipetrain::grouped_mm(x, w, offsets)``: rows ``offsets[e-1]:offsets[e]`` of ``x`` (S, in)
times ``w[e]`` (experts, in, out), for every dtype and device. torch's own ``grouped_mm``
takes bfloat16 only in its shape function, so a float32 mixture of experts cannot be
captured with it. The output's shape depends on the shapes alone (S, out); the offsets'
values only choose which rows go with which expert, so the graph stays static. Rows past
``offsets[-1]`` are zero. The backward is an operator of its own, so autograd does not look
into the loop.

On the CPU, in float32, bfloat16 and float16, both directions run on torch's grouped
kernel (``torch.nn.functional.grouped_mm``) when every operand's strides and address are
multiples of 16 bytes, the kernel's requirement; otherwise, and for every other dtype and
device, a loop of ``mm`` per expert. Both give the same values.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["backward_loop", "grouped_mm", "kernel_takes", "mm_loop"]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def kernel_takes(*ts: Tensor) -> bool:
    """Whether ``torch.nn.functional.grouped_mm`` takes these operands: CPU tensors of one of its dtypes
    whose address and every stride but the unit one are multiples of 16 bytes."""
    for t in ts:
        if t.device.type != "cpu" or t.dtype not in _KERNEL_DTYPES or t.data_ptr() % 16:
            return False
        if any(st != 1 and (st * t.element_size()) % 16 for st in t.stride()):
            return False
    return hasattr(F, "grouped_mm")


def _clear_past(out: Tensor, offsets: Tensor) -> Tensor:
    """Rows past the last offset, which the kernel leaves unwritten, set to zero."""
    end = int(offsets[-1]) if offsets.numel() else 0
    if end < out.size(0):
        out[end:].zero_()
    return out


def mm_loop(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """The forward as a loop of ``mm`` per expert (any dtype and device)."""
    out = x.new_zeros(x.size(0), w.size(2))
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            torch.mm(x[start:end], w[e], out=out[start:end])
        start = end
    return out


def backward_loop(x: Tensor, w: Tensor, offsets: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
    """The backward as a loop of ``mm`` per expert: the gradients of ``x`` and ``w``."""
    gx, gw = torch.zeros_like(x), torch.zeros_like(w)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            torch.mm(grad[start:end], w[e].t(), out=gx[start:end])
            torch.mm(x[start:end].t(), grad[start:end], out=gw[e])
        start = end
    return gx, gw


@torch.library.custom_op("pipetrain::grouped_mm", mutates_args=())
def grouped_mm(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    if x.size(0) and kernel_takes(x, w):
        return _clear_past(F.grouped_mm(x, w, offs=offsets.to(torch.int32)), offsets)
    return mm_loop(x, w, offsets)


@grouped_mm.register_fake
def _grouped_mm_shape(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    if not (x.dim() == 2 and w.dim() == 3 and offsets.dim() == 1 and x.size(1) == w.size(1)
            and offsets.size(0) == w.size(0)):
        raise ValueError(f"grouped_mm takes x (S, in), w (experts, in, out) and offsets (experts,); got "
                         f"{tuple(x.shape)}, {tuple(w.shape)} and {tuple(offsets.shape)}")
    return x.new_empty(x.size(0), w.size(2))


@torch.library.custom_op("pipetrain::grouped_mm_backward", mutates_args=())
def grouped_mm_backward(x: Tensor, w: Tensor, offsets: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
    grad = grad.contiguous()
    wt, xt, gt = w.transpose(-2, -1), x.t(), grad.t()
    if x.size(0) and kernel_takes(x, w, grad, wt, xt, gt):
        offs = offsets.to(torch.int32)
        gx = _clear_past(F.grouped_mm(grad, wt, offs=offs), offsets)
        # w's gradient in w's own layout (an expert without rows gets zeros): a weight used
        # transposed, as transformers' experts use theirs, gets a gradient its parameter
        # holds contiguously, which the updates downstream read fastest
        if w.stride(-2) == 1 and w.stride(-1) != 1:
            return gx, F.grouped_mm(gt, x, offs=offs).transpose(-2, -1)
        return gx, F.grouped_mm(xt, grad, offs=offs)
    return backward_loop(x, w, offsets, grad)


@grouped_mm_backward.register_fake
def _grouped_mm_backward_shape(x: Tensor, w: Tensor, offsets: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(w)


def _setup(ctx: Any, inputs: tuple[Tensor, Tensor, Tensor], output: Tensor) -> None:
    x, w, offsets = inputs
    ctx.save_for_backward(x, w, offsets)


def _backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
    x, w, offsets = ctx.saved_tensors
    gx, gw = torch.ops.pipetrain.grouped_mm_backward(x, w, offsets, grad)
    return gx, gw, None


grouped_mm.register_autograd(_backward, setup_context=_setup)
