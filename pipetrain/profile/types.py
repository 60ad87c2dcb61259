"""The Profile type: per-layer costs of a model for one minibatch size, and its JSON form.

JSON format, version 1::

    {"version": 1, "model": "vgg16", "batch_size": 128, "device": "cpu",
     "optimizer": "sgd", "optimizer_state_bytes_per_parameter_byte": 1.0,
     "nodes": [{"name": "conv1", "op": "Conv2d(3, 64, ...)", "kind": "module",
                "forward_time": 0.01, "backward_time": 0.02,
                "activation_bytes": 411041792, "parameter_bytes": 7168,
                "inputs": ["x"]}, ...]}

Times are seconds for one minibatch of ``batch_size`` samples; sizes are bytes. Nodes are
listed in a topological order. A profile measured by :mod:`pipetrain.profile.profiler` also
holds the whole-model step measured in the same run (optional; readers that do not know it
ignore it; ``first_node``, present when the check ran on the graph's tail from that node
only, see :mod:`pipetrain.profile.measure`)::

     "measured_step": {"forward_time": 0.031, "backward_time": 0.057}
 Readers also accept PipeDream's text format by the ``.txt``
extension (see :mod:`pipetrain.profile.pipedream_txt`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

PROFILE_VERSION = 1


@dataclass
class NodeProfile:
    """Measured costs of one layer. ``kind == "input"`` marks a model input (costs nothing)."""

    name: str
    op: str
    forward_time: float
    backward_time: float
    activation_bytes: int
    parameter_bytes: int
    inputs: list[str] = field(default_factory=list)
    kind: str = "module"
    # -- what autograd keeps for the backward (the memory model, plan/stage_memory.py); None: not measured
    saved_bytes: int | None = None   # distinct new storages the forward saves (its output included if saved)
    saved_inputs: list[str] = field(default_factory=list)  # earlier nodes whose output storage it saves
    output_saved: bool = False       # whether ``saved_bytes`` includes this node's own output

    @property
    def is_input(self) -> bool:
        return self.kind == "input"

    @property
    def compute_time(self) -> float:
        return self.forward_time + self.backward_time


@dataclass
class Profile:
    """Per-layer profile of a model (nodes in topological order)."""

    model: str
    batch_size: int | None
    nodes: list[NodeProfile]
    device: str = "unknown"
    optimizer: str = "sgd"
    optimizer_state_bytes_per_parameter_byte: float = 1.0
    version: int = PROFILE_VERSION
    loss_saved_bytes: int | None = None  # new storages the loss saves for backward (None: not measured)
    loss_saves_output: bool = False      # whether the loss saves the model's output
    # -- the whole model's forward and backward measured in the same run (None: not measured)
    measured_forward_time: float | None = None
    measured_backward_time: float | None = None
    measured_from: str | None = None     # the first node of the measured region (None: the whole model)

    def __post_init__(self) -> None:
        self._index = {n.name: i for i, n in enumerate(self.nodes)}

    def __getitem__(self, name: str) -> NodeProfile:
        return self.nodes[self._index[name]]

    def __len__(self) -> int:
        return len(self.nodes)

    def index(self, name: str) -> int:
        return self._index[name]

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.nodes]

    @property
    def total_forward_time(self) -> float:
        return sum(n.forward_time for n in self.nodes if not n.is_input)

    @property
    def total_backward_time(self) -> float:
        return sum(n.backward_time for n in self.nodes if not n.is_input)

    @property
    def measured_step_time(self) -> float | None:
        """The forward + backward measured with the profile, of the whole model or of the nodes
        from ``measured_from`` on (None: not measured)."""
        if self.measured_forward_time is None or self.measured_backward_time is None:
            return None
        return self.measured_forward_time + self.measured_backward_time

    @property
    def total_parameter_bytes(self) -> int:
        return sum(n.parameter_bytes for n in self.nodes)

    @property
    def has_saved_bytes(self) -> bool:
        """Whether every non-input node carries ``saved_bytes`` (measured by the profiler)."""
        return all(n.saved_bytes is not None for n in self.nodes if not n.is_input)

    def edges(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for n in self.nodes:
            for src in dict.fromkeys(n.inputs):
                out.append((src, n.name))
        return out
