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
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["grouped_mm"]


@torch.library.custom_op("pipetrain::grouped_mm", mutates_args=())
def grouped_mm(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    out = x.new_zeros(x.size(0), w.size(2))
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            torch.mm(x[start:end], w[e], out=out[start:end])
        start = end
    return out


@grouped_mm.register_fake
def _grouped_mm_shape(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    if not (x.dim() == 2 and w.dim() == 3 and offsets.dim() == 1 and x.size(1) == w.size(1)
            and offsets.size(0) == w.size(0)):
        raise ValueError(f"grouped_mm takes x (S, in), w (experts, in, out) and offsets (experts,); got "
                         f"{tuple(x.shape)}, {tuple(w.shape)} and {tuple(offsets.shape)}")
    return x.new_empty(x.size(0), w.size(2))


@torch.library.custom_op("pipetrain::grouped_mm_backward", mutates_args=())
def grouped_mm_backward(x: Tensor, w: Tensor, offsets: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
    gx, gw = torch.zeros_like(x), torch.zeros_like(w)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            torch.mm(grad[start:end], w[e].t(), out=gx[start:end])
            torch.mm(x[start:end].t(), grad[start:end], out=gw[e])
        start = end
    return gx, gw


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
