"""The discrete-event simulator: execute a schedule's action lists with costs.

Every worker runs its list in order. Semantics (the same as the runtime's):

- F, B, I, W and STEP occupy the worker for their cost (:class:`StageCost`).
- A SEND does not block its worker: the transfer starts when the worker reaches it (or when
  the link from sender to receiver is free: transfers on one directed link are FIFO) and
  arrives ``latency + bytes/bandwidth`` later. Links are full duplex and independent.
- A RECV completes when its data has arrived (the runtime posts receives ahead); the worker
  waits until then.
- An ALLREDUCE starts when every replica of the stage reaches it and takes the ring
  all-reduce time of the stage's weights; every replica leaves it together.
- A STEP of a stage holding a tensor tied across stages (``costs.tied``) first takes part
  in one all-reduce per tie, in the ties' order (:mod:`pipetrain.runtime.engine.tied_sync`):
  each starts when every rank of every holding stage has reached its STEP of the same
  minibatch, takes the ring time of the tensor's bytes, and all leave it together; then the
  stage's own step. The STEP's event runs from the rank's arrival to the end of its step.

Events are processed in time order from a heap; if some worker can never proceed the
simulation raises the validator's "schedule deadlocks at ..." error with the marked grid.

Derived figures (see docs/schedules.md, "Simulator"):

- busy time: time in F/B/I/W/STEP (a tied STEP's exchanges included, as the runtime's trace
  records them); idle time = makespan - busy (waits, all-reduces).
- ``time_per_minibatch`` (and ``throughput = 1 / time_per_minibatch``): the one steady-state
  definition shared with the runtime (:func:`pipetrain.schedule.events.steady_state_time_per_minibatch`):
  the slowest (rank, stage)'s interval between its first and last STEP per minibatch; with
  fewer than two steps per stage, ``makespan / steps``. For a flushed schedule both equal
  the flush-to-flush period.
- ``bubble_fraction``: for schedules that flush (flush, gpipe, dp, interleaved, zerobubble)
  ``1 - sum(busy) / (workers * makespan)``. For those that do not (pipedream, 2bw), minibatch
  ``t`` *leaves* when its last backward at stage 0 ends; the steady window runs from the
  latest first backward of any worker to the earliest last forward of any worker (every
  worker is alternating 1F1B inside it), and over the middle half of the minibatches leaving
  inside it (whole periods of ``lcm(replicas)`` for a minibatch unit) the bubble is the idle
  share of all workers between the first and last of them (``steady_window``; None, and the
  flushed definition, when the run is too short).
- traffic per worker (:mod:`pipetrain.simulate.traffic`): bytes sent and received by kind
  (activation, gradient, allreduce, control) from the SEND and ALLREDUCE actions and the
  costs' per-unit sizes, by the conventions the runtime counts with (docs/traffic.md);
  ``bytes_per_sample`` in the summary when the costs know the batch size.
- peak memory per worker, the accounting of the runtime's tensor ledger
  (:mod:`pipetrain.runtime.guards.tensor_ledger`, docs/performance.md "Memory"): gradient
  accumulators held throughout (fused ``Linear`` sinks, flat all-reduce buffers) + optimizer
  state + cached input data, plus, over time, the other gradients (from a group's first
  backward to its STEP), live weight versions
  (a version lives from the step that makes it until it is superseded and no longer used)
  times the stage's weight bytes, units in flight (forward started, last backward piece not
  ended) times the stage's activation bytes (what autograd saves), and the receive buffers
  (a buffer from the post of its RECV, ``lookahead`` actions ahead, to the unit's backward
  end; the pool keeps the most ever in use of each message kind).
"""
from __future__ import annotations

import heapq
import math
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ScheduleError
from ..schedule.action import Action, Op, Schedule
from ..schedule.events import Event, steady_state_time_per_minibatch
from ..schedule.layout import lcm
from ..schedule.registry import SCHEDULES
from ..schedule.traffic import Traffic, tie_ranks
from ..schedule.validate import TransferKey, deadlock_error, transfer_key
from .costs import StageCosts
from .traffic import simulated_samples, simulated_traffic, traffic_summary

_COMPUTE = (Op.F, Op.B, Op.I, Op.W, Op.STEP)
_BACKWARD_END = (Op.B, Op.W)  # the piece after which a unit's activations are freed
_BACKWARD_START = (Op.B, Op.I)


@dataclass
class SimResult:
    """What :func:`simulate` returns. Times in seconds, memory in bytes."""

    schedule: Schedule
    timelines: list[list[Event]]  # timelines[rank]: that rank's events in list order
    makespan: float
    busy_time: list[float]
    idle_time: list[float]
    peak_memory: list[float]
    peak_in_flight: list[int]
    peak_versions: list[int]
    time_per_minibatch: float
    throughput: float
    bubble_fraction: float
    idle_fraction: float
    exit_times: list[float]
    steady_window: tuple[float, float] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    traffic: dict[int, Traffic] = field(default_factory=dict)  # rank -> predicted bytes by kind
    samples: float | None = None  # samples the schedule trains (None: the costs know no batch size)
    recompute_time: list[float] = field(default_factory=list)  # per rank: seconds of B/I recomputing forwards

    @property
    def num_workers(self) -> int:
        return len(self.timelines)

    @property
    def events(self) -> list[Event]:
        """Every rank's events, rank by rank (what :func:`~pipetrain.schedule.events.write_chrome_trace` takes)."""
        return [e for tl in self.timelines for e in tl]

    def summary(self) -> dict[str, Any]:
        """The figures as a JSON-ready dict (what ``pipetrain simulate --json`` prints)."""
        s = self.schedule
        return {
            "schedule": s.name,
            "stages": s.num_stages,
            "workers": s.num_workers,
            "replicas": [len(r) for r in s.stage_ranks],
            "microbatches": s.microbatches,
            "steps": s.steps,
            "options": dict(s.options),
            "makespan": self.makespan,
            "time_per_minibatch": self.time_per_minibatch,
            "throughput": self.throughput,
            "bubble_fraction": self.bubble_fraction,
            "idle_fraction": self.idle_fraction,
            "steady_state": self.steady_window is not None,
            "busy_time": list(self.busy_time),
            "idle_time": list(self.idle_time),
            "peak_memory": list(self.peak_memory),
            "peak_in_flight": list(self.peak_in_flight),
            "peak_versions": list(self.peak_versions),
            "recompute_time": list(self.recompute_time),
            **traffic_summary(s, self.traffic, self.samples),
        }


def simulate(schedule: Schedule, costs: StageCosts) -> SimResult:
    """Run ``schedule`` on ``costs`` and return timelines and figures (see module docstring)."""
    _check_inputs(schedule, costs)
    return _summarise(schedule, costs, _EventLoop(schedule, costs).run())


def _tie_exchanges(schedule: Schedule, costs: StageCosts) -> dict[int, list[tuple[int, tuple[int, ...], float]]]:
    """stage -> the ties it holds, in order: (tie index, ranks of every holding stage, bytes).

    Raises ScheduleError for a tie naming a stage the schedule lacks, and for one rank
    holding two stages that hold ties (their STEPs would enter the ties' all-reduces in an
    order that differs between ranks; the runtime refuses it, ``stages.tied.check_ties``).
    """
    S = schedule.num_stages
    out: dict[int, list[tuple[int, tuple[int, ...], float]]] = {}
    for i, tb in enumerate(costs.tied):
        stages = sorted(set(tb.stages))
        if not all(isinstance(k, int) and 0 <= k < S for k in stages) or not tb.nbytes >= 0:
            raise ScheduleError(f"tied tensor {i} needs bytes >= 0 and stages in 0..{S - 1}, got {tb}; pass "
                                f"stages.tied.tied_buffers of the plan that built the schedule")
        if len(stages) < 2:
            continue
        group = tie_ranks(stages, schedule.stage_ranks)
        for k in stages:
            out.setdefault(k, []).append((i, group, float(tb.nbytes)))
    holder: dict[int, int] = {}
    for k in sorted(out):
        for r in schedule.stage_ranks[k]:
            if holder.setdefault(r, k) != k:
                raise ScheduleError(f"rank {r} holds stages {holder[r]} and {k}, which both hold tied tensors; "
                                    f"tied tensors need their holders on different ranks (one stage per rank), "
                                    f"or put the tied readers in one stage")
    return out


def _check_inputs(schedule: Schedule, costs: StageCosts) -> None:
    if not isinstance(schedule, Schedule):
        raise ScheduleError(f"simulate() needs a Schedule, got {type(schedule).__name__}; "
                            f"build one with build_schedule('pipedream', [1, 1], steps=8)")
    if not isinstance(costs, StageCosts):
        raise ScheduleError(f"simulate() needs StageCosts, got {type(costs).__name__}; "
                            f"build them with StageCosts.from_plan(plan, profile) or StageCosts.synthetic(...)")
    if len(costs) != schedule.num_stages:
        raise ScheduleError(
            f"costs cover {len(costs)} stages but schedule {schedule.name!r} has {schedule.num_stages}; "
            f"build the costs for the schedule's stages"
        )


def _no_peer(r: int, pc: int, a: Action) -> ScheduleError:
    return ScheduleError(f"rank {r} action {pc} ({a.long}) has no peer; build schedules with "
                         f"build_schedule or insert_comm, which set every transfer's peer")


class _EventLoop:
    """The simulation's state: every rank's next action and clock, the messages in flight,
    each directed link's next free time and the all-reduces waiting for their group.

    Ranks are taken from a heap in clock order (ties: the order they were pushed); a rank
    that cannot proceed (a RECV before its message, an ALLREDUCE before its group) leaves the
    heap until the event it waits for pushes it back.
    """

    def __init__(self, schedule: Schedule, costs: StageCosts) -> None:
        W = schedule.num_workers
        self.schedule = schedule
        self.costs = costs
        self.lists = schedule.workers
        self.pcs = [0] * W
        self.clock = [0.0] * W
        self.timelines: list[list[Event]] = [[] for _ in range(W)]
        self.mailbox: dict[TransferKey, deque[float]] = defaultdict(deque)
        self.recv_waiting: dict[TransferKey, int] = {}
        self.link_free: dict[tuple[int, int], float] = defaultdict(float)
        self.ar_ready: dict[tuple[int, int], set[int]] = defaultdict(set)
        self.ties = _tie_exchanges(schedule, costs)
        # a rank inside a tied STEP: (exchanges done, arrival at the STEP); members of a tie's
        # all-reduce waiting for the rest, by (tie index, minibatch)
        self.in_step: dict[int, tuple[int, float]] = {}
        self.tie_ready: dict[tuple[int, int], set[int]] = defaultdict(set)
        self.heap: list[tuple[float, int, int]] = [(0.0, r, r) for r in range(W) if self.lists[r]]
        heapq.heapify(self.heap)
        self.seq = W

    def push(self, rank: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (self.clock[rank], self.seq, rank))

    def run(self) -> list[list[Event]]:
        """Every rank's events in list order; raises the validator's deadlock error if some
        rank can never proceed."""
        while self.heap:
            _, _, r = heapq.heappop(self.heap)
            if self.pcs[r] >= len(self.lists[r]):
                continue
            a = self.lists[r][self.pcs[r]]
            if a.op in _COMPUTE:
                self._compute(r, a)
            elif a.op in (Op.SEND_F, Op.SEND_B):
                self._send(r, a)
            elif a.op in (Op.RECV_F, Op.RECV_B):
                self._receive(r, a)
            elif a.op is Op.ALLREDUCE:
                self._allreduce(r, a)
            else:  # pragma: no cover - Op is closed
                raise ScheduleError(f"cannot simulate action {a.long}")
        self._check_finished()
        return self.timelines

    def _done(self, r: int, a: Action, start: float, end: float) -> None:
        """Rank ``r`` ran ``a`` from ``start`` to ``end``: record it, move on, requeue the rank."""
        self.timelines[r].append(Event(r, a, start, end))
        self.clock[r] = end
        self.pcs[r] += 1
        self.push(r)

    def _compute(self, r: int, a: Action) -> None:
        if a.op is Op.STEP and a.stage in self.ties:
            self._tied_step(r, a)
            return
        t = self.clock[r]
        self._done(r, a, t, t + self.costs[a.stage].compute_time(a.op))

    def _tied_step(self, r: int, a: Action) -> None:
        """STEP of a stage holding ties: each tie's all-reduce starts when every rank of its
        group has reached it and all leave it together; then the stage's step."""
        done, arrived = self.in_step.get(r, (0, self.clock[r]))
        exchanges = self.ties[a.stage]
        while done < len(exchanges):
            tie, group, nbytes = exchanges[done]
            ready = self.tie_ready[(tie, a.mb)]
            ready.add(r)
            self.in_step[r] = (done, arrived)
            if not all(g in ready for g in group):
                return  # the last member to arrive moves every member on
            end = max(self.clock[g] for g in group) + self.costs.collective_time(nbytes, group)
            del self.tie_ready[(tie, a.mb)]
            for g in group:
                g_done, g_arrived = self.in_step[g]
                self.in_step[g] = (g_done + 1, g_arrived)
                self.clock[g] = end
                if g != r:
                    self.push(g)
            done += 1
        del self.in_step[r]
        self._done(r, a, arrived, self.clock[r] + self.costs[a.stage].step_time)

    def _send(self, r: int, a: Action) -> None:
        """The transfer starts when the link is free and arrives ``latency + bytes/bandwidth``
        later; the sender moves on at once (its clock does not advance)."""
        t = self.clock[r]
        st = self.costs[a.stage]
        nbytes = st.activation_send_bytes if a.op is Op.SEND_F else st.grad_send_bytes
        if a.peer is None:
            raise _no_peer(r, self.pcs[r], a)
        dst = a.peer
        start = max(t, self.link_free[(r, dst)])
        dur = self.costs.transfer_time(nbytes, r, dst)
        serial = dur - (self.costs.latency if dur > 0 else 0.0)
        self.link_free[(r, dst)] = start + serial
        self.timelines[r].append(Event(r, a, start, start + dur))
        key = transfer_key(r, a)
        self.mailbox[key].append(start + dur)
        self.pcs[r] += 1
        self.push(r)
        if key in self.recv_waiting:
            self.push(self.recv_waiting.pop(key))

    def _receive(self, r: int, a: Action) -> None:
        if a.peer is None:
            raise _no_peer(r, self.pcs[r], a)
        key = transfer_key(r, a)
        if not self.mailbox[key]:
            self.recv_waiting[key] = r  # the matching SEND pushes this rank again
            return
        t = self.clock[r]
        self._done(r, a, t, max(t, self.mailbox[key].popleft()))

    def _allreduce(self, r: int, a: Action) -> None:
        """Starts when every replica of the stage has reached it; all leave it together."""
        group = self.schedule.stage_ranks[a.stage]
        ready = self.ar_ready[(a.stage, a.mb)]
        ready.add(r)
        if not all(g in ready for g in group):
            return
        start = max(self.clock[g] for g in group)
        end = start + self.costs.allreduce_time(a.stage, group)
        for g in group:
            ga = self.lists[g][self.pcs[g]]
            if ga != a:
                raise deadlock_error(self.schedule, self.pcs, {g: f"expected {a.long}"})
            self._done(g, ga, start, end)
        del self.ar_ready[(a.stage, a.mb)]

    def _check_finished(self) -> None:
        if all(pc >= len(self.lists[r]) for r, pc in enumerate(self.pcs)):
            return
        why = {}
        for r, pc in enumerate(self.pcs):
            if pc < len(self.lists[r]):
                a = self.lists[r][pc]
                if a.peer is not None and a.op in (Op.RECV_F, Op.RECV_B):
                    why[r] = f"waits for rank {a.peer}"
        raise deadlock_error(self.schedule, self.pcs, why)


def _summarise(schedule: Schedule, costs: StageCosts, timelines: list[list[Event]]) -> SimResult:
    W = schedule.num_workers
    makespan = max((e.end for tl in timelines for e in tl), default=0.0)
    busy = [sum(e.duration for e in tl if e.kind == "compute") for tl in timelines]
    idle = [makespan - b for b in busy]
    idle_fraction = 1.0 - sum(busy) / (W * makespan) if makespan > 0 else 0.0
    peak_mem, peak_inflight, peak_versions = _memory(schedule, costs, timelines, makespan)
    exits = _exit_times(schedule, timelines)
    # The one definition of steady-state throughput (schedule/events.py), shared with the
    # runtime; runs with fewer than two steps per stage fall back to makespan / steps.
    tpm = steady_state_time_per_minibatch((e for tl in timelines for e in tl), schedule.steps)
    if tpm is None:
        tpm = makespan / schedule.steps if schedule.steps else makespan
    bubble = idle_fraction
    window = None
    spec = SCHEDULES.get(schedule.name)
    if spec is not None and not spec.flushes:
        steady = _steady(schedule, timelines, exits)
        if steady is not None:
            bubble, window = steady
    return SimResult(
        schedule=schedule, timelines=timelines, makespan=makespan, busy_time=busy, idle_time=idle,
        peak_memory=peak_mem, peak_in_flight=peak_inflight, peak_versions=peak_versions,
        time_per_minibatch=tpm, throughput=(1.0 / tpm if tpm > 0 else math.inf),
        bubble_fraction=max(0.0, bubble), idle_fraction=max(0.0, idle_fraction), exit_times=exits,
        steady_window=window, traffic=simulated_traffic(schedule, costs),
        samples=simulated_samples(schedule, costs),
        recompute_time=[sum(costs[e.action.stage].recompute_time for e in tl if e.action.op in (Op.B, Op.I))
                        for tl in timelines],
    )


def _exit_times(schedule: Schedule, timelines: list[list[Event]]) -> list[float]:
    """When each minibatch leaves the pipeline: the end of its last backward piece at stage 0."""
    m = schedule.microbatches
    exits = [0.0] * schedule.steps
    for tl in timelines:
        for e in tl:
            a = e.action
            if a.stage == 0 and a.op in _BACKWARD_END:
                t = a.mb // m
                if t < len(exits):
                    exits[t] = max(exits[t], e.end)
    return exits


def _steady(schedule: Schedule, timelines: list[list[Event]],
            exits: list[float]) -> tuple[float, tuple[float, float]] | None:
    """(bubble fraction, window) over the steady state, or None if too short."""
    first_b, last_f = [], []
    for tl in timelines:
        bs = [e.start for e in tl if e.action.op in _BACKWARD_START]
        fs = [e.end for e in tl if e.action.op is Op.F]
        if not bs or not fs:
            return None
        first_b.append(min(bs))
        last_f.append(max(fs))
    lo_t, hi_t = max(first_b), min(last_f)
    inside = [t for t, x in enumerate(exits) if lo_t - 1e-12 <= x <= hi_t + 1e-12]
    if len(inside) < 2:
        return None
    # Whole periods of the routing: with r-way stages the departures repeat every lcm(r).
    spec = SCHEDULES.get(schedule.name)
    period = lcm(len(r) for r in schedule.stage_ranks) if spec is not None and spec.unit == "minibatch" else 1
    # The middle half of those departures, in whole periods (replicas may need a period or
    # two to fall into step); the whole range if that leaves no period.
    i0, i1 = inside[0], inside[-1]
    q = (i1 - i0) // 4
    lo, span = i0 + q, (i1 - i0 - 2 * q) // period * period
    if span == 0:
        lo, span = i0, (i1 - i0) // period * period
    if span == 0:
        return None
    hi = lo + span
    t0, t1 = exits[lo], exits[hi]
    if t1 <= t0:
        return None
    busy = 0.0
    for tl in timelines:
        for e in tl:
            if e.kind == "compute":
                busy += max(0.0, min(e.end, t1) - max(e.start, t0))
    bubble = 1.0 - busy / (len(timelines) * (t1 - t0))
    return bubble, (t0, t1)


def _memory(schedule: Schedule, costs: StageCosts, timelines: list[list[Event]],
            makespan: float) -> tuple[list[float], list[int], list[int]]:
    """Peak bytes, peak units in flight and peak live weight versions, per worker."""
    peaks_mem: list[float] = []
    peaks_units: list[int] = []
    peaks_versions: list[int] = []
    for rank, tl in enumerate(timelines):
        stages = schedule.stages_of_rank(rank)
        static = sum(costs[k].gradient_held + costs[k].optimizer_bytes + costs[k].data_bytes for k in stages)
        marks = _Marks.of(tl)
        deltas = (_unit_deltas(costs, marks, makespan) + _gradient_deltas(costs, stages, tl, makespan)
                  + _version_deltas(costs, stages, marks, makespan))
        pool = _pool_changes(costs, rank, tl, marks, makespan)
        peak_mem, peak_units, peak_v = _peaks(deltas, pool)
        peaks_mem.append(static + peak_mem)
        peaks_units.append(peak_units)
        peaks_versions.append(peak_v)
    return peaks_mem, peaks_units, peaks_versions


#: A change of a worker's memory at a time: (time, order, bytes, units, versions); order 0
#: (a release) sorts before 1 (an acquisition) at the same time.
_Delta = tuple[float, int, float, int, int]
#: A receive buffer taken (order 1) or given back (order 0): (time, order, message kind, bytes).
_PoolChange = tuple[float, int, tuple[int, int], float]


@dataclass
class _Marks:
    """When each unit's pieces ran on one worker, keyed by (stage, unit); versions by (stage, version)."""

    forward_start: dict[tuple[int, int], float] = field(default_factory=dict)
    backward_end: dict[tuple[int, int], float] = field(default_factory=dict)   # the last piece (B or W)
    input_grad_end: dict[tuple[int, int], float] = field(default_factory=dict)  # zero-bubble I
    step_end: dict[tuple[int, int], float] = field(default_factory=dict)
    last_use: dict[tuple[int, int], float] = field(default_factory=dict)       # a weight version's last read

    @staticmethod
    def of(tl: list[Event]) -> _Marks:
        m = _Marks()
        for e in tl:
            a = e.action
            if a.op is Op.F:
                m.forward_start[(a.stage, a.mb)] = e.start
            elif a.op in _BACKWARD_END:
                m.backward_end[(a.stage, a.mb)] = e.end
            if a.op is Op.I:
                m.input_grad_end[(a.stage, a.mb)] = e.end
            elif a.op is Op.STEP:
                m.step_end[(a.stage, a.mb)] = e.end
            if a.version is not None and a.op in (Op.F, Op.B, Op.I, Op.W):
                key = (a.stage, a.version)
                m.last_use[key] = max(m.last_use.get(key, 0.0), e.end)
        return m


def _unit_deltas(costs: StageCosts, marks: _Marks, makespan: float) -> list[_Delta]:
    """A unit's activations from its forward's start to its backward's end, and what a
    zero-bubble I keeps for its W from the end of I to the end of W."""
    deltas: list[_Delta] = []
    for (k, u), t0 in marks.forward_start.items():
        t1 = marks.backward_end.get((k, u), makespan)
        act = costs[k].activation_bytes
        deltas.append((t0, 1, act, 1, 0))
        deltas.append((t1, 0, -act, -1, 0))
        kept = costs[k].kept_grad_bytes
        if (k, u) in marks.input_grad_end and kept > 0:
            deltas.append((marks.input_grad_end[(k, u)], 1, kept, 0, 0))
            deltas.append((t1, 0, -kept, 0, 0))
    return deltas


def _gradient_deltas(costs: StageCosts, stages: Sequence[int], tl: list[Event], makespan: float) -> list[_Delta]:
    """The gradients autograd returns: held from a group's first backward to its STEP."""
    deltas: list[_Delta] = []
    for k in stages:
        grad = costs[k].transient_gradient_bytes
        if grad <= 0:
            continue
        held_since: float | None = None
        for e in tl:
            a = e.action
            if a.stage != k:
                continue
            if a.op in _BACKWARD_END and held_since is None:
                held_since = e.end
                deltas.append((e.end, 1, grad, 0, 0))
            elif a.op is Op.STEP and held_since is not None:
                deltas.append((e.end, 0, -grad, 0, 0))
                held_since = None
        if held_since is not None:
            deltas.append((makespan, 0, -grad, 0, 0))
    return deltas


def _version_deltas(costs: StageCosts, stages: Sequence[int], marks: _Marks, makespan: float) -> list[_Delta]:
    """A weight version lives from the step that makes it until it is superseded and no longer used."""
    deltas: list[_Delta] = []
    for k in stages:
        nsteps = sum(1 for (s, _) in marks.step_end if s == k)
        for v in range(nsteps + 1):
            born = 0.0 if v == 0 else marks.step_end[(k, v - 1)]
            superseded = marks.step_end.get((k, v), makespan)
            dies = max(superseded, marks.last_use.get((k, v), born))
            w = costs[k].parameter_bytes
            deltas.append((born, 1, w, 0, 1))
            deltas.append((dies, 0, -w, 0, -1))
    return deltas


def _pool_changes(costs: StageCosts, rank: int, tl: list[Event], marks: _Marks, makespan: float) -> list[_PoolChange]:
    """Receive buffers (comm's pool): a message's buffer is taken when its RECV is posted
    (``lookahead`` actions ahead) and given back when the unit's backward ends."""
    pool: list[_PoolChange] = []
    for j, e in enumerate(tl):
        a = e.action
        if a.op not in (Op.RECV_F, Op.RECV_B) or a.peer == rank:
            continue
        src = a.stage - 1 if a.op is Op.RECV_F else a.stage + 1
        if not 0 <= src < len(costs):
            continue
        nbytes = costs[src].activation_send_bytes if a.op is Op.RECV_F else costs[src].grad_send_bytes
        if nbytes <= 0:
            continue
        posted = tl[max(0, j - costs.lookahead)].start
        kind = (a.stage, 0 if a.op is Op.RECV_F else 1)
        pool.append((posted, 1, kind, nbytes))
        pool.append((marks.backward_end.get((a.stage, a.mb), makespan), 0, kind, nbytes))
    return pool


def _peaks(deltas: list[_Delta], pool: list[_PoolChange]) -> tuple[float, int, int]:
    """Peak bytes (the deltas plus the pool), units and versions over time. The pool never
    shrinks, so each kind of message holds the most buffers it ever had in use."""
    deltas = deltas + [(t, order, 0.0, 0, 0) for t, order, _, _ in pool]  # sample at every pool change
    changes = sorted(pool, key=lambda d: (d[0], d[1]))
    in_use: dict[tuple[int, int], int] = defaultdict(int)
    allocated: dict[tuple[int, int], int] = defaultdict(int)
    deltas.sort(key=lambda d: (d[0], d[1]))
    mem = peak_mem = comm = 0.0
    units = peak_units = versions = peak_v = 0
    ci = 0
    for t, order, b, n, v in deltas:
        while ci < len(changes) and (changes[ci][0], changes[ci][1]) <= (t, order):
            _, acq, kind, nbytes = changes[ci]
            in_use[kind] += 1 if acq else -1
            if in_use[kind] > allocated[kind]:
                allocated[kind] = in_use[kind]
                comm += nbytes
            ci += 1
        mem += b
        units += n
        versions += v
        peak_mem = max(peak_mem, mem + comm)
        peak_units = max(peak_units, units)
        peak_v = max(peak_v, versions)
    return peak_mem, peak_units, peak_v
