"""What activation recomputation and bf16 precision change in a profile, as the planner sees it.

A stage that recomputes (``Stage.recompute``, the runtime's ``--recompute``) keeps only its
input per unit in flight and runs its forward once more in the backward. In profile terms
(:func:`recompute_profile`), for each of its layers:

    backward_time  += forward_time        the recompute cost: one forward
    saved_bytes     = 0                    what it holds from forward to backward: nothing
                                           (the stage input stays: it is the cut before it)

so the memory model (:mod:`.stage_memory`) counts ``x / m`` per unit in flight instead of
``(a + x) / m``, and the cost model one more forward. The recompute's own graph lives only
inside one backward action (the runtime's tensor ledger does not count it either).

With ``--precision bf16`` (:func:`precision_profile`) every layer's output, what it saves
and so every cut's wire bytes are halved (float32 travels as bfloat16); model inputs (token
ids, images as given) are not. Times are left as profiled.
"""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace

from ..profile.types import NodeProfile, Profile

__all__ = ["WIRE_SCALE", "precision_profile", "recompute_profile"]

#: Wire (and activation) bytes per profiled float32 byte, by ``--precision``.
WIRE_SCALE: dict[str, float] = {"fp32": 1.0, "bf16": 0.5}


def _copy(profile: Profile, nodes: list[NodeProfile], **kw: object) -> Profile:
    return replace(profile, nodes=nodes, **kw)  # type: ignore[arg-type]


def recompute_profile(profile: Profile, names: Collection[str] | None = None) -> Profile:
    """``profile`` with the layers ``names`` (default: all) recomputing (module docstring)."""
    want = None if names is None else set(names)
    out = []
    for nd in profile.nodes:
        if nd.is_input or (want is not None and nd.name not in want):
            out.append(nd)
            continue
        out.append(replace(nd, backward_time=nd.backward_time + nd.forward_time, saved_bytes=0, saved_inputs=[],
                           output_saved=False))
    last = next((n.name for n in reversed(profile.nodes) if not n.is_input), None)
    loss = {} if want is not None and last not in want else {"loss_saved_bytes": 0, "loss_saves_output": False}
    return _copy(profile, out, **loss)


def precision_profile(profile: Profile, precision: str) -> Profile:
    """``profile`` with the bytes of ``precision`` (module docstring); fp32: unchanged."""
    scale = WIRE_SCALE[precision]
    if scale == 1.0:
        return profile
    out = []
    for nd in profile.nodes:
        if nd.is_input:
            out.append(nd)
            continue
        out.append(replace(nd, activation_bytes=int(nd.activation_bytes * scale),
                           saved_bytes=None if nd.saved_bytes is None else int(nd.saved_bytes * scale)))
    loss = profile.loss_saved_bytes
    return _copy(profile, out, loss_saved_bytes=None if loss is None else int(loss * scale))
