"""pipetrain: pipeline-parallel DNN training (PipeDream, 2BW, Flush, GPipe, interleaved).

The data flow is model -> graph -> profile -> plan -> schedule -> simulate | run::

    import pipetrain as pt

    bundle = pt.get_model("mlp", batch_size=64)                  # model zoo, or your own module
    captured = pt.capture(bundle.model, bundle.example_inputs)   # LayerGraph + fx GraphModule
    prof = pt.profile_model(bundle)                              # per-layer costs
    p = pt.plan(prof, pt.parse_topology("4", "10Gbit"))          # stages and replicas
    spec = pt.get_schedule("pipedream")                          # what the schedule is (unit, options...)
    sched = spec.build(p.replicas, steps=8)                      # per-worker action lists
    result = pt.simulate(sched, pt.StageCosts.from_plan(p, prof))
    pt.train(pt.TrainConfig.of(model="mlp", data="digits", workers=2, config="1-1", schedule="pipedream", epochs=2))

Errors caused by user input are :class:`PipetrainError` (a ``ValueError``) with one line
that states the rule, the values and the fix.
"""
from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

from .errors import (
    CaptureError,
    ModelError,
    PipetrainError,
    PlanError,
    ProfileError,
    RuntimeConfigError,
    ScheduleError,
)
from .exports import lazy_exports

if TYPE_CHECKING:  # the names below are imported on first use (PEP 562)
    from .graph import CapturedModel, LayerGraph, LayerNode, TensorMeta, capture, run_node_by_node
    from .job import TrainConfig
    from .models import MODEL_NAMES, ModelBundle, get_model, load_model
    from .plan import (
        Level,
        Plan,
        PlanOptions,
        Stage,
        Topology,
        baselines,
        data_parallel_time,
        evaluate,
        parse_topology,
        plan,
        stage_memory,
    )
    from .profile import NodeProfile, Profile, format_profile_table, load_profile, profile_model, save_profile
    from .run import train
    from .runtime import WorkerFailure, replay_schedule, train_single_process
    from .schedule import (
        SCHEDULE_NAMES,
        SCHEDULES,
        Action,
        Event,
        Op,
        Schedule,
        ScheduleSpec,
        build_schedule,
        get_schedule,
        steady_state_throughput,
        steady_state_time_per_minibatch,
        validate,
        write_chrome_trace,
    )
    from .simulate import SimResult, StageCost, StageCosts, save_gantt, simulate, to_chrome_trace

#: Each public name and the submodule it is imported from, on first use: importing the
#: package imports none of them (the command line starts its fork server first).
_LAZY = {
    "CapturedModel": "graph",
    "LayerGraph": "graph",
    "LayerNode": "graph",
    "TensorMeta": "graph",
    "capture": "graph",
    "run_node_by_node": "graph",
    "TrainConfig": "job",
    "MODEL_NAMES": "models",
    "ModelBundle": "models",
    "get_model": "models",
    "load_model": "models",
    "Level": "plan",
    "Plan": "plan",
    "PlanOptions": "plan",
    "Stage": "plan",
    "Topology": "plan",
    "baselines": "plan",
    "data_parallel_time": "plan",
    "evaluate": "plan",
    "parse_topology": "plan",
    "plan": "plan",
    "stage_memory": "plan",
    "NodeProfile": "profile",
    "Profile": "profile",
    "format_profile_table": "profile",
    "load_profile": "profile",
    "profile_model": "profile",
    "save_profile": "profile",
    "train": "run",
    "WorkerFailure": "runtime",
    "replay_schedule": "runtime",
    "train_single_process": "runtime",
    "SCHEDULE_NAMES": "schedule",
    "SCHEDULES": "schedule",
    "Action": "schedule",
    "Event": "schedule",
    "Op": "schedule",
    "Schedule": "schedule",
    "ScheduleSpec": "schedule",
    "build_schedule": "schedule",
    "get_schedule": "schedule",
    "steady_state_throughput": "schedule",
    "steady_state_time_per_minibatch": "schedule",
    "validate": "schedule",
    "write_chrome_trace": "schedule",
    "SimResult": "simulate",
    "StageCost": "simulate",
    "StageCosts": "simulate",
    "save_gantt": "simulate",
    "simulate": "simulate",
    "to_chrome_trace": "simulate",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)


class _Package(types.ModuleType):
    """The package's public names win over its subpackages of the same name (``plan``,
    ``simulate``): importing ``pipetrain.plan`` does not rebind ``pipetrain.plan``, the function."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

__all__ = [
    "__version__",
    # errors
    "PipetrainError", "ModelError", "CaptureError", "ProfileError", "PlanError", "ScheduleError",
    "RuntimeConfigError",
    # model -> graph -> profile
    "MODEL_NAMES", "ModelBundle", "get_model", "load_model",
    "CapturedModel", "LayerGraph", "LayerNode", "TensorMeta", "capture", "run_node_by_node",
    "NodeProfile", "Profile", "profile_model", "load_profile", "save_profile", "format_profile_table",
    # plan
    "Level", "Topology", "Stage", "Plan", "PlanOptions", "parse_topology", "plan", "evaluate",
    "data_parallel_time", "baselines", "stage_memory",
    # schedule -> simulate | run
    "Action", "Op", "Schedule", "SCHEDULE_NAMES", "SCHEDULES", "ScheduleSpec", "get_schedule", "build_schedule",
    "validate", "Event", "write_chrome_trace", "steady_state_time_per_minibatch", "steady_state_throughput",
    "StageCost", "StageCosts", "SimResult", "simulate", "to_chrome_trace", "save_gantt",
    "TrainConfig", "WorkerFailure", "train", "train_single_process", "replay_schedule",
]
