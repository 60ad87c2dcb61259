"""Tied parameters across stages: one copy per stage, gradients summed before each update.

A tensor the model holds under several names (stock GPT-2 ties the token embedding
``transformer.wte.weight`` and the LM head ``lm_head.weight``) may be read by nodes that a
plan puts on different stages. As Megatron does for its embedding group, every stage that
reads it keeps its own copy (initialised identically: every worker builds the model from the
same seed), and at each optimizer step the copies' gradients are summed over the ranks that
hold one, so every copy takes the same step and the copies stay equal::

    stage 0 (embedding)  g_0 = mean over the minibatch of dL/dW through the embedding
    stage S-1 (LM head)  g_1 = mean over the minibatch of dL/dW through the head
    STEP (each copy)     W <- optimizer(W, g_0 + g_1)

which is what one process computes for the single tensor (autograd adds both uses).

Replicated stages: STEP first averages a stage's gradient over its replicas (every replica
then holds the same mean ``g_s``); the tied group holds *every* replica of every holding
stage, and each member contributes ``g_s / r_s`` (``r_s`` the stage's replica count), so the
group's sum is ``sum_s g_s``, the same on every member.

Process groups (``dist.new_group`` per distinct set of ranks) are created by every rank in
the same order, right after :class:`~pipetrain.runtime.comm.Comm`'s, from the partition's
list of ties (the same on every rank: it comes from the same captured graph).

When the exchange happens, and what is refused:

- synchronous schedules (``flush``, ``gpipe``, ``dp``, ``interleaved``, ``zerobubble``): at
  STEP ``k`` of each holding stage, i.e. between the stages' updates of minibatch ``k``;
  every copy has version ``k`` equal at every stage.
- asynchronous schedules (``pipedream``, ``2bw``) are refused when a tied tensor spans
  stages: their stages take STEP ``k`` at different times (the last stage long before the
  first), so a blocking exchange at STEP would stall the pipeline, and stashed versions
  would pair a copy's version ``v`` at one stage with another version at the other: the
  update rule the single-process replay checks would no longer hold. Put both readers in
  one stage (a plan) or untie the weights instead.
- one rank holding two stages that hold tied tensors (interleaved layouts): their STEPs
  would enter the tied collectives in an order that differs between ranks; refused.

Global gradient clipping counts a tied tensor once (each holder's squared norm weighted by
``1 / holders``), as one process does. The all-reduces are counted in the
:class:`~pipetrain.plan.traffic.Traffic` of :class:`Comm` as ``allreduce`` bytes (one call
of the tensor's bytes per tie at each STEP of a holding stage, over the ranks of every
holding stage); :func:`tied_buffers` gives
:func:`~pipetrain.plan.traffic.predict_traffic` the same (its ``tied`` argument), and
:func:`stage_parameters` every stage's trainable tensors (a tie across stages in each holder),
whose :func:`~pipetrain.runtime.comm.reduce_buffers` are the stages' replica all-reduces.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..errors import RuntimeConfigError
from ..plan.traffic import TiedBuffer
from .optim import sum_of_squares

if TYPE_CHECKING:  # only for annotations: executor imports stage, which imports this module
    from ..plan.traffic import Traffic
    from .executor import StageRuntime
    from .stage import StageModule

__all__ = ["TiedParameter", "TiedSync", "alias_state", "check_ties", "stage_parameters", "tied_buffers"]


@dataclass(frozen=True)
class TiedParameter:
    """One model tensor held under several names or read by several stages.

    Attributes:
        names: every qualified name of the tensor in the model
            (``named_parameters(remove_duplicate=False)`` order), e.g.
            ``("transformer.wte.weight", "lm_head.weight")``.
        stages: the stages whose nodes read it, ascending (one entry: a tie inside a stage).
        trainable: whether the tensor requires grad (frozen tensors need no exchange).
    """

    names: tuple[str, ...]
    stages: tuple[int, ...]
    trainable: bool = True

    @property
    def across_stages(self) -> bool:
        """Whether several stages hold a copy (their gradients must be summed)."""
        return len(self.stages) > 1

    def describe(self) -> str:
        """``'lm_head.weight' (also 'transformer.wte.weight')``."""
        first, rest = self.names[0], self.names[1:]
        also = f" (also {', '.join(repr(n) for n in rest)})" if rest else ""
        return f"{first!r}{also}"


def check_ties(ties: Sequence[TiedParameter], stage_ranks: Sequence[Sequence[int]], synchronous: bool,
               schedule_name: str) -> None:
    """Refuse what the tied exchange cannot do (module docstring); call before training.

    Raises:
        RuntimeConfigError: a tie across stages under an asynchronous schedule, or a rank
            holding two stages with ties across stages.
    """
    across = [t for t in ties if t.across_stages and t.trainable]
    if not across:
        return
    t = across[0]
    where = " and ".join(str(k) for k in t.stages)
    if not synchronous:
        raise RuntimeConfigError(
            f"parameter {t.describe()} is tied across stages {where}, which the asynchronous schedule "
            f"{schedule_name!r} cannot keep equal (its stages step at different times on stashed versions); use a "
            f"synchronous schedule (flush, gpipe), put every reader of it in one stage, or untie it (e.g. "
            f"--option tie_word_embeddings=False)")
    holders = sorted({k for t in across for k in t.stages})
    for r in sorted({r for k in holders for r in stage_ranks[k]}):
        mine = [k for k in holders if r in stage_ranks[k]]
        if len(mine) > 1:
            raise RuntimeConfigError(
                f"rank {r} holds stages {mine[0]} and {mine[1]}, which both hold tied parameters (first: "
                f"{across[0].describe()}); tied parameters across stages need their holders on different ranks: "
                f"use a layout with one stage per rank, put the tied readers in one stage, or untie the weights")


def stage_parameters(named: Mapping[str, Tensor], param_stage: Mapping[str, int], ties: Sequence[TiedParameter],
                     num_stages: int) -> list[list[Tensor]]:
    """Every stage's trainable tensors, as its replica all-reduce holds them.

    Args:
        named: the whole model's ``named_parameters()`` (a tied tensor under its first name).
        param_stage: the partition's owner of every name (``Partition.param_stage``).
        ties: the partition's ties (``Partition.tied``).
        num_stages: stages of the plan.

    A tensor counts once per stage; a tensor tied across stages counts in every stage that
    holds it (each holds its own copy, :func:`pipetrain.runtime.stage.build_stage_modules`);
    frozen tensors and tensors no stage reads are in none.
    """
    holders = {n: tie.stages for tie in ties for n in tie.names}
    out: list[list[Tensor]] = [[] for _ in range(num_stages)]
    seen: set[int] = set()
    for name, p in named.items():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        stages = holders.get(name) or ((param_stage[name],) if name in param_stage else ())
        for k in sorted(set(stages)):
            out[k].append(p)
    return out


def tied_buffers(named: Mapping[str, Tensor], ties: Sequence[TiedParameter]) -> list[TiedBuffer]:
    """What :class:`TiedSync` all-reduces, for :func:`~pipetrain.plan.traffic.predict_traffic`:
    one :class:`~pipetrain.plan.traffic.TiedBuffer` per trainable tie across stages (its
    tensor's bytes and holding stages), in the ties' order. ``named``: the model's parameters
    by any of their names."""
    out: list[TiedBuffer] = []
    for tie in ties:
        if not (tie.across_stages and tie.trainable):
            continue
        p = next((named[n] for n in tie.names if n in named), None)
        if p is None:
            raise RuntimeConfigError(f"tied parameter {tie.describe()} is not among the model's parameters; pass "
                                     f"the model that was partitioned")
        out.append(TiedBuffer(p.numel() * p.element_size(), tuple(tie.stages)))
    return out


def alias_state(stage: StageModule, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``state`` (this stage's tensors by its own names) plus every other model name of them.

    A checkpoint keeps every name the model has (``state_dict`` lists tied names twice), so a
    stage holding ``lm_head.weight`` also reports it as ``transformer.wte.weight``.
    """
    out = dict(state)
    for name, others in stage.aliases.items():
        if name in state:
            for other in others:
                out.setdefault(other, state[name])
    return out


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
            if not (tie.across_stages and tie.trainable):
                continue
            ranks = tuple(sorted({r for k in tie.stages for r in stage_ranks[k]}))
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
