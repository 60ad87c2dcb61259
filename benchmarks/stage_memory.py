"""Peak memory of every process of a run, against the model's size: does a worker hold only its stage?

For 1, 2 and 4 workers (``--config 1-1...``, flush), ``pipetrain train`` runs as a fresh
process tree; every process's peak resident set (``VmHWM`` from ``/proc``, sampled every few
milliseconds, :class:`rss.TreeMemory`) is recorded, the launcher's and each worker's, and
compared with the import baseline (the peak of ``python -c "import torch, pipetrain"``) and
the model's fp32 bytes. Workers restart their ``VmHWM`` once set up (``reset_peak_rss``), so
the sampling, not their own report, sees the build's peak.

    python benchmarks/stage_memory.py                         # the issue's GPT (420M parameters)
    python benchmarks/stage_memory.py --workers 4 --json out.json
    python benchmarks/stage_memory.py --pythonpath ../old     # another checkout (``git archive``)
    python benchmarks/stage_memory.py --workers 4 --hf-llama 0.8e9   # also a Hugging Face Llama directory
    python benchmarks/stage_memory.py --layout planner        # stages from the launcher's quick profile

The figure of merit is ``(peak - baseline) / model bytes`` of the largest process: 1.0 or
more when every process builds the whole model, about ``1/W`` of weights plus gradients
when each worker materialises only its stage. Every run also reports its start-up time:
seconds from the launch to the end of the first step (the ``step 1:`` progress line).

``--hf-llama BYTES`` also writes a ``LlamaForCausalLM`` of about ``BYTES`` fp32 bytes with
``save_pretrained`` into a temporary directory (deleted afterwards) and runs it as
``--model hf:DIR`` on ``--hf-workers`` workers: the directory's weights, read per stage.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from hf_dirs import save_pretrained
from rss import TreeMemory

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(BENCH_DIR)

#: The model of issue 20's measurement: a built-in GPT of 420M parameters (1,602 MiB in fp32).
GPT_OPTIONS = {"d_model": 1024, "layers": 32, "heads": 8, "seq_len": 64}


def _cwd(pythonpath: str | None) -> str:
    """Where the runs start: ``python -m`` puts its working directory first on ``sys.path``, so
    a checkout given by ``--pythonpath`` must be it (else a neutral directory)."""
    return pythonpath or tempfile.gettempdir()


def _env(pythonpath: str | None) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")  # progress lines as they happen
    paths = [p for p in (pythonpath, env.get("PYTHONPATH")) if p]
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def _imported_from(pythonpath: str | None) -> str:
    code = "import pipetrain; print(pipetrain.__file__)"
    return subprocess.run([sys.executable, "-c", code], env=_env(pythonpath), capture_output=True, text=True,
                          check=True, cwd=_cwd(pythonpath)).stdout.strip()


def import_baseline_mib(pythonpath: str | None) -> float:
    """Peak RSS of a process that only imports torch and pipetrain (``ru_maxrss``), MiB."""
    code = "import resource, torch, pipetrain; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    out = subprocess.run([sys.executable, "-c", code], env=_env(pythonpath), capture_output=True, text=True,
                         check=True, cwd=_cwd(pythonpath))
    return int(out.stdout.split()[-1]) / 1024.0


def model_mib(model: str, options: dict[str, Any]) -> float:
    """The model's parameters and buffers in fp32, MiB (counted on a weightless build)."""
    sys.path.insert(0, REPO_ROOT)
    from pipetrain.models.loader import load_weightless

    bundle, _ = load_weightless(model, 0, 1, **options)
    tensors = {id(t): t for t in [*bundle.model.parameters(), *bundle.model.buffers()]}
    return sum(t.numel() * 4 for t in tensors.values()) / 2 ** 20


#: How the stages of a run are chosen (``--layout``): named, by the launcher's quick profile, or ``auto``.
LAYOUTS = ("config", "planner", "auto")


def train_command(model: str, options: dict[str, Any], workers: int, steps: int, layout: str = "config") -> list[str]:
    """``pipetrain train`` of ``model`` on ``workers``: ``--config 1-1...`` flush m=4
    (``config``), flush m=4 on the planner's stages from a quick profile in the launcher
    (``planner``), or ``--schedule auto`` (``auto``)."""
    schedule = ["--schedule", "auto"] if layout == "auto" else ["--schedule", "flush", "--microbatches", "4"]
    cmd = [sys.executable, "-m", "pipetrain", "train", "--model", model, "--workers", str(workers), *schedule,
           "--batch-size", "4", "--steps", str(steps), "--log-every", "1"]
    for k, v in options.items():
        cmd += ["--option", f"{k}={v}"]
    if workers > 1 and layout == "config":
        cmd += ["--config", "-".join(["1"] * workers)]
    return cmd


def _read_lines(stream: Any, lines: list[tuple[float, str]]) -> None:
    for line in stream:
        lines.append((time.perf_counter(), line.rstrip("\n")))


def measure(cmd: list[str], pythonpath: str | None, interval: float) -> dict[str, Any]:
    """Run ``cmd``; the peak of its root process (the launcher) and of every descendant, and
    the seconds from the launch to the end of its first step."""
    tree = TreeMemory()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=_env(pythonpath), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=_cwd(pythonpath))
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True)
    reader.start()
    while proc.poll() is None:
        tree.sample(proc.pid)
        time.sleep(interval)
    reader.join(timeout=30)
    output = "\n".join(line for _, line in lines)
    first = next((t for t, line in lines if line.startswith("step 1:")), None)
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({proc.returncode}): {' '.join(cmd)}\n{output[-2000:]}")
    others = sorted((p for p in tree.peaks if p != proc.pid), key=lambda p: -tree.peaks[p])
    return {"seconds": round(time.perf_counter() - start, 1),
            "first_step_seconds": round(first - start, 1) if first is not None else None,
            "launcher_mib": tree.peaks.get(proc.pid, 0.0),
            "child_mib": [round(tree.peaks[p], 1) for p in others], "output": output.strip().splitlines()[-1:]}


def llama_config(target_bytes: float) -> dict[str, Any]:
    """A ``LlamaConfig``'s fields for a model of about ``target_bytes`` fp32 bytes: hidden size
    1024, 16 heads, vocabulary 32000, untied head, layers of 4 h^2 attention and 3 h i MLP
    weights, the MLP width chosen to come closest with 10 layers."""
    hidden, vocab, layers = 1024, 32000, 10
    params = target_bytes / 4
    per_layer = (params - 2 * vocab * hidden - hidden) / layers - 2 * hidden
    intermediate = max(64, int(round((per_layer - 4 * hidden * hidden) / (3 * hidden) / 64)) * 64)
    return {"vocab_size": vocab, "hidden_size": hidden, "intermediate_size": intermediate,
            "num_hidden_layers": layers, "num_attention_heads": 16, "num_key_value_heads": 16,
            "max_position_embeddings": 256, "tie_word_embeddings": False}


def write_llama(directory: str, target_bytes: float) -> None:
    """``LlamaForCausalLM.save_pretrained(directory)`` of :func:`llama_config`, in a child
    process (so that this one stays small)."""
    save_pretrained("LlamaConfig", "LlamaForCausalLM", llama_config(target_bytes), directory, env=_env(None))


def run_rows(model: str, options: dict[str, Any], workers: list[int], args: argparse.Namespace,
             baseline: float) -> list[dict[str, Any]]:
    """Measure ``model`` on each worker count; print a line each."""
    size = model_mib(model, options)
    print(f"model {model} {options}: {size:.0f} MiB fp32; import baseline {baseline:.0f} MiB")
    print(f"stages: {args.layout}")
    print(f"{'workers':>7} {'launcher':>9} {'launcher/model':>14} {'largest worker':>15} {'max/model':>9} "
          f"{'seconds':>8} {'to step 1':>9}  workers' peaks (MiB)")
    rows = []
    for w in workers:
        r = measure([*train_command(model, options, w, args.steps, args.layout), *args.train_arg], args.pythonpath,
                    args.interval)
        peaks = r["child_mib"][:w] if w > 1 else []
        largest = max([r["launcher_mib"], *peaks])
        ratio = (largest - baseline) / size
        launcher_ratio = (r["launcher_mib"] - baseline) / size
        first = r["first_step_seconds"]
        print(f"{w:>7} {r['launcher_mib']:>9.0f} {launcher_ratio:>14.2f} {max(peaks, default=0):>15.0f} {ratio:>9.2f} "
              f"{r['seconds']:>8.1f} {first if first is not None else float('nan'):>9.1f}  "
              f"{', '.join(f'{x:.0f}' for x in peaks) or '-'}")
        rows.append({"model": model, "options": options, "workers": w, "layout": args.layout, "baseline_mib": baseline,
                     "model_mib": size, "ratio": ratio, "launcher_ratio": launcher_ratio, **r})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", default="1,2,4", help="comma-separated worker counts (default 1,2,4; '' for none)")
    ap.add_argument("--model", default="gpt")
    ap.add_argument("--option", action="append", default=[], metavar="K=V",
                    help="model option (default: the issue's GPT, d_model=1024 layers=32 heads=8 seq_len=64)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--interval", type=float, default=0.005, help="seconds between samples of /proc")
    ap.add_argument("--pythonpath", default=None, help="put this checkout first on PYTHONPATH of the runs")
    ap.add_argument("--hf-llama", type=float, default=None, metavar="BYTES",
                    help="also a Hugging Face Llama directory of about BYTES fp32 bytes (e.g. 0.8e9) as hf:DIR")
    ap.add_argument("--hf-workers", default="4", help="worker counts of the Llama runs (default 4)")
    ap.add_argument("--train-arg", action="append", default=[], metavar="ARG",
                    help="one more argument for every train command (repeat: --train-arg=--no-malloc-tuning)")
    ap.add_argument("--layout", choices=LAYOUTS, default="config",
                    help="the stages: --config 1-1... (config), the launcher's quick plan (planner), --schedule auto")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    if args.pythonpath is not None:
        args.pythonpath = os.path.abspath(args.pythonpath)
    options: dict[str, Any] = dict(GPT_OPTIONS) if args.model == "gpt" and not args.option else {}
    for kv in args.option:
        k, _, v = kv.partition("=")
        options[k] = int(v) if v.lstrip("-").isdigit() else v
    baseline = import_baseline_mib(args.pythonpath)
    print(f"pipetrain from {_imported_from(args.pythonpath)}")
    rows = run_rows(args.model, options, [int(x) for x in args.workers.split(",") if x], args, baseline)
    if args.hf_llama is not None:
        directory = tempfile.mkdtemp(prefix="llama-")
        try:
            write_llama(directory, args.hf_llama)
            rows += run_rows(f"hf:{directory}", {"seq_len": 64}, [int(x) for x in args.hf_workers.split(",") if x],
                             args, baseline)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
