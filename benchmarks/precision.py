"""fp32 against bf16, and recomputation against none, on the GPT model, beside the simulator.

One launch of 2 local workers trains the same GPT four times (flush, 2 stages, 4
microbatches): fp32, bf16, fp32 with ``--recompute`` and bf16 with ``--recompute``, each with
the tensor ledger on (``--measure-memory``, which costs the same time in every run). It
prints, per run: steady samples/s, activation + gradient bytes per sample on the wire
(measured and predicted), the measured tensor peak per worker, and the simulator's samples/s
and peak from a profile of the same model (fp32 times: the simulator does not know how fast
bf16 computes on this machine; a recomputing stage's backward includes one more forward).
Ratios are measured in this one run. Usage::

    .venv/bin/python benchmarks/precision.py [--steps 12] [--layers 4] [--d-model 128]
"""
from __future__ import annotations

import argparse
import json
from typing import Any

MIB = 1024.0 * 1024.0


def _configs(args: argparse.Namespace) -> list[tuple[str, Any]]:
    from pipetrain.job import OptimizerConfig, TrainConfig

    opts = {"vocab": 512, "d_model": args.d_model, "layers": args.layers, "heads": 4, "seq_len": args.seq_len}
    out = []
    for precision in ("fp32", "bf16"):
        for rec in (False, True):
            out.append((f"{precision}{' recompute' if rec else ''}", TrainConfig.of(
                model="gpt", model_options=opts, workers=2, config="1-1", schedule="flush", microbatches=4,
                batch_size=args.batch_size, steps=args.steps, warmup_steps=2, seed=0, precision=precision,
                recompute=rec, measure_memory=True, quiet=True, threads=1, timeout=300,
                optimizer=OptimizerConfig("sgd", lr=0.01))))
    return out


def _simulated(run: Any, profile: Any, recompute: bool) -> tuple[float, list[float]]:
    """The simulator's samples/s and tensor peak (MiB) per worker for ``run``'s plan."""
    from pipetrain.plan.types import Plan
    from pipetrain.simulate.costs import StageCosts
    from pipetrain.simulate.engine import simulate
    from pipetrain.simulate.tensor_memory import predict_tensor_memory

    d = run.plan.to_dict()
    plan = Plan.from_dict({**d, "stages": [{**s, "recompute": recompute} for s in d["stages"]]})
    sched = run.segments[-1].schedule
    res = simulate(sched, StageCosts.from_plan(plan, profile, units=run.microbatches))
    peaks = predict_tensor_memory(sched, plan, profile, optimizer_state=0.0, data_steps=run.segments[-1].steps)
    return run.batch_size / res.time_per_minibatch, [p / MIB for p in peaks]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=16)
    args = ap.parse_args()

    from pipetrain.models import get_model
    from pipetrain.plan.recompute import precision_profile
    from pipetrain.profile.profiler import profile_model
    from pipetrain.run import resolve_run
    from pipetrain.runtime import launch_local

    named = _configs(args)
    runs = [resolve_run(c) for _, c in named]
    results = launch_local(runs, timeout=1200)
    opts = dict(named[0][1].model.options)
    profile = profile_model(get_model("gpt", batch_size=args.batch_size, **opts), batch_size=args.batch_size,
                            warmup=1, repeats=3)
    rows = []
    for (name, cfg), run, res in zip(named, runs, results):
        prof = precision_profile(profile, cfg.training.precision)
        sim_rate, sim_peak = _simulated(run, prof, cfg.performance.recompute)
        wire = res.bytes_per_sample or {}
        pred = res.predicted_bytes_per_sample or {}
        rows.append({
            "run": name,
            "samples_per_second": res.samples_per_second_steady or res.samples_per_second,
            "simulated_samples_per_second": sim_rate,
            "wire_bytes_per_sample": wire.get("activation", 0) + wire.get("gradient", 0),
            "predicted_wire_bytes_per_sample": pred.get("activation", 0) + pred.get("gradient", 0),
            "tensor_peak_mib": res.tensor_peak_mib,
            "simulated_peak_mib": sim_peak,
            "activations_max_mib": [k["activations"] / MIB for k in res.tensor_max_by_kind],
            "final_loss": res.final_loss,
        })
    print(json.dumps(rows, indent=1))
    base = rows[0]
    for r in rows[1:]:
        print(f"{r['run']:>16}: samples/s x{r['samples_per_second'] / base['samples_per_second']:.3f}, "
              f"wire bytes x{r['wire_bytes_per_sample'] / base['wire_bytes_per_sample']:.3f}, "
              f"tensor peak x{[round(a / b, 3) for a, b in zip(r['tensor_peak_mib'], base['tensor_peak_mib'])]}")


if __name__ == "__main__":
    main()
