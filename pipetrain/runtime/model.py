"""The model a run trains, built the same way in every process."""
from __future__ import annotations

from typing import Any

import torch

from .config import TrainConfig

__all__ = ["load_bundle"]


def load_bundle(cfg: TrainConfig, unit_batch: int) -> Any:
    """The model bundle, initialised from ``seed`` (same weights in every process), with a
    unit-sized example batch (what the shapes of wire tensors are taken from)."""
    from ..models import load_model

    torch.manual_seed(cfg.training.seed)
    return load_model(cfg.model.name, batch_size=unit_batch, **cfg.model.options)
