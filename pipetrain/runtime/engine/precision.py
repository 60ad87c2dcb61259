"""What ``--precision`` means for the computation and the wire.

``fp32``: everything in float32. ``bf16`` (mixed precision, Micikevicius et al., ICLR'18, with
bfloat16 so no loss scaling is needed):

- every forward (and its recompute) runs under ``torch.autocast(device, bfloat16)``: matrix
  products in bf16, reductions, norms and the loss as autocast's policy keeps them (fp32);
- the weights stay float32 masters: autocast casts them per operation, so weight gradients
  arrive, accumulate and are all-reduced in float32, and the optimizer state and checkpoints
  are float32;
- float32 activations and gradients cross a cut as bfloat16 (:mod:`.comm` rounds them at the
  send and widens them back at the receive), so the bytes on the wire halve.

``fp16`` would need dynamic loss scaling and is not built (``TrainConfig`` refuses it, and
bf16 on a GPU without bfloat16 support).
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

__all__ = ["autocast", "wire_dtype"]


def wire_dtype(precision: str) -> torch.dtype | None:
    """The dtype float32 wires travel in (``None``: as they are)."""
    return torch.bfloat16 if precision == "bf16" else None


def autocast(precision: str, device: torch.device) -> AbstractContextManager[object]:
    """The context a forward of this precision runs in."""
    if precision != "bf16":
        return nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)
