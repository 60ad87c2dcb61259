"""Time to a target: :class:`TargetTracker` and the validation of ``--target-accuracy`` and
``--target-loss``.

The tracker is fed every :class:`~pipetrain.metrics.records.EvalResult` in order. The target
is *reached* at the first evaluation that meets every target given:

    accuracy >= target_accuracy      (a fraction in (0, 1]: 0.9 means 90 %)
    loss     <= target_loss          (mean loss per target element; for a language model
                                      exp(target_loss) is the target perplexity)

and time, epochs and steps to the target are that evaluation's ``wall_time``, ``epoch`` and
``step``; later evaluations never change them (the first crossing counts, as in the paper's
time-to-accuracy). Epochs are fractional where evaluation runs every N steps.

A run that trains until its target (neither ``--steps`` nor ``--epochs``) stops at the
first crossing or after ``--max-epochs`` epochs; :meth:`TargetTracker.summary` given that
limit says, in one line, that the limit ended the run.
"""
from __future__ import annotations

import math
from typing import Any

from ..errors import RuntimeConfigError
from .records import EvalResult


def validate_target_accuracy(value: float | None) -> float | None:
    """``value`` if it is a fraction in (0, 1] (or None); else a one-line RuntimeConfigError.

    Accuracy targets are fractions, not percent: 90 is refused with the hint to pass 0.9.
    """
    if value is None:
        return None
    v = float(value)
    if not math.isfinite(v) or v <= 0.0:
        raise RuntimeConfigError(f"--target-accuracy is a fraction in (0, 1], got {value}; pass e.g. 0.9 for 90%")
    if v > 1.0:
        hint = f"pass {_fmt(v / 100.0)} for {_fmt(v)}%" if v <= 100.0 else "pass e.g. 0.9 for 90%"
        raise RuntimeConfigError(f"--target-accuracy is a fraction in (0, 1], got {value}; {hint}")
    return v


def validate_target_loss(value: float | None) -> float | None:
    """``value`` if it is a finite number (or None); else a one-line RuntimeConfigError."""
    if value is None:
        return None
    v = float(value)
    if not math.isfinite(v):
        raise RuntimeConfigError(f"--target-loss must be a finite number, got {value}; pass e.g. 0.5")
    return v


class TargetTracker:
    """Follows the evaluations of one run and records the first that meets the target.

    Args:
        target_accuracy: a fraction in (0, 1], or None.
        target_loss: a finite loss, or None. With both given, both must be met at the same
            evaluation. With neither, the tracker only keeps the history and the best result
            (``reached`` stays False and the summary says no target was set).

    Attributes:
        history: every EvalResult fed, in order.
        reached_at: the first EvalResult that met the target, or None.
    """

    def __init__(self, target_accuracy: float | None = None, target_loss: float | None = None) -> None:
        self.target_accuracy = validate_target_accuracy(target_accuracy)
        self.target_loss = validate_target_loss(target_loss)
        self.history: list[EvalResult] = []
        self.reached_at: EvalResult | None = None

    @property
    def has_target(self) -> bool:
        """Whether any target was given."""
        return self.target_accuracy is not None or self.target_loss is not None

    def update(self, result: EvalResult) -> bool:
        """Record one evaluation; returns :attr:`reached` (True from the first crossing on), so a
        training loop can stop: ``if tracker.update(result): break``.

        Raises RuntimeConfigError if an accuracy target is set and the evaluation has no
        accuracy (a regression task): use a loss target there.
        """
        if self.target_accuracy is not None and result.accuracy is None:
            raise RuntimeConfigError(
                f"--target-accuracy {_fmt(self.target_accuracy)} needs a classification task, but this evaluation "
                f"measures no accuracy ({result.task}); use --target-loss instead")
        self.history.append(result)
        if self.reached_at is None and self.has_target and self._meets(result):
            self.reached_at = result
        return self.reached

    def _meets(self, r: EvalResult) -> bool:
        if self.target_accuracy is not None and not (r.accuracy is not None and r.accuracy >= self.target_accuracy):
            return False
        return self.target_loss is None or (math.isfinite(r.loss) and r.loss <= self.target_loss)

    @property
    def reached(self) -> bool:
        """Whether some evaluation met the target."""
        return self.reached_at is not None

    @property
    def time_to_target(self) -> float | None:
        """Training seconds at the first evaluation that met the target (None if never)."""
        return self.reached_at.wall_time if self.reached_at else None

    @property
    def epochs_to_target(self) -> float | None:
        """Epochs (fractional) at the first evaluation that met the target (None if never)."""
        return self.reached_at.epoch if self.reached_at else None

    @property
    def steps_to_target(self) -> int | None:
        """Optimizer steps at the first evaluation that met the target (None if never)."""
        return self.reached_at.step if self.reached_at else None

    @property
    def last(self) -> EvalResult | None:
        """The latest evaluation, or None before any."""
        return self.history[-1] if self.history else None

    @property
    def ranks_by_accuracy(self) -> bool:
        """Whether "best" means highest accuracy (an accuracy target, or a classifier without
        a loss target) rather than lowest loss (a loss target, language models, regression)."""
        if self.target_accuracy is not None:
            return True
        return self.target_loss is None and bool(self.history) and self.history[0].task == "classification"

    @property
    def best(self) -> EvalResult | None:
        """The best evaluation so far (see :attr:`ranks_by_accuracy`; ties: lower loss, then
        the earlier)."""
        if not self.history:
            return None
        by_accuracy = self.ranks_by_accuracy

        def key(r: EvalResult) -> tuple[float, float]:
            loss = r.loss if math.isfinite(r.loss) else math.inf
            if by_accuracy:
                return (-(r.accuracy if r.accuracy is not None else -math.inf), loss)
            return (loss, 0.0)
        return min(self.history, key=key)  # min keeps the earliest of equals

    def describe_target(self) -> str:
        """``"target accuracy 0.95"``, ``"target loss 1.2"``, both joined by "and", or ``"no target"``."""
        parts = []
        if self.target_accuracy is not None:
            parts.append(f"accuracy {_fmt(self.target_accuracy)}")
        if self.target_loss is not None:
            parts.append(f"loss {_fmt(self.target_loss)}")
        return "target " + " and ".join(parts) if parts else "no target"

    def summary(self, epochs: float | None = None, max_epochs: int | None = None) -> str:
        """One line for the end of the run, e.g.

        ``target accuracy 0.95 reached at epoch 3 (step 300, 41.2 s): accuracy 0.9512, loss 0.16``
        ``target accuracy 0.95 not reached in 5 epochs (best 0.91 at epoch 4)``
        ``target loss 1.1 not reached in 5 epochs (best loss 1.24 (perplexity 3.456) at epoch 5)``
        ``target accuracy 0.99 not reached in 1 epoch, the --max-epochs 1 limit (best 0.95 at epoch 0.91); pass a
        larger --max-epochs to train longer``

        ``epochs``: the epochs trained (default: the last evaluation's epoch); ``max_epochs``:
        the limit of a run that trains until its target (None: the run's length was fixed).
        """
        last, best = self.last, self.best
        if last is None or best is None:
            return f"{self.describe_target()}: no evaluation ran"
        if self.reached_at is not None:
            r = self.reached_at
            return (f"{self.describe_target()} reached at epoch {_fmt_epoch(r.epoch)} (step {r.step}, "
                    f"{r.wall_time:.1f} s): {_figures(r)}")
        trained = _fmt_epoch(last.epoch if epochs is None else epochs)
        unit = "epoch" if trained == "1" else "epochs"
        if self.ranks_by_accuracy and best.accuracy is not None:
            best_value = _fmt(best.accuracy, 4)
        else:
            best_value = f"loss {_fmt(best.loss, 4)}" + (
                f" (perplexity {_fmt(best.perplexity, 4)})" if best.perplexity is not None else "")
        if not self.has_target:
            return (f"no target set; {_figures(last)} after {trained} {unit} "
                    f"(best {best_value} at epoch {_fmt_epoch(best.epoch)})")
        best_at = f"(best {best_value} at epoch {_fmt_epoch(best.epoch)})"
        if max_epochs is not None:
            return (f"{self.describe_target()} not reached in {trained} {unit}, the --max-epochs {max_epochs} limit "
                    f"{best_at}; pass a larger --max-epochs to train longer")
        return f"{self.describe_target()} not reached in {trained} {unit} {best_at}"

    def to_dict(self) -> dict[str, Any]:
        """The figures ``train --json`` reports: the last evaluation (``eval_accuracy``,
        ``eval_loss``, ``eval_perplexity``), ``reached``, ``time_to_accuracy``,
        ``epochs_to_accuracy``, ``steps_to_accuracy`` (the target's, whether accuracy or
        loss), the targets and the summary line."""
        last = self.last
        return {
            "eval_accuracy": last.accuracy if last else None,
            "eval_loss": last.loss if last and math.isfinite(last.loss) else None,
            "eval_perplexity": last.perplexity if last and last.perplexity is not None
            and math.isfinite(last.perplexity) else None,
            "target_accuracy": self.target_accuracy, "target_loss": self.target_loss,
            "reached": self.reached, "time_to_accuracy": self.time_to_target,
            "epochs_to_accuracy": self.epochs_to_target, "steps_to_accuracy": self.steps_to_target,
            "target_summary": self.summary(),
        }


def _figures(r: EvalResult) -> str:
    parts = []
    if r.accuracy is not None:
        parts.append(f"accuracy {_fmt(r.accuracy, 4)}")
    parts.append(f"loss {_fmt(r.loss, 4)}")
    if r.perplexity is not None:
        parts.append(f"perplexity {_fmt(r.perplexity, 4)}")
    return ", ".join(parts)


def _fmt(v: float, digits: int = 6) -> str:
    """A number without trailing zeros: 0.9 -> "0.9", 90.0 -> "90", 0.91234567 -> "0.912346"."""
    return f"{v:.{digits}g}" if abs(v) < 10 ** digits else f"{v:.0f}"


def _fmt_epoch(e: float) -> str:
    """Whole epochs as integers ("4"), fractional ones with two decimals ("2.50")."""
    return str(int(round(e))) if abs(e - round(e)) < 1e-9 else f"{e:.2f}"
