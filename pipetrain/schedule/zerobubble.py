"""ZB-H1 zero-bubble 1F1B (Qi et al., ICLR'24): backward split into I and W.

``I`` computes the gradient with respect to the stage's input (what the previous stage
waits for) and ``W`` the gradient with respect to the weights (needed only by the step).
ZB-H1 keeps 1F1B's order of forwards and input-gradient backwards, but defers ``W``: stage
``k`` keeps up to ``k`` weight gradients pending and runs them in the drain, where 1F1B
leaves it waiting for the step. The first stage runs ``F I W F I W ...`` (its ``I`` is
empty when its inputs need no gradient, so its deferred ``W`` would delay the forwards the
next stage waits for); the last defers ``P-1``: its ``I`` sends each gradient back before
its ``W``, and the ``W``'s it keeps fill the drain while the earlier stages finish the last
units' backwards. With per-unit times ``F``, ``I = W = B/2`` the bubble shrinks from
1F1B's ``(P-1)(F+B)`` to about ``(P-1)(F+I-W)``. Simulated on the unit times traced from
the GPT's 2-stage runs (benchmarks/run.py's ``lm``, whose second stage computes 1.45x the
first's), this order takes 660 ms a minibatch, the first stage deferring instead 735,
1F1B 698. Per replica (routing as in flush)::

    depth forwards; then for each unit: I, W (if more than k pending), F (if any left);
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
