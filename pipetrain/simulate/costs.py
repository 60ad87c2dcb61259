"""What every action costs in the simulator: per-stage times and sizes, and the network.

:class:`StageCost` holds one stage's per-unit figures; :class:`StageCosts` holds them for
every stage plus the network (a flat bandwidth or a hierarchical :class:`Topology`). Two
constructors:

- :meth:`StageCosts.from_plan` (plan, profile, topology, units): a stage's time is the sum
  of its nodes' profiled times divided by ``units`` (profile times are for one minibatch of
  ``profile.batch_size`` samples; a microbatched schedule cuts it into ``units`` pieces, a
  PipeDream unit is the whole minibatch, ``units=1``). The bytes crossing the cut between
  stage ``k`` and ``k+1`` are the outputs of nodes at or before ``k`` read at or after
  ``k+1`` (relay: a skip connection crosses every cut on its way).
- :meth:`StageCosts.synthetic`: given forward and backward times per unit, no communication.

:class:`MeasuredUnit` is one stage's compute as its worker runs it (a rehearsal,
:mod:`pipetrain.runtime.rehearsal`); :meth:`StageCosts.with_measured` puts it in place of the
profile's sums: the runtime's own work around the graph (binding a weight version, the
fused gradient sinks, the numerics checks, the loss) and a zero-bubble backward's two
autograd passes are in it, and no profile holds them.

Times are seconds, sizes bytes, bandwidths bytes/second.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import PlanError, ProfileError
from ..plan.stage_memory import loss_held_bytes, node_held_bytes
from ..plan.types import Plan, Topology
from ..profile.types import Profile
from ..schedule.action import Op
from ..schedule.traffic import TiedBuffer


@dataclass(frozen=True)
class StageCost:
    """Per-unit costs of one stage.

    Attributes:
        forward_time: seconds of one unit's forward.
        backward_time: seconds of one unit's backward (I + W for zero-bubble schedules).
        activation_send_bytes: bytes this stage sends to the next per unit (crossing its cut).
        grad_send_bytes: bytes of input gradient this stage sends to the previous per unit.
        parameter_bytes: bytes of one copy of the stage's weights (one weight version).
        activation_bytes: bytes a replica holds per unit in flight (forward done, backward not).
        step_time: seconds of one optimizer step.
        optimizer_bytes: bytes of optimizer state (held once, besides the weights' gradient).
        weight_grad_fraction: share of ``backward_time`` that is the weight-gradient half W.
        data_bytes: bytes of input data the stage's worker keeps (cached minibatches), held throughout.
        gradient_bytes: bytes of the gradient accumulators held throughout (None:
            ``parameter_bytes``, every weight's). The runtime's persistent ones: fused ``Linear``
            sinks and the flat all-reduce buffers of replicated stages.
        transient_gradient_bytes: bytes of gradients held only from a group's first backward
            (B or W) to its STEP (the ones autograd returns, kept in the accumulator dict).
        kept_grad_bytes: bytes a zero-bubble I keeps for its W per unit (the gradients at the
            outputs of the layers holding weights), held from the end of I to the end of W.
        recompute_time: seconds of the forward a recomputing stage (``Stage.recompute``) runs
            again in each unit's first backward piece (B, or I), included in that action's time.
    """

    forward_time: float
    backward_time: float
    activation_send_bytes: float = 0.0
    grad_send_bytes: float = 0.0
    parameter_bytes: float = 0.0
    activation_bytes: float = 0.0
    step_time: float = 0.0
    optimizer_bytes: float = 0.0
    weight_grad_fraction: float = 0.5
    data_bytes: float = 0.0
    gradient_bytes: float | None = None
    kept_grad_bytes: float = 0.0
    transient_gradient_bytes: float = 0.0
    recompute_time: float = 0.0

    @property
    def gradient_held(self) -> float:
        """Bytes of the gradient accumulators (``gradient_bytes``, else one copy of the weights)."""
        return self.parameter_bytes if self.gradient_bytes is None else self.gradient_bytes

    def compute_time(self, op: Op) -> float:
        """Seconds of a compute action (F, B, I, W) or STEP of one unit at this stage."""
        if op is Op.F:
            return self.forward_time
        if op is Op.B:
            return self.backward_time + self.recompute_time
        if op is Op.I:
            return self.backward_time * (1.0 - self.weight_grad_fraction) + self.recompute_time
        if op is Op.W:
            return self.backward_time * self.weight_grad_fraction
        if op is Op.STEP:
            return self.step_time
        raise ValueError(f"{op} is not a compute action")


@dataclass(frozen=True)
class MeasuredUnit:
    """One stage's measured seconds per unit as its worker runs them: the forward (F), the
    whole backward (B) or its halves (I, W: zero-bubble), and one STEP; ``None``: not run
    (a backward is B or I + W, whichever the measured schedule runs)."""

    forward: float
    backward: float | None = None
    input: float | None = None
    weight: float | None = None
    step: float | None = None

    def __post_init__(self) -> None:
        values = [self.forward, self.backward, self.input, self.weight, self.step]
        if any(v is not None and not 0 <= v < math.inf for v in values):
            raise PlanError(f"a measured unit needs finite times >= 0, got {self}")
        if self.backward is None and (self.input is None or self.weight is None):
            raise PlanError(f"a measured unit needs its backward (B) or both halves (I and W), got {self}")

    def applied_to(self, cost: StageCost) -> StageCost:
        """``cost`` with this compute: the backward B, else I + W (its W share as measured
        when both halves are, else the profile's), this STEP where measured; a recomputing
        stage's forward is inside the measured backward already."""
        fraction = cost.weight_grad_fraction
        halves = (self.input or 0.0) + (self.weight or 0.0)
        if self.input is not None and self.weight is not None and halves > 0:
            fraction = self.weight / halves
        return replace(cost, forward_time=self.forward, backward_time=self.whole_backward,
                       weight_grad_fraction=fraction,
                       step_time=cost.step_time if self.step is None else self.step, recompute_time=0.0)

    @property
    def whole_backward(self) -> float:
        """The unit's backward seconds: B, else I + W."""
        return self.backward if self.backward is not None else (self.input or 0.0) + (self.weight or 0.0)

    @property
    def compute(self) -> float:
        """The unit's forward and backward seconds."""
        return self.forward + self.whole_backward

    def to_dict(self) -> dict[str, float | None]:
        return {"forward": self.forward, "backward": self.backward, "input": self.input, "weight": self.weight,
                "step": self.step}

    @staticmethod
    def from_dict(d: Any) -> MeasuredUnit:
        if not isinstance(d, dict) or not isinstance(d.get("forward"), (int, float)):
            raise ValueError(f"not a measured unit: {d!r}")

        def time(k: str) -> float | None:
            return None if d.get(k) is None else float(d[k])

        return MeasuredUnit(float(d["forward"]), time("backward"), time("input"), time("weight"), time("step"))


@dataclass
class StageCosts:
    """Costs of every stage plus the network.

    Attributes:
        stages: one :class:`StageCost` per schedule stage.
        bandwidth: bytes/s between any two ranks when ``topology`` is None.
        latency: seconds added to every transfer (and per ring step of an all-reduce).
        topology: if given, the bandwidth between two ranks is that of the innermost level
            whose group holds both (ranks laid out in order over the levels).
        lookahead: actions ahead of its RECV a receive buffer is posted (the runtime's
            ``--lookahead``): the memory model holds a buffer from then until the unit's backward ends.
        tied: tensors tied across stages (:class:`~pipetrain.schedule.traffic.TiedBuffer`,
            from :func:`pipetrain.stages.tied.tied_buffers`): the STEP of each holding stage
            all-reduces the tensor's gradient over the ranks of every holding stage
            (:mod:`pipetrain.runtime.engine.tied_sync`), so those STEPs meet.
    """

    stages: list[StageCost]
    bandwidth: float = math.inf
    latency: float = 0.0
    topology: Topology | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    lookahead: int = 8
    tied: tuple[TiedBuffer, ...] = ()

    def __len__(self) -> int:
        return len(self.stages)

    def __getitem__(self, stage: int) -> StageCost:
        return self.stages[stage]

    # -- network -----------------------------------------------------------------------
    def link_bandwidth(self, src: int, dst: int) -> float:
        """Bytes/s from rank ``src`` to rank ``dst``."""
        if src == dst:
            return math.inf
        if self.topology is None or not self.topology.levels:
            return self.bandwidth
        group = 1
        for level in self.topology.levels:
            group *= level.workers
            if src // group == dst // group:
                return level.bandwidth
        return self.topology.levels[-1].bandwidth

    def transfer_time(self, nbytes: float, src: int, dst: int) -> float:
        """Seconds to move ``nbytes`` from ``src`` to ``dst``: latency + bytes / bandwidth."""
        if nbytes <= 0:
            return 0.0
        return self.latency + nbytes / self.link_bandwidth(src, dst)

    def allreduce_time(self, stage: int, ranks: Sequence[int]) -> float:
        """Ring all-reduce of the stage's weights over ``ranks`` (:meth:`collective_time`)."""
        return self.collective_time(self.stages[stage].parameter_bytes, ranks)

    def collective_time(self, nbytes: float, ranks: Sequence[int]) -> float:
        """Ring all-reduce of ``nbytes`` over ``ranks``.

        Each rank sends and receives ``2 (r-1)/r`` of the bytes over the slowest ring link,
        in ``2 (r-1)`` latency-bound steps.
        """
        r = len(ranks)
        if r <= 1 or nbytes <= 0:
            return 0.0
        ring = list(ranks) + [ranks[0]]
        bw = min(self.link_bandwidth(a, b) for a, b in zip(ring, ring[1:]))
        return 2 * (r - 1) / r * nbytes / bw + 2 * (r - 1) * self.latency

    def with_measured(self, measured: Sequence[MeasuredUnit]) -> StageCosts:
        """These costs with every stage's compute as measured (one :class:`MeasuredUnit` per stage)."""
        if len(measured) != len(self.stages):
            raise PlanError(f"measured compute for {len(measured)} stages, the costs have {len(self.stages)}; "
                            f"measure every stage of the plan")
        return replace(self, stages=[m.applied_to(c) for m, c in zip(measured, self.stages)])

    # -- constructors ------------------------------------------------------------------
    @staticmethod
    def synthetic(num_stages: int, forward_time: float | Sequence[float], backward_time: float | Sequence[float],
                  step_time: float = 0.0, activation_bytes: float = 1.0, parameter_bytes: float = 1.0) -> StageCosts:
        """Costs with given per-unit times (a number for every stage, or one per stage) and no communication.

        ``activation_bytes`` and ``parameter_bytes`` default to 1 so that peak memory counts
        units in flight plus weight versions.
        """
        from ..errors import ScheduleError

        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
            raise ScheduleError(
                f"num_stages must be an integer >= 1, got {num_stages!r}; pass the schedule's stage count")
        _check_seconds(step_time, "step_time")
        for value, name in ((activation_bytes, "activation_bytes"), (parameter_bytes, "parameter_bytes")):
            _check_seconds(value, name, unit="bytes")
        fwd = _per_stage(forward_time, num_stages, "forward_time")
        bwd = _per_stage(backward_time, num_stages, "backward_time")
        stages = [StageCost(f, b, parameter_bytes=parameter_bytes, activation_bytes=activation_bytes,
                            step_time=step_time) for f, b in zip(fwd, bwd)]
        return StageCosts(stages)

    @staticmethod
    def from_plan(plan: Plan, profile: Profile, topology: Topology | None = None, units: int = 1,
                  step_time: float = 0.0, latency: float = 0.0,
                  fused_linear: bool = True, tied: Sequence[TiedBuffer] = ()) -> StageCosts:
        """Costs of the plan's stages from the profile, for units of ``1/units`` minibatch.

        Args:
            plan: the stages (node names) in pipeline order.
            profile: per-node times for one minibatch of ``profile.batch_size``, sizes in bytes.
            topology: the network; defaults to ``plan.topology`` (infinite bandwidth if none).
            units: units per minibatch (the microbatch count; 1 for pipedream).
            step_time: seconds of one optimizer step of a stage.
            latency: seconds added to every transfer.
            fused_linear: the runtime's ``--fused-grads`` (default): the gradients of ``Linear``
                layers (and of every weight of a replicated stage) live in persistent buffers;
                the others exist from a group's first backward to its STEP.
            tied: tensors tied across the plan's stages (:attr:`StageCosts.tied`).
        """
        _check_plan_inputs(plan, profile, units, step_time, latency)
        S = plan.num_stages
        # What a unit holds (plan/stage_memory.py): autograd's saved tensors, when the profile
        # measured them; else every node's output and the stage's input.
        stage_of = _stage_of(plan, profile)
        saved = node_held_bytes(profile) if profile.has_saved_bytes else None
        sums = _StageSums.of(profile, stage_of, S, saved, fused_linear)
        osb = profile.optimizer_state_bytes_per_parameter_byte
        if saved is not None and S:
            sums.held[S - 1] += loss_held_bytes(profile)
        stages = []
        for k in range(S):
            # without saved bytes the received input counts as held; with them, the receive
            # buffers are the simulator's communication pool (engine._memory)
            received = sums.cut_act[k - 1] if k > 0 and saved is None else 0.0
            persistent, transient = _gradient_split(sums.params[k], sums.linear[k], plan.stages[k].replicas,
                                                    profile.has_saved_bytes)
            rec = plan.stages[k].recompute  # holds only its input per unit, one more forward in B
            held = 0.0 if rec else sums.held[k]
            stages.append(StageCost(
                forward_time=sums.fwd[k] / units,
                backward_time=sums.bwd[k] / units,
                activation_send_bytes=(sums.cut_act[k] if k < S - 1 else 0.0) / units,
                grad_send_bytes=(sums.cut_grad[k - 1] if k > 0 else 0.0) / units,
                parameter_bytes=sums.params[k],
                activation_bytes=(held + received) / units,
                recompute_time=sums.fwd[k] / units if rec else 0.0,
                step_time=step_time,
                optimizer_bytes=sums.params[k] * osb,
                kept_grad_bytes=sums.kept[k] / units,
                gradient_bytes=persistent, transient_gradient_bytes=transient,
            ))
        topo = topology if topology is not None else plan.topology
        return StageCosts(stages, latency=latency, topology=topo, tied=tuple(tied),
                          extra={"units": units, "batch_size": profile.batch_size, "model": profile.model})

    def with_step_time(self, step_time: float) -> StageCosts:
        """A copy with every stage's optimizer step taking ``step_time`` seconds."""
        return replace(self, stages=[replace(s, step_time=step_time) for s in self.stages])


def _check_plan_inputs(plan: Plan, profile: Profile, units: int, step_time: float, latency: float) -> None:
    if isinstance(units, bool) or not isinstance(units, int) or units < 1:
        raise PlanError(
            f"units must be an integer >= 1 (got {units!r}); pass the number of microbatches per minibatch")
    if not isinstance(plan, Plan):
        raise PlanError(
            f"from_plan() needs a Plan, got {type(plan).__name__}; load one with Plan.load('plan.json')")
    if not isinstance(profile, Profile):
        raise ProfileError(
            f"from_plan() needs a Profile, got {type(profile).__name__}; load one with load_profile(path)")
    _check_seconds(step_time, "step_time")
    _check_seconds(latency, "latency")


def _stage_of(plan: Plan, profile: Profile) -> dict[str, int]:
    """Node name -> its stage; model inputs the plan does not list belong to stage 0. Raises
    when the plan and the profile name different nodes."""
    stage_of: dict[str, int] = {}
    for k, st in enumerate(plan.stages):
        for name in st.nodes:
            stage_of[name] = k
    known = set(profile.names)
    missing = [n for n in stage_of if n not in known]
    if missing:
        raise ProfileError(
            f"plan and profile disagree: plan nodes {missing[:5]} are not in the profile of {profile.model!r}; "
            f"simulate with the profile the plan was made from"
        )
    for node in profile.nodes:
        if node.name not in stage_of:
            if node.is_input:
                stage_of[node.name] = 0
            else:
                raise PlanError(
                    f"profile node {node.name!r} is in no stage of the plan; plan and profile disagree, "
                    f"use the profile the plan was made from"
                )
    return stage_of


@dataclass
class _StageSums:
    """Per-minibatch sums over every stage's nodes (``cut_*``: over every cut's crossing outputs)."""

    fwd: list[float]
    bwd: list[float]
    params: list[float]
    held: list[float]      # what a minibatch in flight holds (saved tensors, or node outputs)
    linear: list[float]    # weight bytes of Linear layers (fused gradient sinks)
    kept: list[float]      # zero-bubble: output bytes of the weight-holding layers, what I keeps for W
    cut_act: list[float]   # forward message of each cut (relay: an output crosses every cut to its last reader)
    cut_grad: list[float]  # backward message of each cut (no gradient for model inputs)

    @staticmethod
    def of(profile: Profile, stage_of: dict[str, int], S: int, saved: dict[str, float] | None,
           fused_linear: bool) -> _StageSums:
        ncuts = max(S - 1, 0)
        sums = _StageSums([0.0] * S, [0.0] * S, [0.0] * S, [0.0] * S, [0.0] * S, [0.0] * S,
                          [0.0] * ncuts, [0.0] * ncuts)
        last_reader: dict[str, int] = {}
        for node in profile.nodes:
            for src in node.inputs:
                last_reader[src] = max(last_reader.get(src, -1), stage_of[node.name])
        for node in profile.nodes:
            k = stage_of[node.name]
            if not node.is_input:
                sums.fwd[k] += node.forward_time
                sums.bwd[k] += node.backward_time
                sums.held[k] += node.activation_bytes if saved is None else saved[node.name]
                if node.parameter_bytes > 0 and k > 0:  # stage 0's I does nothing (no input gradient)
                    sums.kept[k] += node.activation_bytes
            sums.params[k] += node.parameter_bytes
            if fused_linear and node.kind == "module" and node.op.startswith("Linear("):
                sums.linear[k] += node.parameter_bytes
            for cut in range(k, last_reader.get(node.name, k)):
                sums.cut_act[cut] += node.activation_bytes
                if not node.is_input:
                    sums.cut_grad[cut] += node.activation_bytes
        return sums


def _gradient_split(params: float, linear: float, replicas: int, exact: bool) -> tuple[float | None, float]:
    """StageCost's ``gradient_bytes`` and ``transient_gradient_bytes``: every gradient persistent
    (a profile without saved bytes, or a replicated stage's flat buffers), else the Linear
    sinks persistent and the rest transient."""
    if not exact or replicas > 1:
        return None, 0.0
    return linear, params - linear


def _check_seconds(value: object, name: str, unit: str = "seconds") -> None:
    """Raise ScheduleError unless ``value`` is a finite real number >= 0."""
    from ..errors import ScheduleError

    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ScheduleError(f"{name} must be a finite number of {unit} >= 0, got {value!r}; pass e.g. 0 or 0.001")


def _per_stage(value: float | Sequence[float], n: int, name: str) -> list[float]:
    from ..errors import ScheduleError

    try:
        if isinstance(value, (int, float)):
            vals = [float(value)] * n
        else:
            vals = [float(v) for v in value]
            if len(vals) == 1:
                vals = vals * n
    except (TypeError, ValueError):
        raise ScheduleError(f"{name} must be a number of seconds or one per stage, got {value!r}; "
                            f"pass e.g. 1.0 or [1.0, 2.0]") from None
    if len(vals) != n:
        raise ScheduleError(f"{name} needs one value or one per stage ({n} stages), got {len(vals)}: {list(vals)}")
    if any(not 0 <= v < math.inf for v in vals):
        raise ScheduleError(f"{name} must be finite and >= 0 seconds, got {vals}; fix the times")
    return vals
