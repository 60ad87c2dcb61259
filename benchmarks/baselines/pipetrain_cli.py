"""pipetrain's own schedules, measured through ``pipetrain train ... --json``.

The orchestrator calls :func:`probe` once per run: if the ``train`` subcommand does not
exist yet (or fails to start), every pipetrain configuration is reported as
``unavailable`` with the reason instead of being launched. :func:`run_pipetrain` starts one
training run as one process tree (its own session, killed past the deadline) and reads the
one JSON object the CLI prints (at least ``samples_per_second``, ``steps``, ``final_loss``).

Warm-up: when ``train --help`` lists ``--warmup-steps`` the harness passes the same warm-up
as the other configurations and ``--steps S`` for the timed steps; otherwise it runs
``warmup + S`` steps and flags the figure ``includes_warmup`` (pipetrain is then
slightly under-reported against the baselines, whose warm-up is excluded).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from typing import Any

import common

# JSON keys of the CLI that are copied into the benchmark output when present.
_PASSTHROUGH = re.compile(r"mem|rss|predict|stash|version|warmup|seconds|steady|final_loss|steps|plan|config|stage|bytes")


@dataclass
class CliInfo:
    """What :func:`probe` learned about the ``pipetrain train`` command."""

    path: str
    available: bool
    reason: str = ""
    flags: set[str] = field(default_factory=set)


def default_cli() -> str:
    """``pipetrain`` next to this interpreter (the repository's .venv)."""
    import sys

    return os.path.join(os.path.dirname(os.path.abspath(sys.executable)), "pipetrain")


def probe(path: str, timeout_s: float = 60.0) -> CliInfo:
    """Whether ``pipetrain train`` exists and which flags its ``--help`` lists."""
    if not os.path.exists(path):
        return CliInfo(path, False, f"{path} does not exist")
    try:
        p = subprocess.run([path, "train", "--help"], capture_output=True, text=True,
                           timeout=timeout_s, env=common.bench_env(), cwd=common.REPO_ROOT)
    except subprocess.TimeoutExpired:
        return CliInfo(path, False, f"'pipetrain train --help' took over {timeout_s:.0f} s")
    if p.returncode != 0:
        lines = [ln for ln in (p.stderr or p.stdout).splitlines() if ln.strip()]
        return CliInfo(path, False, "'pipetrain train --help' failed: " + (lines[-1] if lines else f"exit {p.returncode}"))
    flags = set(re.findall(r"(--[a-z0-9][a-z0-9-]*)", p.stdout))
    needed = {"--model", "--workers", "--schedule", "--batch-size", "--microbatches", "--steps", "--json"}
    missing = sorted(needed - flags)
    if missing:
        return CliInfo(path, False, f"'pipetrain train' lacks {', '.join(missing)}", flags)
    return CliInfo(path, True, "", flags)


def parse_json_output(stdout: str) -> dict[str, Any] | None:
    """The JSON object the CLI printed: all of stdout, or else its last ``{...}`` line."""
    text = stdout.strip()
    try:
        obj = json.loads(text)
        return obj if isinstance(obj, dict) else None
    except ValueError:
        pass
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                return obj
    return None


def command(info: CliInfo, model_spec: str, schedule: str, workers: int, config: str | None,
            batch_size: int, microbatches: int, steps: int, warmup: int, seed: int,
            timeout_s: float | None = None, cut: list[str] | None = None) -> tuple[list[str], bool]:
    """The ``pipetrain train`` command line, and whether its figure includes the warm-up."""
    has_warmup = "--warmup-steps" in info.flags
    cmd = [info.path, "train", "--model", model_spec, "--workers", str(workers),
           "--schedule", schedule, "--batch-size", str(batch_size),
           "--microbatches", str(microbatches),
           "--steps", str(steps if has_warmup else steps + warmup), "--json"]
    if config and "--config" in info.flags:
        cmd += ["--config", config]
    if cut and "--cut" in info.flags:  # the harness's cut, so every configuration trains the same stages
        cmd += ["--cut", ",".join(cut)]
    if has_warmup:
        cmd += ["--warmup-steps", str(warmup)]
    if "--seed" in info.flags:
        cmd += ["--seed", str(seed)]
    if "--log-every" in info.flags:  # no per-step printing inside the timed window
        cmd += ["--log-every", "0"]
    if "--threads" in info.flags:  # one intra-op thread per worker, like every configuration
        cmd += ["--threads", "1"]
    if "--timeout" in info.flags and timeout_s:  # bound every receive and collective
        cmd += ["--timeout", str(int(max(10, timeout_s)))]
    return cmd, not has_warmup


def _per_worker_memory(obj: dict[str, Any]) -> list[float]:
    """Per-worker peak memory in MiB if the CLI reports it (a few plausible spellings)."""
    for key in ("peak_rss_mib", "peak_memory_mib", "max_rss_mib"):
        v = obj.get(key)
        if isinstance(v, list) and all(isinstance(x, (int, float)) for x in v):
            return [float(x) for x in v]
        if isinstance(v, (int, float)):
            return [float(v)]
    workers = obj.get("workers")
    if isinstance(workers, list):
        vals = [w.get(k) for w in workers if isinstance(w, dict)
                for k in ("peak_rss_mib", "peak_memory_mib", "max_rss_mib") if k in w]
        if vals and all(isinstance(x, (int, float)) for x in vals):
            return [float(x) for x in vals]
    return []


def run_pipetrain(info: CliInfo, model_spec: str, schedule: str, workers: int, config: str | None,
                  batch_size: int, microbatches: int, steps: int, warmup: int, seed: int,
                  timeout_s: float, cut: list[str] | None = None) -> common.Measurement:
    """One ``pipetrain train`` run: its samples/s, or why there is none."""
    if not info.available:
        return common.Measurement(None, "unavailable", info.reason)
    cmd, includes_warmup = command(info, model_spec, schedule, workers, config, batch_size,
                                   microbatches, steps, warmup, seed, timeout_s, cut)
    (res,) = common.run_group([cmd], timeout_s)
    obj = parse_json_output(res.stdout)
    if res.returncode != 0 or obj is None:
        why = res.error_line() if res.returncode != 0 else "no JSON object on stdout"
        return common.Measurement(None, "failed", why, res.tree_peaks_mib,
                                  {"command": " ".join(cmd)})
    sps = obj.get("samples_per_second")
    if not isinstance(sps, (int, float)) or sps <= 0:
        return common.Measurement(None, "failed", f"samples_per_second missing or not > 0: {sps!r}",
                                  res.tree_peaks_mib, {"command": " ".join(cmd)})
    mem = _per_worker_memory(obj)
    extra = {k: v for k, v in obj.items()
             if _PASSTHROUGH.search(k) and k not in ("samples_per_second", "warmup_losses")}
    extra.update(includes_warmup=includes_warmup, command=" ".join(cmd), cut=cut,
                 peak_scope=obj.get("peak_rss_scope", "process"),
                 memory_source="pipetrain JSON" if mem else "sampled VmHWM of every process of the launch (launcher + workers)")
    return common.Measurement(float(sps), "ok", "", mem or res.tree_peaks_mib, extra)
