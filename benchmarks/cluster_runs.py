"""One configuration of ``benchmarks/cluster.py``: train it on the emulated hosts, predict it.

:class:`ModelSetup` holds the benchmark model (captured once here) with its profiles per unit
size and its optimizer-step times per stage; :func:`run_config` trains one configuration
with one torchrun agent per host and returns its measured and predicted figures.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

#: The communication-heavy model: VGG-16 at 32x32 pixels with every width x 1/8 (convolutions
#: of 8..64 channels, 512-wide fully connected layers): 2.1 M parameters (8 MiB), 87 % of
#: them in the classifier, whose input is 64 values per sample before the 7x7 average pool.
MODEL = "vgg16"
MODEL_OPTIONS = {"image_size": 32, "width_mult": 0.125, "num_classes": 10, "dropout": 0.0}


def option_args() -> list[str]:
    out: list[str] = []
    for k, v in MODEL_OPTIONS.items():
        out += ["--option", f"{k}={v}"]
    return out


class ModelSetup:
    """The model captured here, its profiles per unit size and its step times per stage."""

    def __init__(self, batch_size: int, seed: int = 0, repeats: int = 5) -> None:
        import torch

        from pipetrain.graph import capture
        from pipetrain.models import get_model

        torch.set_num_threads(1)
        self.batch_size = batch_size
        self.repeats = repeats
        bundle = get_model(MODEL, batch_size=batch_size, **MODEL_OPTIONS)
        inputs, _ = bundle.make_batch(batch_size, torch.Generator().manual_seed(seed))
        self.inputs = tuple(inputs)
        self.captured = capture(bundle.model, self.inputs)
        self.profiles: dict[int, Any] = {}
        self.step_times: dict[tuple[str, ...], float] = {}
        self._values: dict[int, dict[str, Any]] = {}
        self._stage_seconds: dict[tuple[tuple[str, ...], int], float] = {}

    def profile(self, samples: int) -> Any:
        """The profile on units of ``samples`` samples (measured once, one thread)."""
        if samples not in self.profiles:
            from pipetrain.profile.profiler import profile_captured

            unit = tuple(x[:samples] for x in self.inputs)
            self.profiles[samples] = profile_captured(self.captured, unit, batch_size=samples, warmup=1,
                                                      repeats=self.repeats, threads=1, optimizer="sgd", momentum=0.0,
                                                      model_name=MODEL)
        return self.profiles[samples]

    def minibatch_profile(self, units: int) -> Any:
        """A profile of the whole minibatch made of ``units`` unit-size profiles: times and
        activations ``x units`` (so the simulator's division by ``units`` gives the unit's
        measured times back), parameters unchanged."""
        prof = self.profile(self.batch_size // units)
        if units == 1:
            return prof
        from pipetrain.profile.types import Profile

        nodes = [replace(n, forward_time=n.forward_time * units, backward_time=n.backward_time * units,
                         activation_bytes=n.activation_bytes * units) for n in prof.nodes]
        return Profile(prof.model, self.batch_size, nodes, prof.device, prof.optimizer,
                       prof.optimizer_state_bytes_per_parameter_byte)

    def unit_inputs(self, samples: int) -> tuple[Any, ...]:
        """The model's inputs for a unit: the first ``samples`` samples."""
        return tuple(x[:samples] for x in self.inputs)

    def node_values(self, samples: int) -> dict[str, Any]:
        """Every node's output on the first ``samples`` samples (one forward of the whole model)."""
        from pipetrain.auto.stage_timing import node_values

        if samples not in self._values:
            self._values[samples] = node_values(self.captured.gm, self.unit_inputs(samples))
        return self._values[samples]

    def concurrent_stage_seconds(self, plan: Any, units: int, window: float = 2.0) -> list[float]:
        """Forward + backward seconds of every stage as a whole, measured with one process per
        rank *at the same time* (rank ``i`` times the stage it runs, on a unit), as the run's
        workers share this machine's cores: on an emulated cluster every host is a process on
        the same CPUs, so a stage computes slower than alone. Each process repeats its stage
        for ``window`` seconds from a common start; the median iteration counts."""
        import multiprocessing as mp

        samples = self.batch_size // units
        ranks = [k for k, st in enumerate(plan.stages) for _ in range(st.replicas)]
        funcs = [self._stage_fn(list(plan.stages[k].nodes), samples) for k in sorted(set(ranks))]
        by_stage = dict(zip(sorted(set(ranks)), funcs))
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        start = time.time() + 0.5
        procs = [ctx.Process(target=_time_loop, args=(by_stage[k], start, window, i, q)) for i, k in enumerate(ranks)]
        for p in procs:
            p.start()
        got = dict(q.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(timeout=30)
        per_stage: dict[int, list[float]] = {}
        for i, k in enumerate(ranks):
            per_stage.setdefault(k, []).append(got[i])
        return [statistics.mean(per_stage[k]) for k in range(len(plan.stages))]

    def stage_seconds(self, nodes: list[str], samples: int) -> float:
        """Measured forward + backward seconds of the stage made of ``nodes`` as a whole, on a
        unit of ``samples`` samples (median of ``repeats``, one thread, alone)."""
        from pipetrain.auto.stage_timing import stage_seconds

        key = (tuple(nodes), samples)
        if key not in self._stage_seconds:
            self._stage_seconds[key] = stage_seconds(self.captured.gm, self.unit_inputs(samples), [nodes],
                                                     self.repeats, self.node_values(samples))[0]
        return self._stage_seconds[key]

    def _stage_fn(self, nodes: list[str], samples: int) -> Any:
        """A function timing one forward + backward of the stage made of ``nodes`` on a unit
        (:func:`pipetrain.auto.stage_timing.stage_function`)."""
        from pipetrain.auto.stage_timing import stage_function

        return stage_function(self.captured.gm, nodes, self.node_values(samples))

    def stage_profile(self, plan: Any, units: int, concurrent: bool = True) -> Any:
        """:meth:`minibatch_profile` with each stage's node times scaled so that they add up to
        the stage's measured time as a whole (:meth:`concurrent_stage_seconds`, or alone with
        ``concurrent=False``); the forward/backward split within a stage stays the per-node
        profile's (:func:`pipetrain.auto.stage_timing.refine_profile`)."""
        from pipetrain.auto.stage_timing import refine_profile

        prof = self.minibatch_profile(units)
        samples = self.batch_size // units
        measured = (self.concurrent_stage_seconds(plan, units) if concurrent else
                    [self.stage_seconds(list(st.nodes), samples) for st in plan.stages])
        # ``measured`` is a unit's seconds; ``prof`` holds ``units`` units' worth
        return refine_profile(prof, [list(st.nodes) for st in plan.stages], [secs * units for secs in measured])

    def step_time(self, nodes: list[str]) -> float:
        """Seconds of one SGD step (``_foreach_add_``) over the weights of ``nodes`` (median of 7)."""
        key = tuple(nodes)
        if key not in self.step_times:
            import torch

            names = set(nodes)
            gm = self.captured.gm
            shapes = [p.shape for n in gm.graph.nodes if n.name in names and n.op == "call_module"
                      for p in gm.get_submodule(str(n.target)).parameters(recurse=False)]
            ps = [torch.randn(s) for s in shapes]
            gs = [torch.randn(s) for s in shapes]
            runs = []
            for _ in range(7):
                t = time.perf_counter()
                if ps:
                    torch._foreach_add_(ps, gs, alpha=-0.01)
                runs.append(time.perf_counter() - t)
            self.step_times[key] = statistics.median(runs)
        return self.step_times[key]


def _time_loop(once: Any, start: float, window: float, index: int, q: Any) -> None:
    """In a forked process: wait for ``start``, run ``once`` until ``start + window``; put the median."""
    import torch

    torch.set_num_threads(1)
    once()
    time.sleep(max(0.0, start - time.time()))
    times = []
    while time.time() < start + window or len(times) < 3:
        times.append(once())
    q.put((index, statistics.median(times)))


def train_args(name: str, hosts: int, batch: int, steps: int, warmup: int, cal_path: Path) -> list[str]:
    """``pipetrain train`` arguments of configuration ``name``."""
    base = ["train", "--model", MODEL, *option_args(), "--batch-size", str(batch), "--steps", str(steps),
            "--warmup-steps", str(warmup), "--json", "--log-every", "0", "--threads", "1", "--seed", "0",
            "--timeout", "200"]
    if name == "dp":
        return base + ["--schedule", "dp"]
    if name == "planner":
        return base + ["--calibration", str(cal_path)]
    if name == "straight":
        return base + ["--config", "-".join(["1"] * hosts)]
    raise ValueError(name)


def run_config(cluster: Any, name: str, hosts: int, setup: ModelSetup, cal: Any, cal_path: Path, steps: int,
               warmup: int, timeout: float) -> dict[str, Any]:
    """Train configuration ``name`` across the cluster; measured and predicted figures."""
    from pipetrain.cluster.launch import launch_torchrun
    from pipetrain.plan.types import Plan
    from pipetrain.schedule import get_schedule
    from pipetrain.simulate.calibrated import predict_run

    batch = setup.batch_size
    t0 = time.monotonic()
    r = launch_torchrun(cluster, train_args(name, hosts, batch, steps, warmup, cal_path), nproc_per_node=1,
                        timeout=timeout)
    out: dict[str, Any] = {"wall_seconds": time.monotonic() - t0}
    j = r.json_output() if r.ok else None
    if j is None:
        out["error"] = r.describe_failure()[-800:]
        return out
    run = j.get("run") or {}
    plan = Plan.from_dict(run["plan"])
    spec = get_schedule(j["schedule"])
    m = int(j.get("microbatches") or 1)
    rate = j.get("samples_per_second_steady") or j.get("samples_per_second")
    total_samples = batch * int(j["steps"])  # bytes_sent counts the timed steps only
    out.update({
        "config": plan.config, "schedule": spec.name, "microbatches": m, "plan_source": j.get("plan_source"),
        "stage_first_nodes": j.get("stage_first_nodes"),
        "samples_per_second": rate, "samples_per_second_window": j.get("samples_per_second"),
        "time_per_minibatch": batch / rate if rate else None,
        "bytes_sent": j.get("bytes_sent"),
        "bytes_per_sample": sum(j.get("bytes_sent") or []) / total_samples if j.get("bytes_sent") else None,
    })
    if j.get("bytes_per_sample") is not None:  # per kind, once train --json reports it
        out["bytes_per_sample_by_kind"] = j["bytes_per_sample"]
    out["planner_predicted_time"] = plan.predicted_time  # the planner's own figure (quick profile), if planned
    units = 1 if spec.unit == "minibatch" else m
    step_times = [setup.step_time(list(s.nodes)) for s in plan.stages]
    options = run.get("schedule_options") or {}
    # predictions: stage times measured as a whole, alone (each host its own CPU: what a real
    # cluster sees; the headline), with every rank timing its stage at once on this machine's
    # shared cores (an upper bound: in a run the ranks are not all computing all the time), and
    # from the per-node profile as is (what the planner starts from)
    kinds = {"": setup.stage_profile(plan, units, concurrent=False),
             "_concurrent": setup.stage_profile(plan, units, concurrent=True),
             "_node_profile": setup.minibatch_profile(units)}
    measured = out["time_per_minibatch"]
    for suffix, prof in kinds.items():
        pred = predict_run(plan, prof, cal, spec.name, microbatches=m, steps=steps, options=options,
                           step_time=step_times)
        out["predicted_time_per_minibatch" + suffix] = pred["time_per_minibatch"]
        if measured:
            out["prediction_error" + suffix] = (pred["time_per_minibatch"] - measured) / measured
        if not suffix:
            out["predicted_bytes_per_sample"] = pred["bytes_per_sample"]["total"]
            out["predicted_bytes_per_sample_by_kind"] = pred["bytes_per_sample"]
    return out
