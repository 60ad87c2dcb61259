"""``pipetrain plan PROFILE``: partition a profiled model into replicated pipeline stages.

Examples::

    pipetrain plan tests/data/profiles/vgg16.txt --workers 16 --bandwidth 10Gbit --cost-model pipedream
    pipetrain plan model.json --workers 4,4 --bandwidth 300e9,1.25e9 --compare
    pipetrain plan model.json --workers 8 --memory 16GB --json --output plan.json   # or -o plan.json
    pipetrain plan model.json --workers 2 --calibration cal.json     # measured costs: schedule chosen too
    pipetrain plan model.json --workers 2 --calibration cal.json --schedule pipedream   # PipeDream's plan only

The plan is printed (a table, or one JSON object with ``--json``); it is written to a file
only when ``--output`` (``-o``) is given.

With measured link costs (``--calibration``) and no ``--schedule``, ``--microbatches``,
``--straight`` or ``--stages``, the planner also chooses the schedule and the microbatches
(:func:`pipetrain.auto.choose.choose_on_profile`, as ``train --schedule auto`` does on a profile
measured there): data parallelism, straight and replicated pipelines under every schedule the
registry marks ``auto``, each simulated on the calibrated costs; the fastest is printed with
its predicted time per minibatch and every other candidate. ``--schedule auto`` asks for it
explicitly. Without a calibration the plan is PipeDream's (section 3.1) for ``--schedule``
(default pipedream), on the bandwidths given.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import PlanError
from ..plan import PlanOptions, baselines, parse_topology, plan
from ..plan.cost import COST_MODELS, DEFAULT_COST_MODEL
from ..plan.stage_memory import MEMORY_SCHEDULES
from ..plan.types import Plan, Topology
from ..profile.io import load_profile
from ..profile.types import Profile

if TYPE_CHECKING:
    from ..cluster.calibration import Calibration


def register(subparsers: Any) -> None:
    """Add the ``plan`` subcommand."""
    p = subparsers.add_parser(
        "plan", help="partition a profiled model into pipeline stages (PipeDream's optimizer)",
        description="Find the stages and replica counts that minimise the time per minibatch. "
                    "PROFILE is a pipetrain JSON profile or a PipeDream .txt profile.",
    )
    p.add_argument("profile", metavar="PROFILE", help="profile file (.json, or PipeDream .txt)")
    p.add_argument("--workers", default="4", help="workers per level, innermost first, e.g. 16 or 4,4 (default 4)")
    p.add_argument("--bandwidth", default=None,
                   help="bytes/s per level, innermost first, e.g. 1.25e9 or 300e9,10Gbit "
                        "(default 10Gbit for one level)")
    p.add_argument("--calibration", default=None, metavar="FILE",
                   help="plan on measured link costs: a file from `pipetrain calibrate --output FILE`, or 'measure' "
                        "(loopback, now); sets the bandwidth, latency and all-reduce cost of the pipetrain model")
    p.add_argument("--memory", default=None, help="memory per worker in bytes (e.g. 16e9 or 16GB); default: no limit")
    p.add_argument("--straight", action="store_true", help="no replication: one worker per stage")
    p.add_argument("--stages", type=int, default=None, metavar="K", help="use exactly K stages (flat topologies)")
    p.add_argument("--cost-model", default=DEFAULT_COST_MODEL, choices=COST_MODELS,
                   help=f"cost model (default {DEFAULT_COST_MODEL})")
    p.add_argument("--schedule", default=None, choices=(*MEMORY_SCHEDULES, "auto"),
                   help="schedule whose memory rule --memory checks (default pipedream); 'auto' (the default with "
                        "--calibration): choose the schedule and microbatches too")
    p.add_argument("--microbatches", type=int, default=None,
                   help="microbatches per minibatch (flush/2bw/gpipe memory; default 1, or chosen under auto)")
    p.add_argument("--batch-size", type=int, default=None, help="samples per minibatch (default: the profile's)")
    p.add_argument("--max-states", type=int, default=2048, help="most DAG states before coarsening (default 2048)")
    p.add_argument("--no-recompute", dest="recompute", action="store_false",
                   help="with --memory, never let a stage recompute its activations (by default a stage that "
                        "would not fit otherwise does, marked \"recompute\": true in the plan)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                   help="bf16: plan with activation and wire bytes halved (train --precision bf16)")
    p.add_argument("--compare", action="store_true",
                   help="also evaluate the baselines (data parallel, uniform, by parameters, by time)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--output", "-o", default=None, metavar="PLAN.json",
                   help="save the plan here (not saved unless given), as `profile -o` saves a profile")
    p.set_defaults(func=run)


def _topology(args: argparse.Namespace) -> Topology:
    bandwidth = args.bandwidth
    if bandwidth is None:
        levels = [w for w in str(args.workers).replace("x", ",").split(",") if w.strip()]
        if len(levels) > 1:
            raise PlanError(f"--workers {args.workers} has {len(levels)} levels; "
                            "give --bandwidth with one value per level, e.g. 300e9,10Gbit")
        bandwidth = "1.25e9"
    return parse_topology(args.workers, bandwidth, args.memory)


@dataclass
class _Planned:
    """What ``pipetrain plan`` prints: the plan, the automatic choice (or None), the topology
    and options it was planned on (also ``--compare``'s), and the calibration (or None)."""

    plan: Plan
    choice: Any
    topology: Topology
    options: PlanOptions
    calibration: Calibration | None


def _calibrated(args: argparse.Namespace, options: PlanOptions,
                measure_at_workers: bool = False) -> tuple[Topology, PlanOptions, Calibration]:
    """The topology and options of ``--calibration``: flat, at the measured costs, and the
    calibration. ``measure_at_workers``: ``measure`` runs with the plan's number of ranks
    (else 2), so the all-reduce fit is at that count."""
    from dataclasses import replace

    from ..plan.calibrated import calibrated_params, calibrated_topology, resolve_calibration

    if args.bandwidth is not None:
        raise PlanError(f"--calibration sets the bandwidth from measurements, but --bandwidth {args.bandwidth} was "
                        f"given too; drop one of them")
    levels = [w for w in str(args.workers).replace("x", ",").split(",") if w.strip()]
    if len(levels) != 1 or not levels[0].strip().isdigit() or int(levels[0]) < 1:
        raise PlanError(f"--calibration plans on one flat level of workers, but --workers is {args.workers!r}; "
                        f"give one count, e.g. --workers 2")
    if args.cost_model != "pipetrain":
        raise PlanError(f"--calibration sets the pipetrain cost model's constants, but --cost-model is "
                        f"{args.cost_model}; drop --cost-model or --calibration")
    workers = int(levels[0])
    cal = resolve_calibration(args.calibration, ranks=workers if measure_at_workers and workers >= 2 else 2)
    assert cal is not None  # called only when --calibration was given
    topology = calibrated_topology(cal, workers, parse_topology("1", "1", args.memory).memory_per_worker)
    return topology, replace(options, cost_params=calibrated_params(cal, options.cost_params.minibatches)), cal


def _ms(t: float | None) -> str:
    return "-" if t is None or not math.isfinite(t) else f"{t * 1e3:.3f} ms"


def _bytes(b: float | None) -> str:
    if b is None:
        return "-"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= div:
            return f"{b / div:.2f} {unit}"
    return f"{b:.0f} B"


def _summary(p: Plan) -> dict[str, Any]:
    return {"config": p.config, "predicted_time": p.predicted_time, "data_parallel_time": p.data_parallel_time,
            "speedup_over_data_parallel": p.speedup_over_data_parallel,
            "stages": [{"nodes": s.nodes, "replicas": s.replicas} for s in p.stages]}


def _is_auto(args: argparse.Namespace) -> bool:
    """Whether the schedule and microbatches are chosen too (module docstring)."""
    if args.schedule == "auto":
        for flag, given in (("--straight", args.straight), ("--stages", args.stages is not None)):
            if given:
                raise PlanError(f"--schedule auto chooses the stages and replicas itself, but {flag} was given; "
                                f"drop {flag}, or name a schedule")
        if args.calibration is None:
            raise PlanError("--schedule auto compares configurations on measured link costs: pass --calibration FILE "
                            "(from `pipetrain calibrate --output FILE`) or --calibration measure")
        return True
    return (args.schedule is None and args.calibration is not None and args.microbatches is None
            and not args.straight and args.stages is None)


def _choose(args: argparse.Namespace, profile: Any) -> _Planned:
    """The automatic choice on the profile: its plan (with the choice in ``extra["auto"]``),
    the choice, and the calibrated topology and options (for ``--compare``)."""
    from ..auto.choose import choose_on_profile

    # --microbatches is checked as the planner checks it (one line naming the flag); the
    # options serve --compare's baselines.
    options = PlanOptions(cost_model=args.cost_model, max_states=args.max_states,
                          microbatches=1 if args.microbatches is None else args.microbatches)
    topology, options, cal = _calibrated(args, options, measure_at_workers=True)
    choice = choose_on_profile(profile, topology.total_workers, cal,
                               microbatches=args.microbatches, memory_limit=topology.memory_per_worker,
                               max_states=args.max_states)
    result = choice.best.plan
    assert result is not None  # the best candidate is runnable, so planned
    result.extra["auto"] = choice.to_json()
    return _Planned(result, choice, topology, options, cal)


def _plan_for_schedule(args: argparse.Namespace, profile: Any) -> _Planned:
    """PipeDream's plan for ``--schedule`` (default pipedream), on the calibrated costs when
    ``--calibration`` is given, else on the bandwidths given."""
    options = PlanOptions(straight=args.straight, cost_model=args.cost_model, num_stages=args.stages,
                          schedule=args.schedule or "pipedream",
                          microbatches=1 if args.microbatches is None else args.microbatches,
                          max_states=args.max_states, recompute=args.recompute, precision=args.precision)
    cal = None
    if args.calibration is not None:
        from ..plan.calibrated import slowed

        topology, options, cal = _calibrated(args, options)
        profile = slowed(profile, cal.compute_slowdown)  # as plan_with_calibration: compute as inside a run
    else:
        topology = _topology(args)
    return _Planned(plan(profile, topology, options), None, topology, options, cal)


def _simulated_data_parallel(choice: Any) -> float | None:
    """The data-parallel candidate's simulated time per minibatch, if one was runnable."""
    if choice is None:
        return None
    from ..schedule import get_schedule

    return next((c.predicted_time for c in choice.runnable if get_schedule(c.schedule).one_stage), None)


def _load(args: argparse.Namespace) -> Profile:
    """``PROFILE``, with ``--batch-size`` when given."""
    profile = load_profile(args.profile)
    if args.batch_size is not None:
        if args.batch_size <= 0:
            raise PlanError(f"--batch-size {args.batch_size} must be positive")
        profile.batch_size = args.batch_size
    return profile


def _throughput(planned: _Planned, profile: Profile) -> dict[str, float | None]:
    """Minibatches and samples per second at the predicted time per minibatch (the simulated
    one under the automatic choice)."""
    choice = planned.choice
    t = (choice.best.predicted_time if choice is not None else planned.plan.predicted_time) or math.inf
    return {"minibatches_per_second": 1.0 / t if t > 0 else math.inf,
            "samples_per_second": profile.batch_size / t if profile.batch_size and t > 0 else None}


def _print_json(planned: _Planned, base: dict[str, Plan], throughput: dict[str, float | None],
                compare: bool) -> None:
    result, choice = planned.plan, planned.choice
    d = result.to_dict()
    d["throughput"] = throughput
    d["num_workers"] = result.num_workers
    if choice is not None:
        d["schedule"], d["microbatches"] = choice.best.schedule, choice.best.microbatches
        d["predicted_time_per_minibatch"] = choice.best.predicted_time
    if compare:
        d["baselines"] = {name: _summary(b) for name, b in base.items()}
    json.dump(d, sys.stdout)
    sys.stdout.write("\n")


def _print_stages(args: argparse.Namespace, profile: Profile, planned: _Planned) -> None:
    """The header line, one line per stage and the plan's configuration."""
    result, topology = planned.plan, planned.topology
    levels = " x ".join(f"{lv.workers} @ {lv.bandwidth / 1e9:.4g} GB/s" for lv in topology.levels)
    print(f"plan for {profile.model or args.profile} ({len(profile)} nodes, batch {profile.batch_size or '?'}) on "
          f"{topology.total_workers} workers ({levels}), cost model {result.cost_model}")
    print(f"{'stage':>5}  {'nodes':<28} {'count':>5}  {'replicas':>8}  {'compute':>12}  {'memory/worker':>13}")
    for k, s in enumerate(result.stages):
        span = s.nodes[0] if len(s.nodes) == 1 else f"{s.nodes[0]}..{s.nodes[-1]}"
        print(f"{k:>5}  {span:<28} {len(s.nodes):>5}  {s.replicas:>8}  {_ms(s.compute_time):>12}  "
              f"{_bytes(s.memory_bytes):>13}")
    idle = result.extra.get("idle_workers")
    print(f"config: {result.config}" + (f"  ({result.extra['idle_workers']} workers idle)" if idle else ""))


def _print_times(planned: _Planned, throughput: dict[str, float | None]) -> None:
    """The predicted time per minibatch, the throughput, data parallelism's time and the solve."""
    result, choice = planned.plan, planned.choice
    if choice is not None:
        from ..auto.choose import summary_lines

        print("\n".join(summary_lines(choice)))
        print(f"predicted time per minibatch: {_ms(choice.best.predicted_time)} ({choice.best.schedule} "
              f"m={choice.best.microbatches}, simulated; the planner's cost model for these stages: "
              f"{_ms(result.predicted_time)})")
    else:
        print(f"predicted time per minibatch: {_ms(result.predicted_time)}")
    line = f"throughput: {throughput['minibatches_per_second']:.3f} minibatches/s"
    if throughput["samples_per_second"] is not None:
        line += f", {throughput['samples_per_second']:.1f} samples/s"
    print(line)
    sp = result.speedup_over_data_parallel
    dp = _simulated_data_parallel(choice)
    if dp is not None and choice is not None and choice.best.predicted_time:
        print(f"data parallelism (simulated as above): {_ms(dp)} per minibatch; the choice is "
              f"{dp / choice.best.predicted_time:.3f}x faster")
    else:
        print(f"data parallelism: {_ms(result.data_parallel_time)} per minibatch; speedup {sp:.3f}x"
              if sp else "data parallelism: -")
    st = result.extra.get("states")
    if st is not None:
        print(f"solved in {result.solve_seconds:.3f} s ({st['count']} states, {st['mode']})")


def _print_baselines(result: Plan, base: dict[str, Plan]) -> None:
    print()
    print(f"{'method':<14} {'config':<24} {'time/minibatch':>15} {'speedup vs DP':>14}")
    rows = [("planner", result)] + list(base.items())
    for name, b in rows:
        cfg = b.config if len(b.config) <= 24 else b.config[:21] + "..."
        print(f"{name:<14} {cfg:<24} {_ms(b.predicted_time):>15} {b.speedup_over_data_parallel or 0:>13.3f}x")


def _worker_memory(args: argparse.Namespace, profile: Profile, planned: _Planned) -> Any:
    """Every worker's predicted peak under the plan's schedule and microbatches
    (:mod:`pipetrain.plan.worker_memory`), as ``extra["worker_memory"]`` records it."""
    from ..plan.worker_memory import memory_json, worker_memory

    p, choice = planned.plan, planned.choice
    schedule = choice.best.schedule if choice is not None else (args.schedule or "pipedream")
    m = choice.best.microbatches if choice is not None else (args.microbatches or 1)
    workers = worker_memory(profile, p, [p.ranks_of_stage(k) for k in range(p.num_stages)], schedule, m)
    return memory_json(workers, planned.topology.memory_per_worker, f"profile {args.profile}, schedule {schedule}, "
                                                                    f"{m} microbatches")


def run(args: argparse.Namespace) -> int:
    """Plan ``PROFILE`` on the given topology, print the plan (table or JSON), optionally save it."""
    profile = _load(args)
    planned = _choose(args, profile) if _is_auto(args) else _plan_for_schedule(args, profile)
    result, choice = planned.plan, planned.choice
    result.batch_size = profile.batch_size
    if planned.calibration is not None:
        from ..plan.calibrated import calibration_summary

        result.extra["calibration"] = calibration_summary(planned.calibration)
    result.extra["worker_memory"] = _worker_memory(args, profile, planned)
    base = baselines(profile, planned.topology, args.cost_model, planned.options.cost_params) if args.compare else {}
    if args.output:
        # `pipetrain simulate PLAN` finds the profile through this path, relative to the plan file.
        result.extra["profile_path"] = os.path.relpath(os.path.abspath(args.profile),
                                                       os.path.dirname(os.path.abspath(args.output)))
        result.save(args.output)
    throughput = _throughput(planned, profile)
    if args.json:
        _print_json(planned, base, throughput, args.compare)
        return 0
    _print_stages(args, profile, planned)
    _print_times(planned, throughput)
    if args.compare:
        _print_baselines(result, base)
    if args.output:
        print(f"plan written to {args.output}")
        if choice is not None:
            print(f"train it with: pipetrain train --plan {args.output} --schedule {choice.best.schedule} "
                  f"--microbatches {choice.best.microbatches}")
    return 0
