"""Metrics of a training run: evaluation, time to a target, logs, progress, comparison.

The pieces, each in its own module, independent of the distributed runtime:

- :mod:`.records`: :class:`EvalResult` (one evaluation) and :class:`TrainPoint` (one training
  log point), torch-free records;
- :mod:`.accumulate`: :class:`EvalAccumulator`, exact sums over eval batches (independent of
  batching, mergeable over ranks);
- :mod:`.clock`: :class:`TrainClock`, training wall time that pauses during evaluation;
- :mod:`.target`: :class:`TargetTracker`, time/epochs/steps to a target accuracy or loss;
- :mod:`.logger`: :class:`MetricsLogger` (``metrics.jsonl`` and TensorBoard) and
  :func:`write_run_files` (``config.json``, ``plan.json``, ``schedule.txt``);
- :mod:`.progress`: :class:`Progress`, a tqdm bar or periodic log lines;
- :mod:`.compare`: :class:`CompareRow`, :func:`format_table`, :func:`rows_to_json`;
- :mod:`.plots`: :func:`write_plots` (matplotlib; imported on first use, not here).

A driving process uses them like this::

    tracker = TargetTracker(target_accuracy=0.9)
    clock = TrainClock()
    with MetricsLogger(log_dir) as mlog, Progress(total_steps, batch_size=b) as bar:
        for step in ...:
            ...
            bar.update(step, loss=loss)
            mlog.log_train(TrainPoint(step, step / steps_per_epoch, step * b, loss, sps, clock.elapsed()))
            if step % eval_every == 0:
                with clock.paused():
                    acc = EvalAccumulator()
                    for x, y in eval_batches:
                        acc.update(model(x), y)
                result = acc.result(step, step / steps_per_epoch, step * b, clock.elapsed())
                mlog.log_eval(result)
                bar.eval(result)
                if tracker.update(result):
                    break
    print(tracker.summary())
"""
from __future__ import annotations

from typing import Any

from .accumulate import EvalAccumulator, task_kind_of
from .clock import TrainClock
from .compare import ROW_KEYS, CompareRow, format_table, rows_to_json
from .logger import MetricsLogger, prepare_log_dir, read_metrics, write_run_files
from .progress import Progress
from .records import TASK_KINDS, EvalResult, TaskKind, TrainPoint
from .target import TargetTracker, validate_target_accuracy, validate_target_loss

__all__ = [
    "ROW_KEYS", "TASK_KINDS", "CompareRow", "EvalAccumulator", "EvalResult", "MetricsLogger", "Progress",
    "TargetTracker", "TaskKind", "TrainClock", "TrainPoint", "format_table", "prepare_log_dir", "read_metrics",
    "rows_to_json", "task_kind_of", "validate_target_accuracy",
    "validate_target_loss", "write_plots", "write_run_files",
]


def __getattr__(name: str) -> Any:
    # matplotlib loads only when plots are asked for: `from pipetrain.metrics import write_plots`.
    if name == "write_plots":
        from .plots import write_plots

        return write_plots
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
