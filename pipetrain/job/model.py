"""The model a run trains, built the same way in every process.

:func:`load_bundle` makes the model from the seed (the same initial weights in every
process); :func:`build_stages` also captures it and cuts the captured graph into the run's
stage node lists: what every worker and the reference replay start from.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .config import TrainConfig
from .resolved import ResolvedRun

if TYPE_CHECKING:
    from ..graph.capture import CapturedModel
    from ..models.bundle import ModelBundle
    from ..stages.partition import Partition

__all__ = ["StagedModel", "build_stages", "load_bundle"]


def load_bundle(cfg: TrainConfig, unit_batch: int) -> Any:
    """The model bundle, initialised from ``seed`` (same weights in every process), with a
    unit-sized example batch (what the shapes of wire tensors are taken from)."""
    from ..models import load_model

    torch.manual_seed(cfg.training.seed)
    return load_model(cfg.model.name, batch_size=unit_batch, **cfg.model.options)


@dataclass(frozen=True)
class StagedModel:
    """A run's model, its capture, and the capture cut into the plan's stages.

    Attributes:
        bundle: the :class:`~pipetrain.models.ModelBundle` (from the seed, unit-sized example batch).
        captured: ``bundle.model`` captured (:func:`pipetrain.graph.capture`).
        partition: the captured graph's nodes assigned to the plan's stages
            (:func:`pipetrain.stages.partition.partition_graph`).
    """

    bundle: ModelBundle
    captured: CapturedModel
    partition: Partition


def build_stages(run: ResolvedRun) -> StagedModel:
    """Load a multi-worker run's model from the seed, capture it, cut it into its stages."""
    from ..graph.capture import capture
    from ..stages.partition import partition_graph

    bundle = load_bundle(run.config, run.unit_batch)
    captured = capture(bundle.model, bundle.example_inputs)
    return StagedModel(bundle, captured, partition_graph(captured.gm, run.stage_nodes))
