"""Curves of a comparison as PNGs: :func:`write_plots`.

Two figures, one line per :class:`~pipetrain.metrics.compare.CompareRow`, each point an
evaluation of its ``history``:

    <metric>_vs_time.png     the metric against training wall time (seconds)
    <metric>_vs_epochs.png   the metric against epochs

``<metric>`` is ``perplexity`` for language models (log scale), ``accuracy`` for classifiers
and ``loss`` otherwise. The target is a dashed horizontal line (a loss target becomes
``exp(target_loss)`` on a perplexity plot), and each row's first crossing is ringed.

Figures are drawn on matplotlib's Agg canvas without pyplot, so nothing global changes
(no backend switch, no open-figure registry) and no display is needed.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Literal

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from .compare import CompareRow
from .records import EvalResult, perplexity_of

Metric = Literal["auto", "accuracy", "perplexity", "loss"]


def choose_metric(rows: list[CompareRow]) -> Literal["accuracy", "perplexity", "loss"]:
    """Perplexity if any evaluation has one, else accuracy if any has one, else loss."""
    results = [r for row in rows for r in row.history]
    if any(r.perplexity is not None for r in results):
        return "perplexity"
    if any(r.accuracy is not None for r in results):
        return "accuracy"
    return "loss"


def write_plots(rows: list[CompareRow], out_dir: str | os.PathLike[str], *, target_accuracy: float | None = None,
                target_loss: float | None = None, metric: Metric = "auto", title: str | None = None,
                dpi: int = 120) -> list[Path]:
    """Write ``<metric>_vs_time.png`` and ``<metric>_vs_epochs.png`` into ``out_dir``
    (created if missing); returns their paths."""
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    m = choose_metric(rows) if metric == "auto" else metric
    target = _target_value(m, target_accuracy, target_loss)
    written = []
    for axis, xlabel in (("time", "training time (s)"), ("epochs", "epochs")):
        fig = Figure(figsize=(7.0, 4.5), dpi=dpi)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        for row in rows:
            points = [(_x(r, axis), _y(r, m)) for r in row.history]
            points = [(x, y) for x, y in points if y is not None and math.isfinite(y)]
            if not points:
                continue
            xs, ys = zip(*points)
            (line,) = ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.5, label=row.schedule)
            hit = _crossing(row)
            if hit is not None:
                hy = _y(hit, m)
                if hy is not None and math.isfinite(hy):
                    # an explicit color keeps the next row on the next color of the cycle
                    ax.plot([_x(hit, axis)], [hy], marker="o", markersize=9, markerfacecolor="none",
                            color=line.get_color(), linestyle="none")
        if target is not None:
            label = f"target {target:.4g}" + (f" (loss {target_loss:g})" if m == "perplexity" else "")
            ax.axhline(target, color="0.3", linestyle="--", linewidth=1.0, label=label)
        if m == "perplexity":
            ax.set_yscale("log")
            # ticks at 1, 2, 5 x 10^k written as plain numbers (not 2 x 10^1)
            ax.yaxis.set_major_locator(LogLocator(base=10.0, subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(xlabel)
        ax.set_ylabel({"accuracy": "eval accuracy", "perplexity": "eval perplexity", "loss": "eval loss"}[m])
        ax.set_title(title or f"{m} against {'training time' if axis == 'time' else 'epochs'}")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize="small")
        fig.tight_layout()
        out = path / f"{m}_vs_{axis}.png"
        fig.savefig(out)
        written.append(out)
    return written


def _x(r: EvalResult, axis: str) -> float:
    return r.wall_time if axis == "time" else r.epoch


def _y(r: EvalResult, metric: str) -> float | None:
    if metric == "accuracy":
        return r.accuracy
    if metric == "perplexity":
        return r.perplexity
    return r.loss


def _crossing(row: CompareRow) -> EvalResult | None:
    """The evaluation at which the row reached its target (matched by its step)."""
    if not row.reached or row.steps_to_accuracy is None:
        return None
    return next((r for r in row.history if r.step == row.steps_to_accuracy), None)


def _target_value(metric: str, target_accuracy: float | None, target_loss: float | None) -> float | None:
    if metric == "accuracy":
        return target_accuracy
    if metric == "perplexity":
        return perplexity_of(target_loss) if target_loss is not None else None
    return target_loss
