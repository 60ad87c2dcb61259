"""Per-worker memory of a plan's stages under a schedule.

A worker of stage ``k`` (``P`` stages, ``r_k`` replicas, ``W_k`` workers in stages ``>= k``)
holds its stage's parameters ``p``, their gradients ``p``, optimizer state ``s * p``
(``s = profile.optimizer_state_bytes_per_parameter_byte``), weight versions, and for every
unit (minibatch or microbatch) in flight the stage's activations ``a`` plus its input ``x``
(every tensor crossing the cut before it, the receive buffers: relayed skip connections
included, see design.md "Relay"). With ``m`` microbatches a minibatch, a microbatch holds
``(a + x) / m``. ``a`` is what autograd saves for the backward (:func:`node_held_bytes`,
from the profiler's per-node ``saved_bytes``; the loss's on the last stage), the accounting
the simulator (:mod:`pipetrain.simulate.tensor_memory`) and the runtime's tensor ledger
(:mod:`pipetrain.runtime.guards.tensor_ledger`) use; a profile without those fields falls back to
the outputs of the stage's nodes.

============  ===========================================  ===============  ==============
schedule      units in flight                              unit size        weight copies
============  ===========================================  ===============  ==============
pipedream     ``n = ceil(W_k / r_k)`` (1F1B, NOAM in paper)  ``a + x``        ``n`` (stashing)
flush         ``min(m, ceil(W_k / r_k))``                  ``(a + x) / m``  1
2bw           ``min(m, ceil(W_k / r_k))``                  ``(a + x) / m``  2
gpipe         ``m`` (all forwards before any backward)     ``(a + x) / m``  1
============  ===========================================  ===============  ==============

so ``memory = copies * p + p + s * p + units * unit_size``. For a straight pipeline
``ceil(W_k / r_k) = P - k``, PipeDream's count for stage ``k``; the input stage of a plan
with ``N`` workers holds ``NOAM = ceil(N / r_0)`` minibatches.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import PlanError
from ..profile.types import Profile
from ..schedule.registry import SCHEDULES
from .cost import stage_arrays
from .types import Plan, Stage

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import ArrayLike

#: Names of the schedules with a memory rule (the registry's ``ScheduleSpec.memory_rule``).
MEMORY_SCHEDULES: tuple[str, ...] = tuple(n for n, s in SCHEDULES.items() if s.memory_rule is not None)


@dataclass(frozen=True)
class MemoryParts:
    """A worker's predicted bytes by kind: its weights (every version it keeps), their
    gradients, the optimizer's state, and the activations of the units in flight (inputs
    received included)."""

    weights: float
    gradients: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations

    def __add__(self, other: MemoryParts) -> MemoryParts:
        return MemoryParts(self.weights + other.weights, self.gradients + other.gradients,
                           self.optimizer + other.optimizer, self.activations + other.activations)


@dataclass(frozen=True)
class MemoryModel:
    """The schedule and sizes the memory estimate depends on."""

    schedule: str = "pipedream"
    microbatches: int = 1
    optimizer_state: float = 1.0  # optimizer bytes per parameter byte

    def __post_init__(self) -> None:
        if self.schedule not in MEMORY_SCHEDULES:
            raise PlanError(f"unknown schedule {self.schedule!r} for memory; choose one of "
                            f"{', '.join(MEMORY_SCHEDULES)}")
        if int(self.microbatches) < 1:
            raise PlanError(f"microbatches={self.microbatches} must be >= 1")

    @property
    def rule(self) -> str:
        """The schedule's memory rule: ``stash``, ``two_versions``, ``one_f_one_b`` or ``all_forwards``."""
        rule = SCHEDULES[self.schedule].memory_rule
        assert rule is not None  # __post_init__ admits only schedules with a rule
        return rule

    @property
    def units_per_minibatch(self) -> int:
        """Units a minibatch is split into: 1 when the unit is the minibatch, else ``microbatches``."""
        return 1 if SCHEDULES[self.schedule].unit == "minibatch" else int(self.microbatches)

    def units(self, workers_from_here: int, replicas: int) -> int:
        """Units (minibatches or microbatches) in flight at one worker of the stage."""
        n = -(-workers_from_here // replicas)
        if self.rule == "stash":
            return n
        if self.rule == "all_forwards":
            return self.microbatches
        return min(self.microbatches, n)

    def copies(self, units: int) -> int:
        """Weight copies held: stashed versions for PipeDream, 2 for 2BW, else 1."""
        return {"stash": max(units, 1), "two_versions": 2}.get(self.rule, 1)

    def unit_bytes(self, act: float, inp: float) -> float:
        return (act + inp) / self.units_per_minibatch

    def parts(self, params: float, act: float, inp: float, workers_from_here: int, replicas: int) -> MemoryParts:
        """Bytes per worker of a stage, by kind (see the module docstring)."""
        u = self.units(workers_from_here, replicas)
        return MemoryParts(self.copies(u) * params, params, self.optimizer_state * params,
                           u * self.unit_bytes(act, inp))

    def bytes(self, params: float, act: float, inp: float, workers_from_here: int, replicas: int) -> float:
        """Bytes per worker of a stage (see the module docstring)."""
        return self.parts(params, act, inp, workers_from_here, replicas).total

    def max_units(self, params: float, act: float, inp: float, limit: float) -> float:
        """The most in-flight units ``n`` (as counted for pipedream/flush/2bw) that fit ``limit``.

        ``inf`` when any number fits, ``-1`` when even one does not. Used by the planner to
        turn a memory limit into a lower bound on replicas.
        """
        ub = self.unit_bytes(act, inp)
        if self.rule == "stash":
            per = params + ub
            room = limit - (1.0 + self.optimizer_state) * params
            if per <= 0:
                return math.inf if room >= 0 else -1
            return math.floor(room / per) if room >= per else -1
        fixed = (self.copies(1) + 1.0 + self.optimizer_state) * params
        if self.rule == "all_forwards":
            return math.inf if fixed + self.microbatches * ub <= limit else -1
        if fixed + self.microbatches * ub <= limit:
            return math.inf
        return math.floor((limit - fixed) / ub) if ub > 0 and limit - fixed >= ub else -1


def node_held_bytes(profile: Profile) -> dict[str, float]:
    """Bytes each node adds to what one minibatch holds from its forward to its backward.

    With the profiler's saved-for-backward fields (``Profile.has_saved_bytes``): the new
    storages the node's forward saves (``saved_bytes``), plus its output when a later node
    saves it and the node itself did not (a ``ReLU`` saves its output, which the next
    ``Linear`` saves again: counted once). A view's storage is its root's, so the root
    carries it. This is what the runtime's ledger counts as ``activations``
    (runtime/guards/tensor_ledger.py); weights are left out (counted per version). Without those
    fields: every node's output (``activation_bytes``).
    """
    if not profile.has_saved_bytes:
        return {n.name: (0.0 if n.is_input else float(n.activation_bytes)) for n in profile.nodes}
    read = {src for n in profile.nodes for src in n.saved_inputs}
    out: dict[str, float] = {}
    for n in profile.nodes:
        if n.is_input:
            out[n.name] = 0.0
            continue
        held = float(n.saved_bytes or 0)
        if n.name in read and not n.output_saved:
            held += n.activation_bytes
        out[n.name] = held
    return out


def loss_held_bytes(profile: Profile) -> float:
    """Bytes the loss keeps for its backward per minibatch (the last stage's; 0 if not measured).

    The model's output, when the loss saves it, is counted unless the last node already
    saves it (a network ending in a ReLU)."""
    if profile.loss_saved_bytes is None:
        return 0.0
    extra = 0.0
    if profile.loss_saves_output:
        last = next((n for n in reversed(profile.nodes) if not n.is_input), None)
        if last is not None and not last.output_saved:
            extra = float(last.activation_bytes)
    return float(profile.loss_saved_bytes) + extra


def stage_held_bytes(profile: Profile, stages: Sequence[Sequence[str]]) -> list[float]:
    """Bytes one minibatch holds at each stage (:func:`node_held_bytes` summed, the loss on the last)."""
    held = node_held_bytes(profile)
    out = [sum(held.get(n, 0.0) for n in nodes) for nodes in stages]
    if out:
        out[-1] += loss_held_bytes(profile)
    return out


def stage_memory(profile: Profile, stages: Sequence[Stage] | Plan, schedule: str = "pipedream",
                 microbatches: int = 1) -> list[float]:
    """Bytes per worker of each stage of a plan under ``schedule`` (see the module docstring).

    ``a`` is what a minibatch really holds (:func:`stage_held_bytes`: autograd's saved
    tensors when the profile measured them, the simulator's and the runtime ledger's
    accounting); ``x``, the input crossing the cut, is the receive buffers."""
    return [p.total for p in stage_memory_parts(profile, stages, schedule, microbatches)]


def stage_memory_parts(profile: Profile, stages: Sequence[Stage] | Plan, schedule: str = "pipedream",
                       microbatches: int = 1) -> list[MemoryParts]:
    """:func:`stage_memory` by kind (:class:`MemoryParts`), one per stage."""
    stage_list = stages.stages if isinstance(stages, Plan) else list(stages)
    arr = stage_arrays(profile, [s.nodes for s in stage_list])
    act = stage_held_bytes(profile, [s.nodes for s in stage_list]) if profile.has_saved_bytes else list(arr.act)
    # a recomputing stage holds only its input per unit in flight (plan/recompute.py)
    act = [0.0 if s.recompute else a for s, a in zip(stage_list, act)]
    model = MemoryModel(schedule, microbatches, profile.optimizer_state_bytes_per_parameter_byte)
    reps = [int(s.replicas) for s in stage_list]
    return [model.parts(arr.params[k], act[k], arr.cuts[k], sum(reps[k:]), reps[k]) for k in range(len(stage_list))]


def max_units_array(model: MemoryModel, params: ArrayLike, act: ArrayLike, inp: ArrayLike,
                    limit: float) -> np.ndarray:
    """Vectorised :meth:`MemoryModel.max_units` over numpy arrays (``inf``: any, ``-1``: none)."""
    import numpy as np

    params = np.asarray(params, dtype=float)
    ub = (np.asarray(act, dtype=float) + np.asarray(inp, dtype=float)) / model.units_per_minibatch
    with np.errstate(divide="ignore", invalid="ignore"):
        if model.rule == "stash":
            per = params + ub
            room = limit - (1.0 + model.optimizer_state) * params
            q = np.where(per > 0, np.floor(room / np.where(per > 0, per, 1.0)), np.where(room >= 0, np.inf, -1.0))
            return np.where(q >= 1, q, -1.0)
        fixed = (model.copies(1) + 1.0 + model.optimizer_state) * params
        whole = fixed + model.microbatches * ub <= limit
        if model.rule == "all_forwards":
            return np.where(whole, np.inf, -1.0)
        q = np.where(ub > 0, np.floor((limit - fixed) / np.where(ub > 0, ub, 1.0)), -1.0)
        return np.where(whole, np.inf, np.where(q >= 1, q, -1.0))
