"""Where a measured pipeline's time goes: summary and picture of a ``pipetrain train --trace`` run.

    python benchmarks/trace_summary.py DIR [--png OUT.png] [--steps-shown 4] [--json]

Reads ``DIR/trace.json`` (every rank's measured actions, seconds from the timed segment's
start) and prints, per rank, the share of the timed window spent in forward (F), backward
(B), optimizer step (STEP), waiting on receives (RECV_*), posting sends (SEND_*) and
between actions (executor overhead, untracked). ``--png`` draws a Gantt chart of a few
steady-state steps (one row per rank, compute on top, transfers below).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

COLORS = {"F": "#4c72b0", "B": "#55a868", "STEP": "#c44e52", "RECV_F": "#8172b2", "RECV_B": "#8172b2",
          "SEND_F": "#ccb974", "SEND_B": "#ccb974", "ALLREDUCE": "#64b5cd", "I": "#55a868", "W": "#2f6b3a"}


def load(directory: str) -> dict[int, list[dict[str, Any]]]:
    """Rank -> its measured actions (name, op, unit, stage, start/end in ms), sorted by start."""
    d = json.loads((Path(directory) / "trace.json").read_text())
    by: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in d["traceEvents"]:
        if e.get("ph") != "X":
            continue
        by[int(e["pid"])].append({"name": e["name"], "op": e["args"]["op"], "unit": e["args"].get("unit"),
                                  "stage": e["args"].get("stage"),
                                  "start": e["ts"] / 1e3, "end": (e["ts"] + e["dur"]) / 1e3})
    return {r: sorted(v, key=lambda x: x["start"]) for r, v in sorted(by.items())}


def summarise(ranks: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per rank: ms and percent of the window in each kind of action, plus the gaps."""
    window = max(e["end"] for evs in ranks.values() for e in evs)
    out: dict[str, Any] = {"window_ms": window, "ranks": {}}
    for r, evs in ranks.items():
        t: dict[str, float] = defaultdict(float)
        for e in evs:
            kind = e["op"] if e["op"] in ("F", "B", "STEP", "I", "W", "ALLREDUCE") else (
                "recv wait" if e["op"].startswith("RECV") else "send")
            t[kind] += e["end"] - e["start"]
        t["between actions"] = window - sum(t.values())
        out["ranks"][r] = {k: {"ms": round(v, 2), "percent": round(100 * v / window, 1)} for k, v in t.items()}
    return out


def draw(ranks: dict[int, list[dict[str, Any]]], path: str, steps_shown: int, title: str) -> None:
    """A Gantt chart of ``steps_shown`` steady-state steps (the middle of the window)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = max(e["end"] for evs in ranks.values() for e in evs)
    steps = max(1, sum(1 for e in ranks[max(ranks)] if e["op"] == "STEP"))
    span = window / steps * steps_shown
    t0 = window / 2 - span / 2
    fig, ax = plt.subplots(figsize=(10, 0.9 + 0.8 * len(ranks)))
    for row, evs in enumerate(ranks.values()):
        y = (len(ranks) - 1 - row) * 1.0
        for e in evs:
            if e["end"] < t0 or e["start"] > t0 + span:
                continue
            comm = e["op"].startswith(("SEND", "RECV"))
            ax.broken_barh([(e["start"] - t0, e["end"] - e["start"])],
                           (y + (0.02 if comm else 0.36), 0.3 if comm else 0.58),
                           facecolors=COLORS.get(e["op"], "#999999"), edgecolor="white", linewidth=0.3)
            if not comm and e["end"] - e["start"] > span / 40:
                ax.text(e["start"] - t0 + (e["end"] - e["start"]) / 2, y + 0.65, e["name"][1:] if e["op"] != "STEP"
                        else "S", ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks([(len(ranks) - 1 - i) + 0.5 for i in range(len(ranks))])
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.set_xlim(0, span)
    ax.set_xlabel(f"ms (from {t0:.0f} ms into the timed window)")
    ax.set_title(title, fontsize=9)
    from matplotlib.patches import Patch

    ax.legend(handles=[Patch(color=COLORS[k], label=k) for k in ("F", "B", "STEP", "RECV_F", "SEND_F")],
              labels=["forward", "backward", "optimizer step", "receive wait (lower band)",
                      "send posting (lower band)"],
              fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=5, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("directory")
    ap.add_argument("--png", default=None)
    ap.add_argument("--steps-shown", type=int, default=4)
    ap.add_argument("--title", default="measured pipetrain trace")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    ranks = load(a.directory)
    s = summarise(ranks)
    if a.json:
        print(json.dumps(s, indent=1))
    else:
        print(f"timed window {s['window_ms']:.1f} ms")
        for r, kinds in s["ranks"].items():
            print(f"rank {r}: " + ", ".join(f"{k} {v['percent']}% ({v['ms']:.1f} ms)" for k, v in kinds.items()))
    if a.png:
        draw(ranks, a.png, a.steps_shown, a.title)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
