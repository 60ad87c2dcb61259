"""``plan(profile, topology, options) -> Plan``: the planner's entry point (a pure function).

Example::

    >>> from pipetrain.profile.io import load_profile
    >>> from pipetrain.plan import plan, PlanOptions, parse_topology
    >>> prof = load_profile("tests/data/profiles/vgg16.txt")                # doctest: +SKIP
    >>> p = plan(prof, parse_topology("16", "1.25e9"), PlanOptions(cost_model="pipedream"))
    >>> p.config, p.speedup_over_data_parallel                              # doctest: +SKIP
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace

from ..errors import PlanError
from ..profile.types import Profile
from .cost import DEFAULT_COST_MODEL, CostParams, data_parallel_time, evaluate_detail, get_cost_model, stage_arrays
from .dag import Dag, States, build_states, coarsen
from .partition import Problem, Solution, fill_idle, hierarchy_dict, leaves, solve
from .recompute import WIRE_SCALE, precision_profile, recompute_profile
from .stage_memory import MEMORY_SCHEDULES, MemoryModel, stage_memory
from .topology import check_topology
from .types import Plan, Stage, Topology


@dataclass
class PlanOptions:
    """What to optimise and under which constraints.

    Attributes:
        straight: no replication (every stage, and every block at outer levels, on one unit).
        cost_model: ``"pipetrain"`` (default: overlapped communication, ring all-reduce,
            latency, amortised fill) or ``"pipedream"`` (the published formula, exactly).
        cost_params: constants of the pipetrain model (latency, overlap, minibatches).
        memory_limit: bytes per worker a stage may use; None: ``topology.memory_per_worker``;
            both None: no limit.
        schedule: the schedule whose memory is checked: ``pipedream`` (weight stashing, the
            default), ``flush``, ``2bw`` or ``gpipe``.
        microbatches: microbatches per minibatch for the flush/2bw/gpipe memory rules.
        num_stages: use exactly this many stages (flat topologies only); None: any number.
        use_all_workers: after finding the optimum (which uses the fewest workers among the
            optimal plans), give idle workers to the stages whose term they lower most
            (:func:`~pipetrain.plan.partition.fill_idle`); the predicted time does not change.
        max_states: at most this many DAG states (ideals); beyond, prefixes of four
            topological orders are used, then the states are thinned (dag.coarsen).
        max_work: bound on the inner-level tables' work (about K^3 w^2 / 12 operations for
            K states and w units per server) for hierarchical topologies; K is thinned to fit.
        rel_tol: relative precision of the search on the time per minibatch.
        recompute: with a memory limit, let the stages that would not fit otherwise recompute
            their activations (:mod:`~pipetrain.plan.recompute`; ``Stage.recompute``), when
            no plan fits without (``pipetrain plan`` sets it unless ``--no-recompute``).
        precision: ``fp32`` or ``bf16`` (activation and wire bytes halved).
    """

    straight: bool = False
    cost_model: str = DEFAULT_COST_MODEL
    cost_params: CostParams = field(default_factory=CostParams)
    memory_limit: float | None = None
    schedule: str = "pipedream"
    microbatches: int = 1
    num_stages: int | None = None
    use_all_workers: bool = True
    max_states: int = 2048
    max_work: float = 2e8
    rel_tol: float = 1e-10
    recompute: bool = False
    precision: str = "fp32"

    def __post_init__(self) -> None:
        get_cost_model(self.cost_model)  # validates the name
        if self.precision not in WIRE_SCALE:
            raise PlanError(f"unknown precision {self.precision!r}; choose one of {', '.join(WIRE_SCALE)}")
        if self.schedule not in MEMORY_SCHEDULES:
            raise PlanError(f"unknown schedule {self.schedule!r}; choose one of {', '.join(MEMORY_SCHEDULES)}")
        if self.num_stages is not None and (not _is_int(self.num_stages) or self.num_stages < 1):
            raise PlanError(f"num_stages (--stages) must be an integer >= 1 or None, got {self.num_stages!r}; "
                            f"pass e.g. 4, or None to let the planner choose")
        if self.memory_limit is not None and not (
                isinstance(self.memory_limit, (int, float)) and 0 < self.memory_limit < math.inf):
            raise PlanError("memory_limit (--memory) must be positive finite bytes or None, "
                            f"got {self.memory_limit!r}; pass e.g. 16e9")
        if not _is_int(self.microbatches) or self.microbatches < 1:
            raise PlanError(f"microbatches (--microbatches) must be an integer >= 1, got {self.microbatches!r}; "
                            "pass e.g. 4")
        if not _is_int(self.max_states) or self.max_states < 3:
            raise PlanError(f"max_states (--max-states) must be an integer >= 3, got {self.max_states!r}; "
                            f"the default 2048 suits most models")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _states_for(dag: Dag, topology: Topology, options: PlanOptions) -> States:
    states = build_states(dag, options.max_states)
    notes: list[str] = []
    if states.k > options.max_states:
        states = coarsen(dag, states, options.max_states)
    if len(topology.levels) > 1:
        w = max(lv.workers for lv in topology.levels[:-1])
        pairs_per_state = max(w * (w + 1) / 2.0, 1.0) * (len(topology.levels) - 1)
        cap = int((options.max_work * 12.0 / pairs_per_state) ** (1.0 / 3.0))
        if states.k > cap:
            notes.append(f"hierarchical tables limited to {cap} states by max_work={options.max_work:g}")
            states = coarsen(dag, states, cap)
    states.notes.extend(notes)
    return states


def plan(profile: Profile, topology: Topology, options: PlanOptions | None = None) -> Plan:
    """Partition ``profile`` into replicated pipeline stages on ``topology``.

    Returns a Plan whose ``predicted_time`` is :func:`~pipetrain.plan.cost.evaluate` of its
    stages under ``options.cost_model``; ``extra`` holds the hierarchy (which stages share a
    server), per-level terms, the state-space facts and the search's statistics.

    Raises:
        PlanError: bad topology; more stages than layers or workers; a profile with a cycle;
            no plan fits in memory (the message gives the smallest memory that would fit).
    """
    t0 = time.perf_counter()
    if not isinstance(profile, Profile):
        raise PlanError(f"plan() needs a Profile as its first argument, got {type(profile).__name__}; "
                        f"load one with load_profile('model.json') or make one with profile_model(...)")
    if options is None:
        options = PlanOptions()
    elif not isinstance(options, PlanOptions):
        raise PlanError(f"plan() options must be a PlanOptions, got {type(options).__name__}; "
                        f"pass e.g. PlanOptions(straight=True)")
    check_topology(topology)
    profile = precision_profile(profile, options.precision)
    model = get_cost_model(options.cost_model, options.cost_params)
    dag = Dag.from_profile(profile)
    N = topology.total_workers
    layers = int((~dag.is_input).sum())
    if options.num_stages is not None:
        if options.num_stages > layers:
            raise PlanError(f"num_stages={options.num_stages} is more stages than layers ({layers}); "
                            f"ask for at most {layers}")
        if options.num_stages > N:
            raise PlanError(f"num_stages={options.num_stages} needs at least one worker a stage but the topology has "
                            f"{N}; add workers or ask for fewer stages")
        if len(topology.levels) > 1:
            raise PlanError("num_stages is supported on flat topologies only; give one level (e.g. --workers 16) or "
                            "drop --stages")
    limit = options.memory_limit if options.memory_limit is not None else topology.memory_per_worker
    states = _states_for(dag, topology, options)
    if options.num_stages is not None and states.k - 1 < options.num_stages:
        raise PlanError(
            f"num_stages={options.num_stages} exceeds the {states.k - 1} cut points the planner kept; "
            "raise max_states or ask for fewer stages"
        )
    mem = MemoryModel(options.schedule, options.microbatches, profile.optimizer_state_bytes_per_parameter_byte)
    prob = Problem(dag=dag, states=states, model=model, topology=topology, straight=options.straight,
                   memory=mem, limit=limit, num_stages=options.num_stages, rel_tol=options.rel_tol)
    sol, prob = _solve(prob, profile, options)
    if options.use_all_workers:
        fill_idle(prob, sol.elements)
    stages_idx = leaves(sol.elements)
    stages = [Stage(nodes=[dag.names[i] for i in states.stage_nodes(a, z)], replicas=r) for a, z, r in stages_idx]
    timed = _mark_recompute(profile, stages, mem, limit) if prob.dag is not dag else profile
    hier = hierarchy_dict(sol.elements)
    ev = evaluate_detail(timed, stages, topology, model, hierarchy=hier)
    mems = stage_memory(profile, stages, options.schedule, options.microbatches)
    comp = stage_arrays(timed, [s.nodes for s in stages]).compute
    for k, s in enumerate(stages):
        s.compute_time = comp[k] if timed is not profile else float(
            states.compute[stages_idx[k][1]] - states.compute[stages_idx[k][0]])
        s.sync_time = ev.sync[k]
        s.memory_bytes = mems[k]
    dp = data_parallel_time(profile, topology, model)
    result = Plan(
        stages=stages, model=profile.model, batch_size=profile.batch_size, predicted_time=ev.time,
        data_parallel_time=dp, cost_model=model.name, topology=topology,
        solve_seconds=time.perf_counter() - t0,
    )
    used = sum(r for _, _, r in stages_idx)
    result.extra = {
        "hierarchy": hier,
        "level_terms": ev.level_terms,
        "stage_terms": ev.stage_terms,
        "cut_bytes": ev.cuts[1:-1],
        "steady_time": ev.steady,
        "pipeline_latency": ev.latency_sum,
        "dp_value": sol.value,
        "idle_workers": N - used,
        "states": {"count": states.k, "mode": states.mode, "exact": states.exact,
                   "total_ideals": states.total_ideals, "notes": states.notes},
        "search_steps": sol.steps,
        "memory_limit": limit,
        "options": {k: v for k, v in asdict(options).items()},
    }
    return result


def _solve(prob: Problem, profile: Profile, options: PlanOptions) -> tuple[Solution, Problem]:
    """The optimal plan of ``prob``; when none fits and recomputation is allowed, that of the
    problem where every stage recomputes (:func:`_recompute_problem`), with that problem.
    A one-line PlanError when neither fits, stating the memory each would need."""
    sol = solve(prob)
    if sol is not None:
        return sol, prob
    rprob = _recompute_problem(prob, profile, options) if options.recompute and prob.limit is not None else None
    if rprob is not None:
        rsol = solve(rprob)
        if rsol is not None:
            return rsol, rprob
    need = _memory_needed(prob)
    what = f"about {need:.4g} bytes ({need / 2**30:.3g} GiB)" if math.isfinite(need) else "more than any tried"
    if rprob is not None:
        rneed = _memory_needed(rprob)
        what += (f" without recomputation, about {rneed:.4g} bytes ({rneed / 2**30:.3g} GiB) with it"
                 if math.isfinite(rneed) else " without recomputation")
    topology, limit = prob.topology, prob.limit
    note = (" (on a multi-level topology a stage with r replicas in a server is assumed to hold "
            "ceil(N / r) minibatches, an upper bound)" if len(topology.levels) > 1 else "")
    raise PlanError(
        f"no plan fits in {limit:.4g} bytes per worker on {topology.total_workers} workers with schedule "
        f"{options.schedule!r}{' and ' + str(options.num_stages) + ' stages' if options.num_stages else ''}; "
        f"the smallest memory per worker that fits is {what}{note}; "
        "raise --memory, add workers, or use a schedule that stashes less (flush, 2bw)"
    )


def _recompute_problem(prob: Problem, profile: Profile, options: PlanOptions) -> Problem:
    """``prob`` with every stage recomputing: one more forward in each backward, and no
    activation held per unit beyond the stage input (plan/recompute.py)."""
    import numpy as np

    dag = Dag.from_profile(recompute_profile(profile))
    dag = replace(dag, act=np.where(dag.is_input, dag.act, 0.0))
    return replace(prob, dag=dag, states=_states_for(dag, prob.topology, options))


def _mark_recompute(profile: Profile, stages: list[Stage], mem: MemoryModel, limit: float | None) -> Profile:
    """Mark the stages that do not fit ``limit`` without recomputation (the planner's memory
    model); returns the profile whose times include their recompute."""
    arr = stage_arrays(profile, [s.nodes for s in stages])
    reps = [s.replicas for s in stages]
    for k, s in enumerate(stages):
        need = mem.bytes(arr.params[k], arr.act[k], arr.cuts[k], sum(reps[k:]), reps[k])
        s.recompute = limit is not None and need > limit
    return recompute_profile(profile, [n for s in stages if s.recompute for n in s.nodes])


def _memory_needed(prob: Problem) -> float:
    """The smallest memory limit (within 1%) for which some plan fits, by bisection."""
    lo = float(prob.limit or 1.0)
    hi = lo * 2.0
    found = False
    for _ in range(60):
        p = replace(prob, limit=hi)
        if solve_feasible(p):
            found = True
            break
        lo, hi = hi, hi * 4.0
    if not found:
        return math.inf
    while hi > lo * 1.01:
        mid = math.sqrt(lo * hi)
        if solve_feasible(replace(prob, limit=mid)):
            hi = mid
        else:
            lo = mid
    return hi


def solve_feasible(prob: Problem) -> bool:
    """Whether any plan (any time) meets the memory limit of ``prob``."""
    from .partition import TAU_INF, feasible, prepare, top_level

    tables, E, BwE = prepare(prob)
    return feasible(prob, top_level(prob, E, BwE), TAU_INF) is not None


def under_schedule(plan: Plan, profile: Profile, schedule: str, microbatches: int) -> Plan:
    """A copy of ``plan``, made by :func:`plan` on ``profile`` without a memory limit, as
    :func:`plan` makes it for ``schedule`` at ``microbatches``: the same stages, their memory
    by that schedule's rule (:func:`~pipetrain.plan.stage_memory.stage_memory`) and the
    options saying so. The dynamic program reads the memory rule only against a limit, so
    without one its answer is every schedule's (the automatic choice plans each unit size
    once for its 2bw, flush and zero-bubble candidates).

    Raises:
        PlanError: ``plan`` was made under a memory limit, or ``schedule`` has no memory rule.
    """
    import copy

    if plan.extra.get("memory_limit") is not None:
        raise PlanError(f"a plan made under a memory limit ({plan.extra['memory_limit']:.4g} bytes) is its "
                        f"schedule's alone; plan again for {schedule!r}")
    if schedule not in MEMORY_SCHEDULES:
        raise PlanError(f"unknown schedule {schedule!r}; choose one of {', '.join(MEMORY_SCHEDULES)}")
    out = copy.deepcopy(plan)
    options = out.extra.setdefault("options", {})
    options.update(schedule=schedule, microbatches=microbatches)
    held = precision_profile(profile, str(options.get("precision", "fp32")))
    for stage, nbytes in zip(out.stages, stage_memory(held, out.stages, schedule, microbatches)):
        stage.memory_bytes = nbytes
    return out
