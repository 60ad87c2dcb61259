"""Chrome trace event format (viewable in Perfetto / chrome://tracing), shared with the runtime.

One process per worker (``pid`` = rank, named ``rank R (stage S)``); thread 0 holds its
compute (F, B, I, W, STEP, ALLREDUCE), threads 1, 2, ... its transfers (which overlap
compute and each other, so they are packed into as many rows as needed). Every slice is a
complete event (``"ph": "X"``) with ``ts`` and ``dur`` in microseconds, ``name`` the action
(``1F3``), ``cat`` ``compute`` or ``comm`` and ``args`` with stage, unit and version.

The runtime writes measured traces with the same :func:`trace_event` so that simulated and
measured runs open side by side::

    events = [trace_process_name(rank, "rank 0 (stage 0)"),
              trace_event(rank, "0F3", t0, t1, "compute", {"stage": 0, "unit": 3, "version": 1})]
    save_trace({"traceEvents": events}, "run.json")
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engine import SimResult

COMPUTE_TID = 0


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


def save_trace(trace: dict[str, Any], path: str | Path) -> None:
    """Write a trace dict as JSON."""
    Path(path).write_text(json.dumps(trace))


def to_chrome_trace(result: "SimResult") -> dict[str, Any]:
    """The simulated run as a Chrome trace dict (``{"traceEvents": [...], ...}``)."""
    s = result.schedule
    events: list[dict[str, Any]] = []
    for rank, tl in enumerate(result.timelines):
        stages = "/".join(str(k) for k in s.stages_of_rank(rank))
        events.append(trace_process_name(rank, f"rank {rank} (stage {stages})"))
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        events.append(trace_thread_name(rank, COMPUTE_TID, "compute"))
        lanes: list[float] = []  # end time of the last transfer in each comm row
        for e in tl:
            a = e.action
            args: dict[str, Any] = {"stage": a.stage, "unit": a.mb, "op": a.op.value}
            if a.version is not None:
                args["version"] = a.version
            if a.peer is not None:
                args["peer"] = a.peer
            if e.kind == "compute" or a.op.value == "ALLREDUCE":
                cat = "compute" if e.kind == "compute" else "comm"
                events.append(trace_event(rank, str(a), e.start, e.end, cat, args, tid=COMPUTE_TID))
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
                events.append(trace_thread_name(rank, i + 1, f"comm {i}"))
            events.append(trace_event(rank, str(a), e.start, e.end, "comm", args, tid=i + 1))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "schedule": s.name, "microbatches": s.microbatches, "steps": s.steps,
            "makespan_s": result.makespan, "bubble_fraction": result.bubble_fraction,
            "time_per_minibatch_s": result.time_per_minibatch,
        },
    }
