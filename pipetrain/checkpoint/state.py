"""What one rank hands to a checkpoint, and the keys it is stored under.

Keys name the model's own parameters, never a stage, rank or plan, so any later layout can
find what it needs (PyTorch DCP's rule: a checkpoint is a flat ``{key: tensor}`` map, and
resharding is matching keys):

    model/<name>              newest weights and buffers (model.state_dict() names)
    stash/<version>/<name>    an older weight version still held (weight stashing)
    optim/<name>/<key>        a tensor of the optimizer state of <name> (momentum_buffer, exp_avg)
    rank<r>/<key>             a tensor extra of rank r (RNG state, ...): not resharded

Non-tensor values (Adam's integer ``step``, a data position, a seed) are small: they go to
the manifest as JSON instead of DCP's files.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from .manifest import TensorSpec

__all__ = ["RankState", "model_key", "stash_key", "optim_key", "rank_key", "flatten", "RankSummary"]


@dataclass
class RankState:
    """Everything one rank holds at a checkpoint's step.

    Args:
        model: newest weights and buffers of this rank's stages, by ``model.state_dict()`` name.
        stashed: older weight versions this rank still holds: ``{version: {name: tensor}}``
            (version = optimizer steps of the stage, as in ``WeightVersions``); empty for a
            schedule drained before the save.
        optimizer: optimizer state by parameter name: ``{name: {key: tensor | int | float}}``
            (``FunctionalOptimizer.state_dict()["state"]``).
        stage_steps: optimizer steps of the stage holding each parameter: ``{name: steps}``.
        extras: this rank's own state, not resharded (RNG states as tensors, data position as
            an int, ...): tensors go to DCP, anything else must be JSON-serializable.
        writer: whether this rank writes ``model``/``stashed``/``optimizer``/``stage_steps``.
            Replicas of a stage hold identical values: pass ``True`` on one of them (e.g.
            the stage's first rank) and ``False`` on the others. (If several ranks do pass
            the same key, DCP's planner still writes it once.)
    """

    model: Mapping[str, Tensor] = field(default_factory=dict)
    stashed: Mapping[int, Mapping[str, Tensor]] = field(default_factory=dict)
    optimizer: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    stage_steps: Mapping[str, int] = field(default_factory=dict)
    extras: Mapping[str, Any] = field(default_factory=dict)
    writer: bool = True


def model_key(name: str) -> str:
    return f"model/{name}"


def stash_key(version: int, name: str) -> str:
    return f"stash/{version}/{name}"


def optim_key(name: str, key: str) -> str:
    return f"optim/{name}/{key}"


def rank_key(rank: int, key: str) -> str:
    return f"rank{rank}/{key}"


@dataclass
class RankSummary:
    """The small, JSON-able part of one rank's state (gathered to every rank before saving)."""

    rank: int
    model: dict[str, dict[str, Any]] = field(default_factory=dict)       # name -> spec json
    stash: dict[int, list[str]] = field(default_factory=dict)
    optimizer: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    stage_steps: dict[str, int] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)
    tensor_extras: dict[str, dict[str, Any]] = field(default_factory=dict)
    error: str | None = None   # a user error found on this rank: every rank raises it


def _json_ok(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def flatten(state: RankState, rank: int) -> tuple[dict[str, Tensor], RankSummary]:
    """This rank's DCP state dict (tensors only, detached) and its summary.

    A value that is neither a tensor nor JSON-serializable is reported in ``summary.error``
    (not raised here, so that every rank can raise it together instead of leaving the
    others waiting in a collective).
    """
    sd: dict[str, Tensor] = {}
    summ = RankSummary(rank)
    if state.writer:
        for name, t in state.model.items():
            sd[model_key(name)] = t.detach()
            summ.model[name] = TensorSpec.of(t).to_json()
        for version, tensors in state.stashed.items():
            summ.stash[int(version)] = list(tensors)
            for name, t in tensors.items():
                sd[stash_key(int(version), name)] = t.detach()
        for name, st in state.optimizer.items():
            entry: dict[str, dict[str, Any]] = {}
            for k, v in st.items():
                if isinstance(v, Tensor):
                    sd[optim_key(name, k)] = v.detach()
                    entry[k] = TensorSpec.of(v).to_json()
                elif _json_ok(v):
                    entry[k] = {"value": v}
                elif summ.error is None:
                    summ.error = (f"optimizer state {k!r} of parameter {name!r} is a {type(v).__name__}, neither a "
                                  f"tensor nor JSON-serializable; store it as a tensor or a number")
            summ.optimizer[name] = entry
        summ.stage_steps = {n: int(s) for n, s in state.stage_steps.items()}
    for k, v in state.extras.items():
        if isinstance(v, Tensor):
            sd[rank_key(rank, k)] = v.detach()
            summ.tensor_extras[k] = TensorSpec.of(v).to_json()
        elif _json_ok(v):
            summ.extras[k] = v
        elif summ.error is None:
            summ.error = (f"rank {rank}'s extra {k!r} is a {type(v).__name__}, neither a tensor nor "
                          f"JSON-serializable; store it as a tensor or convert it to lists and numbers")
    return sd, summ
