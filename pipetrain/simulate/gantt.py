"""Gantt pictures of a simulated run (matplotlib, Agg backend; PNG or SVG by extension).

One row per worker (rank 0 at the top). Forward, backward (or I and W), all-reduce and
step boxes are coloured by kind, with the unit number inside when the box is wide enough;
transfers are thin bars under the row (they overlap compute). On ranks holding several
stages (interleaved), later model chunks are drawn lighter. The title gives the schedule,
its shape and the bubble fraction.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import PipetrainError
from ..schedule.action import Op
from ..schedule.registry import SCHEDULES
from .engine import SimResult

COLORS = {
    Op.F: "#4C72B0",
    Op.B: "#55A868",
    Op.I: "#2E8B57",
    Op.W: "#B5BD68",
    Op.ALLREDUCE: "#C44E52",
    Op.STEP: "#7F7F7F",
    "comm": "#8172B2",
}
LABELS = {Op.F: "forward", Op.B: "backward", Op.I: "backward (input grad)", Op.W: "backward (weight grad)",
          Op.ALLREDUCE: "all-reduce", Op.STEP: "optimizer step", "comm": "transfer"}


def _lighten(hex_color: str, amount: float) -> tuple[float, float, float]:
    r, g, b = (int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5))
    return (r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount)


def save_gantt(result: SimResult, path: str | Path, title: str | None = None, dpi: int = 150) -> Path:
    """Draw ``result`` to ``path`` (``.png`` or ``.svg``) and return the path.

    Args:
        result: what :func:`pipetrain.simulate.simulate` returned.
        path: output file; the extension picks the format.
        title: replaces the default title (schedule, stages, workers, units, bubble).
        dpi: resolution of PNG output.
    """
    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in ("png", "svg"):
        raise PipetrainError(f"timeline picture {str(path)!r}: the extension must be .png or .svg; e.g. timeline.png")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    s = result.schedule
    W = s.num_workers
    makespan = result.makespan or 1.0
    ncompute = max((sum(1 for e in tl if e.kind == "compute" and e.duration > 0) for tl in result.timelines), default=1)
    width = min(max(8.0, 0.42 * ncompute + 2.5), 40.0)
    height = 0.62 * W + 1.9
    fig, ax = plt.subplots(figsize=(width, height))
    axes_width_pt = width * 72 * 0.86
    used: set[Any] = set()
    box_h = 0.72
    for rank, tl in enumerate(result.timelines):
        stages = s.stages_of_rank(rank)
        for e in tl:
            a = e.action
            if e.duration <= 0:
                continue
            if e.kind == "compute" or a.op is Op.ALLREDUCE:
                chunk = stages.index(a.stage) if a.stage in stages else 0
                color = _lighten(COLORS[a.op], 0.45 * chunk / max(len(stages) - 1, 1)) if chunk else COLORS[a.op]
                ax.broken_barh([(e.start, e.duration)], (rank - box_h / 2, box_h), facecolors=color,
                               edgecolors="white", linewidth=0.6)
                used.add(a.op)
                if a.op in (Op.F, Op.B, Op.I, Op.W):
                    label = str(a.mb)
                    box_pt = e.duration / makespan * axes_width_pt
                    size = min(9.0, box_pt / (0.62 * len(label) + 0.6))
                    if size >= 4.5:
                        ax.text(e.start + e.duration / 2, rank, label, ha="center", va="center",
                                fontsize=size, color="white", fontweight="bold")
            elif a.op in (Op.SEND_F, Op.SEND_B):
                ax.broken_barh([(e.start, e.duration)], (rank + box_h / 2 + 0.02, 0.1),
                               facecolors=COLORS["comm"], alpha=0.75)
                used.add("comm")
    ax.set_ylim(W - 0.4, -0.6)
    ax.set_yticks(range(W))
    ax.set_yticklabels([f"rank {r}\nstage {'/'.join(map(str, s.stages_of_rank(r)))}" for r in range(W)], fontsize=8)
    ax.set_xlim(0, makespan * 1.005)
    ax.set_xlabel("time (s)")
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    if title is None:
        spec = SCHEDULES.get(s.name)
        units = (f"{s.steps} minibatches" if spec is not None and spec.unit == "minibatch"
                 else f"{s.microbatches} microbatches x {s.steps} minibatch{'es' if s.steps > 1 else ''}")
        kind = "steady-state bubble" if result.steady_window is not None else "bubble"
        title = (f"{s.name}: {s.num_stages} stages on {W} workers, {units}; "
                 f"{kind} {result.bubble_fraction:.1%}")
    ax.set_title(title, fontsize=10)
    order = [Op.F, Op.B, Op.I, Op.W, Op.ALLREDUCE, Op.STEP, "comm"]
    handles = [Patch(facecolor=COLORS[k], label=LABELS[k]) for k in order if k in used]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.35 / height, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format=fmt, dpi=dpi)
    plt.close(fig)
    return path
