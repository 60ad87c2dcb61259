"""Schedules as data: builders by name, the communication pass and validation.

``build_schedule(name, replicas, microbatches, steps, **options)`` returns a complete
:class:`Schedule` (compute, transfers with peers, all-reduces, steps); ``validate`` dry-runs
it. See ``docs/schedules.md`` for every schedule's order and weight-version rule.
"""
from __future__ import annotations

from .action import COMM_OPS, COMPUTE_OPS, Action, Op, Schedule  # noqa: F401
from .comm import insert_comm, strip_comm, unit_ranks  # noqa: F401
from .dp import build_dp  # noqa: F401
from .flush import build_flush  # noqa: F401
from .gpipe import build_gpipe  # noqa: F401
from .interleaved import build_interleaved, interleaved_order  # noqa: F401
from .layout import stage_ranks_of, warmup_depth  # noqa: F401
from .pipedream import build_pipedream  # noqa: F401
from .registry import FLUSHED_SCHEDULES, SCHEDULE_NAMES, build_schedule  # noqa: F401
from .twobw import build_twobw  # noqa: F401
from .validate import check_structure, dry_run, validate  # noqa: F401
from .zerobubble import build_zerobubble  # noqa: F401

__all__ = [
    "Action", "Op", "Schedule", "COMPUTE_OPS", "COMM_OPS", "SCHEDULE_NAMES", "FLUSHED_SCHEDULES",
    "build_schedule", "validate", "check_structure", "dry_run", "insert_comm", "strip_comm", "unit_ranks",
    "build_pipedream", "build_twobw", "build_flush", "build_gpipe", "build_dp", "build_interleaved",
    "build_zerobubble", "interleaved_order", "stage_ranks_of", "warmup_depth",
]
