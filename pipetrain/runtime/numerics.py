"""Stop a run at the first non-finite loss or gradient, naming where it appeared.

:class:`NumericsGuard` is called by the executor at every STEP of a stage (a hook:
``Executor.numerics``), before the optimizer touches the weights:

1. on the last stage, every loss computed since the previous check (one per unit) must be
   finite; the first that is not names its minibatch and unit;
2. on every stage, every parameter's mean gradient must be finite; the first that is not
   names the parameter (its model name, e.g. ``net.4.weight``, i.e. the node ``net.4``).

Either raises :class:`NonFiniteError` on the rank that saw it: the step is not applied, no
checkpoint is written after it (checkpoints are written only at drained boundaries that the
run reaches), so the latest complete checkpoint in ``--checkpoint-dir`` is the last good one,
and the message names it. The other ranks stop when their waits on this rank break
(:mod:`pipetrain.runtime.peers`), and the launcher reports this rank's error.

Where a NaN first appears *inside* a stage's forward (which node produced it) is not
searched: the gradient check names the parameter whose gradient is non-finite, which is
the node that consumed it. A loss that is non-finite while every gradient upstream of it is
not yet computed is reported as a loss. Cost: one ``isfinite`` pass over the gradients per
step (as cheap as a gradient norm).

Minibatch numbering: ``step`` is minibatches done before this STEP's minibatch, counted from
the run's start; for a stage with ``r`` replicas under pipedream (one step per ``r``
minibatches) it is the segment's first minibatch plus the stage's step index.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = ["NonFiniteError", "NumericsGuard", "first_nonfinite"]


class NonFiniteError(RuntimeError):
    """A loss or gradient became NaN or Inf (module docstring); ``step``, ``stage`` and
    ``where`` (a unit's loss or a parameter name) say where it first appeared."""

    def __init__(self, message: str, step: int, stage: int, where: str) -> None:
        super().__init__(message)
        self.step, self.stage, self.where = step, stage, where


def first_nonfinite(tensors: Mapping[str, Tensor | None]) -> tuple[str, float] | None:
    """The first ``(name, a bad value)`` among ``tensors`` holding a NaN or Inf, else ``None``."""
    for name, t in tensors.items():
        if t is None or not (t.is_floating_point() or t.is_complex()):
            continue
        if not bool(torch.isfinite(t).all()):
            bad = t[~torch.isfinite(t)].flatten()[0]
            return name, float(bad.real if bad.is_complex() else bad)
    return None


class NumericsGuard:
    """Checks losses and gradients at every STEP (module docstring).

    Args:
        rank: this worker's rank (for messages).
        checkpoint_dir: ``--checkpoint-dir`` (to name the last good checkpoint), or ``None``.
    """

    def __init__(self, rank: int, checkpoint_dir: str | None = None) -> None:
        self.rank = rank
        self.checkpoint_dir = checkpoint_dir
        self._checked: set[int] = set()
        self._losses_id = 0

    def _last_good(self) -> str:
        if self.checkpoint_dir is None:
            return "no --checkpoint-dir was given, so no checkpoint was kept"
        from ..checkpoint import latest_checkpoint

        path = latest_checkpoint(self.checkpoint_dir)
        if path is None:
            return f"{self.checkpoint_dir} holds no complete checkpoint yet"
        return f"the last good checkpoint is {Path(path)}"

    def _fail(self, what: str, step: int, stage: int, where: str) -> None:
        raise NonFiniteError(
            f"non-finite {what} at minibatch {step} on stage {stage} (rank {self.rank}): {where}; the step was not "
            f"applied and {self._last_good()}; lower --lr, clip with --clip-grad-norm, or check the data",
            step, stage, where)

    def check_step(self, executor: Any, st: Any, action: Any, grads: Mapping[str, Tensor | None]) -> None:
        """Called at a STEP of stage ``st`` with its mean gradients, before the update."""
        data = executor.data
        if st.stage.is_last:
            losses: Mapping[int, Tensor] = executor.losses
            if id(losses) != self._losses_id:  # a new segment: a new dict
                self._losses_id, self._checked = id(losses), set()
            for unit in sorted(u for u in losses if u not in self._checked):
                self._checked.add(unit)
                value = float(losses[unit])
                if not math.isfinite(value):
                    self._fail("loss", data.step_of(unit), st.index, f"the loss of unit {unit} is {value}")
        bad = first_nonfinite(grads)
        if bad is not None:
            name, value = bad
            module = name.rpartition(".")[0] or name
            self._fail("gradient", data.step_offset + int(action.mb), st.index,
                       f"parameter {name!r} (node {module!r}) has gradient value {value}")
