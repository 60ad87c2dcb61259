"""Evaluation sums that add up exactly over batches: correct predictions and summed losses.

Every function takes the model's output as it comes and an optional ``count``: only the
first ``count`` samples of the batch are real (the rest is padding, see
:class:`~pipetrain.data.eval_batches.EvalBatches`), so summing over an epoch's eval batches counts
every eval sample exactly once. The run's accumulator over batches and ranks is
:class:`pipetrain.metrics.EvalAccumulator` (it takes the same ``count``).
"""
from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor

from ..models.output import output_logits

__all__ = ["correct_count", "loss_sum", "token_loss_sum"]


def _real(logits: Tensor, target: Tensor, count: int | None) -> tuple[Tensor, Tensor]:
    if count is None:
        return logits, target
    return logits[:count], target[:count]


def correct_count(output: Any, target: Tensor, count: int | None = None) -> int:
    """How many of the (first ``count``) samples' targets equal the argmax of the logits' last
    dimension; token targets ``[B, T]`` count every token."""
    logits, target = _real(output_logits(output), target, count)
    return int((logits.argmax(dim=-1) == target).sum().item())


def token_loss_sum(output: Any, target: Tensor, count: int | None = None) -> tuple[float, int]:
    """``(sum of cross entropies, number of targets)`` over the first ``count`` samples: every
    class target, or every token of ``[B, T]`` targets."""
    logits, target = _real(output_logits(output), target, count)
    total = F.cross_entropy(logits.flatten(0, -2).double(), target.flatten(), reduction="sum")
    return float(total.item()), int(target.numel())


def loss_sum(output: Any, target: Tensor, count: int | None = None) -> tuple[float, int]:
    """:func:`token_loss_sum` for integer targets; ``(sum of squared errors, elements)`` for
    floating-point ones. ``sum / elements`` is the mean loss of :func:`~pipetrain.data.loss.loss_for`."""
    if not target.dtype.is_floating_point:
        return token_loss_sum(output, target, count)
    logits, target = _real(output_logits(output), target, count)
    if logits.shape != target.shape and logits.numel() == target.numel():
        logits = logits.reshape(target.shape)
    total = F.mse_loss(logits.double(), target.double(), reduction="sum")
    return float(total.item()), int(target.numel())
