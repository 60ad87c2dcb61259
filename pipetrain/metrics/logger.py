"""Metrics on disk in ``--log-dir``: :class:`MetricsLogger` and :func:`write_run_files`.

A run's log directory holds:

    metrics.jsonl            one JSON object per line: every training log point
                             ({"kind": "train", ...TrainPoint fields}) and every evaluation
                             ({"kind": "eval", ...EvalResult fields, "samples_per_second"});
                             train and eval lines have kind, step, epoch, samples, loss, accuracy,
                             samples_per_second, wall_time and time (Unix seconds)
    events.out.tfevents.*    the same scalars for TensorBoard (train/loss,
                             train/samples_per_second, train/lr, eval/loss, eval/accuracy,
                             eval/perplexity; the x axis is the step)
    config.json, plan.json, schedule.txt   what ran (:func:`write_run_files`)

Every write is flushed to the operating system at once, so a run that fails later (an
exception, a killed worker, ``os._exit``) leaves every line written so far on disk. Only the
driving process (rank 0 or the logging rank) writes; the others write nothing.

TensorBoard event files need the ``tensorboard`` package (``torch.utils.tensorboard``); if it
cannot be imported the logger warns once through the ``pipetrain`` logger and keeps writing
the JSON lines.
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from ..errors import RuntimeConfigError
from .records import EvalResult, TrainPoint

log = logging.getLogger("pipetrain")

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"
PLAN_FILE = "plan.json"
SCHEDULE_FILE = "schedule.txt"


def prepare_log_dir(log_dir: str | os.PathLike[str]) -> Path:
    """Create ``log_dir`` (and its parents) and return it; a one-line RuntimeConfigError if
    it is a file or cannot be created."""
    path = Path(log_dir)
    if path.exists() and not path.is_dir():
        raise RuntimeConfigError(f"--log-dir {path} is a file; pass a directory (it is created if missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RuntimeConfigError(f"--log-dir {path} cannot be created ({e.strerror}); pass a writable directory") from e
    return path


def write_run_files(log_dir: str | os.PathLike[str], config: dict[str, Any], plan: dict[str, Any] | None,
                    schedule: str) -> list[Path]:
    """Write ``config.json``, ``plan.json`` and ``schedule.txt`` into ``log_dir``; returns
    the paths written. ``plan`` None (one process, no plan) writes no ``plan.json``. Values
    JSON cannot hold are written as their ``str``."""
    path = prepare_log_dir(log_dir)
    files = [(path / CONFIG_FILE, json.dumps(config, indent=2, default=str) + "\n")]
    if plan is not None:
        files.append((path / PLAN_FILE, json.dumps(plan, indent=2, default=str) + "\n"))
    files.append((path / SCHEDULE_FILE, schedule if schedule.endswith("\n") else schedule + "\n"))
    for p, text in files:
        p.write_text(text, encoding="utf-8")
    return [p for p, _ in files]


class MetricsLogger:
    """Writes training log points and evaluations as JSON lines and TensorBoard scalars.

    Args:
        log_dir: the directory (created if missing).
        tensorboard: also write TensorBoard event files (default True; skipped with one
            warning if ``tensorboard`` is not installed).
        append: append to an existing ``metrics.jsonl`` (a resumed run) instead of starting it
            afresh.

    Use as a context manager, or call :meth:`close`. Writing after close is an error.
    """

    def __init__(self, log_dir: str | os.PathLike[str], *, tensorboard: bool = True, append: bool = False) -> None:
        self.log_dir = prepare_log_dir(log_dir)
        self.path = self.log_dir / METRICS_FILE
        # Held open for the logger's lifetime; closed by close()/__exit__.
        self._file: IO[str] | None = open(self.path, "a" if append else "w", encoding="utf-8")  # noqa: SIM115
        self._tb: Any = _open_summary_writer(self.log_dir) if tensorboard else None

    @property
    def tensorboard(self) -> bool:
        """Whether TensorBoard event files are being written."""
        return self._tb is not None

    def log_train(self, point: TrainPoint) -> None:
        """One training log point: a ``"train"`` line and the train/* scalars."""
        self._write({"kind": "train", **point.to_dict()})
        self._scalars(point.step, {"train/loss": point.loss, "train/samples_per_second": point.samples_per_second,
                                   "train/lr": point.lr, "train/accuracy": point.accuracy})

    def log_eval(self, result: EvalResult, samples_per_second: float | None = None) -> None:
        """One evaluation: an ``"eval"`` line (with the training throughput up to it, if
        given) and the eval/* scalars."""
        self._write({"kind": "eval", **result.to_dict(), "samples_per_second": samples_per_second})
        self._scalars(result.step, {"eval/loss": result.loss, "eval/accuracy": result.accuracy,
                                    "eval/perplexity": result.perplexity, "eval/epoch": result.epoch})

    def log_event(self, kind: str, **fields: Any) -> None:
        """Any other line, e.g. ``log_event("target", reached=True, ...)`` at the end of a run."""
        self._write({"kind": kind, **fields})

    def _write(self, obj: dict[str, Any]) -> None:
        if self._file is None:
            raise RuntimeError(f"MetricsLogger for {self.path} is closed")
        obj = _finite(obj)
        obj.setdefault("time", time.time())
        self._file.write(json.dumps(obj, default=_json_default) + "\n")
        self._file.flush()  # to the OS: survives the process dying right after

    def _scalars(self, step: int, values: dict[str, float | None]) -> None:
        if self._tb is None:
            return
        for tag, v in values.items():
            if v is not None and math.isfinite(v):
                self._tb.add_scalar(tag, v, global_step=step)
        self._tb.flush()

    def close(self) -> None:
        """Flush and close both outputs (idempotent)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def read_metrics(log_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every line of ``log_dir/metrics.jsonl`` as dicts (a half-written last line is skipped)."""
    out: list[dict[str, Any]] = []
    with open(Path(log_dir) / METRICS_FILE, encoding="utf-8") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def _json_default(v: Any) -> Any:
    return str(v)


def _finite(v: Any) -> Any:
    """``v`` with every non-finite float (at any depth of dicts and lists) replaced by None:
    strict JSON has no NaN or Infinity."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


_warned_no_tensorboard = False


def _open_summary_writer(log_dir: Path) -> Any:
    """A ``torch.utils.tensorboard.SummaryWriter`` on ``log_dir``, or None (warned once per
    process) when the ``tensorboard`` package is missing."""
    global _warned_no_tensorboard
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        if not _warned_no_tensorboard:
            _warned_no_tensorboard = True
            log.warning("TensorBoard event files not written (%s); metrics.jsonl only. "
                        "pip install tensorboard to get them", e)
        return None
    return SummaryWriter(log_dir=str(log_dir))
