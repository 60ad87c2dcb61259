"""pipetrain's own schedules, measured through ``pipetrain train ... --json``.

:func:`run_pipetrain` starts one training run as one process tree (its own session, killed
past the deadline) and reads the JSON object the CLI prints (``samples_per_second``,
``samples_per_second_steady``, ``final_loss``, ``peak_rss_mib`` per worker, ...). The run
gets the same warm-up as the other configurations (``--warmup-steps``, excluded from the
figure), the harness's cut (``--cut``) and one thread per worker. The ``auto`` configuration
passes no schedule, microbatch count, configuration or cut (``schedule=None``): what
``pipetrain train`` chooses by itself for the number of workers.
"""
from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

from processes import run_group
from timing import Measurement

# JSON keys of the CLI that are copied into the benchmark output when present.
_PASSTHROUGH = re.compile(r"mem|rss|peak|predict|stash|version|warmup|seconds|steady|final_loss|steps|plan|config"
                          r"|stage|bytes")


def default_cli() -> str:
    """``pipetrain`` next to this interpreter (the repository's .venv)."""
    return os.path.join(os.path.dirname(os.path.abspath(sys.executable)), "pipetrain")


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


def command(cli: str, model_spec: str, schedule: str | None, workers: int, config: str | None,
            batch_size: int, microbatches: int, steps: int, warmup: int, seed: int,
            timeout_s: float | None = None, cut: list[str] | None = None, measure_memory: bool = False,
            plan: str | None = None) -> list[str]:
    """The ``pipetrain train`` command line of one configuration (``schedule`` None: the
    planner's choice, ``--schedule auto`` and no microbatches, config or cut: a run shorter
    than the default length that names no schedule would train a straight pipeline).
    ``measure_memory``: the tensor ledger (a separate run; it slows the timed ones); ``plan``:
    a plan file."""
    cmd = [cli, "train", "--model", model_spec, "--workers", str(workers), "--batch-size", str(batch_size)]
    cmd += ["--schedule", "auto"] if schedule is None else ["--schedule", schedule, "--microbatches", str(microbatches)]
    cmd += ["--steps", str(steps), "--warmup-steps", str(warmup),
            "--seed", str(seed), "--log-every", "0", "--threads", "1", "--json"]
    if measure_memory:
        cmd += ["--measure-memory"]
    if plan:
        cmd += ["--plan", plan]
    if config:
        cmd += ["--config", config]
    if cut:  # the harness's cut, so every configuration trains the same stages
        cmd += ["--cut", ",".join(cut)]
    if timeout_s:  # bound every receive and collective
        cmd += ["--timeout", str(int(max(10, timeout_s)))]
    return cmd


def run_pipetrain(cli: str, model_spec: str, schedule: str | None, workers: int, config: str | None,
                  batch_size: int, microbatches: int, steps: int, warmup: int, seed: int,
                  timeout_s: float, cut: list[str] | None = None, measure_memory: bool = False,
                  plan: str | None = None) -> Measurement:
    """One ``pipetrain train`` run: its samples/s, or why there is none."""
    cmd = command(cli, model_spec, schedule, workers, config, batch_size, microbatches, steps, warmup, seed,
                  timeout_s, cut, measure_memory, plan)
    (res,) = run_group([cmd], timeout_s)
    obj = parse_json_output(res.stdout)
    if res.returncode != 0 or obj is None:
        why = res.error_line() if res.returncode != 0 else "no JSON object on stdout"
        return Measurement(None, "failed", why, res.tree_peaks_mib, {"command": " ".join(cmd)})
    sps = obj.get("samples_per_second")
    if not isinstance(sps, (int, float)) or sps <= 0:
        return Measurement(None, "failed", f"samples_per_second missing or not > 0: {sps!r}",
                           res.tree_peaks_mib, {"command": " ".join(cmd)})
    mem = [float(x) for x in obj.get("peak_rss_mib") or []]
    extra = {k: v for k, v in obj.items()
             if _PASSTHROUGH.search(k) and k not in ("samples_per_second", "warmup_losses")}
    extra.update(chosen=chosen_configuration(obj))
    extra.update(command=" ".join(cmd), cut=cut, peak_scope=obj.get("peak_rss_scope", "process"),
                 memory_source="pipetrain JSON" if mem
                 else "sampled VmHWM of every process of the launch (launcher + workers)")
    return Measurement(float(sps), "ok", "", mem or res.tree_peaks_mib, extra)


def chosen_configuration(obj: dict[str, Any]) -> dict[str, Any]:
    """What a run trained (schedule, microbatches, replicas per stage, plan) from its ``--json``
    object: for ``auto`` this is the planner's choice; the plan lets the harness predict it."""
    run = obj.get("run") or {}
    plan = run.get("plan") or None
    par = ((run.get("config") or {}).get("parallel") or {})
    return {"schedule": obj.get("schedule") or par.get("schedule"), "microbatches": obj.get("microbatches"),
            "config": obj.get("config"), "stages": obj.get("stages"), "workers": obj.get("workers"),
            "plan": plan, "plan_source": obj.get("plan_source"),
            "schedule_options": run.get("schedule_options") or {}}
