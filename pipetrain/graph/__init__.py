"""Layer graphs: the torch-free :class:`LayerGraph` and its capture from live models."""
from __future__ import annotations

from .capture import CapturedModel, SharedParameter, capture, model_parameter_bytes
from .execute import NodeInterpreter, run_node_by_node
from .types import LayerGraph, LayerNode, TensorMeta, dtype_bytes

__all__ = [
    "CapturedModel", "LayerGraph", "LayerNode", "NodeInterpreter", "SharedParameter", "TensorMeta",
    "capture", "dtype_bytes", "model_parameter_bytes", "run_node_by_node",
]
