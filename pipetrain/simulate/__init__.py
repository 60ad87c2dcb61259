"""The simulator: execute a schedule's action lists with costs; traces and pictures.

``simulate(schedule, StageCosts) -> SimResult``; ``to_chrome_trace(result)`` and
``save_gantt(result, path)`` draw it. Its events are :class:`pipetrain.schedule.events.Event`
and its ``time_per_minibatch`` is the steady-state definition the runtime uses too. See
``docs/schedules.md`` for the definitions.
"""
from __future__ import annotations

from pathlib import Path

from ..schedule.events import Event  # noqa: F401
from .costs import MeasuredUnit, StageCost, StageCosts  # noqa: F401
from .engine import SimResult, simulate  # noqa: F401
from .trace import save_trace, to_chrome_trace, trace_event, trace_process_name, write_chrome_trace  # noqa: F401


def save_gantt(result: SimResult, path: str | Path, title: str | None = None, dpi: int = 150) -> Path:
    """Draw ``result`` as a Gantt chart (PNG or SVG by extension); imports matplotlib lazily.

    See :func:`pipetrain.simulate.gantt.save_gantt`.
    """
    from .gantt import save_gantt as _save

    return _save(result, path, title=title, dpi=dpi)


__all__ = ["StageCost", "StageCosts", "MeasuredUnit", "Event", "SimResult", "simulate", "to_chrome_trace",
           "trace_event", "trace_process_name", "save_trace", "save_gantt", "write_chrome_trace"]
