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
