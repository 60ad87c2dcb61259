"""Entry point of one measured process: ``python benchmarks/run.py _worker SPEC_JSON``.

``SPEC_JSON`` holds ``kind`` (``single``, ``ceiling``, ``torch_pipe``, ``ddp``), ``model``,
``rank``, ``world``, ``port``, ``steps``, ``warmup``, ``seed``, ``timeout_s``, ``cuts``
(child indices where stages 1.. begin, null: halves by layers) and, for
``torch_pipe``, ``schedule`` (``gpipe`` or ``1f1b``) and ``microbatches``. The worker pins
torch to one thread, builds the benchmark model from the shared seed, joins the gloo group
on 127.0.0.1 when ``world > 1`` (every collective bounded by ``timeout_s``), runs the
configuration and prints one ``BENCH_RESULT {...}`` line: the timed window's wall time,
the per-step times, the last loss and memory: RSS once torch is imported and the group
joined (``rss_import_mib``), once set up, and
the peak of the training phase (counted from the set-up point: see
``baselines.common.begin_training_phase``).
"""
from __future__ import annotations

import json
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from bench_models import BenchModel, build_bench_model
from processes import emit_result
from rss import current_rss_mib, rss_mib


def _runner(kind: str) -> Callable[[dict[str, Any], BenchModel], dict[str, Any]]:
    if kind == "single":
        from baselines.local import run_single
        return run_single
    if kind == "ceiling":
        from baselines.local import run_ceiling
        return run_ceiling
    if kind == "torch_pipe":
        from baselines.torch_pipelining import run_torch_pipe
        return run_torch_pipe
    if kind == "ddp":
        from baselines.ddp import run_ddp
        return run_ddp
    raise SystemExit(f"unknown worker kind {kind!r}")


def main(argv: list[str]) -> int:
    """Run the worker described by ``argv[0]`` (a JSON object) and print its result."""
    spec: dict[str, Any] = json.loads(argv[0])
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    run = _runner(spec["kind"])
    if spec["world"] > 1:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=spec["rank"],
            world_size=spec["world"], timeout=timedelta(seconds=spec["timeout_s"]))
    # The baseline of the memory figures: torch imported, the process group joined.
    rss_import = current_rss_mib()
    try:
        bm = build_bench_model(spec["model"], seed=spec["seed"])
        nparams = bm.num_parameters()
        out = run(spec, bm)
    finally:
        if spec["world"] > 1 and dist.is_initialized():
            dist.destroy_process_group()
    out.update(rank=spec["rank"], batch_size=bm.batch_size,
               num_parameters=nparams, threads=torch.get_num_threads(),
               rss_import_mib=rss_import, rss_peak_mib=rss_mib())
    emit_result(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
