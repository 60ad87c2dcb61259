"""PipeDream-Flush: 1F1B within each minibatch, then a flush (Narayanan et al., ICML'21).

Per minibatch of ``m`` microbatches, stage ``k`` of ``P`` admits ``min(P-k, m)``
microbatches (the warm-up, ``P-k-1`` forwards, plus the first forward of the steady state),
then alternates one backward and one forward, drains, and steps. The first stage therefore
holds at most ``P`` microbatches' activations, against ``m`` for GPipe, with the same
bubble ``(P-1)/(m+P-1)``. The lists with P=3, m=4 (``schedule.grid()``; each ends with
a STEP)::

    rank 0 | 0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3
    rank 1 | 1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3
    rank 2 | 2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3

Replicated stages use the depth ``ceil(workers from stage k on / r_k)`` per replica.
Versions: minibatch ``t`` uses version ``t`` everywhere.
"""
from __future__ import annotations

from collections.abc import Sequence

from .action import Schedule
from .layout import one_f_one_b
from .sync import build_flushed


def _order(units: list[int], depth: int, stage: int, num_stages: int) -> list[tuple[str, int]]:
    return one_f_one_b(units, depth)


def build_flush(replicas: Sequence[int], microbatches: int, steps: int) -> Schedule:
    """Compute-only PipeDream-Flush schedule."""
    return build_flushed("flush", replicas, microbatches, steps, _order)
