"""Compare schedules by time to a target accuracy: the library side of ``pipetrain compare``.

One *entry* per configuration: a schedule (``dp``, ``pipedream``, ``2bw``, ``flush``,
``gpipe``, ...) with its options, and with ``no_stashing`` an extra "pipedream (no stashing)"
entry (PipeDream's ablation: backward with the newest weights, docs/schedules.md). Every
entry is trained one after the other through :func:`pipetrain.run.train` with the same base
configuration (model, data, seed, batch size, optimizer, length, target), so the rows differ
only in the schedule::

    rows = compare(TrainConfig.of(model="mlp", data="digits", workers=2, target_accuracy=0.9),
                   ["dp", "pipedream", "flush"], no_stashing=True).rows

With a target and neither steps nor epochs, every entry trains until the target, at most
``max_epochs`` epochs (:func:`pipetrain.run.resolve.resolve_length`).

What each entry runs on ``N`` workers (:func:`entry_config`):

- a schedule that runs one stage on every worker (``dp``): ``N`` replicas of the whole model;
- a pipeline schedule: the stages of ``--plan`` / ``--config`` / ``--cut`` when given, else
  a straight pipeline of ``N`` stages (``1-1-...``, cut by balanced estimated compute), or,
  with ``auto_plan``, what the planner chooses for that schedule from a quick profile;
  a schedule with its own layout (``interleaved``: ``virtual_stages`` chunks per rank) keeps it;
- microbatches: the given count for schedules whose unit is the microbatch, else each
  schedule's default; schedule options go to the schedules that take them;
- evaluation: on real data, :data:`EVALS_PER_EPOCH` times an epoch unless ``eval_every`` or
  ``evals_per_epoch`` says, so that epochs and seconds to the target resolve to a tenth of
  an epoch rather than whole epochs.

Figures of a row (:class:`~pipetrain.metrics.CompareRow`): time, epochs (fractional) and
steps to the target (training time only: evaluation excluded), the last evaluation, the
training throughput, ``bytes_per_sample`` (the bytes all ranks sent: activations, gradients
and all-reduce traffic, divided by the samples trained), and apart from training the
evaluations (count, and their time where measured) and the configuration's wall seconds
(start-up, training and evaluation, measured here around ``train``).

An entry that cannot run (a schedule whose rules the options break, a worker failure) becomes
one :class:`Failure` line; the rows already run are kept and returned.
"""
from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import PipetrainError, RuntimeConfigError
from ..job.config import ParallelSection, TrainConfig
from ..job.result import RunResult
from ..job.settings import settings
from ..metrics import CompareRow, EvalResult, rows_to_json
from ..schedule import SCHEDULES, get_schedule

__all__ = ["CompareEntry", "Failure", "Comparison", "TrainFunction", "compare_entries", "entry_config", "row_of",
           "compare", "schedule_option_keys", "EVALS_PER_EPOCH"]

log = logging.getLogger("pipetrain.compare")

#: What trains one entry's configuration and returns its result: :func:`pipetrain.run.train`
#: (local processes; ``None`` under an outer torchrun), or
#: :func:`pipetrain.run.on_cluster.cluster_train`'s function (across emulated hosts).
TrainFunction = Callable[[TrainConfig], RunResult | None]


@dataclass(frozen=True)
class CompareEntry:
    """One configuration of a comparison: its row label, schedule and schedule options."""

    label: str
    schedule: str
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Failure:
    """An entry that did not run: its label and one line saying why."""

    label: str
    message: str


@dataclass
class Comparison:
    """The rows that ran (in order), the entries that failed, and each row's configuration."""

    rows: list[CompareRow] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    details: dict[str, dict[str, Any]] = field(default_factory=dict)   # label -> config, workers, steps...

    def to_json(self, **extra: Any) -> dict[str, Any]:
        """``{"rows": [...], "failed": [...], **extra}``; each row has the :data:`~pipetrain.metrics.ROW_KEYS`,
        its ``history`` and its configuration details (``config``, ``workers``, ``microbatches``...)."""
        out = rows_to_json(self.rows, **extra)
        for row, d in zip(self.rows, out["rows"]):
            d.update(self.details.get(row.schedule, {}))
        out["failed"] = [{"schedule": f.label, "error": f.message} for f in self.failures]
        return out


def schedule_option_keys() -> list[str]:
    """The flat keys of the schedule options (``vertical_sync``, ``stashing``, ``virtual_stages``)."""
    return [fl.key for _, fl in settings(ParallelSection) if fl.schedule_option]


#: Evaluations per epoch of real data an entry runs when neither ``eval_every`` nor
#: ``evals_per_epoch`` is given (``train``'s default is once an epoch).
EVALS_PER_EPOCH = 10

#: The schedule option whose ``False`` makes the extra "no stashing" entry.
NO_STASHING_OPTION = "stashing"


def compare_entries(schedules: Sequence[str], no_stashing: bool = False) -> list[CompareEntry]:
    """The entries of ``schedules`` in order; ``no_stashing`` adds, after each schedule that
    takes the ``stashing`` option (or at the end, for the first registry schedule that does,
    when none of ``schedules`` does), its ``stashing=False`` entry "NAME (no stashing)".

    Raises:
        ScheduleError: an unknown schedule name (the message lists the valid ones).
        RuntimeConfigError: no schedules, or one named twice.
    """
    names = [s.strip().lower() for s in schedules if s.strip()]
    if not names:
        raise RuntimeConfigError(f"--schedules needs at least one schedule, e.g. --schedules dp,pipedream,flush "
                                 f"(valid: {', '.join(SCHEDULES)})")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise RuntimeConfigError(f"--schedules names {', '.join(twice)} twice; name each schedule once")
    opt = NO_STASHING_OPTION
    entries: list[CompareEntry] = []
    added = False
    for n in names:
        spec = get_schedule(n)
        entries.append(CompareEntry(spec.name, spec.name))
        if no_stashing and opt in spec.options:
            entries.append(CompareEntry(f"{spec.name} (no stashing)", spec.name, {opt: False}))
            added = True
    if no_stashing and not added:
        spec = next(s for s in SCHEDULES.values() if opt in s.options)
        entries.append(CompareEntry(f"{spec.name} (no stashing)", spec.name, {opt: False}))
    return entries


def entry_config(base: TrainConfig, entry: CompareEntry, schedule_options: Mapping[str, Any] | None = None,
                 auto_plan: bool = False, microbatches: int | None = None) -> TrainConfig:
    """The configuration ``entry`` trains with (module docstring): ``base`` with the entry's
    schedule, its layout on ``base.parallel.workers`` workers, its microbatches and options.

    ``schedule_options`` (flat key -> value) are the options given for the comparison; each
    goes to the schedules that take it, the entry's own options win. ``microbatches`` (default
    ``base``'s) goes to the schedules whose unit is the microbatch; the others get their own.
    On real data, evaluation runs :data:`EVALS_PER_EPOCH` times an epoch unless ``base`` says.
    """
    spec = get_schedule(entry.schedule)
    par = base.parallel
    workers = par.workers
    if workers is None or workers < 1:
        raise RuntimeConfigError("compare needs --workers N (the workers every configuration runs on), e.g. "
                                 "--workers 2")
    values: dict[str, Any] = {"schedule": spec.name}
    given = {**dict(schedule_options or {}), **dict(entry.options)}
    for f, fl in settings(ParallelSection):
        if fl.schedule_option:
            v = given.get(fl.key)
            values[fl.key] = v if (v is not None and f.name in spec.options) else f.default
    layout_given = par.plan is not None or par.config is not None or par.cut is not None
    if spec.one_stage:
        values.update(plan=None, config=None, cut=None)
    elif not layout_given and spec.chunks_option is None and not auto_plan:
        values["config"] = "-".join(["1"] * workers) if workers > 1 else None
    m = microbatches if microbatches is not None else par.microbatches
    values["microbatches"] = m if spec.unit == "microbatch" else None
    ev = base.evaluation
    if not base.data.synthetic and ev.eval_every is None and ev.evals_per_epoch is None:
        values["evals_per_epoch"] = EVALS_PER_EPOCH
    return base.replace(**values)


def _bytes_per_sample(result: RunResult) -> float | None:
    samples = result.steps * result.batch_size
    if not result.bytes_sent or samples <= 0:
        return None
    return float(sum(result.bytes_sent)) / samples


def _max_epochs(result: RunResult) -> int | None:
    """The epoch limit of a run that trained until its target (its resolved configuration's)."""
    limit = (result.run.get("config") or {}).get("training", {}).get("max_epochs")
    return None if limit is None else int(limit)


def row_of(label: str, result: RunResult, run_seconds: float | None = None) -> CompareRow:
    """The comparison row of a finished run (:class:`~pipetrain.job.result.RunResult`);
    ``run_seconds``: the wall time of the whole run, where the caller measured it."""
    history = [EvalResult.from_dict(d) for d in (getattr(result, "eval_history", None) or [])]
    last = history[-1] if history else None
    final_loss = getattr(result, "eval_loss", None)
    if final_loss is None and last is not None:
        final_loss = last.loss
    return CompareRow(
        schedule=label, reached=bool(getattr(result, "reached", None)),
        time_to_accuracy=getattr(result, "time_to_accuracy", None),
        epochs_to_accuracy=getattr(result, "epochs_to_accuracy", None),
        steps_to_accuracy=getattr(result, "steps_to_accuracy", None),
        final_accuracy=getattr(result, "eval_accuracy", None),
        final_loss=final_loss,
        final_perplexity=getattr(result, "eval_perplexity", None),
        samples_per_second=float(result.samples_per_second),
        bytes_per_sample=_bytes_per_sample(result),
        history=history, train_seconds=float(result.seconds), run_seconds=run_seconds,
        max_epochs=_max_epochs(result))


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    first = text[0] if text else ""
    if isinstance(e, PipetrainError):
        return first
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _slug(label: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")


def compare(base: TrainConfig, schedules: Sequence[str], *, no_stashing: bool = False,
            schedule_options: Mapping[str, Any] | None = None, auto_plan: bool = False,
            microbatches: int | None = None,
            train: TrainFunction | None = None,
            on_start: Callable[[CompareEntry, TrainConfig], None] | None = None,
            on_row: Callable[[CompareRow], None] | None = None,
            on_failure: Callable[[Failure], None] | None = None) -> Comparison:
    """Train every entry of ``schedules`` one after the other (module docstring).

    Args:
        base: the shared configuration; ``base.parallel.workers`` is N. Its ``log_dir``, when
            set, gets one subdirectory per entry (``DIR/dp``, ``DIR/pipedream-no-stashing``).
        schedules: schedule names, in the order the rows appear.
        no_stashing: add the "pipedream (no stashing)" entry.
        schedule_options: options given for the comparison (flat keys), each passed to the
            schedules that take it.
        auto_plan: let the planner choose each pipeline's stages (default: a straight pipeline).
        microbatches: units per minibatch of the schedules whose unit is the microbatch
            (default: each schedule's own default).
        train: the function that trains each entry's configuration (:data:`TrainFunction`;
            default :func:`pipetrain.run.train`, local processes).
        on_start, on_row, on_failure: called as each entry starts, finishes, or fails.

    Returns:
        The :class:`Comparison`; an entry that fails is a :class:`Failure` and the next one runs.
        ``KeyboardInterrupt`` stops the comparison and returns the rows so far.
    """
    if train is None:
        from .launcher import train as train_fn
        train = train_fn
    result = Comparison()
    entries = compare_entries(schedules, no_stashing)
    log_dir = base.output.log_dir
    if not base.data.synthetic:
        # the data every row reads: a missing or broken data set fails once, not once per row
        from .resolve import resolve_data

        resolve_data(base)
    for entry in entries:
        try:
            cfg = entry_config(base, entry, schedule_options, auto_plan, microbatches)
            if log_dir is not None:
                cfg = cfg.replace(log_dir=str(Path(log_dir) / _slug(entry.label)))
            if on_start is not None:
                on_start(entry, cfg)
            t0 = time.perf_counter()
            run = train(cfg)
            seconds = time.perf_counter() - t0
            if run is None:
                raise RuntimeConfigError("compare runs its configurations itself; start it without torchrun")
        except KeyboardInterrupt:
            fail = Failure(entry.label, "interrupted")
            result.failures.append(fail)
            if on_failure is not None:
                on_failure(fail)
            break
        except Exception as e:  # noqa: BLE001 - one line per failed entry; the others still run
            log.debug("entry %s failed", entry.label, exc_info=True)
            fail = Failure(entry.label, _failure_message(e))
            result.failures.append(fail)
            if on_failure is not None:
                on_failure(fail)
            continue
        row = row_of(entry.label, run, seconds)
        result.rows.append(row)
        result.details[entry.label] = {
            "config": run.config, "workers": run.workers, "microbatches": run.microbatches, "steps": run.steps,
            "batch_size": run.batch_size, "epochs": getattr(run, "epochs", None), "seconds": run.seconds,
            "plan_source": run.plan_source}
        if on_row is not None:
            on_row(row)
    return result


def _failure_message(e: BaseException) -> str:
    from ..runtime.process.failures import WorkerFailure

    if isinstance(e, WorkerFailure):
        return e.message if e.user_error else str(e)
    return _one_line(e)

