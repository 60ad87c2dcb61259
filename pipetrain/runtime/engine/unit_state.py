"""A forward in flight at one stage: what its backward (B, or I then W) needs.

The executor creates a :class:`UnitState` at a unit's F and drops it at the unit's last
backward piece (B, or W for zero-bubble schedules); hooks read it
(:meth:`pipetrain.runtime.engine.executor.Executor.unit`) but never change it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from ...schedule.action import Action
from .split_backward import WeightWork

__all__ = ["UnitState"]


@dataclass
class UnitState:
    """One unit's forward at one stage, kept until its backward.

    Attributes:
        version: the weight version the forward ran with (B must use the same, or recompute).
        params: that version's tensors by name.
        leaves: the received wires that require grad (their gradients go upstream).
        outputs: the wires whose gradient comes back, or the last stage's loss: the roots of
            the backward (empty when the backward recomputes, or once I has run).
        recv_action: the RECV_F whose buffers go back to the pool after the backward.
        recv_bufs: those buffers.
        grad_bufs: the received output gradients (RECV_B), once taken.
        grad_action: the RECV_B they came with.
        inputs: the stage input, kept when the backward recomputes under a newer version
            (:mod:`pipetrain.runtime.engine.recompute`).
        rng: the random state the forward started from (for that recompute).
        weight_work: what a zero-bubble I kept for its W (:mod:`pipetrain.runtime.engine.split_backward`).
        recomputed: what autograd saved during the recompute of the forward (held with the
            recomputed graph until the unit's last backward piece).
    """

    version: int
    params: dict[str, Tensor]
    leaves: list[Tensor]
    outputs: list[Tensor]
    recv_action: Action | None
    recv_bufs: list[Tensor] = field(default_factory=list)
    grad_bufs: list[Tensor] | None = None
    grad_action: Action | None = None
    inputs: tuple[Any, ...] = ()
    rng: Any = None
    weight_work: WeightWork | None = None
    recomputed: list[Tensor] = field(default_factory=list)
