"""Each pipetrain configuration's predicted tensor memory per worker, beside the measured one.

The measured side is what ``pipetrain train --json`` reports per rank: ``tensor_peak_mib``,
the peak of the tensors the worker really holds (weights, gradients, optimizer state,
activations saved for backward, receive buffers, cached data; each storage once:
``pipetrain.runtime.guards.tensor_ledger``). The prediction is
``pipetrain.simulate.tensor_memory.predict_tensor_memory`` of the run's own plan and schedule (its
``--json`` carries them, so ``auto`` is predicted for what the planner chose), from a profile
of the same model measured here on the whole minibatch with the profiler's saved-for-backward
fields and the loss's: the same accounting on both sides, so the figures are byte counts that
agree to a few percent, not timings. The orchestrator calls it after the last round.
"""
from __future__ import annotations

import math
from typing import Any

from bench_models import BenchModel

MIB = 1024.0 * 1024.0


class MemoryPredictor:
    """A profile of one benchmark model (whole minibatch, saved bytes, loss) and predictions from it."""

    def __init__(self, bm: BenchModel, seed: int = 0) -> None:
        import torch

        from pipetrain.graph import capture
        from pipetrain.profile import profile_captured

        self.bm = bm
        inputs, target = bm.make_batch(bm.batch_size, torch.Generator().manual_seed(seed + 1))
        captured = capture(bm.model, tuple(inputs))
        self.profile = profile_captured(captured, tuple(inputs), batch_size=bm.batch_size, warmup=0, repeats=1,
                                        threads=1, optimizer="sgd", momentum=0.0, model_name=bm.pipetrain_spec,
                                        loss_fn=bm.loss_fn, target=target)
        self.target_bytes = float(target.numel() * target.element_size())

    def predict(self, chosen: dict[str, Any], steps: int, lookahead: int = 8) -> list[float] | None:
        """Peak MiB per worker of a run (``chosen``: ``pipetrain_cli.chosen_configuration``) whose
        timed segment has ``steps`` steps (the runtime's synthetic data caches that many)."""
        from pipetrain.plan.types import Plan
        from pipetrain.schedule import get_schedule
        from pipetrain.simulate.tensor_memory import predict_tensor_memory

        if not chosen.get("plan") or not chosen.get("schedule"):
            return None
        plan = Plan.from_dict(chosen["plan"])
        spec = get_schedule(chosen["schedule"])
        m = int(chosen.get("microbatches") or 1)
        units = 1 if spec.unit == "minibatch" else m
        period = math.lcm(*plan.replicas)
        sched = spec.build(plan.replicas, microbatches=units, steps=-(-max(steps, 2) // period) * period,
                           **dict(chosen.get("schedule_options") or {}))
        peaks = predict_tensor_memory(sched, plan, self.profile, optimizer_state=0.0, data_steps=steps,
                                      target_bytes=self.target_bytes, lookahead=lookahead)
        return [b / MIB for b in peaks]


def measured_tensor_peak(extra: dict[str, Any]) -> list[float] | None:
    """The run's measured tensor peak per worker in MiB (``tensor_peak_mib`` of its ``--json``)."""
    v = extra.get("tensor_peak_mib")
    if isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v):
        return [float(x) for x in v]
    return None
