"""Executed actions as events: one type, one trace writer, one steady-state figure.

The simulator predicts and the runtime measures the same thing: every action of every
worker's list with the interval it occupied. Both describe it with :class:`Event`, write it
with :func:`write_chrome_trace` and compute throughput with
:func:`steady_state_time_per_minibatch`, so a predicted and a measured figure are the same
quantity.

Steady state (the one definition). A run's first and last minibatches include the
pipeline's fill and drain; in a long run they happen once. For every (rank, stage) with
``n >= 2`` STEPs among the events, its rate is ``(n - 1) * (M / n)`` minibatches over the
time from the end of its first STEP to the end of its last, where ``M`` is the number of
minibatches the events cover (a PipeDream stage with ``r`` replicas steps ``M / r`` times,
each step covering ``r`` minibatches). The pipeline runs at its slowest rate::

    time_per_minibatch = max over (rank, stage) of  (end of last STEP - end of first STEP) / ((n - 1) * M / n)

``None`` when no (rank, stage) steps twice (then only the makespan is known).

Chrome trace (Perfetto / chrome://tracing): one process per worker (``pid`` = rank, named
``rank R (stage S)``); thread 0 holds its compute (F, B, I, W, STEP) and all-reduces,
threads 1, 2, ... its transfers (which overlap compute and each other, so they are packed
into as many rows as needed; zero-length transfers are left out). Every slice is a complete
event (``"ph": "X"``) with ``ts`` and ``dur`` in microseconds, ``name`` the action
(``1F3``), ``cat`` ``compute`` or ``comm`` and ``args`` with stage, unit, op, version and
peer. ``otherData`` holds the schedule, ``measured`` (runtime) or not (simulator), the
steady-state time per minibatch and the caller's ``meta``.
"""
from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .action import COMPUTE_OPS, Action, Op

if TYPE_CHECKING:
    from .action import Schedule

#: Thread id of a worker's compute row in a Chrome trace.
COMPUTE_TID = 0


@dataclass(frozen=True)
class Event:
    """One action executed by worker ``rank`` from ``start`` to ``end`` (seconds from the run's start).

    For a SEND, ``start``..``end`` is the transfer (it overlaps compute); for a RECV, the wait
    from reaching it to the data's arrival; for an ALLREDUCE, the collective.
    """

    rank: int
    action: Action
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def kind(self) -> str:
        """``"compute"`` for F, B, I, W and STEP (the worker is busy), else ``"comm"``."""
        return "compute" if self.action.op in COMPUTE_OPS or self.action.op is Op.STEP else "comm"


# -- the steady state --------------------------------------------------------------------
def steady_state_rates(events: Iterable[Event], minibatches: int) -> dict[tuple[int, int], float]:
    """Minibatches per second of every (rank, stage) with at least two STEPs (see the module docstring)."""
    ends: dict[tuple[int, int], list[float]] = defaultdict(list)
    for e in events:
        if e.action.op is Op.STEP:
            ends[(e.rank, e.action.stage)].append(e.end)
    out: dict[tuple[int, int], float] = {}
    for key, ts in ends.items():
        n = len(ts)
        first, last = min(ts), max(ts)
        if n >= 2 and last > first:
            out[key] = (n - 1) * (minibatches / n) / (last - first)
    return out


def steady_state_time_per_minibatch(events: Iterable[Event], minibatches: int) -> float | None:
    """Seconds per minibatch in the steady state: the slowest (rank, stage)'s, or ``None``."""
    rates = steady_state_rates(events, minibatches)
    return 1.0 / min(rates.values()) if rates else None


def steady_state_throughput(events: Iterable[Event], minibatches: int) -> float | None:
    """Minibatches per second in the steady state (``1 / time_per_minibatch``), or ``None``."""
    rates = steady_state_rates(events, minibatches)
    return min(rates.values()) if rates else None


# -- Chrome traces -----------------------------------------------------------------------
def trace_event(rank: int, name: str, start_s: float, end_s: float, cat: str,
                args: dict[str, Any] | None = None, tid: int | None = None) -> dict[str, Any]:
    """One complete ("X") event on worker ``rank``; times in seconds, written in microseconds.

    ``tid`` defaults to 0 for ``cat == "compute"`` and 1 otherwise.
    """
    if tid is None:
        tid = COMPUTE_TID if cat == "compute" else 1
    return {
        "name": name, "cat": cat, "ph": "X", "pid": int(rank), "tid": int(tid),
        "ts": start_s * 1e6, "dur": max(0.0, end_s - start_s) * 1e6, "args": dict(args or {}),
    }


def trace_process_name(rank: int, label: str) -> dict[str, Any]:
    """Metadata event naming worker ``rank``'s row (and sorting rows by rank)."""
    return {"name": "process_name", "ph": "M", "pid": int(rank), "tid": 0, "args": {"name": label}}


def trace_thread_name(rank: int, tid: int, label: str) -> dict[str, Any]:
    """Metadata event naming one thread row of a worker."""
    return {"name": "thread_name", "ph": "M", "pid": int(rank), "tid": int(tid), "args": {"name": label}}


def _action_args(a: Action) -> dict[str, Any]:
    args: dict[str, Any] = {"stage": a.stage, "unit": a.mb, "op": a.op.value}
    if a.version is not None:
        args["version"] = a.version
    if a.peer is not None:
        args["peer"] = a.peer
    return args


def chrome_trace(events: Iterable[Event], *, schedule: Schedule, measured: bool,
                 meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The events as a Chrome trace dict (``{"traceEvents": [...], "otherData": {...}}``).

    Args:
        events: any subset of a run's events (one rank's, or all ranks').
        schedule: the schedule they executed (names the ranks' stages; its ``steps`` is the
            number of minibatches for the steady state).
        measured: True for the runtime's wall-clock events, False for the simulator's.
        meta: extra figures for ``otherData`` (e.g. the makespan).
    """
    by_rank: dict[int, list[Event]] = defaultdict(list)
    for e in events:
        by_rank[e.rank].append(e)
    out: list[dict[str, Any]] = []
    for rank in sorted(by_rank):
        stages = "/".join(str(k) for k in schedule.stages_of_rank(rank))
        out.append(trace_process_name(rank, f"rank {rank} (stage {stages})"))
        out.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        out.append(trace_thread_name(rank, COMPUTE_TID, "compute"))
        lanes: list[float] = []  # end time of the last transfer in each comm row
        for e in sorted(by_rank[rank], key=lambda ev: ev.start):
            a = e.action
            if e.kind == "compute" or a.op is Op.ALLREDUCE:
                out.append(trace_event(rank, str(a), e.start, e.end, e.kind, _action_args(a), tid=COMPUTE_TID))
                continue
            if e.duration <= 0:
                continue
            for i, free in enumerate(lanes):
                if free <= e.start:
                    lanes[i] = e.end
                    break
            else:
                lanes.append(e.end)
                i = len(lanes) - 1
                out.append(trace_thread_name(rank, i + 1, f"comm {i}"))
            out.append(trace_event(rank, str(a), e.start, e.end, "comm", _action_args(a), tid=i + 1))
    all_events = [e for evs in by_rank.values() for e in evs]
    other: dict[str, Any] = {
        "schedule": schedule.name, "microbatches": schedule.microbatches, "steps": schedule.steps,
        "options": dict(schedule.options), "measured": bool(measured),
        "time_per_minibatch_s": steady_state_time_per_minibatch(all_events, schedule.steps),
    }
    other.update(meta or {})
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": other}


def save_trace(trace: Mapping[str, Any], path: str | Path) -> None:
    """Write a trace dict as JSON."""
    Path(path).write_text(json.dumps(trace))


def write_chrome_trace(events: Iterable[Event], path: str | Path, *, schedule: Schedule, measured: bool,
                       meta: Mapping[str, Any] | None = None) -> None:
    """Write :func:`chrome_trace` of ``events`` to ``path`` (JSON); see the module docstring."""
    save_trace(chrome_trace(events, schedule=schedule, measured=measured, meta=meta), path)
