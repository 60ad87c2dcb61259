"""pipetrain: pipeline-parallel DNN training (PipeDream, 2BW, Flush, GPipe, interleaved).

The data flow is model -> graph -> profile -> plan -> schedule -> simulate | run.
"""
from __future__ import annotations

__version__ = "0.1.0"

from .errors import (  # noqa: F401
    CaptureError, ModelError, PipetrainError, PlanError, ProfileError, RuntimeConfigError, ScheduleError,
)
from .graph.types import LayerGraph, LayerNode, TensorMeta  # noqa: F401
from .plan.types import Level, Plan, Stage, Topology  # noqa: F401
from .profile.types import NodeProfile, Profile  # noqa: F401
from .schedule.action import Action, Op, Schedule  # noqa: F401
