"""The records of a run's progress: one evaluation (:class:`EvalResult`) and one training log
point (:class:`TrainPoint`).

Both are plain frozen dataclasses without torch, so the comparison table, the plots and the
JSON output read them without importing torch. Their fields are the keys of the JSON lines in
``metrics.jsonl`` (see :mod:`pipetrain.metrics.logger`).

Where a run is (the clock of every record):

- ``step``: optimizer steps (minibatches) completed, counted from the start of training;
- ``samples``: training samples consumed so far (``step * batch_size`` for a fixed batch);
- ``epoch``: fractional epochs completed, ``samples / len(train_set)``: 1.0 at the end of the
  first epoch, 0.5 halfway through it (evaluating every N steps gives fractional epochs);
- ``wall_time``: seconds of training since the run started (see :class:`~pipetrain.metrics.clock.TrainClock`:
  the time spent evaluating is not counted, so time to accuracy measures training alone);
  an evaluation's own cost is its ``eval_seconds``, apart.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

#: What an evaluation measures: classification (accuracy over classes; also per token),
#: a language model (per-token loss, accuracy and perplexity), or regression (loss only).
TaskKind = Literal["classification", "language", "regression"]
TASK_KINDS: tuple[TaskKind, ...] = ("classification", "language", "regression")


@dataclass(frozen=True)
class EvalResult:
    """One evaluation of the whole eval split at one point of training.

    ``loss`` is the mean loss per target element (per sample for class labels, per token for
    token targets, per value for regression); ``accuracy`` the fraction of target elements
    whose argmax over the output's last dimension equals them (None for regression);
    ``perplexity`` is ``exp(loss)`` for language models, else None; ``task`` says which of
    these the evaluation measures. ``eval_samples`` counts
    the eval samples (batch rows) and ``eval_targets`` the target elements the means are over.
    ``eval_seconds`` is the wall time the evaluation itself took (outside ``wall_time``'s
    training clock); None where the caller did not measure it.
    """

    step: int
    epoch: float
    samples: int
    loss: float
    accuracy: float | None
    perplexity: float | None
    wall_time: float
    task: TaskKind = "classification"
    eval_samples: int = 0
    eval_targets: int = 0
    eval_seconds: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (every field; non-finite floats become None so the JSON stays valid)."""
        return {k: _json_number(v) for k, v in asdict(self).items()}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> EvalResult:
        """Inverse of :meth:`to_dict` (unknown keys such as a JSON line's ``kind`` are ignored)."""
        loss = d.get("loss")
        return EvalResult(
            step=int(d["step"]), epoch=float(d["epoch"]), samples=int(d.get("samples", 0)),
            loss=float("nan") if loss is None else float(loss), accuracy=_opt_float(d.get("accuracy")),
            perplexity=_opt_float(d.get("perplexity")), wall_time=float(d.get("wall_time", 0.0)),
            task=d.get("task", "classification"), eval_samples=int(d.get("eval_samples", 0)),
            eval_targets=int(d.get("eval_targets", 0)), eval_seconds=_opt_float(d.get("eval_seconds")))


@dataclass(frozen=True)
class TrainPoint:
    """One training log point: the loss of the step just finished and the recent throughput.

    ``loss`` is the minibatch's mean loss as the last stage computed it (None where the
    logging process does not hold the last stage); ``samples_per_second`` is measured over
    the steps since the previous log point; ``lr`` the learning rate of that step and
    ``accuracy`` the minibatch's training accuracy, where the caller knows them.
    """

    step: int
    epoch: float
    samples: int
    loss: float | None
    samples_per_second: float | None
    wall_time: float
    lr: float | None = None
    accuracy: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (non-finite floats become None)."""
        return {k: _json_number(v) for k, v in asdict(self).items()}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> TrainPoint:
        """Inverse of :meth:`to_dict` (e.g. a point sent from a worker to the driving process)."""
        return TrainPoint(step=int(d["step"]), epoch=float(d["epoch"]), samples=int(d.get("samples", 0)),
                          loss=_opt_float(d.get("loss")), samples_per_second=_opt_float(d.get("samples_per_second")),
                          wall_time=float(d.get("wall_time", 0.0)), lr=_opt_float(d.get("lr")),
                          accuracy=_opt_float(d.get("accuracy")))


def perplexity_of(loss: float) -> float:
    """``exp(loss)`` of a mean per-token cross entropy (natural log); inf where it overflows."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def _json_number(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _opt_float(v: Any) -> float | None:
    return None if v is None else float(v)
