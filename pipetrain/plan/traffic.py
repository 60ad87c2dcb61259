"""Predicted communication: the bytes a schedule's actions put on the wire, per worker and kind.

:func:`predict_traffic` derives, from a schedule's actions and the bytes of every cut, the
same :class:`~pipetrain.schedule.traffic.Traffic` the runtime's ``Comm`` counts as it sends
(the kinds and conventions are :mod:`pipetrain.schedule.traffic`'s), so for a known plan the
prediction and the count are equal, byte for byte.

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

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..errors import PlanError
from ..schedule.action import Op, Schedule
from ..schedule.traffic import CLIP_NORM_BYTES, CutBytes, ReduceBuffer, TiedBuffer, Traffic, tie_ranks

if TYPE_CHECKING:
    from ..profile.types import Profile
    from .types import Plan, Stage

__all__ = ["predict_traffic", "schedule_units", "plan_cut_bytes", "plan_stage_param_bytes", "plan_traffic"]


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
    # stage -> (bytes, ranks of the tie's group) of every tie it holds (stages/tied.py's groups)
    ties: dict[int, list[tuple[float, int]]] = {}
    for tb in tied:
        if len(set(tb.stages)) > 1:
            group = len(tie_ranks(tb.stages, schedule.stage_ranks))
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
                   unit_samples: int, wire_scale: float = 1.0) -> list[CutBytes]:
    """What one unit of ``unit_samples`` samples moves across every cut of ``stages``.

    ``wire_scale``: the wire bytes of a layer's output per profiled byte (0.5 with
    ``--precision bf16``: float32 outputs travel as bfloat16; model inputs travel as they are).

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
        size = nd.activation_bytes if nd.is_input else int(nd.activation_bytes * wire_scale)
        for cut in range(where[nd.name], last_reader.get(nd.name, -1)):
            act[cut] += size
            if not nd.is_input:
                grad[cut] += size
    return [CutBytes(_per_unit(a, unit_samples, batch), _per_unit(g, unit_samples, batch)) for a, g in zip(act, grad)]


def plan_stage_param_bytes(stages: Plan | Sequence[Stage] | Sequence[Sequence[str]], profile: Profile) -> list[int]:
    """The parameter bytes of every stage (its nodes' ``parameter_bytes``; see the module docstring)."""
    lists = _node_lists(stages)
    known = set(profile.names)
    return [sum(profile[n].parameter_bytes for n in nodes if n in known) for nodes in lists]


def plan_traffic(plan: Plan, profile: Profile, schedule: Schedule, unit_samples: int | None = None, *,
                 global_clip: bool = False, wire_scale: float = 1.0,
                 tied: Sequence[TiedBuffer] = ()) -> dict[int, Traffic]:
    """:func:`predict_traffic` of ``schedule`` with the cut and parameter sizes of ``plan`` from ``profile``
    (``tied``: the tensors tied across its stages, as :func:`predict_traffic` takes them).

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
    return predict_traffic(schedule, plan_cut_bytes(plan, profile, unit_samples, wire_scale),
                           plan_stage_param_bytes(plan, profile), global_clip=global_clip, tied=tied)
