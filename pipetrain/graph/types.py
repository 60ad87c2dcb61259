"""The layer graph: what the profiler measures, the planner cuts and the runtime runs.

A :class:`LayerGraph` is a DAG whose nodes are layers (leaf modules, functional ops, model
inputs) and whose edges are tensors. Nodes are stored in a topological order. The graph is
plain data (no torch objects) so that profiles imported from PipeDream's text format and
graphs captured from live models are the same type.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

_DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
    "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16,
}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype given by name (``"float32"``, ``"torch.float32"``)."""
    return _DTYPE_BYTES[dtype.replace("torch.", "")]


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of one tensor on an edge (for the example batch)."""

    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_bytes(self.dtype)


@dataclass
class LayerNode:
    """One layer of the graph.

    Attributes:
        name: unique id (the fx node name for captured graphs, ``node12`` for PipeDream files).
        op: human description: the module's repr, ``add``, ``Input``...
        kind: ``"input"`` (a model input: costs nothing, lives with the first stage),
            ``"module"`` (a leaf module call), ``"function"`` (a functional op or method),
            ``"output"`` is never a node: outputs are the nodes listed in ``LayerGraph.outputs``.
        inputs: names of the nodes whose outputs this node reads, in argument order.
        outputs: metadata of every tensor the node produces (several for an LSTM).
        parameter_bytes: bytes of the parameters (and buffers) owned by this node.
        target: the module path (``layer1.0.conv1``) or function name, for captured graphs.
    """

    name: str
    op: str
    kind: str = "module"
    inputs: list[str] = field(default_factory=list)
    outputs: list[TensorMeta] = field(default_factory=list)
    parameter_bytes: int = 0
    target: str | None = None

    @property
    def activation_bytes(self) -> int:
        return sum(t.nbytes for t in self.outputs)

    @property
    def is_input(self) -> bool:
        return self.kind == "input"


@dataclass
class LayerGraph:
    """A DAG of layers in topological order, with the names of the model's outputs."""

    nodes: list[LayerNode]
    outputs: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._index = {n.name: i for i, n in enumerate(self.nodes)}

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[LayerNode]:
        return iter(self.nodes)

    def __getitem__(self, name: str) -> LayerNode:
        return self.nodes[self._index[name]]

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def index(self, name: str) -> int:
        return self._index[name]

    def edges(self) -> Iterable[tuple[str, str]]:
        """Every (producer, consumer) pair, once per distinct pair."""
        for n in self.nodes:
            for src in dict.fromkeys(n.inputs):
                yield src, n.name

    def successors(self) -> dict[str, list[str]]:
        succ: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for a, b in self.edges():
            succ[a].append(b)
        return succ

    @property
    def parameter_bytes(self) -> int:
        return sum(n.parameter_bytes for n in self.nodes)
