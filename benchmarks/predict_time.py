"""The time per minibatch pipetrain predicts for each measured configuration, beside the measured one.

For a run's resolved plan (its ``--json`` object carries it, so ``auto`` is predicted for
what the planner chose) the prediction is the automatic choice's own method
(``pipetrain.auto.choose``, steps 4-5): the configuration rehearsed as its workers run it
(``pipetrain.run.rehearse.CandidateRehearsal``: every rank's actions, timed in this
process) and simulated on those unit times (``pipetrain.simulate.calibrated.predict_run``)
with a loopback calibration measured here at the run's number of ranks; the bytes on the
wires come from a profile measured here at the run's unit size. Should a rehearsal fail,
the profile alone is simulated, as before rehearsals existed (``source`` says which): a
flat topology at ``pipetrain.auto.quick.LOCAL_BANDWIDTH``, each stage's optimizer step
timed on tensors of its weights' sizes.

The measured counterpart is the run's steady-state time per minibatch
(``batch / samples_per_second_steady``), the definition the simulator's
``time_per_minibatch`` uses too. :class:`RoundPredictions` predicts every run right after it
ran (the calibration measured again in every round), as ``auto`` predicts right before its
run: a 2-core machine whose speed drifts 20-30% between rounds (a configuration's
samples/s from round to round, 2026-12-07) moves a prediction made minutes away by as much.
:func:`paired_error` compares the two as the benchmark's other ratios are compared: the
median over rounds of each round's predicted / measured.
"""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from bench_models import BenchModel


class TimePredictor:
    """Profiles of one benchmark model per unit size, and predictions from them."""

    def __init__(self, bm: BenchModel, seed: int = 0, repeats: int = 3,
                 calibrations: dict[int, Any] | None = None) -> None:
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
        #: ranks -> a loopback calibration (shared with other predictors; cleared to measure again)
        self.calibrations: dict[int, Any] = {} if calibrations is None else calibrations

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

    def calibration(self, ranks: int) -> Any:
        """A loopback calibration at ``ranks`` ranks of one thread (measured once)."""
        if ranks not in self.calibrations:
            from pipetrain.plan.calibrated import MEASURE, resolve_calibration

            self.calibrations[ranks] = resolve_calibration(MEASURE, ranks=ranks, threads=1)
        return self.calibrations[ranks]

    def predict(self, chosen: dict[str, Any], steps: int) -> dict[str, Any] | None:
        """pipetrain's prediction for a run (``chosen``: :func:`pipetrain_cli.chosen_configuration`)."""
        from pipetrain.plan.types import Plan
        from pipetrain.schedule import get_schedule

        if not chosen.get("plan") or not chosen.get("schedule"):
            return None
        from pipetrain.runtime.process.rss import workers_allocator

        plan = Plan.from_dict(chosen["plan"])
        spec = get_schedule(chosen["schedule"])
        m = int(chosen.get("microbatches") or 1)
        units = 1 if spec.unit == "minibatch" else m
        with workers_allocator():  # timed as the launcher's choice times it: under the workers' allocator
            profiled = self._simulated(plan, spec, m, units, dict(chosen.get("schedule_options") or {}), steps)
            try:  # rehearsed as long as the choice rehearses a candidate the profile predicts so
                return self._rehearsed(plan, spec.name, m, units, profiled["time_per_minibatch_s"])
            except Exception as e:  # noqa: BLE001 - a configuration the rehearsal cannot run: the profile's figure
                profiled["source"] = f"profile (the rehearsal failed: {type(e).__name__}: {e})"
                return profiled

    def _rehearsed(self, plan: Any, schedule: str, m: int, units: int, profiled: float) -> dict[str, Any]:
        from pipetrain.auto.choose import Candidate, plan_ties, scale_profile
        from pipetrain.job import TrainConfig
        from pipetrain.run.rehearse import CandidateRehearsal
        from pipetrain.simulate.calibrated import predict_run

        workers = plan.num_workers
        cfg = TrainConfig.of(model=self.bm.pipetrain_spec, batch_size=self.bm.batch_size, workers=workers,
                             threads=1, seed=self.seed)
        measured = CandidateRehearsal(cfg, workers, self.bm.batch_size)(Candidate(schedule, m, plan, profiled))
        profile = scale_profile(self.profile(self.bm.batch_size // units), units, self.bm.batch_size)
        pred = predict_run(plan, profile, self.calibration(workers), schedule, microbatches=m,
                           tied=plan_ties(self.captured.gm, plan), measured=measured)
        return {"time_per_minibatch_s": pred["time_per_minibatch"], "unit_samples": self.bm.batch_size // units,
                "config": plan.config, "schedule": schedule, "microbatches": m,
                "stage_unit_seconds": pred["stage_unit_seconds"],
                "source": "rehearsal + loopback calibration (pipetrain.auto.choose's method)"}

    def _simulated(self, plan: Any, spec: Any, m: int, units: int, options: dict[str, Any],
                   steps: int) -> dict[str, Any]:
        from pipetrain.auto.quick import LOCAL_BANDWIDTH
        from pipetrain.plan.types import Topology
        from pipetrain.simulate import StageCosts, simulate

        samples = self.bm.batch_size // units
        topo = plan.topology or Topology.flat(plan.num_workers, LOCAL_BANDWIDTH)
        costs = StageCosts.from_plan(plan, self.profile(samples), topo, units=1)
        costs = replace(costs, stages=[replace(c, step_time=self.step_time(list(st.nodes)))
                                       for c, st in zip(costs.stages, plan.stages)])
        period = math.lcm(*plan.replicas)  # pipedream: steps a multiple of every replica count
        sched = spec.build(plan.replicas, microbatches=m, steps=-(-max(steps, 3) // period) * period, **options)
        sim = simulate(sched, costs)
        return {"time_per_minibatch_s": sim.time_per_minibatch, "bubble_fraction": sim.bubble_fraction,
                "unit_samples": samples, "config": plan.config, "schedule": spec.name, "microbatches": m}


class RoundPredictions:
    """Every pipetrain run's prediction, made right after the run: one :class:`TimePredictor`
    per model (built at its first prediction) and one loopback calibration per rank count and
    round (:meth:`new_round` lets go of the last round's)."""

    def __init__(self, build: Callable[[str], BenchModel], seed: int = 0, repeats: int = 3) -> None:
        self.build = build
        self.seed = seed
        self.repeats = repeats
        self.calibrations: dict[int, Any] = {}
        self.predictors: dict[str, TimePredictor] = {}

    def new_round(self) -> None:
        """The next predictions measure their calibration again."""
        self.calibrations.clear()

    def predict(self, model: str, chosen: dict[str, Any], steps: int) -> dict[str, Any] | None:
        """:meth:`TimePredictor.predict` for a run of ``model``."""
        if model not in self.predictors:
            self.predictors[model] = TimePredictor(self.build(model), self.seed, self.repeats, self.calibrations)
        return self.predictors[model].predict(chosen, steps)

    def close(self) -> None:
        """Let go of every model and profile."""
        self.predictors.clear()
        self.calibrations.clear()


def paired_error(predicted: Sequence[float | None], measured: Sequence[float | None]) -> float | None:
    """``|median over rounds of predicted / measured - 1|``, over the rounds with both."""
    ratios = [p / m for p, m in zip(predicted, measured) if p and m]
    return abs(statistics.median(ratios) - 1.0) if ratios else None


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
