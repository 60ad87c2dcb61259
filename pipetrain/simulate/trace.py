"""Chrome traces of simulated runs: the writer shared with the runtime, applied to a :class:`SimResult`.

The trace format, :class:`~pipetrain.schedule.events.Event` and the writer live in
:mod:`pipetrain.schedule.events` (the runtime writes measured traces with the same
:func:`~pipetrain.schedule.events.write_chrome_trace`); this module re-exports them and adds
:func:`to_chrome_trace` for a simulation result::

    save_trace(to_chrome_trace(result), "sim.json")
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..schedule.events import (  # noqa: F401  (re-exported)
    COMPUTE_TID,
    chrome_trace,
    save_trace,
    trace_event,
    trace_process_name,
    trace_thread_name,
    write_chrome_trace,
)
from .traffic import traffic_summary

if TYPE_CHECKING:
    from .engine import SimResult

__all__ = ["COMPUTE_TID", "chrome_trace", "save_trace", "to_chrome_trace", "trace_event", "trace_process_name",
           "trace_thread_name", "write_chrome_trace"]


def to_chrome_trace(result: SimResult) -> dict[str, Any]:
    """The simulated run as a Chrome trace dict (``{"traceEvents": [...], ...}``); ``otherData``
    carries the predicted traffic (:func:`~pipetrain.schedule.traffic.traffic_report`)."""
    return chrome_trace(result.events, schedule=result.schedule, measured=False, meta={
        "makespan_s": result.makespan, "bubble_fraction": result.bubble_fraction,
        "time_per_minibatch_s": result.time_per_minibatch,
        **traffic_summary(result.schedule, result.traffic, result.samples),
    })
