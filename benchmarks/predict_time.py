"""The simulator's time per minibatch of each pipetrain configuration, beside the measured one.

For a run's resolved plan (its ``--json`` object carries it, so ``auto`` is predicted for
what the planner chose) the prediction is ``pipetrain.simulate.simulate`` of the run's
schedule on :meth:`StageCosts.from_plan` with a profile *measured here at the run's unit
size* (``pipetrain.profile.profile_captured`` on ``batch / units`` samples, one thread; a
PipeDream unit is the whole minibatch): per-node times do not scale linearly with the unit
size on a CPU, so each unit size gets its own profile (cached). Each stage's optimizer step
is timed on tensors of its weights' sizes (SGD: one ``_foreach_add_``). Communication uses a
flat topology of the run's workers at ``pipetrain.plan.quick.LOCAL_BANDWIDTH`` unless the plan
carries its own topology.

The measured counterpart is the run's steady-state time per minibatch
(``batch / samples_per_second_steady``), the definition the simulator's
``time_per_minibatch`` uses too. The orchestrator calls :func:`predict_run` after the last
round (no tensor work between measured runs).
"""
from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Any

from bench_models import BenchModel


class TimePredictor:
    """Profiles of one benchmark model per unit size, and predictions from them."""

    def __init__(self, bm: BenchModel, seed: int = 0, repeats: int = 3) -> None:
        import torch

        from pipetrain.graph import capture

        self.bm = bm
        self.seed = seed
        self.repeats = repeats
        inputs, _ = bm.make_batch(bm.batch_size, torch.Generator().manual_seed(seed + 1))
        self.inputs = tuple(inputs)
        self.captured = capture(bm.model, self.inputs)
        self.profiles: dict[int, Any] = {}
        self.step_times: dict[tuple[str, ...], float] = {}

    def profile(self, samples: int) -> Any:
        """The profile of the model on units of ``samples`` samples (measured once)."""
        if samples not in self.profiles:
            from pipetrain.profile import profile_captured

            unit = tuple(a[:samples] for a in self.inputs)
            self.profiles[samples] = profile_captured(self.captured, unit, batch_size=samples, warmup=1,
                                                      repeats=self.repeats, threads=1, optimizer="sgd",
                                                      momentum=0.0, model_name=self.bm.pipetrain_spec)
        return self.profiles[samples]

    def step_time(self, nodes: list[str]) -> float:
        """Seconds of one SGD step over the weights of ``nodes`` (median of 5)."""
        key = tuple(nodes)
        if key not in self.step_times:
            import torch

            names = set(nodes)
            shapes = [p.shape for n in self.captured.gm.graph.nodes if n.name in names and n.op == "call_module"
                      for p in self.captured.gm.get_submodule(str(n.target)).parameters(recurse=False)]
            ps = [torch.randn(s) for s in shapes]
            gs = [torch.randn(s) for s in shapes]
            runs = []
            for _ in range(5):
                t = time.perf_counter()
                if ps:
                    torch._foreach_add_(ps, gs, alpha=-0.01)
                runs.append(time.perf_counter() - t)
            self.step_times[key] = sorted(runs)[2]
        return self.step_times[key]

    def predict(self, chosen: dict[str, Any], steps: int) -> dict[str, Any] | None:
        """The simulator's figures for a run (``chosen``: :func:`pipetrain_cli.chosen_configuration`)."""
        from pipetrain.auto.quick import LOCAL_BANDWIDTH
        from pipetrain.plan.types import Plan, Topology
        from pipetrain.schedule import get_schedule
        from pipetrain.simulate import StageCosts, simulate

        if not chosen.get("plan") or not chosen.get("schedule"):
            return None
        plan = Plan.from_dict(chosen["plan"])
        spec = get_schedule(chosen["schedule"])
        m = int(chosen.get("microbatches") or 1)
        units = 1 if spec.unit == "minibatch" else m
        samples = self.bm.batch_size // units
        topo = plan.topology or Topology.flat(plan.num_workers, LOCAL_BANDWIDTH)
        costs = StageCosts.from_plan(plan, self.profile(samples), topo, units=1)
        costs = replace(costs, stages=[replace(c, step_time=self.step_time(list(st.nodes)))
                                       for c, st in zip(costs.stages, plan.stages)])
        options = dict(chosen.get("schedule_options") or {})
        period = math.lcm(*plan.replicas)  # pipedream: steps a multiple of every replica count
        sched = spec.build(plan.replicas, microbatches=m, steps=-(-max(steps, 3) // period) * period, **options)
        sim = simulate(sched, costs)
        return {"time_per_minibatch_s": sim.time_per_minibatch, "bubble_fraction": sim.bubble_fraction,
                "unit_samples": samples, "config": plan.config, "schedule": spec.name, "microbatches": m}


def measured_time(extra: dict[str, Any], samples_per_second: float | None, batch: int) -> float | None:
    """A run's measured time per minibatch: steady-state if reported, else the window's."""
    rate = extra.get("samples_per_second_steady") or samples_per_second
    return batch / rate if rate else None


def cli_prediction(extra: dict[str, Any]) -> float | None:
    """The time per minibatch ``pipetrain train --json`` itself predicted, if it reports one
    (``predicted_time_per_minibatch_s`` or ``predicted_time_per_minibatch``; else the plan's
    ``predicted_time``, the planner's figure for the plan it chose)."""
    for key in ("predicted_time_per_minibatch_s", "predicted_time_per_minibatch"):
        v = extra.get(key)
        if isinstance(v, (int, float)) and v > 0:
            return float(v)
    plan = (extra.get("chosen") or {}).get("plan") or {}
    v = plan.get("predicted_time")
    return float(v) if isinstance(v, (int, float)) and v > 0 else None
