"""GPipe: all forwards, then all backwards, then a flush (Huang et al., NeurIPS'19).

Per minibatch every stage runs the forwards of its ``m`` microbatches, then their backwards
in the same order, then steps. The bubble is ``(P-1)/(m+P-1)`` like PipeDream-Flush, but
every stage holds all ``m`` microbatches' activations at the turn. Versions: minibatch
``t`` uses version ``t``.
"""
from __future__ import annotations

from collections.abc import Sequence

from .action import Schedule
from .layout import all_f_all_b
from .sync import build_flushed


def _order(units: list[int], depth: int, stage: int, num_stages: int) -> list[tuple[str, int]]:
    return all_f_all_b(units)


def build_gpipe(replicas: Sequence[int], microbatches: int, steps: int) -> Schedule:
    """Compute-only GPipe schedule."""
    return build_flushed("gpipe", replicas, microbatches, steps, _order)
