"""Schedules as data: builders by name, the communication pass and validation.

``get_schedule(name)`` returns the schedule's :class:`ScheduleSpec` (synchronous or not, its
unit, default microbatches, ranks a plan needs, options, version rule); every caller asks it
instead of comparing names. ``build_schedule(name, replicas, microbatches, steps, **options)``
(= ``get_schedule(name).build(...)``) returns a complete
:class:`Schedule` (compute, transfers with peers, all-reduces, steps); ``validate`` dry-runs
it. See ``docs/schedules.md`` for every schedule's order and weight-version rule.
"""
from __future__ import annotations

from .action import COMM_OPS, COMPUTE_OPS, Action, Op, Schedule  # noqa: F401
from .comm import insert_comm, strip_comm, unit_ranks  # noqa: F401
from .dp import build_dp  # noqa: F401
from .events import (  # noqa: F401
    Event,
    chrome_trace,
    steady_state_rates,
    steady_state_throughput,
    steady_state_time_per_minibatch,
    write_chrome_trace,
)
from .flush import build_flush  # noqa: F401
from .gpipe import build_gpipe  # noqa: F401
from .interleaved import build_interleaved, interleaved_order  # noqa: F401
from .layout import lcm, stage_ranks_of, warmup_depth  # noqa: F401
from .pipedream import build_pipedream  # noqa: F401
from .registry import (  # noqa: F401
    FLUSHED_SCHEDULES,
    SCHEDULE_NAMES,
    SCHEDULES,
    ScheduleSpec,
    build_schedule,
    get_schedule,
)
from .twobw import build_twobw  # noqa: F401
from .validate import check_structure, dry_run, validate  # noqa: F401
from .zerobubble import build_zerobubble  # noqa: F401

__all__ = [
    "Action", "Op", "Schedule", "COMPUTE_OPS", "COMM_OPS", "SCHEDULE_NAMES", "SCHEDULES", "FLUSHED_SCHEDULES",
    "ScheduleSpec", "get_schedule", "build_schedule", "lcm", "validate", "check_structure", "dry_run", "insert_comm",
    "strip_comm", "unit_ranks",
    "build_pipedream", "build_twobw", "build_flush", "build_gpipe", "build_dp", "build_interleaved",
    "build_zerobubble", "interleaved_order", "stage_ranks_of", "warmup_depth",
    "Event", "chrome_trace", "write_chrome_trace", "steady_state_rates", "steady_state_time_per_minibatch",
    "steady_state_throughput",
]
