"""The points at which the executor calls its hooks, and what hooks may read of it.

An :class:`~pipetrain.runtime.engine.executor.Executor` is built with a list of
:class:`EngineHooks` (the guards of :mod:`pipetrain.runtime.guards`: the numerics checks,
the tensor ledger) and calls each, in list order, at fixed points of a segment::

    before_run                      start of a segment, before its first action
    forward_scope                   a context entered around an F action's handler
    after_forward                   inside F, once the stage's outputs (or loss) exist
    after_backward                  inside B, with its gradients, before they are accumulated
    check_step                      inside STEP, with the mean gradients, before the update
    agree -> bool                   at a rank's last STEP of a minibatch, when a hook
                                    ``drops_steps``: true drops the step on every stage
    after_update                    inside STEP, after a stage's update
    after_action                    after every action's handler
    after_run                       after the segment's last action

A hook reads the executor through :class:`EngineView` and changes none of its state (the
one switch a hook may set is a stage's gradient probe, ``GradSink.probe``: the numerics
guard's); what it does with a finding (raise, record) is its own. Every method of the base
class does nothing, so a hook overrides only the points it needs.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

from torch import Tensor

from ...schedule.action import Action
from .comm import Comm
from .stage_runtime import StageRuntime
from .unit_state import UnitState
from .units import UnitData

__all__ = ["EngineHooks", "EngineView"]


class EngineView(Protocol):
    """What hooks read of the executor that calls them."""

    @property
    def stages(self) -> Mapping[int, StageRuntime]:
        """This worker's stages by index."""
        ...

    @property
    def comm(self) -> Comm:
        ...

    @property
    def position(self) -> int:
        """Index in the segment's list of the action running (or the last one run)."""
        ...

    @property
    def data(self) -> UnitData:
        """The segment's unit data (``step_of``, ``unit``, ``step_offset``)."""
        ...

    @property
    def loss_fn(self) -> Callable[[Any, Any], Tensor]:
        ...

    @property
    def losses(self) -> Mapping[int, Tensor]:
        """Unit -> loss of the last stage's forwards in this segment (a new mapping per segment)."""
        ...

    def unit(self, stage: int, mb: int) -> UnitState | None:
        """The forward of unit ``mb`` in flight at ``stage`` (until its last backward piece)."""
        ...

    def outgoing(self, stage: int, mb: int, direction: int) -> list[Tensor] | None:
        """The wires waiting for their SEND (``direction`` 0: SEND_F, 1: SEND_B)."""
        ...

    def received(self) -> list[Tensor]:
        """The tensors of every receive done and not yet taken by a forward or backward."""
        ...


class EngineHooks:
    """Called by the executor at fixed points (module docstring); every method does nothing."""

    @property
    def drops_steps(self) -> bool:
        """Whether this hook may drop a step (then the executor defers every update to the
        rank's last STEP of the minibatch and asks :meth:`agree` first)."""
        return False

    def before_run(self, ex: EngineView) -> None:
        """A segment starts (before its first action)."""

    def after_run(self, ex: EngineView) -> None:
        """A segment ended with every unit finished."""

    def forward_scope(self, ex: EngineView, a: Action) -> AbstractContextManager[object]:
        """A context the F action ``a`` runs in (all of its handler)."""
        return nullcontext()

    def after_forward(self, ex: EngineView, a: Action, inputs: Sequence[Any], params: Mapping[str, Tensor],
                      outputs: Sequence[Tensor]) -> None:
        """F ran the stage on ``inputs`` with ``params``: ``outputs`` are its output wires
        (the last stage: ``[loss]``)."""

    def after_backward(self, ex: EngineView, a: Action, unit: UnitState, grad_outputs: Sequence[Tensor] | None,
                       grads: Sequence[Tensor | None]) -> None:
        """B computed ``grads`` (the input leaves', then the trainable weights') from the
        received ``grad_outputs`` (``None`` on the last stage: the loss)."""

    def check_step(self, ex: EngineView, st: StageRuntime, a: Action, grads: Mapping[str, Tensor | None]) -> None:
        """STEP ``a`` of ``st`` has its mean gradients ``grads``; the update follows."""

    def agree(self, ex: EngineView, a: Action) -> bool:
        """Whether the step must be dropped on every stage (called only when :attr:`drops_steps`;
        may be a collective: every rank calls it at the same point)."""
        return False

    def after_update(self, ex: EngineView, st: StageRuntime, a: Action) -> None:
        """``st`` applied its update of STEP ``a`` (its newest version is the result)."""

    def after_action(self, ex: EngineView, a: Action) -> None:
        """The handler of ``a`` returned."""
