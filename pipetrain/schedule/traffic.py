"""Communication accounting: what one worker puts on and takes off the wire, by kind.

The schedule's transfer and collective actions (``SEND_F``/``RECV_F``, ``SEND_B``/``RECV_B``,
``ALLREDUCE``, ``STEP`` of a tied parameter) are the wire; this module holds the one type that
counts them, :class:`Traffic`, split by *kind*:

- ``activation``: forward messages, one per ``SEND_F``/``RECV_F`` action: every wire tensor
  crossing the cut for one unit (relayed skip connections and model inputs included);
- ``gradient``: backward messages, one per ``SEND_B``/``RECV_B``: the gradients of the cut's
  wires that need one (floating point and requiring grad);
- ``allreduce``: the gradient all-reduce of a replicated stage (one per ``ALLREDUCE`` action
  and flat buffer);
- ``control``: everything else the runtime's ``Comm`` puts on the wire: the unit count that
  rides in the last element of every all-reduce buffer, and the squared-norm all-reduce of
  global gradient clipping (one float64 per step index).

The runtime (:class:`pipetrain.runtime.engine.comm.Comm`) counts these as it sends, and
:func:`pipetrain.plan.traffic.predict_traffic` derives the same numbers from a schedule's
actions and the bytes of every cut, so the two are the same quantity: for a known plan they
are equal, byte for byte.

Conventions (the runtime and the prediction both follow them):

- A point-to-point message counts at the sender in ``sent`` and at the receiver in
  ``received``, with the bytes of its tensors (``numel * element_size``, no headers). A
  transfer between two stages on the same rank (``peer == rank``) stays in memory and counts
  nothing. An empty message (a cut with no wire needing a gradient) counts nothing.
- A collective over ``r`` ranks on a buffer of ``n`` bytes counts, on every member, the bytes
  a ring all-reduce moves per rank (reduce-scatter then all-gather, ``r - 1`` chunks of
  ``n / r`` each)::

      ring_allreduce_bytes(n, r) = floor(2 (r - 1) n / r)          (0 when r = 1)

  in both ``sent`` and ``received`` (gloo's exact chunking differs by a few elements; this is
  the algorithmic figure the cost models use). The buffer itself is counted too, in
  ``reduced`` (``n`` per call), so both views exist.
- The all-reduce buffer of a replicated stage (one per parameter dtype) holds the gradients
  and, in its last element, the unit count: the gradient part counts as ``allreduce``
  (``ring(gradient bytes)``), the count element as ``control`` (``ring(element size)``).
  So ``allreduce`` is exactly the planner's quantity (the stage's parameter bytes).
- Messages: one per transfer action carrying bytes, one per collective call.
- A parameter tied across stages (:class:`TiedBuffer`; ``stages/tied.py``): every stage
  that reads it holds a copy, and at each ``STEP`` of such a stage its gradient is summed over
  every rank of every holding stage, one call of its own bytes per tie, as ``allreduce``
  (no count element: the collective carries the gradient only).
- Bytes per sample (:func:`bytes_per_sample`): the bytes *sent* over all workers, by kind,
  divided by the samples the counted actions trained (units x samples per unit).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import PlanError

__all__ = [
    "KINDS", "FLOAT32_BYTES", "CLIP_NORM_BYTES", "Traffic", "CutBytes", "ReduceBuffer", "TiedBuffer", "tie_ranks",
    "ring_allreduce_bytes", "total_traffic", "bytes_per_sample", "traffic_report",
]

#: The kinds of traffic, in report order.
KINDS: tuple[str, ...] = ("activation", "gradient", "allreduce", "control")

#: Bytes of the count element of a float32 all-reduce buffer.
FLOAT32_BYTES = 4
#: Bytes of the float64 squared norm that global gradient clipping sums over all ranks.
CLIP_NORM_BYTES = 8


def _zeros() -> dict[str, float]:
    return {k: 0 for k in KINDS}


def _counts() -> dict[str, int]:
    return {k: 0 for k in KINDS}


def ring_allreduce_bytes(nbytes: float, ranks: int) -> float:
    """Bytes each of ``ranks`` members sends (and receives) in a ring all-reduce of ``nbytes``.

    ``floor(2 (r - 1) nbytes / r)`` for an integer ``nbytes`` (so counts stay integers), the
    exact quotient for a float (the simulator's fractional per-unit sizes); 0 for one rank.
    """
    if ranks <= 1 or nbytes <= 0:
        return 0
    if isinstance(nbytes, int):
        return 2 * (ranks - 1) * nbytes // ranks
    return 2 * (ranks - 1) * nbytes / ranks


@dataclass
class Traffic:
    """What one worker put on and took off the wire, by kind (see the module docstring).

    Attributes:
        sent: kind -> bytes sent (collectives: the ring convention).
        received: kind -> bytes received (collectives: the ring convention).
        messages_sent: kind -> transfer actions sent (collectives: calls).
        messages_received: kind -> transfer actions received (collectives: calls).
        reduced: kind -> bytes of the buffers this worker entered into collectives
            (``allreduce``: gradients; ``control``: count elements and clipping norms).

    Every dict has every kind of :data:`KINDS`. Values are integers when counted by the
    runtime or predicted from integer sizes.
    """

    sent: dict[str, float] = field(default_factory=_zeros)
    received: dict[str, float] = field(default_factory=_zeros)
    messages_sent: dict[str, int] = field(default_factory=_counts)
    messages_received: dict[str, int] = field(default_factory=_counts)
    reduced: dict[str, float] = field(default_factory=_zeros)

    # -- counting ----------------------------------------------------------------------
    def count_send(self, kind: str, nbytes: float) -> None:
        """One point-to-point message of ``nbytes`` sent (nothing for an empty one)."""
        if nbytes > 0:
            self.sent[kind] += nbytes
            self.messages_sent[kind] += 1

    def count_receive(self, kind: str, nbytes: float) -> None:
        """One point-to-point message of ``nbytes`` received (nothing for an empty one)."""
        if nbytes > 0:
            self.received[kind] += nbytes
            self.messages_received[kind] += 1

    def count_collective(self, kind: str, nbytes: float, ranks: int, calls: int = 1) -> None:
        """A collective on a buffer of ``nbytes`` over ``ranks`` ranks (ring convention)."""
        if ranks <= 1 or nbytes <= 0:
            return
        ring = ring_allreduce_bytes(nbytes, ranks)
        self.sent[kind] += ring
        self.received[kind] += ring
        self.reduced[kind] += nbytes
        self.messages_sent[kind] += calls
        self.messages_received[kind] += calls

    # -- figures -----------------------------------------------------------------------
    @property
    def total_sent(self) -> float:
        """Bytes sent, all kinds."""
        return sum(self.sent.values())

    @property
    def total_received(self) -> float:
        """Bytes received, all kinds."""
        return sum(self.received.values())

    def _fields(self) -> tuple[str, ...]:
        return ("sent", "received", "messages_sent", "messages_received", "reduced")

    def copy(self) -> Traffic:
        return Traffic(*(dict(getattr(self, f)) for f in self._fields()))

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(*({k: getattr(self, f)[k] + getattr(other, f)[k] for k in KINDS} for f in self._fields()))

    def __sub__(self, other: Traffic) -> Traffic:
        """What was counted since ``other`` (a :meth:`copy` taken earlier): e.g. the timed segment."""
        return Traffic(*({k: getattr(self, f)[k] - getattr(other, f)[k] for k in KINDS} for f in self._fields()))

    def to_json(self) -> dict[str, Any]:
        """``{"sent": {kind: bytes}, "received": ..., "messages_sent": ..., "messages_received": ...,
        "reduced": ..., "total_sent": bytes, "total_received": bytes}``."""
        d: dict[str, Any] = {f: dict(getattr(self, f)) for f in self._fields()}
        d["total_sent"] = self.total_sent
        d["total_received"] = self.total_received
        return d

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> Traffic:
        """The inverse of :meth:`to_json` (totals are recomputed)."""
        t = Traffic()
        for f in t._fields():
            getattr(t, f).update({k: v for k, v in d.get(f, {}).items() if k in KINDS})
        return t


@dataclass(frozen=True)
class CutBytes:
    """Bytes one unit moves across one cut (stage ``k`` -> ``k+1``).

    Attributes:
        activation: the forward message (every wire tensor of the cut).
        gradient: the backward message (gradients of the wires that need one).
    """

    activation: float
    gradient: float


@dataclass(frozen=True)
class ReduceBuffer:
    """One flat buffer a replicated stage all-reduces at each ``ALLREDUCE``.

    Attributes:
        gradient_bytes: the stage's trainable parameters of the buffer's dtype.
        count_bytes: the element carrying the unit count (its dtype's size).
    """

    gradient_bytes: float
    count_bytes: float = FLOAT32_BYTES


@dataclass(frozen=True)
class TiedBuffer:
    """A trainable tensor tied across stages (``stages/tied.py``): its gradient is summed over
    the ranks of every stage in ``stages`` at each ``STEP`` of each of them.

    Attributes:
        nbytes: the tensor's bytes (``numel * element_size``; the gradient has its dtype).
        stages: the stages holding a copy, ascending (two or more; one stage: no exchange).
    """

    nbytes: float
    stages: tuple[int, ...]


def tie_ranks(stages: Iterable[int], stage_ranks: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The ranks of a tie's exchange, ascending: every replica of every stage holding it
    (``stage_ranks[k]``, ``Schedule.stage_ranks``); the runtime's group
    (``runtime/engine/tied_sync.py``) and the predictions' (traffic, simulator) are this one."""
    return tuple(sorted({r for k in stages for r in stage_ranks[k]}))


def total_traffic(traffic: Mapping[int, Traffic] | Iterable[Traffic]) -> Traffic:
    """The sum over workers."""
    values = traffic.values() if isinstance(traffic, Mapping) else traffic
    total = Traffic()
    for t in values:
        total = total + t
    return total


def bytes_per_sample(traffic: Mapping[int, Traffic] | Iterable[Traffic], samples: float) -> dict[str, float]:
    """Bytes sent over all workers per sample trained, by kind, plus ``"total"``.

    ``samples``: the samples the counted actions trained (e.g. ``schedule_units(s) * unit
    samples``, or ``batch_size * steps``).
    """
    if not samples > 0:
        raise PlanError(f"bytes per sample needs a positive number of samples, got {samples!r}; pass the samples "
                        f"the counted steps trained (batch size x steps)")
    total = total_traffic(traffic)
    out = {k: total.sent[k] / samples for k in KINDS}
    out["total"] = total.total_sent / samples
    return out


def traffic_report(traffic: Mapping[int, Traffic] | Sequence[Traffic], samples: float | None = None,
                   minibatches: float | None = None) -> dict[str, Any]:
    """The one JSON form of a run's traffic, predicted or measured (simulator summary, runtime
    ``--json``, trace ``otherData``)::

        {"traffic": [rank 0's Traffic.to_json(), ...],
         "bytes_per_sample": {kind: bytes, ..., "total": bytes} | None,     (None without samples)
         "bytes_per_minibatch": {kind: bytes, ..., "total": bytes} | None}  (None without minibatches)

    Per-sample and per-minibatch figures are bytes *sent*, summed over workers.
    """
    ranks = [traffic[r] for r in sorted(traffic)] if isinstance(traffic, Mapping) else list(traffic)
    return {
        "traffic": [t.to_json() for t in ranks],
        "bytes_per_sample": bytes_per_sample(ranks, samples) if samples else None,
        "bytes_per_minibatch": bytes_per_sample(ranks, minibatches) if minibatches else None,
    }
