"""Comparing configurations by time to accuracy: :class:`CompareRow`, :func:`format_table`,
:func:`rows_to_json`.

One row per configuration that ``pipetrain compare`` ran (``"dp"``, ``"pipedream"``,
``"pipedream (no stashing)"``, ``"2bw"``, ...), all with the same seed, data and target:

    schedule   reached  time to target  epochs to target  final acc  final loss  samples/s  evals  wall s  bytes/sample
    dp             yes          41.2 s              2.73     0.9512      0.1630      812.3     30    52.0       10.4 KB
    pipedream       no               -                 -     0.9104      0.2871      951.0    110   141.3        6.1 KB

``-`` marks a target never reached. Time to target counts training alone (the clock
pauses while evaluating), epochs to target are fractional (the epoch of the first evaluation
that met the target). The evaluations' cost is apart: ``evals`` counts them, ``eval s`` is
the wall time they took (shown when measured), ``wall s`` the whole configuration's wall
time (start-up, training, evaluation; shown when measured). ``bytes/sample`` is what all
workers sent per training sample (activations, gradients and all-reduce traffic together).
:meth:`CompareRow.limit_notice` is the one line saying that ``--max-epochs`` ended a row
that trained until its target without reaching it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .records import EvalResult
from .target import TargetTracker

#: Keys every row of :func:`rows_to_json` has (``pipetrain compare --json``).
ROW_KEYS = ("schedule", "reached", "time_to_accuracy", "epochs_to_accuracy", "steps_to_accuracy", "final_accuracy",
            "final_loss", "final_perplexity", "samples_per_second", "bytes_per_sample", "evaluations",
            "eval_seconds", "train_seconds", "run_seconds", "max_epochs", "stopped_by")


@dataclass
class CompareRow:
    """The outcome of one configuration of a comparison.

    ``time_to_accuracy`` (training seconds), ``epochs_to_accuracy`` and ``steps_to_accuracy``
    are None when the target was never reached; ``final_*`` are the last evaluation's
    figures; ``samples_per_second`` the training throughput; ``bytes_per_sample`` the bytes
    all workers sent per training sample (None if not measured); ``history`` every evaluation
    in order (for the plots).

    The cost apart from training: ``train_seconds`` (the run's training seconds),
    ``run_seconds`` (the wall seconds of the whole configuration: start-up, training,
    evaluation) and :attr:`eval_seconds` (the evaluations' own wall time); each None where not
    measured. ``max_epochs`` is the limit of a run that trained until its target (None: its
    length was fixed by steps or epochs).
    """

    schedule: str
    reached: bool
    time_to_accuracy: float | None
    epochs_to_accuracy: float | None
    final_accuracy: float | None
    final_loss: float | None
    samples_per_second: float
    bytes_per_sample: float | None
    steps_to_accuracy: int | None = None
    final_perplexity: float | None = None
    history: list[EvalResult] = field(default_factory=list)
    train_seconds: float | None = None
    run_seconds: float | None = None
    max_epochs: int | None = None

    @property
    def evaluations(self) -> int:
        """How many evaluations ran."""
        return len(self.history)

    @property
    def eval_seconds(self) -> float | None:
        """The evaluations' wall time, summed (None unless every evaluation measured its own)."""
        times = [r.eval_seconds for r in self.history]
        if not times or any(t is None for t in times):
            return None
        return float(sum(t for t in times if t is not None))

    @property
    def stopped_by(self) -> str:
        """What ended the run: ``"target"`` (reached), ``"max_epochs"`` (a run until its target
        that did not reach it) or ``"length"`` (its steps or epochs)."""
        if self.reached:
            return "target"
        return "max_epochs" if self.max_epochs is not None else "length"

    def limit_notice(self, target_accuracy: float | None = None, target_loss: float | None = None) -> str | None:
        """``"NAME: target ... not reached in E epochs, the --max-epochs E limit (best ...); ..."``
        when ``--max-epochs`` ended this row (:attr:`stopped_by`), else None."""
        if self.stopped_by != "max_epochs":
            return None
        tracker = TargetTracker(target_accuracy, target_loss)
        for r in self.history:
            tracker.update(r)
        return f"{self.schedule}: {tracker.summary(max_epochs=self.max_epochs)}"

    @staticmethod
    def from_tracker(schedule: str, tracker: TargetTracker, samples_per_second: float,
                     bytes_per_sample: float | None) -> CompareRow:
        """The row of a run whose evaluations were fed to ``tracker``."""
        last = tracker.last
        return CompareRow(
            schedule=schedule, reached=tracker.reached, time_to_accuracy=tracker.time_to_target,
            epochs_to_accuracy=tracker.epochs_to_target, steps_to_accuracy=tracker.steps_to_target,
            final_accuracy=last.accuracy if last else None,
            final_loss=last.loss if last and math.isfinite(last.loss) else None,
            final_perplexity=last.perplexity if last else None,
            samples_per_second=samples_per_second, bytes_per_sample=bytes_per_sample,
            history=list(tracker.history))

    def to_dict(self, history: bool = True) -> dict[str, Any]:
        """The JSON form: the :data:`ROW_KEYS` (non-finite floats as None), then ``history``
        (a list of EvalResult dicts) if asked for."""
        d = {k: _finite_or_none(getattr(self, k)) for k in ROW_KEYS}
        if history:
            d["history"] = [r.to_dict() for r in self.history]
        return d


def rows_to_json(rows: list[CompareRow], *, history: bool = True, **extra: Any) -> dict[str, Any]:
    """``{"rows": [row.to_dict(), ...], **extra}`` (``extra``: e.g. the target, the model)."""
    return {"rows": [r.to_dict(history=history) for r in rows], **extra}


def format_table(rows: list[CompareRow], target: str | None = None) -> str:
    """The rows as an aligned text table (see the module docstring), with a first line
    naming the target when given (e.g. ``TargetTracker.describe_target()``). Columns that no
    row measures (accuracy for language models, perplexity for classifiers) are left out."""
    show_acc = any(r.final_accuracy is not None for r in rows)
    show_ppl = any(r.final_perplexity is not None for r in rows)
    header = ["schedule", "reached", "time to target", "epochs to target"]
    if show_acc:
        header.append("final acc")
    header.append("final loss")
    if show_ppl:
        header.append("final ppl")
    show_eval = any(r.eval_seconds is not None for r in rows)
    show_wall = any(r.run_seconds is not None for r in rows)
    header += ["samples/s", "evals"] + ["eval s"] * show_eval + ["wall s"] * show_wall + ["bytes/sample"]
    body: list[list[str]] = []
    for r in rows:
        cells = [r.schedule, "yes" if r.reached else "no",
                 "-" if r.time_to_accuracy is None else f"{r.time_to_accuracy:.1f} s",
                 "-" if r.epochs_to_accuracy is None else f"{r.epochs_to_accuracy:.2f}"]
        if show_acc:
            cells.append(_num(r.final_accuracy, ".4f"))
        cells.append(_num(r.final_loss, ".4f"))
        if show_ppl:
            cells.append(_num(r.final_perplexity, ".3f"))
        cells += [_num(r.samples_per_second, ".1f"), str(r.evaluations)]
        cells += [_num(r.eval_seconds, ".1f")] * show_eval + [_num(r.run_seconds, ".1f")] * show_wall
        cells.append(format_bytes(r.bytes_per_sample))
        body.append(cells)
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        # The first column (names) aligns left, the figures right.
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    out = [line(header), *(line(c) for c in body)]
    if target:
        out.insert(0, target)
    return "\n".join(out)


def format_bytes(n: float | None) -> str:
    """``10650.0`` -> ``"10.4 KB"`` (powers of 1024); None -> ``"-"``."""
    if n is None or not math.isfinite(n):
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"  # unreachable; keeps the type checker sure of a return


def _num(v: float | None, spec: str) -> str:
    return "-" if v is None or not math.isfinite(v) else format(v, spec)


def _finite_or_none(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v
