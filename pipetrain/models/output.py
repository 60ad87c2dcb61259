"""Model outputs as they come: the logits tensor inside whatever a model's forward returns.

A zoo model returns its logits tensor. A Hugging Face model returned as it is returns a
``ModelOutput`` (an ordered dict whose ``.logits`` is the tensor); other models return a dict
with ``"logits"`` or a tuple whose first element is the logits. :func:`output_logits` accepts
all of these, so losses and metrics never need a wrapper around the model.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from ..errors import ModelError

__all__ = ["output_logits"]


def output_logits(output: Any) -> Tensor:
    """The logits of a model's output.

    Rules, first match wins: a ``Tensor`` is the logits; an object with a tensor attribute
    ``logits`` (a Hugging Face ``ModelOutput``) gives it; a mapping with key ``"logits"`` gives
    that value; a non-empty tuple or list gives its first element (recursively).

    Raises:
        ModelError: no tensor can be found; the message names what the output was.

    Example:
        >>> import torch
        >>> output_logits((torch.zeros(2, 3), "aux")).shape
        torch.Size([2, 3])
    """
    if isinstance(output, Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    if isinstance(output, Mapping) and isinstance(output.get("logits"), Tensor):
        return output["logits"]
    if isinstance(output, (tuple, list)) and output:
        return output_logits(output[0])
    kind = type(output).__name__
    keys = f" with keys {sorted(map(str, output.keys()))}" if isinstance(output, Mapping) else ""
    raise ModelError(
        f"cannot find the logits in the model's output, a {kind}{keys}; return a tensor, an object with "
        f".logits, a dict with 'logits' or a tuple whose first element is the logits")
