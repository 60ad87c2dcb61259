"""Communication accounting: bytes per worker by kind, counted (runtime) and predicted (here).

One type, :class:`Traffic`, holds what one worker sends and receives, split by *kind*:

- ``activation``: forward messages, one per ``SEND_F``/``RECV_F`` action: every wire tensor
  crossing the cut for one unit (relayed skip connections and model inputs included);
- ``gradient``: backward messages, one per ``SEND_B``/``RECV_B``: the gradients of the cut's
  wires that need one (floating point and requiring grad);
- ``allreduce``: the gradient all-reduce of a replicated stage (one per ``ALLREDUCE`` action
  and flat buffer);
- ``control``: everything else the runtime's ``Comm`` puts on the wire: the unit count that
  rides in the last element of every all-reduce buffer, and the squared-norm all-reduce of
  global gradient clipping (one float64 per step index).

The runtime (:class:`pipetrain.runtime.comm.Comm`) counts these as it sends, and
:func:`predict_traffic` derives the same numbers from a schedule's actions and the bytes of
every cut, so the two are the same quantity: for a known plan they are equal, byte for byte.

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
- A parameter tied across stages (:class:`TiedBuffer`; ``runtime/tied.py``): every stage
  that reads it holds a copy, and at each ``STEP`` of such a stage its gradient is summed over
  every rank of every holding stage, one call of its own bytes per tie, as ``allreduce``
  (no count element: the collective carries the gradient only).
- Bytes per sample (:func:`bytes_per_sample`): the bytes *sent* over all workers, by kind,
  divided by the samples the counted actions trained (units x samples per unit).

Prediction from a plan and a profile (:func:`plan_cut_bytes`, :func:`plan_traffic`): a node's
``activation_bytes`` is its output for ``profile.batch_size`` samples, so one unit of ``u``
samples carries ``activation_bytes * u / batch_size``. The forward message of cut ``k`` holds
every node output produced at or before stage ``k`` and read after it (model inputs too); the
backward message the same minus the model inputs. This is exact when every crossing output
is floating point, needs a gradient and is proportional to the batch (an MLP, a CNN); an
integer tensor (token ids read by a later stage) carries no gradient in the runtime but is
counted here. A stage's all-reduce is its nodes' ``parameter_bytes`` in one float32 buffer:
exact when every parameter is trainable float32 and no stage holds buffers (batch norm).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import PlanError
from ..schedule.action import Op, Schedule

if TYPE_CHECKING:
    from ..profile.types import Profile
    from .types import Plan, Stage

__all__ = [
    "KINDS", "Traffic", "CutBytes", "ReduceBuffer", "TiedBuffer",
    "ring_allreduce_bytes", "predict_traffic", "bytes_per_sample",
    "total_traffic", "traffic_report", "schedule_units", "plan_cut_bytes", "plan_stage_param_bytes", "plan_traffic",
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
    """A trainable tensor tied across stages (``runtime/tied.py``): its gradient is summed over
    the ranks of every stage in ``stages`` at each ``STEP`` of each of them.

    Attributes:
        nbytes: the tensor's bytes (``numel * element_size``; the gradient has its dtype).
        stages: the stages holding a copy, ascending (two or more; one stage: no exchange).
    """

    nbytes: float
    stages: tuple[int, ...]


def _buffers(entry: float | Sequence[ReduceBuffer]) -> list[ReduceBuffer]:
    """A stage's all-reduce buffers: a number ``n`` is one float32 buffer (none if ``n == 0``)."""
    if isinstance(entry, (int, float)):
        ok = entry >= 0
        bufs = [ReduceBuffer(entry)] if entry > 0 else []
    else:
        bufs = list(entry)
        ok = all(b.gradient_bytes >= 0 and b.count_bytes >= 0 for b in bufs)
    if not ok:
        raise PlanError(f"parameter bytes must be >= 0, got {entry!r}; pass the stage's trainable parameter bytes")
    return bufs


def _check_sizes(schedule: Schedule, cut_bytes: Sequence[CutBytes],
                 stage_param_bytes: Sequence[float | Sequence[ReduceBuffer]],
                 tied: Sequence[TiedBuffer] = ()) -> None:
    if not isinstance(schedule, Schedule):
        raise PlanError(f"predict_traffic needs a Schedule, got {type(schedule).__name__}; build one with "
                        f"build_schedule('flush', [1, 1], 4, steps=2)")
    S = schedule.num_stages
    if len(cut_bytes) != max(S - 1, 0):
        raise PlanError(f"the schedule has {S} stages, so {max(S - 1, 0)} cuts, but {len(cut_bytes)} cut sizes were "
                        f"given; pass one CutBytes per cut")
    if len(stage_param_bytes) != S:
        raise PlanError(f"the schedule has {S} stages but {len(stage_param_bytes)} parameter sizes were given; pass "
                        f"one per stage (0 for a stage without trainable parameters)")
    for c in cut_bytes:
        if not (c.activation >= 0 and c.gradient >= 0):
            raise PlanError(f"cut sizes must be >= 0 bytes, got {c}; fix the sizes")
    for t in tied:
        if not (t.nbytes >= 0 and all(isinstance(k, int) and 0 <= k < S for k in t.stages)):
            raise PlanError(f"a tied buffer needs bytes >= 0 and stages in 0..{S - 1}, got {t}; pass the tensor's "
                            f"bytes and the stages that hold it")


def predict_traffic(schedule: Schedule, cut_bytes: Sequence[CutBytes],
                    stage_param_bytes: Sequence[float | Sequence[ReduceBuffer]], *,
                    global_clip: bool = False, tied: Sequence[TiedBuffer] = ()) -> dict[int, Traffic]:
    """The traffic of every rank of ``schedule``, from its actions (module docstring conventions).

    Args:
        schedule: a complete schedule (with SEND/RECV peers and ALLREDUCE actions).
        cut_bytes: ``cut_bytes[k]``: what one unit moves across cut ``k`` (``S - 1`` cuts).
        stage_param_bytes: per stage, the gradient bytes of its all-reduce: a number (one
            float32 buffer with a 4-byte count element; 0: no trainable parameters) or the
            list of its :class:`ReduceBuffer` (one per parameter dtype).
        global_clip: synchronous global gradient clipping: every rank sums an 8-byte norm over
            all ranks once per step index it steps.
        tied: tensors tied across stages (:class:`TiedBuffer`): at each ``STEP`` of a holding
            stage, one ``allreduce`` call of ``nbytes`` over the ranks of all holding stages.

    Returns:
        rank -> :class:`Traffic`, every rank present.

    Each ``kSEND_Fu>q`` moves ``cut_bytes[k].activation`` (``kRECV_Fu<p``: ``cut_bytes[k-1]``),
    each ``kSEND_Bu>p`` ``cut_bytes[k-1].gradient`` (``kRECV_Bu<q``: ``cut_bytes[k].gradient``),
    each ``kALLREDUCEs`` every buffer of stage ``k`` over ``len(stage_ranks[k])`` ranks, each
    ``kSTEPs`` every tie stage ``k`` holds over the ranks of its holding stages.
    """
    _check_sizes(schedule, cut_bytes, stage_param_bytes, tied)
    buffers = [_buffers(e) for e in stage_param_bytes]
    # stage -> (bytes, ranks of the tie's group) of every tie it holds (runtime/tied.py's groups)
    ties: dict[int, list[tuple[float, int]]] = {}
    for tb in tied:
        if len(set(tb.stages)) > 1:
            group = len({r for k in tb.stages for r in schedule.stage_ranks[k]})
            for k in sorted(set(tb.stages)):
                ties.setdefault(k, []).append((tb.nbytes, group))
    world = schedule.num_workers
    out: dict[int, Traffic] = {}
    for rank, actions in enumerate(schedule.workers):
        t = Traffic()
        step_indices: set[int] = set()
        for a in actions:
            if a.op in (Op.SEND_F, Op.SEND_B, Op.RECV_F, Op.RECV_B):
                if a.peer == rank:
                    continue
                if a.op is Op.SEND_F:
                    t.count_send("activation", cut_bytes[a.stage].activation)
                elif a.op is Op.RECV_F:
                    t.count_receive("activation", cut_bytes[a.stage - 1].activation)
                elif a.op is Op.SEND_B:
                    t.count_send("gradient", cut_bytes[a.stage - 1].gradient)
                else:
                    t.count_receive("gradient", cut_bytes[a.stage].gradient)
            elif a.op is Op.ALLREDUCE:
                r = len(schedule.stage_ranks[a.stage])
                for b in buffers[a.stage]:
                    t.count_collective("allreduce", b.gradient_bytes, r)
                    t.count_collective("control", b.count_bytes, r, calls=0)  # same call as the gradients
            elif a.op is Op.STEP:
                step_indices.add(a.mb)
                for nbytes, group in ties.get(a.stage, []):
                    t.count_collective("allreduce", nbytes, group)
        if global_clip and world > 1:
            for _ in step_indices:
                t.count_collective("control", CLIP_NORM_BYTES, world)
        out[rank] = t
    return out


def schedule_units(schedule: Schedule) -> int:
    """Units the schedule trains: the distinct units of its stage-0 forwards."""
    return len({a.mb for actions in schedule.workers for a in actions if a.op is Op.F and a.stage == 0})


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


# -- from a plan and a profile ----------------------------------------------------------
def _per_unit(nbytes: int, unit_samples: int, batch: int) -> float:
    """``nbytes * unit_samples / batch``, an int when exact."""
    q, r = divmod(nbytes * unit_samples, batch)
    return q if r == 0 else nbytes * unit_samples / batch


def _node_lists(stages: Plan | Sequence[Stage] | Sequence[Sequence[str]]) -> list[list[str]]:
    from .types import Plan, Stage

    if isinstance(stages, Plan):
        return [list(s.nodes) for s in stages.stages]
    return [list(s.nodes) if isinstance(s, Stage) else list(s) for s in stages]


def plan_cut_bytes(stages: Plan | Sequence[Stage] | Sequence[Sequence[str]], profile: Profile,
                   unit_samples: int) -> list[CutBytes]:
    """What one unit of ``unit_samples`` samples moves across every cut of ``stages``.

    ``stages``: a Plan, its stages, or their node lists. Model inputs not listed belong to
    stage 0. Relay: an output produced in stage ``i`` and last read in stage ``j`` crosses
    cuts ``i .. j-1``. Raises PlanError when the profile has no batch size or a node is in
    no stage.
    """
    lists = _node_lists(stages)
    batch = profile.batch_size
    if not batch:
        raise PlanError(f"profile of {profile.model!r} has no batch size, so bytes per sample are unknown; profile "
                        f"with a batch size (pipetrain profile --batch-size N)")
    if isinstance(unit_samples, bool) or not isinstance(unit_samples, int) or unit_samples < 1:
        raise PlanError(f"unit_samples must be an integer >= 1, got {unit_samples!r}; pass the batch size divided "
                        f"by the microbatches")
    where: dict[str, int] = {n: k for k, nodes in enumerate(lists) for n in nodes}
    for nd in profile.nodes:
        if nd.name not in where:
            if not nd.is_input:
                raise PlanError(f"profile node {nd.name!r} is in no stage of the plan; plan and profile disagree; use "
                                f"the profile the plan was made from")
            where[nd.name] = 0
    last_reader: dict[str, int] = {}
    for nd in profile.nodes:
        for src in dict.fromkeys(nd.inputs):
            last_reader[src] = max(last_reader.get(src, -1), where[nd.name])
    ncuts = max(len(lists) - 1, 0)
    act = [0] * ncuts
    grad = [0] * ncuts
    for nd in profile.nodes:
        for cut in range(where[nd.name], last_reader.get(nd.name, -1)):
            act[cut] += nd.activation_bytes
            if not nd.is_input:
                grad[cut] += nd.activation_bytes
    return [CutBytes(_per_unit(a, unit_samples, batch), _per_unit(g, unit_samples, batch)) for a, g in zip(act, grad)]


def plan_stage_param_bytes(stages: Plan | Sequence[Stage] | Sequence[Sequence[str]], profile: Profile) -> list[int]:
    """The parameter bytes of every stage (its nodes' ``parameter_bytes``; see the module docstring)."""
    lists = _node_lists(stages)
    known = set(profile.names)
    return [sum(profile[n].parameter_bytes for n in nodes if n in known) for nodes in lists]


def plan_traffic(plan: Plan, profile: Profile, schedule: Schedule, unit_samples: int | None = None, *,
                 global_clip: bool = False) -> dict[int, Traffic]:
    """:func:`predict_traffic` of ``schedule`` with the cut and parameter sizes of ``plan`` from ``profile``.

    ``unit_samples`` defaults to ``profile.batch_size // schedule.microbatches`` (the profile's
    minibatch cut into the schedule's units; the whole minibatch for pipedream).
    """
    if plan.num_stages != schedule.num_stages:
        raise PlanError(f"the plan has {plan.num_stages} stages but the schedule {schedule.num_stages}; build the "
                        f"schedule for the plan's stages")
    if unit_samples is None:
        if not profile.batch_size:
            raise PlanError(f"profile of {profile.model!r} has no batch size; pass unit_samples")
        unit_samples = max(1, profile.batch_size // max(1, schedule.microbatches))
    return predict_traffic(schedule, plan_cut_bytes(plan, profile, unit_samples),
                           plan_stage_param_bytes(plan, profile), global_clip=global_clip)
