"""The loss follows the data where the model does not bring its own.

=======================  ===============================================================
targets                  loss (the mean over every target element of the unit)
=======================  ===============================================================
integer (class, token)   cross entropy over the logits' last dimension: ``[B, C]`` with
                         ``[B]``, ``[B, T, V]`` with ``[B, T]``
floating point           mean squared error (logits reshaped to the target's shape when
                         they have as many elements, e.g. ``[B, 1]`` against ``[B]``)
=======================  ===============================================================

A ``ModelBundle`` built by its author (``default_loss=False``) keeps its ``loss_fn``; the zoo's
and wrapped factories' stand-in losses give way to the data's (:func:`loss_for_bundle`). Both
losses read the model's output as it comes (:func:`~pipetrain.models.output.output_logits`),
and both are module-level dataclasses, so they pickle to worker processes.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import DataError
from ..models.bundle import ModelBundle
from ..models.output import output_logits
from .source import DataSource

__all__ = ["CrossEntropy", "LossFn", "MeanSquaredError", "loss_for", "loss_for_bundle", "target_dtype_of"]

LossFn = Callable[[Any, Tensor], Tensor]
"""``loss(output, target) -> scalar``: the mean over the unit's samples."""


@dataclass(frozen=True)
class CrossEntropy:
    """Cross entropy of the logits' last dimension against integer targets, mean over elements."""

    def __call__(self, output: Any, target: Tensor) -> Tensor:
        logits = output_logits(output)
        return F.cross_entropy(logits.flatten(0, -2), target.flatten())


@dataclass(frozen=True)
class MeanSquaredError:
    """Mean squared error of the logits against floating-point targets."""

    def __call__(self, output: Any, target: Tensor) -> Tensor:
        logits = output_logits(output)
        if logits.shape != target.shape and logits.numel() == target.numel():
            logits = logits.reshape(target.shape)
        return F.mse_loss(logits, target.to(logits.dtype))


def target_dtype_of(data: DataSource | torch.dtype | Tensor) -> torch.dtype:
    """The target dtype of a source, a target tensor, or a dtype itself."""
    if isinstance(data, DataSource):
        if data.synthetic:
            raise DataError("synthetic data has no target dtype: its loss is the model's own loss_fn; pass the "
                            "bundle's loss as bundle_loss")
        return data.target_dtype
    if isinstance(data, Tensor):
        return data.dtype
    if isinstance(data, torch.dtype):
        return data
    raise DataError(f"loss_for takes a DataSource, a target tensor or a torch.dtype, got {type(data).__name__}")


def loss_for(data: DataSource | torch.dtype | Tensor, bundle_loss: LossFn | None = None) -> LossFn:
    """The loss for targets like ``data``'s: ``bundle_loss`` if given, else by target dtype.

    Raises:
        DataError: the targets are neither integers nor floating point (e.g. bool).

    Example:
        >>> loss_for(torch.int64)
        CrossEntropy()
    """
    if bundle_loss is not None:
        return bundle_loss
    dtype = target_dtype_of(data)
    if dtype.is_floating_point:
        return MeanSquaredError()
    if dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        return CrossEntropy()
    raise DataError(f"targets of dtype {dtype} have no default loss (integers: cross entropy, floating point: mean "
                    f"squared error); convert the targets or give the model a ModelBundle with its own loss_fn")


def loss_for_bundle(bundle: ModelBundle, source: DataSource) -> LossFn:
    """The loss of ``bundle`` trained on ``source``: the author's own ``loss_fn`` wins; a stand-in
    (``bundle.default_loss``) gives way to the data's, and synthetic data keeps the bundle's."""
    if source.synthetic or not bundle.default_loss:
        return bundle.loss_fn
    return loss_for(source)
