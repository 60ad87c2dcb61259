"""What one worker's forward runs when the model draws random numbers: its graph as one stage.

The per-unit random stream (:mod:`pipetrain.graph.random_ops`) is defined on the captured
graph's nodes, so one worker, to draw the masks a pipeline draws, runs the captured graph
built as a single stage (:func:`pipetrain.stages.partition.whole_graph_stage`: random nodes
seeded, buffers the forward updates read through copies) instead of the model's own forward. It
shares the model's parameters and buffers, so the optimizer, the checkpoint and the
evaluation keep using the model. A model without random nodes runs as it is (the same thing,
exactly); one that cannot be captured runs as it is too, drawing from the global generator.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ...errors import CaptureError
from ...graph.capture import capture
from ...graph.random_ops import random_nodes
from ...stages.partition import StageModule, whole_graph_stage

__all__ = ["WholeGraph", "unit_graph"]


class WholeGraph(nn.Module):
    """``forward(*inputs)``: the model's output, computed by its graph built as one stage."""

    def __init__(self, stage: StageModule) -> None:
        super().__init__()
        self.graph = stage.module
        self._stage = stage

    def forward(self, *inputs: Any) -> Any:
        return self._stage.finish_output(self.graph(*inputs))


def unit_graph(model: nn.Module, example_inputs: Sequence[Any], microbatches: int) -> WholeGraph | None:
    """The :class:`WholeGraph` of ``model`` (captured in training mode on one unit's share of
    ``example_inputs``, on the model's device), or ``None`` when the model draws no random
    numbers or cannot be captured (module docstring)."""
    if not example_inputs:
        return None
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    unit = tuple(x[:max(1, x.shape[0] // microbatches)].to(device) if isinstance(x, Tensor) and x.dim() else x
                 for x in example_inputs)
    model.train()
    try:
        captured = capture(model, unit)
    except CaptureError:
        return None
    if not random_nodes(captured.gm):
        return None
    return WholeGraph(whole_graph_stage(captured))
