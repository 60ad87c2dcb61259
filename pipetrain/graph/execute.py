"""Execute a captured graph one node at a time.

The runtime and the profiler both run a :class:`CapturedModel` node by node; this module is
the reference: :func:`run_node_by_node` must reproduce the model's output exactly.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from .capture import CapturedModel

__all__ = ["NodeInterpreter", "run_node_by_node"]

NodeCallback = Callable[[str, Any], None]


class NodeInterpreter(torch.fx.Interpreter):
    """A ``torch.fx.Interpreter`` that reports every LayerGraph node's value to a callback.

    ``on_node(name, value)`` is called after each placeholder, module, function and method
    node runs (``get_attr`` and ``output`` nodes are not LayerGraph nodes and are skipped).
    """

    def __init__(self, gm: torch.fx.GraphModule, on_node: NodeCallback | None = None) -> None:
        super().__init__(gm)
        self.on_node = on_node

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        if self.on_node is not None and n.op not in ("get_attr", "output"):
            self.on_node(n.name, out)
        return out


def run_node_by_node(captured: CapturedModel, *inputs: Any, on_node: NodeCallback | None = None) -> Any:
    """Run ``captured.gm`` on ``inputs`` one node at a time and return the model's output.

    Args:
        captured: the result of :func:`pipetrain.graph.capture`.
        *inputs: the model's positional inputs (any batch size for graphs whose batch
            dimension is dynamic: always for fx captures, usually for export captures).
        on_node: optional ``on_node(name, value)`` called with each node's output.

    Returns:
        The model's output, with the structure the model returns (tensor, tuple,
        Hugging Face ``ModelOutput``...).
    """
    return NodeInterpreter(captured.gm, on_node).run(*inputs)
