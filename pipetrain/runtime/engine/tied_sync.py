"""The gradient exchange of parameters tied across stages, at STEP.

Every stage that reads a tied tensor keeps its own copy (:mod:`pipetrain.stages.tied`); at
each optimizer step the copies' gradients are summed over the ranks that hold one, so every
copy takes the same step and the copies stay equal::

    stage 0 (embedding)  g_0 = mean over the minibatch of dL/dW through the embedding
    stage S-1 (LM head)  g_1 = mean over the minibatch of dL/dW through the head
    STEP (each copy)     W <- optimizer(W, g_0 + g_1)

which is what one process computes for the single tensor (autograd adds both uses).

Replicated stages: STEP first averages a stage's gradient over its replicas (every replica
then holds the same mean ``g_s``); the tied group holds *every* replica of every holding
stage, and each member contributes ``g_s / r_s`` (``r_s`` the stage's replica count), so the
group's sum is ``sum_s g_s``, the same on every member.

Process groups (``dist.new_group`` per distinct set of ranks) are created by every rank in
the same order, right after :class:`~pipetrain.runtime.engine.comm.Comm`'s, from the partition's
list of ties (the same on every rank: it comes from the same captured graph). The exchange
runs at STEP ``k`` of each holding stage of a synchronous schedule, between the stages'
updates of minibatch ``k``; what it cannot do is refused before training
(:func:`pipetrain.stages.tied.check_ties`).

Global gradient clipping counts a tied tensor once (each holder's squared norm weighted by
``1 / holders``, :meth:`TiedSync.sum_of_squares`), as one process does. The all-reduces are
counted in the :class:`~pipetrain.schedule.traffic.Traffic` of ``Comm`` as ``allreduce``
bytes (one call of the tensor's bytes per tie at each STEP of a holding stage, over the ranks
of every holding stage); :func:`pipetrain.stages.tied.tied_buffers` gives
:func:`~pipetrain.plan.traffic.predict_traffic` the same.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ...schedule.traffic import Traffic, tie_ranks
from ...stages.partition import StageModule
from ...stages.tied import TiedParameter
from .optim import sum_of_squares
from .stage_runtime import StageRuntime

__all__ = ["TiedSync"]


@dataclass
class _Exchange:
    """One tie this rank takes part in: its stage's name for the tensor and the group."""

    tie: TiedParameter
    stage: int
    name: str
    group: Any
    size: int   # ranks in the group


class TiedSync:
    """Sums the gradients of tied copies at STEP (module docstring).

    Args:
        rank: this worker's rank.
        stage_ranks: ``stage_ranks[k]``, the ranks of stage ``k`` (``Schedule.stage_ranks``).
        ties: the partition's ties (the same list on every rank).
        local: this rank's stage modules by stage (their names for each tie).
        timeout: seconds for the new process groups.
        traffic: where to count the all-reduced bytes (``Comm.traffic``), or None.
    """

    def __init__(self, rank: int, stage_ranks: Sequence[Sequence[int]], ties: Sequence[TiedParameter],
                 local: Mapping[int, StageModule], timeout: float, traffic: Traffic | None = None) -> None:
        self.rank = rank
        self.traffic = traffic
        self._by_stage: dict[int, list[_Exchange]] = {}
        self._share: dict[int, dict[str, float]] = {}
        distributed = dist.is_available() and dist.is_initialized()
        groups: dict[tuple[int, ...], Any] = {}
        for tie in ties:
            if not tie.exchanged:
                continue
            ranks = tie_ranks(tie.stages, stage_ranks)
            if ranks not in groups:  # every rank creates every group, in the ties' order
                groups[ranks] = (dist.new_group(ranks=list(ranks), timeout=timedelta(seconds=timeout))
                                 if distributed and len(ranks) > 1 else None)
            for k in tie.stages:
                if k in local:
                    name = local[k].tie_names[tie.names[0]]
                    self._by_stage.setdefault(k, []).append(_Exchange(tie, k, name, groups[ranks], len(ranks)))
                    self._share.setdefault(k, {})[name] = 1.0 / len(tie.stages)

    @property
    def active(self) -> bool:
        """Whether any of this rank's stages holds a tie across stages."""
        return bool(self._by_stage)

    def sync(self, st: StageRuntime, grads: dict[str, Tensor | None]) -> None:
        """Replace each tied gradient of stage ``st`` (its replica mean) by the sum over stages.

        Called at STEP after :meth:`StageRuntime.mean_gradients`, before clipping and the
        update. Every holder enters the same all-reduces in the same (tie) order.
        """
        for ex in self._by_stage.get(st.index, []):
            g = grads.get(ex.name)
            if g is None:  # no unit read it in this group: contribute zeros (the collective still runs)
                g = torch.zeros_like(st.versions.latest[ex.name])
                grads[ex.name] = g
            if st.replicas > 1:
                g.div_(st.replicas)   # every replica holds the mean: the group sums g_s once per stage
            if ex.group is not None:
                if self.traffic is not None:
                    self.traffic.count_collective("allreduce", g.numel() * g.element_size(), ex.size)
                dist.all_reduce(g, op=dist.ReduceOp.SUM, group=ex.group)

    def sum_of_squares(self, st: StageRuntime, grads: Mapping[str, Tensor | None]) -> float:
        """Squared 2-norm of a stage's gradients, a tied tensor counted ``1 / holders`` per copy."""
        share = self._share.get(st.index, {})
        return sum(share.get(n, 1.0) * sum_of_squares([g]) for n, g in grads.items())
