"""What a training run is: its configuration, its resolved decisions, its model and its result.

    settings     Flag, setting, settings          how a configuration field is declared
    parse        parse_config, parse_cut, ...     the parsers of --config, --cut, --option, --debug-fail
    config       TrainConfig and its sections     the typed configuration, checked
    data         DataSpec                         the real data set a run carries
    resolved     ResolvedRun, Segment             every decision of a run, made once
    segments     cut_at, segments_done, ...       segment ends, checkpoint points, resuming
    model        load_bundle, build_stages        the run's model, captured, cut into stages, materialised
    result       RunResult, RankReport            what a run reports

Nothing here imports the runtime, the launcher or the command line: they all read these.
"""
from __future__ import annotations

from .config import (
    SECTIONS,
    CheckpointSection,
    DataSection,
    DebugSection,
    EvaluationSection,
    LRSchedule,
    ModelSection,
    OptimizerConfig,
    OutputSection,
    ParallelSection,
    PerformanceSection,
    TrainConfig,
    TrainingSection,
)
from .data import DataSpec
from .model import StagedModel, build_stages, load_bundle
from .parse import DEBUG_FAIL_MODES, parse_config, parse_cut, parse_debug_fail, parse_model_option
from .resolved import ResolvedRun, Segment
from .result import RankReport, RunResult
from .segments import check_boundary, checkpoint_due, checkpoint_steps, cut_at, segments_done, stage_step_count
from .settings import Flag, setting, settings

__all__ = [
    "SECTIONS", "CheckpointSection", "DataSection", "DebugSection", "EvaluationSection", "LRSchedule", "ModelSection",
    "OptimizerConfig", "OutputSection", "ParallelSection", "PerformanceSection", "TrainConfig", "TrainingSection",
    "DataSpec", "StagedModel", "build_stages", "load_bundle",
    "DEBUG_FAIL_MODES", "parse_config", "parse_cut", "parse_debug_fail", "parse_model_option",
    "ResolvedRun", "Segment", "RankReport", "RunResult",
    "check_boundary", "checkpoint_due", "checkpoint_steps", "cut_at", "segments_done", "stage_step_count",
    "Flag", "setting", "settings",
]
