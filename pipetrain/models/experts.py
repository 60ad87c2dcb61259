"""Mixture-of-experts layers of Hugging Face models, in a form a pipeline can capture.

transformers 5 runs an experts layer (Mixtral, Qwen-MoE, OLMoE, DeepSeek...) through an
*experts implementation* named in the config. Its default, ``grouped_mm``, cannot be
captured in float32: it chooses its kernel by the tensors' device (``histc`` on integers
off the CPU, which a capture on ``meta`` bakes into the graph and the CPU then cannot run)
and ``torch.nn.functional.grouped_mm``, whose shape function takes bfloat16 only. Its
``eager`` implementation loops over the experts a batch routes to: shapes that depend on
the data.

:func:`experts_forward`, registered with transformers as :data:`EXPERTS` (its
``ExpertsInterface``, the documented way to add one), computes what ``grouped_mm`` computes
with shapes fixed by the batch alone and the same code on every device:

- the (token, expert) pairs sorted by expert, and each expert's end offset among them by
  ``searchsorted`` on the sorted ids (no histogram);
- each projection as a grouped matrix product over those offsets: torch's ``grouped_mm``
  for bfloat16, else :func:`pipetrain.graph.ops.grouped_mm` (a shape function for any
  dtype and its own backward; torch's grouped kernel on the CPU where it takes the
  operands, a loop of ``mm`` per expert otherwise);
- the outputs put back in token order and summed over each token's experts, weighted by
  the router.

Invariant: for the same weights and batch it equals ``eager`` (tests/runtime/test_hf_moe.py).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..graph.ops import grouped_mm

__all__ = ["EXPERTS", "experts_forward", "register"]

#: The experts implementation name pipetrain builds Hugging Face models with.
EXPERTS = "pipetrain"


def _grouped_mm(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """``x`` (S, in) rows grouped by ``offsets`` times ``w`` (experts, in, out)."""
    if w.dtype == torch.bfloat16 and hasattr(torch.nn.functional, "grouped_mm"):
        return torch.nn.functional.grouped_mm(x.to(w.dtype), w, offs=offsets)
    return grouped_mm(x.to(w.dtype), w, offsets)


def _linear(x: Tensor, w: Tensor, offsets: Tensor, bias: Tensor | None, transposed: bool) -> Tensor:
    out = _grouped_mm(x, w if transposed else w.transpose(-2, -1), offsets)
    return out if bias is None else out + bias


def experts_forward(self: Any, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """An experts module's forward (transformers' signature: tokens (T, hidden), the router's
    top-k expert ids and weights (T, k)) -> (T, hidden); module docstring."""
    if getattr(self, "_is_expert_parallel", False):
        raise NotImplementedError("pipetrain's experts implementation does not shard experts across processes")
    k = top_k_index.size(-1)
    tokens, hidden = hidden_states.shape
    ids = top_k_index.reshape(-1)
    ids_sorted, perm = torch.sort(ids)
    x = hidden_states[perm // k]
    experts = torch.arange(self.num_experts, device=ids.device, dtype=ids_sorted.dtype)
    offsets = torch.searchsorted(ids_sorted, experts, right=True).to(torch.int32)
    up, up_bias = (("gate_up_proj", "gate_up_proj_bias") if self.has_gate else ("up_proj", "up_proj_bias"))
    h = _linear(x, getattr(self, up), offsets, getattr(self, up_bias)[ids_sorted] if self.has_bias else None,
                self.is_transposed)
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    h = _linear(h, self.down_proj, offsets, self.down_proj_bias[ids_sorted] if self.has_bias else None,
                self.is_transposed)
    if self.has_post_expert_norm:
        h = self.post_expert_norm(h)
    h = h * top_k_weights.reshape(-1)[perm].unsqueeze(-1)
    out = h[torch.argsort(perm)].view(tokens, k, hidden).sum(dim=1)
    return out.to(hidden_states.dtype)


def register() -> bool:
    """Register :data:`EXPERTS` with transformers (idempotent); False where transformers has
    no experts interface (then models are built with their own)."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return False
    if EXPERTS not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(EXPERTS, experts_forward)
    return True
