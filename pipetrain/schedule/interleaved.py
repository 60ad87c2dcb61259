"""Interleaved 1F1B (Narayanan et al., SC'21, Megatron-LM) with ``v`` virtual stages per rank.

The model is cut into ``P*v`` stages; stage ``k`` lives on rank ``k mod P``, so rank ``p``
holds the model chunks ``p, p+P, p+2P, ...``. Within a minibatch of ``m`` microbatches
(``m`` a multiple of ``P``), rank ``p`` runs ``m*v`` forwards and ``m*v`` backwards in
Megatron's order: the ``i``-th forward of a rank is chunk ``(i mod P*v) // P`` on microbatch
``(i // (P*v)) * P + i mod P`` (groups of ``P`` microbatches go through one chunk, then the
next); backwards visit the chunks in reverse. Rank ``p`` first runs

    warm-up = min((P - p - 1) * 2 + (v - 1) * P, m*v)

forwards (``P - p - 1`` for ``v = 1``, making it plain 1F1B), then alternates forward
``i + warm-up`` and backward ``i``, then drains, then flushes and steps every chunk. Each
chunk is ``1/v`` of a rank's work per microbatch, so the pipeline fills and drains in
``(P-1)`` chunk-times instead of ``(P-1)`` stage-times: the bubble is ``(P-1)/(v*m + P-1)``
of the makespan with per-chunk forward and backward times (tests check it), ``v`` times
smaller than 1F1B's ``(P-1)/(m+P-1)`` in bubble time.
Versions: minibatch ``t`` uses version ``t``.
"""
from __future__ import annotations

from collections.abc import Sequence

from ..errors import ScheduleError
from .action import Action, Op, Schedule
from .layout import check_replicas


def interleaved_order(ranks: int, virtual_stages: int, microbatches: int, rank: int) -> list[tuple[str, int, int]]:
    """Megatron's interleaved order of one rank within one minibatch: ``(op, chunk, microbatch)``."""
    P, v, m = ranks, virtual_stages, microbatches
    total = m * v

    def chunk_mb(i: int, forward: bool) -> tuple[int, int]:
        chunk = (i % (P * v)) // P
        if not forward:
            chunk = v - 1 - chunk
        return chunk, (i // (P * v)) * P + i % P

    # Megatron's depth; with one chunk per rank it is plain 1F1B's P - rank - 1.
    warmup = (P - rank - 1) * 2 + (v - 1) * P if v > 1 else P - rank - 1
    warmup = min(warmup, total)
    out: list[tuple[str, int, int]] = []
    for i in range(warmup):
        out.append(("F", *chunk_mb(i, True)))
    for i in range(total - warmup):
        out.append(("F", *chunk_mb(i + warmup, True)))
        out.append(("B", *chunk_mb(i, False)))
    for i in range(total - warmup, total):
        out.append(("B", *chunk_mb(i, False)))
    return out


def interleaved_ranks(replicas: Sequence[int], virtual_stages: int) -> int:
    """Ranks ``P`` of an interleaved pipeline of ``len(replicas)`` chunks, ``virtual_stages`` per rank.

    Raises :class:`ScheduleError` unless ``replicas`` is all 1, its length a multiple of
    ``virtual_stages`` and ``P >= 2``.
    """
    reps = check_replicas(replicas)
    v = virtual_stages
    if any(r != 1 for r in reps):
        raise ScheduleError(
            f"interleaved does not replicate stages: replicas must be all 1 (one per model chunk), got {reps}; "
            f"use replicas={[1] * len(reps)}"
        )
    if len(reps) % v:
        raise ScheduleError(
            f"interleaved puts virtual_stages={v} chunks on every rank, so the stage count must be a multiple of "
            f"{v}: got {len(reps)} stages; use {len(reps) // v * v or v} stages or another virtual_stages"
        )
    P = len(reps) // v
    if P < 2:
        raise ScheduleError(
            f"interleaved needs at least 2 ranks ({len(reps)} stages with virtual_stages={v} make {P} rank); "
            f"use flush or gpipe on one rank, or more stages"
        )
    return P


def check_interleaved_microbatches(ranks: int, microbatches: int) -> None:
    """Interleaved runs microbatches in groups of ``ranks``: ``microbatches`` must be a multiple of it."""
    P = ranks
    if microbatches % P:
        raise ScheduleError(
            f"interleaved runs microbatches in groups of P={P} ranks: microbatches={microbatches} is not a "
            f"multiple of {P}; use microbatches={(microbatches // P + 1) * P}"
        )


def build_interleaved(replicas: Sequence[int], microbatches: int, steps: int, virtual_stages: int = 2) -> Schedule:
    """Compute-only interleaved 1F1B: ``replicas`` is ``[1]*(P*v)``, one entry per model chunk."""
    v = int(virtual_stages)
    if v < 1:
        raise ScheduleError(f"interleaved needs virtual_stages >= 1 (got {v}); use virtual_stages=2")
    P = interleaved_ranks(replicas, v)
    if microbatches < 1 or steps < 1:
        raise ScheduleError(f"interleaved needs microbatches >= 1 and steps >= 1 (got {microbatches}, {steps})")
    check_interleaved_microbatches(P, microbatches)
    m = microbatches
    stage_ranks = [[k % P] for k in range(P * v)]
    workers: list[list[Action]] = [[] for _ in range(P)]
    for t in range(steps):
        for p in range(P):
            for op, chunk, i in interleaved_order(P, v, m, p):
                workers[p].append(Action(chunk * P + p, Op(op), t * m + i, version=t))
            for chunk in range(v):
                workers[p].append(Action(chunk * P + p, Op.STEP, t))
    return Schedule("interleaved", workers, stage_ranks, microbatches=m, steps=steps,
                    options={"virtual_stages": v})
