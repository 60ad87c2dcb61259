"""Tied parameters across stages: one copy per stage, gradients summed before each update.

A tensor the model holds under several names (stock GPT-2 ties the token embedding
``transformer.wte.weight`` and the LM head ``lm_head.weight``) may be read by nodes that a
plan puts on different stages. As Megatron does for its embedding group, every stage that
reads it keeps its own copy (initialised identically: every worker builds the model from the
same seed), and at each optimizer step the copies' gradients are summed over the ranks that
hold one (:mod:`pipetrain.runtime.engine.tied_sync`), so every copy takes the same step and
the copies stay equal.

This module holds the analysis: the ties a partition finds (:class:`TiedParameter`), what a
schedule can and cannot do with them (:func:`check_ties`), every stage's trainable tensors
(:func:`stage_parameters`, whose :func:`~pipetrain.runtime.engine.comm.reduce_buffers` are the
stages' replica all-reduces), the exchange's buffers for
:func:`~pipetrain.plan.traffic.predict_traffic` (:func:`tied_buffers`) and every model name of
a stage's tensors (:func:`alias_state`).

When the exchange happens, and what is refused:

- synchronous schedules (``flush``, ``gpipe``, ``dp``, ``interleaved``, ``zerobubble``): at
  STEP ``k`` of each holding stage, i.e. between the stages' updates of minibatch ``k``;
  every copy has version ``k`` equal at every stage.
- asynchronous schedules (``pipedream``, ``2bw``) are refused when a tied tensor spans
  stages: their stages take STEP ``k`` at different times (the last stage long before the
  first), so a blocking exchange at STEP would stall the pipeline, and stashed versions
  would pair a copy's version ``v`` at one stage with another version at the other: the
  update rule the single-process replay checks would not hold. Put both readers in one
  stage (a plan) or untie the weights instead.
- one rank holding two stages that hold tied tensors (interleaved layouts): their STEPs
  would enter the tied collectives in an order that differs between ranks; refused.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from ..errors import RuntimeConfigError
from ..schedule.traffic import TiedBuffer

__all__ = ["TiedParameter", "alias_state", "check_ties", "holds_tie", "stage_parameters", "tied_buffers"]


class Aliased(Protocol):
    """What :func:`alias_state` reads of a stage (:class:`~pipetrain.stages.partition.StageModule`)."""

    @property
    def aliases(self) -> Mapping[str, Sequence[str]]:
        """A name the stage holds -> its other names in the model."""
        ...


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

    @property
    def exchanged(self) -> bool:
        """Whether its holders' gradients are summed at STEP: trainable and across stages."""
        return self.trainable and self.across_stages

    def describe(self) -> str:
        """``'lm_head.weight' (also 'transformer.wte.weight')``."""
        first, rest = self.names[0], self.names[1:]
        also = f" (also {', '.join(repr(n) for n in rest)})" if rest else ""
        return f"{first!r}{also}"


def holds_tie(ties: Sequence[TiedParameter], stages: Sequence[int]) -> bool:
    """Whether one of ``stages`` holds an exchanged tie: a rank whose gradients
    :class:`~pipetrain.runtime.engine.tied_sync.TiedSync` sums with other stages' at STEP."""
    return any(t.exchanged and any(k in t.stages for k in stages) for t in ties)


def check_ties(ties: Sequence[TiedParameter], stage_ranks: Sequence[Sequence[int]], synchronous: bool,
               schedule_name: str) -> None:
    """Refuse what the tied exchange cannot do (module docstring); call before training.

    Raises:
        RuntimeConfigError: a tie across stages under an asynchronous schedule, or a rank
            holding two stages with ties across stages.
    """
    across = [t for t in ties if t.exchanged]
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
    holds it (each holds its own copy, :func:`pipetrain.stages.partition.build_stage_modules`);
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
    """What :class:`~pipetrain.runtime.engine.tied_sync.TiedSync` all-reduces, for
    :func:`~pipetrain.plan.traffic.predict_traffic`: one
    :class:`~pipetrain.schedule.traffic.TiedBuffer` per trainable tie across stages (its
    tensor's bytes and holding stages), in the ties' order. ``named``: the model's parameters
    by any of their names."""
    out: list[TiedBuffer] = []
    for tie in ties:
        if not tie.exchanged:
            continue
        p = next((named[n] for n in tie.names if n in named), None)
        if p is None:
            raise RuntimeConfigError(f"tied parameter {tie.describe()} is not among the model's parameters; pass "
                                     f"the model that was partitioned")
        out.append(TiedBuffer(p.numel() * p.element_size(), tuple(tie.stages)))
    return out


def alias_state(stage: Aliased, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
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
