"""ZB-H1 zero-bubble 1F1B (Qi et al., ICLR'24): backward split into I and W.

``I`` computes the gradient with respect to the stage's input (what the previous stage
waits for) and ``W`` the gradient with respect to the weights (needed only by the step).
ZB-H1 keeps 1F1B's order of forwards and input-gradient backwards, but defers ``W``: stage
``k`` of ``P`` keeps up to ``P-1-k`` weight gradients pending and runs them in the drain,
where 1F1B leaves the stage idle. The last stage runs ``F I W F I W ...``; the first defers
most. With per-unit times ``F``, ``I = W = B/2`` the bubble shrinks from 1F1B's
``(P-1)(F+B)`` to about ``(P-1)(F+I-W)``. Per replica (routing as in flush)::

    depth forwards; then for each unit: I, W (if more than P-1-k pending), F (if any left);
    then the pending W's.

Versions: minibatch ``t`` uses version ``t``; the flush and the step follow the last W.
"""
from __future__ import annotations

from collections.abc import Sequence

from .action import Schedule
from .layout import check_replicas
from .sync import build_flushed


def _order(units: list[int], depth: int, stage: int, num_stages: int) -> list[tuple[str, int]]:
    n = len(units)
    w = max(1, min(depth, n))
    defer = stage
    out: list[tuple[str, int]] = [("F", u) for u in units[:w]]
    next_f, next_w = w, 0
    for i in range(n):
        out.append(("I", units[i]))
        if i + 1 - next_w > defer:
            out.append(("W", units[next_w]))
            next_w += 1
        if next_f < n:
            out.append(("F", units[next_f]))
            next_f += 1
    out.extend(("W", u) for u in units[next_w:])
    return out


def build_zerobubble(replicas: Sequence[int], microbatches: int, steps: int) -> Schedule:
    """Compute-only ZB-H1 schedule (F, I, W, STEP)."""
    return build_flushed("zerobubble", check_replicas(replicas), microbatches, steps, _order)
