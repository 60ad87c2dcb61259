"""``pipetrain simulate``: run a schedule in the discrete-event simulator.

Two modes:

- from a plan: ``pipetrain simulate PLAN --schedule NAME --minibatches N [--microbatches m]
  [--profile PROFILE]`` (the profile path defaults to ``plan.extra["profile_path"]``; the
  network comes from the plan's topology);
- synthetic: ``pipetrain simulate --stages P --microbatches M --forward-time F
  --backward-time B --schedule NAME [--replicas 2,1,1] [--virtual-stages v]``, where ``M``
  is the number of units flowing through the pipeline: the microbatches of one minibatch
  (gpipe, flush, 2bw, interleaved, zerobubble, dp; ``--minibatches`` repeats it), whole
  minibatches for pipedream.

Outputs: a summary (or one JSON object with ``--json``), the action grid with
``--print-schedule``, a Gantt picture with ``--timeline out.png|svg`` and a Chrome trace with
``--trace out.json``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..errors import PipetrainError, ProfileError, ScheduleError
from ..schedule.registry import SCHEDULE_NAMES, ScheduleSpec


def register(subparsers: Any) -> None:
    """Add the ``simulate`` subcommand."""
    p = subparsers.add_parser(
        "simulate",
        help="simulate a pipeline schedule (from a plan and profile, or with synthetic stage times)",
        description="Run a pipeline schedule in the discrete-event simulator, either on a plan and its profile "
                    "or with synthetic per-stage times (--stages, --microbatches, --forward-time, --backward-time).",
    )
    p.add_argument("plan", nargs="?", help="plan JSON written by `pipetrain plan --output` (omit for synthetic mode)")
    p.add_argument("--schedule", default="pipedream",
                   help=f"{', '.join(SCHEDULE_NAMES)} (default: pipedream)")
    p.add_argument("--minibatches", type=int, default=None,
                   help="minibatches (optimizer steps) to simulate; required with a plan, default 1 when synthetic")
    p.add_argument("--microbatches", type=int, default=None,
                   help="with a plan: microbatches per minibatch (default: the schedule's rule, "
                        "max(stages, replicas) rounded up to what it accepts; 1 for pipedream); "
                        "synthetic: units flowing through the pipeline (minibatches for pipedream)")
    p.add_argument("--profile", help="profile JSON/TXT the plan was made from (default: plan.extra['profile_path'])")
    p.add_argument("--stages", type=int, help="synthetic mode: number of stages (ranks for interleaved)")
    p.add_argument("--forward-time", type=float, help="synthetic mode: forward seconds per stage per unit")
    p.add_argument("--backward-time", type=float, help="synthetic mode: backward seconds per stage per unit")
    p.add_argument("--replicas", help="synthetic mode: replicas per stage, comma-separated, e.g. 2,1,1")
    p.add_argument("--virtual-stages", type=int, default=None,
                   help="interleaved: model chunks per rank (default 2); the stage count is stages x this")
    p.add_argument("--vertical-sync", action="store_true", help="pipedream: vertical sync of weight versions")
    p.add_argument("--step-time", type=float, default=0.0, help="seconds of one optimizer step (default 0)")
    p.add_argument("--latency", type=float, default=0.0, help="seconds added to every transfer (default 0)")
    p.add_argument("--timeline", help="write a Gantt picture (.png or .svg)")
    p.add_argument("--trace", help="write a Chrome trace JSON (open in https://ui.perfetto.dev)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    p.add_argument("--print-schedule", action="store_true", help="print the per-worker action grid")
    p.set_defaults(func=run)


#: Most (stage, unit) pairs the CLI simulates: about 110 us and 5 KB each on a laptop core, so
#: this bounds a run to roughly a minute and a few GB. Steady-state figures need far fewer.
MAX_STAGE_UNITS = 500_000


def _check_size(num_stages: int, units: int, flags: str) -> None:
    """Refuse simulations so large they would run for many minutes (or exhaust memory)."""
    if num_stages * units > MAX_STAGE_UNITS:
        raise ScheduleError(
            f"{flags} asks for {units:,} units through {num_stages} stages ({num_stages * units:,} stage-units); "
            f"the simulator takes at most {MAX_STAGE_UNITS:,} (about a minute); steady-state figures need only "
            f"a few dozen minibatches, so lower {' or '.join(w for w in flags.split() if w.startswith('--'))}"
        )


def _check_seconds(value: float, flag: str) -> None:
    if not 0 <= value < float("inf"):
        raise ScheduleError(f"{flag} must be a finite number of seconds >= 0, got {value!r}; pass e.g. {flag} 0.001")


def _parse_replicas(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ScheduleError(f"--replicas must be comma-separated integers such as 2,1,1; got {text!r}") from None


def _options(spec: ScheduleSpec, args: argparse.Namespace) -> dict[str, Any]:
    """The schedule's options from the flags; a flag the schedule does not take is an error."""
    from ..schedule import SCHEDULES

    if args.virtual_stages is not None and args.virtual_stages < 1:
        raise ScheduleError(f"--virtual-stages must be >= 1 (got {args.virtual_stages}); model chunks per rank, "
                            f"e.g. --virtual-stages 2")
    given = {"vertical_sync": True if args.vertical_sync else None, "virtual_stages": args.virtual_stages}
    for option, value in given.items():
        if value is not None and option not in spec.options:
            takers = [s.name for s in SCHEDULES.values() if option in s.options]
            raise ScheduleError(f"--{option.replace('_', '-')} applies to {', '.join(takers)} only, not "
                                f"{spec.name!r}; drop it")
    return spec.check_options(given)


def _build(args: argparse.Namespace) -> tuple[Any, Any]:
    """(schedule, costs) from the arguments, in plan or synthetic mode."""
    from ..schedule import get_schedule
    from ..simulate import StageCosts

    spec = get_schedule(args.schedule)
    options = _options(spec, args)
    whole = spec.unit == "minibatch"  # units are whole minibatches (pipedream)
    if args.microbatches is not None and args.microbatches < 1:
        raise ScheduleError(f"--microbatches must be >= 1 (got {args.microbatches})")
    if args.minibatches is not None and args.minibatches < 1:
        raise ScheduleError(f"--minibatches must be >= 1 (got {args.minibatches})")
    _check_seconds(args.step_time, "--step-time")
    _check_seconds(args.latency, "--latency")

    if args.plan:
        from ..plan.types import Plan
        from ..profile import load_profile

        plan = Plan.load(args.plan)
        if args.minibatches is None:
            raise ScheduleError("simulating a plan needs --minibatches N (minibatches to run, e.g. 16)")
        profile_path = args.profile or plan.extra.get("profile_path")
        if not profile_path:
            raise ProfileError(f"plan {args.plan!r} names no profile (extra.profile_path); pass --profile PROFILE")
        if not args.profile and not Path(profile_path).is_absolute() and not Path(profile_path).exists():
            # A relative path recorded in the plan is relative to the plan file.
            profile_path = Path(args.plan).parent / profile_path
        profile = load_profile(str(profile_path))
        replicas = plan.replicas
        if whole:
            if args.microbatches not in (None, 1):
                raise ScheduleError(f"{spec.name} moves whole minibatches: drop --microbatches (or use flush/2bw)")
            m, steps, units = 1, args.minibatches, 1
        else:
            rank_reps = spec.rank_replicas(replicas, options)
            m = (args.microbatches if args.microbatches is not None
                 else spec.default_microbatches(len(rank_reps), rank_reps))
            steps, units = args.minibatches, m
        _check_size(len(replicas), m * steps, f"--minibatches {steps}" + (f" x --microbatches {m}" if m > 1 else ""))
        schedule = spec.build(replicas, m, steps, **options)
        costs = StageCosts.from_plan(plan, profile, units=units, step_time=args.step_time, latency=args.latency)
        return schedule, costs

    missing = [flag for flag, val in (("--stages", args.stages), ("--microbatches", args.microbatches),
                                      ("--forward-time", args.forward_time), ("--backward-time", args.backward_time))
               if val is None]
    if missing:
        raise ScheduleError(
            f"give a PLAN file, or the synthetic mode's {', '.join(missing)} "
            f"(e.g. --stages 4 --microbatches 8 --forward-time 1 --backward-time 2)"
        )
    if args.profile:
        raise ScheduleError("--profile needs a PLAN; the synthetic mode takes --forward-time/--backward-time instead")
    P = args.stages
    if P < 1:
        raise ScheduleError(f"--stages must be >= 1 (got {P})")
    _check_seconds(args.forward_time, "--forward-time")
    _check_seconds(args.backward_time, "--backward-time")
    replicas = _parse_replicas(args.replicas) if args.replicas else ([P] if spec.one_stage else [1] * P)
    if not spec.replicates:
        if args.replicas and any(r != 1 for r in replicas):
            raise ScheduleError(f"{spec.name} does not replicate stages; drop --replicas (got {args.replicas})")
        replicas = [1] * spec.model_stages(P, options)
    elif spec.one_stage:
        if len(replicas) != 1:
            raise ScheduleError(f"{spec.name} runs one stage: give --replicas N (one number), got {args.replicas}")
    elif len(replicas) != P:
        raise ScheduleError(f"--replicas lists {len(replicas)} stages but --stages is {P}; give one count per stage")
    units = args.microbatches * (1 if whole else args.minibatches or 1)
    _check_size(len(replicas), units, f"--microbatches {args.microbatches}"
                + ("" if whole else f" x --minibatches {args.minibatches or 1}"))
    if whole:
        schedule = spec.build(replicas, 1, args.microbatches, **options)
    else:
        schedule = spec.build(replicas, args.microbatches, args.minibatches or 1, **options)
    costs = StageCosts.synthetic(len(replicas), args.forward_time, args.backward_time, step_time=args.step_time)
    costs.latency = args.latency
    return schedule, costs


def run(args: argparse.Namespace) -> int:
    """Build, validate and simulate the schedule the arguments describe; returns the exit code."""
    from ..schedule import get_schedule, validate
    from ..simulate import save_gantt, save_trace, simulate, to_chrome_trace

    schedule, costs = _build(args)
    validate(schedule)
    result = simulate(schedule, costs)
    if args.print_schedule:
        print(schedule.grid(), file=sys.stderr if args.json else sys.stdout)
    if args.timeline:
        save_gantt(result, args.timeline)
    if args.trace:
        try:
            save_trace(to_chrome_trace(result), args.trace)
        except OSError as e:
            raise PipetrainError(f"cannot write trace {args.trace!r}: {e.strerror}; choose a writable path") from None
    summary = result.summary()
    if args.json:
        print(json.dumps(summary))
        return 0
    units = (f"{summary['steps']} minibatches" if get_schedule(schedule.name).unit == "minibatch"
             else f"{summary['microbatches']} microbatches x {summary['steps']} minibatches")
    print(f"schedule {summary['schedule']}: {summary['stages']} stages on {summary['workers']} workers "
          f"(replicas {'-'.join(map(str, summary['replicas']))}), {units}")
    print(f"  makespan            {result.makespan:.6g} s")
    print(f"  time per minibatch  {result.time_per_minibatch:.6g} s"
          + (" (steady state)" if result.steady_window else ""))
    print(f"  throughput          {result.throughput:.6g} minibatches/s")
    print(f"  bubble fraction     {result.bubble_fraction:.2%}")
    for r in range(result.num_workers):
        print(f"  rank {r}: busy {result.busy_time[r]:.6g} s, peak memory {result.peak_memory[r]:.6g} B, "
              f"peak in flight {result.peak_in_flight[r]}, weight versions {result.peak_versions[r]}"
              + (f", recompute {result.recompute_time[r]:.6g} s of it" if result.recompute_time[r] else ""))
    if args.timeline:
        print(f"timeline written to {args.timeline}")
    if args.trace:
        print(f"trace written to {args.trace}")
    return 0
