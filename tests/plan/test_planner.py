"""The planner: exactness against brute force, consistency with evaluate, published profiles."""
from __future__ import annotations

import itertools
import math
import random
from pathlib import Path

import pytest

from pipetrain.errors import PlanError
from pipetrain.plan import PlanOptions, baselines, evaluate, parse_topology, plan
from pipetrain.plan.cost import check_hierarchy, evaluate_detail
from pipetrain.plan.stage_memory import stage_memory
from pipetrain.plan.types import Level, Stage, Topology
from pipetrain.profile.io import load_profile
from pipetrain.profile.types import NodeProfile, Profile

#: The published PipeDream profiles, carried by the tests (MIT; see data/profiles/NOTICE).
PROFILES = Path(__file__).resolve().parents[1] / "data" / "profiles"
TXT_FILES = sorted(PROFILES.glob("*.txt"))
PD = PlanOptions(cost_model="pipedream")


# -- small random models and a brute-force optimum -------------------------------------------
def random_profile(n: int, seed: int, chain: bool) -> Profile:
    """``n`` nodes: one input, then layers reading 1-2 of the previous three nodes (or a chain)."""
    rnd = random.Random(seed)
    nodes = [NodeProfile("in", "Input", 0.0, 0.0, 3_000_000, 0, [], "input")]
    for i in range(1, n):
        if chain or i == 1:
            preds = [nodes[i - 1].name]
        else:
            window = [nd.name for nd in nodes[max(0, i - 3):i] if nd.kind != "input" or i <= 2]
            preds = sorted(set(rnd.sample(window, min(len(window), rnd.choice([1, 1, 2])))))
        f = rnd.uniform(0.5e-3, 4e-3)
        nodes.append(NodeProfile(
            f"n{i}", "Layer", f, f * rnd.uniform(1.0, 2.5), rnd.choice([1e5, 1e6, 4e6, 8e6]),
            rnd.choice([0, 1e5, 1e6, 5e6]), preds))
    return Profile(f"rand{seed}", 32, nodes)


def _bits(prof: Profile) -> tuple[list[int], list[int], int]:
    idx = {nd.name: i for i, nd in enumerate(prof.nodes)}
    preds = [sum(1 << idx[s] for s in nd.inputs) for nd in prof.nodes]
    succs = [0] * len(prof.nodes)
    for i, nd in enumerate(prof.nodes):
        for s in nd.inputs:
            succs[idx[s]] |= 1 << i
    inputs = sum(1 << i for i, nd in enumerate(prof.nodes) if nd.is_input)
    return preds, succs, inputs


def all_ideals(prof: Profile) -> list[int]:
    """Every downward-closed set that contains the inputs and at least one layer."""
    preds, _, inputs = _bits(prof)
    n = len(prof.nodes)
    out = []
    for mask in range(1 << n):
        if mask & inputs != inputs or mask == inputs:
            continue
        if all(not (mask >> v) & 1 or preds[v] & ~mask == 0 for v in range(n)):
            out.append(mask)
    return out


def brute_force(prof: Profile, N: int, B: float, straight: bool = False, num_stages: int | None = None,
                memory: float | None = None) -> float:
    """Minimum of the PipeDream formula over every partition into ideals and every replica
    assignment with at most N workers (written independently of the planner)."""
    _, succs, _ = _bits(prof)
    n = len(prof.nodes)
    nodes = prof.nodes

    def tot(mask: int, attr: str) -> float:
        return sum(getattr(nodes[v], attr) for v in range(n) if (mask >> v) & 1 and not nodes[v].is_input)

    def params(mask: int) -> float:
        return sum(nodes[v].parameter_bytes for v in range(n) if (mask >> v) & 1)

    def act(mask: int) -> float:
        return sum(nodes[v].activation_bytes for v in range(n) if (mask >> v) & 1)

    def cut(ideal: int) -> float:
        return sum(nodes[v].activation_bytes for v in range(n)
                   if (ideal >> v) & 1 and succs[v] & ~ideal)  # model inputs are relayed too

    ideals = sorted(all_ideals(prof), key=lambda m: bin(m).count("1"))
    full = (1 << n) - 1
    best = math.inf

    def chains(cur: int, acc: list[int]):
        if cur == full:
            yield list(acc)
            return
        if len(acc) >= N:
            return
        for J in ideals:
            if cur != J and J & cur == cur:
                acc.append(J)
                yield from chains(J, acc)
                acc.pop()

    for chain in chains(0, []):
        P = len(chain)
        if num_stages is not None and num_stages != P:
            continue
        prev = [0] + chain[:-1]
        stages = [J & ~ideal for ideal, J in zip(prev, chain)]
        C = [tot(s, "forward_time") + tot(s, "backward_time") for s in stages]
        W = [params(s) for s in stages]
        X = [cut(ideal) for ideal in chain[:-1]]
        A = [act(s) for s in stages]
        Xin = [0.0] + X
        reps = [(1,) * P] if straight else [r for r in itertools.product(range(1, N + 1), repeat=P) if sum(r) <= N]
        for r in reps:
            if memory is not None:
                inflight = [math.ceil(sum(r[k:]) / r[k]) for k in range(P)]
                # PipeDream: n weight versions + gradients + optimizer state (1 byte a byte),
                # n minibatches of activations and inputs
                if any((inflight[k] + 1 + 1.0) * W[k] + inflight[k] * (A[k] + Xin[k]) > memory for k in range(P)):
                    continue
            t = max(max(C[k], 4 * (r[k] - 1) * W[k] / (r[k] * B) if r[k] > 1 else 0.0) / r[k] for k in range(P))
            c = max([2 * X[k] / (B * min(r[k], r[k + 1])) for k in range(P - 1)], default=0.0)
            best = min(best, max(t, c))
    return best


CASES = [(n, seed, chain, N) for seed, (n, chain, N) in enumerate(
    [(6, True, 2), (7, True, 3), (8, True, 4), (9, True, 3), (6, False, 4), (7, False, 3),
     (8, False, 3), (9, False, 2), (7, False, 4), (8, True, 3), (6, False, 3), (8, False, 2)])]


@pytest.fixture(params=["tabulated", "closed form"])
def replica_search(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways the DP finds an element's least replicas: the table of its terms at every
    count (and the search over the times a plan can take), and the closed form beyond
    ``TABLE_ELEMENTS`` (with the geometric search to ``rel_tol``)."""
    if request.param == "closed form":
        from pipetrain.plan import cost

        monkeypatch.setattr(cost, "TABLE_ELEMENTS", 0)
    return str(request.param)


@pytest.mark.parametrize("n,seed,chain,N", CASES)
@pytest.mark.parametrize("B", [1e9, 1e10])
def test_optimum_equals_brute_force(n: int, seed: int, chain: bool, N: int, B: float, replica_search: str) -> None:
    prof = random_profile(n, seed, chain)
    topo = Topology.flat(N, B)
    p = plan(prof, topo, PD)
    assert p.predicted_time == pytest.approx(brute_force(prof, N, B), rel=1e-9)
    ps = plan(prof, topo, PlanOptions(cost_model="pipedream", straight=True))
    assert ps.predicted_time == pytest.approx(brute_force(prof, N, B, straight=True), rel=1e-9)
    assert all(s.replicas == 1 for s in ps.stages) and p.num_workers <= N


@pytest.mark.parametrize("n,seed,chain,N", CASES[:6])
def test_forced_stage_count_equals_brute_force(n: int, seed: int, chain: bool, N: int, replica_search: str) -> None:
    prof = random_profile(n, seed, chain)
    for k in range(1, N + 1):
        p = plan(prof, Topology.flat(N, 1e9), PlanOptions(cost_model="pipedream", num_stages=k))
        assert p.num_stages == k
        assert p.predicted_time == pytest.approx(brute_force(prof, N, 1e9, num_stages=k), rel=1e-9)


@pytest.mark.parametrize("n,seed,chain,N", CASES[:8])
def test_memory_limited_optimum_equals_brute_force(n: int, seed: int, chain: bool, N: int,
                                                   replica_search: str) -> None:
    prof = random_profile(n, seed, chain)
    prof.optimizer_state_bytes_per_parameter_byte = 1.0
    free = plan(prof, Topology.flat(N, 1e9), PD)
    limit = 0.7 * max(s.memory_bytes for s in free.stages)
    want = brute_force(prof, N, 1e9, memory=limit)
    if math.isinf(want):
        with pytest.raises(PlanError, match="no plan fits"):
            plan(prof, Topology.flat(N, 1e9, limit), PD)
        return
    p = plan(prof, Topology.flat(N, 1e9, limit), PD)
    assert p.predicted_time == pytest.approx(want, rel=1e-9)
    assert all(s.memory_bytes <= limit for s in p.stages)


def test_pipetrain_steady_state_is_optimal() -> None:
    """The pipetrain model's bottleneck (steady state) is minimised exactly too."""
    for seed in range(4):
        prof = random_profile(7, 100 + seed, chain=seed % 2 == 0)
        topo = Topology.flat(3, 2e9)
        p = plan(prof, topo, PlanOptions(cost_model="pipetrain"))
        best = math.inf
        for stage_list in _stage_lists(prof, 3):
            for r in itertools.product(range(1, 4), repeat=len(stage_list)):
                if sum(r) <= 3:
                    stages = [Stage(nodes, rr) for nodes, rr in zip(stage_list, r)]
                    best = min(best, evaluate_detail(prof, stages, topo, "pipetrain").steady)
        assert p.extra["steady_time"] == pytest.approx(best, rel=1e-9)


def _stage_lists(prof: Profile, max_stages: int) -> list[list[list[str]]]:
    ideals = sorted(all_ideals(prof), key=lambda m: bin(m).count("1"))
    full = (1 << len(prof.nodes)) - 1
    out: list[list[list[str]]] = []

    def rec(cur: int, acc: list[list[str]]) -> None:
        if cur == full:
            out.append(list(acc))
            return
        if len(acc) >= max_stages:
            return
        for J in ideals:
            if cur != J and J & cur == cur:
                acc.append([nd.name for v, nd in enumerate(prof.nodes) if (J & ~cur) >> v & 1])
                rec(J, acc)
                acc.pop()

    rec(0, [])
    return out


# -- the published profiles ------------------------------------------------------------------------
@pytest.mark.parametrize("path", TXT_FILES, ids=lambda p: p.stem)
def test_predicted_time_equals_evaluate(path: Path) -> None:
    prof = load_profile(path)
    for N in (4, 8, 16):
        for B in (1.25e9, 3.125e9):
            topo = Topology.flat(N, B)
            p = plan(prof, topo, PD)
            assert p.predicted_time == evaluate(prof, p.stages, topo, "pipedream")
            # the DP's own value of the plan agrees with the formula
            assert p.extra["dp_value"] == pytest.approx(p.predicted_time, rel=1e-9)
            assert p.predicted_time <= p.data_parallel_time * (1 + 1e-12)
            assert p.num_workers <= N
            names = [n for s in p.stages for n in s.nodes]
            assert sorted(names) == sorted(prof.names)
            assert all(prof[n].kind != "input" for s in p.stages[1:] for n in s.nodes)
            # the data-parallel time is the formula's max(C, sync(N)) / N
            C = prof.total_forward_time + prof.total_backward_time
            assert p.data_parallel_time == pytest.approx(
                max(C, 4 * (N - 1) * prof.total_parameter_bytes / (N * B)) / N, rel=1e-12)


@pytest.mark.parametrize("path", TXT_FILES, ids=lambda p: p.stem)
def test_the_tabulated_search_plans_as_the_closed_form(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same stages, replicas and time either way, on both cost models, with and without
    a stage count, flat and hierarchical."""
    from pipetrain.plan import cost

    prof = load_profile(path)
    cases = [(Topology.flat(4, 1.25e9), PD), (Topology.flat(16, 1e9), PlanOptions()),
             (Topology.flat(3, 5e8), PlanOptions(num_stages=2)), (parse_topology("4,2", "1e10,1e9"), PlanOptions())]
    for topo, opts in cases:
        tabulated = plan(prof, topo, opts)
        monkeypatch.setattr(cost, "TABLE_ELEMENTS", 0)
        closed = plan(prof, topo, opts)
        monkeypatch.undo()
        assert [(s.nodes, s.replicas) for s in tabulated.stages] == [(s.nodes, s.replicas) for s in closed.stages]
        assert tabulated.predicted_time == pytest.approx(closed.predicted_time, rel=1e-9)


def test_vgg16_16_workers_10gbit_is_15_1() -> None:
    """Paper (Table 1): VGG-16 on 16 workers at 10 Gbit/s is "15-1": the convolutions
    (compute-heavy, few parameters) replicated, the fully connected layers (about 90% of the
    parameters, little compute) on one worker so their weights are never synchronised."""
    prof = load_profile(PROFILES / "vgg16.txt")
    p = plan(prof, Topology.flat(16, 1.25e9), PD)
    assert p.config == "15-1"
    tail = p.stages[1].nodes
    assert all(not prof[n].op.startswith("Conv2d") for n in tail)
    assert sum(prof[n].op.startswith("Linear") for n in tail) == 3
    assert sum(prof[n].parameter_bytes for n in tail) > 0.8 * prof.total_parameter_bytes
    assert p.speedup_over_data_parallel > 2.0


def test_resnet50_prefers_data_parallelism() -> None:
    """Paper: ResNet-50's best configuration at 16 workers is data parallelism."""
    prof = load_profile(PROFILES / "resnet50.txt")
    p = plan(prof, Topology.flat(16, 1.25e9), PD)
    assert p.config == "16"
    assert p.predicted_time == p.data_parallel_time


@pytest.mark.parametrize("name", ["vgg16", "resnet50", "gnmt"])
@pytest.mark.parametrize("cost_model", ["pipedream", "pipetrain"])
def test_hierarchical_4x4(name: str, cost_model: str) -> None:
    prof = load_profile(PROFILES / f"{name}.txt")
    topo = parse_topology("4,4", "300e9,1.25e9")
    p = plan(prof, topo, PlanOptions(cost_model=cost_model))
    check_hierarchy(p.extra["hierarchy"], p.replicas, topo)
    assert p.predicted_time == evaluate(prof, p, topo, cost_model)
    assert p.num_workers <= 16
    # data parallelism and the straight baselines (packed into servers) are hierarchical
    # plans too, so the optimum is at least as good (for pipetrain: its steady state)
    key = "time" if cost_model == "pipedream" else "steady"
    ours = getattr(evaluate_detail(prof, p, topo, cost_model), key)
    for b in baselines(prof, topo, cost_model).values():
        assert ours <= getattr(evaluate_detail(prof, b, topo, cost_model), key) * (1 + 1e-9)
    if cost_model == "pipedream":
        assert p.extra["dp_value"] == pytest.approx(p.predicted_time, rel=1e-9)


def test_hierarchy_degenerate_levels_match_flat() -> None:
    prof = random_profile(9, 7, chain=False)
    flat = plan(prof, Topology.flat(4, 1e9), PD).predicted_time
    # one server of 4: the outer level has nothing to do
    assert plan(prof, parse_topology("4,1", "1e9,1e3"), PD).predicted_time == pytest.approx(flat, rel=1e-9)
    # four servers of one worker, with free inner links: the outer level is the flat problem
    assert plan(prof, parse_topology("1,4", "1e30,1e9"), PD).predicted_time == pytest.approx(flat, rel=1e-9)


def test_deterministic_and_straight_uses_one_replica() -> None:
    prof = load_profile(PROFILES / "resnet18.txt")
    topo = Topology.flat(8, 1.25e9)
    a, b = plan(prof, topo, PD), plan(prof, topo, PD)
    assert a.to_dict()["stages"] == b.to_dict()["stages"]
    s = plan(prof, topo, PlanOptions(cost_model="pipedream", straight=True))
    assert set(s.replicas) == {1} and s.num_stages <= 8


def test_wide_dag_state_control() -> None:
    """Past max_states the planner uses prefixes of several topological orders."""
    prof = load_profile(PROFILES / "gnmt.txt")
    topo = Topology.flat(8, 1.25e9)
    exact = plan(prof, topo, PD)
    small = plan(prof, topo, PlanOptions(cost_model="pipedream", max_states=60))
    assert exact.extra["states"]["exact"] and not small.extra["states"]["exact"]
    assert small.extra["states"]["count"] <= 60
    assert small.predicted_time == evaluate(prof, small.stages, topo, "pipedream")
    assert small.predicted_time >= exact.predicted_time * (1 - 1e-12)


def test_memory_rule_per_stage() -> None:
    prof = random_profile(6, 3, chain=True)
    stages = [Stage(prof.names[:3], 2), Stage(prof.names[3:5], 1), Stage(prof.names[5:], 1)]
    mem = stage_memory(prof, stages, "pipedream")
    p0 = sum(prof[n].parameter_bytes for n in prof.names[:3])
    a0 = sum(prof[n].activation_bytes for n in prof.names[:3])
    # stage 0: ceil(4 workers / 2 replicas) = 2 minibatches in flight, 2 weight versions
    assert mem[0] == pytest.approx(2 * p0 + p0 + 1.0 * p0 + 2 * a0)
    last = prof.names[5:]
    p2 = sum(prof[n].parameter_bytes for n in last)
    a2 = sum(prof[n].activation_bytes for n in last) + prof.nodes[4].activation_bytes
    assert mem[2] == pytest.approx(p2 + p2 + p2 + a2)
    gp = stage_memory(prof, stages, "gpipe", microbatches=4)
    assert gp[0] == pytest.approx(3 * p0 + a0)


# -- errors -----------------------------------------------------------------------------------------
def test_error_more_stages_than_layers() -> None:
    prof = random_profile(5, 1, chain=True)
    with pytest.raises(PlanError, match="more stages than layers"):
        plan(prof, Topology.flat(16, 1e9), PlanOptions(num_stages=5))


def test_error_stages_more_than_workers() -> None:
    prof = random_profile(8, 1, chain=True)
    with pytest.raises(PlanError, match="needs at least one worker a stage"):
        plan(prof, Topology.flat(2, 1e9), PlanOptions(num_stages=3))


@pytest.mark.parametrize("levels,match", [
    ((Level(0, 1e9),), "positive integer"), ((Level(4, 0.0),), "bandwidth"), ((Level(4, -1e9),), "bandwidth"),
])
def test_error_bad_topology(levels: tuple, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        plan(random_profile(5, 1, chain=True), Topology(levels), PD)


@pytest.mark.parametrize("workers,bandwidth,match", [
    ("0", "1e9", "positive integer"), ("4,-2", "1e9,1e9", "positive integer"), ("4", "0", "positive"),
    ("4,4", "1e9", "one bandwidth per level"), ("4", "fast", "cannot read bandwidth"),
])
def test_error_parse_topology(workers: str, bandwidth: str, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        parse_topology(workers, bandwidth)


def test_error_no_plan_fits_gives_needed_memory() -> None:
    prof = random_profile(8, 2, chain=True)
    with pytest.raises(PlanError,
                       match=r"no plan fits .* smallest memory per worker that fits is about ([0-9.e+]+) bytes") as err:
        plan(prof, Topology.flat(4, 1e9, 1000.0), PD)
    need = float(err.value.args[0].split("about ")[1].split(" bytes")[0])
    p = plan(prof, Topology.flat(4, 1e9, need * 1.001), PD)
    assert max(s.memory_bytes for s in p.stages) <= need * 1.001
    with pytest.raises(PlanError, match="no plan fits"):
        plan(prof, Topology.flat(4, 1e9, need * 0.95), PD)


def test_error_cycle() -> None:
    nodes = [NodeProfile("x", "Input", 0, 0, 8, 0, [], "input"),
             NodeProfile("a", "L", 1e-3, 1e-3, 8, 8, ["x", "b"]), NodeProfile("b", "L", 1e-3, 1e-3, 8, 8, ["a"])]
    with pytest.raises(PlanError, match="cycle through node"):
        plan(Profile("cyc", 1, nodes), Topology.flat(2, 1e9), PD)


def test_error_unknown_cost_model_and_stages_need_flat() -> None:
    with pytest.raises(PlanError, match="unknown cost model 'fast'"):
        PlanOptions(cost_model="fast")
    with pytest.raises(PlanError, match="flat topologies only"):
        plan(random_profile(8, 1, chain=True), parse_topology("2,2", "1e10,1e9"), PlanOptions(num_stages=2))


def test_evaluate_rejects_bad_stages() -> None:
    prof = random_profile(5, 1, chain=True)
    topo = Topology.flat(2, 1e9)
    names = prof.names
    with pytest.raises(PlanError, match="back to stage"):
        evaluate(prof, [Stage(names[:1] + names[3:], 1), Stage(names[1:3], 1)], topo)
    with pytest.raises(PlanError, match="in no stage"):
        evaluate(prof, [Stage(names[:3], 1)], topo)
    with pytest.raises(PlanError, match="input node 'in' is in stage 1"):
        evaluate(prof, [Stage(names[1:3], 1), Stage([names[0]] + names[3:], 1)], topo)


def inception_like(modules: int, branches: int, depth: int) -> Profile:
    """Fork-join modules with ``branches`` parallel chains of ``depth`` layers, joined by a concat."""
    rnd = random.Random(modules * 100 + branches)
    nodes = [NodeProfile("in", "Input", 0, 0, 1_000_000, 0, [], "input")]
    prev = "in"
    for m in range(modules):
        ends = []
        for b in range(branches):
            last = prev
            for d in range(depth):
                name = f"m{m}b{b}d{d}"
                f = rnd.uniform(0.2e-3, 2e-3)
                nodes.append(NodeProfile(name, "Conv", f, 2 * f, rnd.choice([1e6, 2e6]), rnd.choice([1e5, 1e6]),
                                         [last]))
                last = name
            ends.append(last)
        nodes.append(NodeProfile(f"cat{m}", "Concat", 0, 0, 4e6, 0, ends))
        prev = f"cat{m}"
    return Profile("inception", 32, nodes)


def test_wide_modules_use_topological_prefixes() -> None:
    prof = inception_like(modules=6, branches=5, depth=3)  # 4^5 = 1024 ideals per module
    topo = Topology.flat(8, 1.25e9)
    p = plan(prof, topo, PD)
    assert p.extra["states"]["mode"] == "orders" and not p.extra["states"]["exact"]
    assert p.predicted_time == evaluate(prof, p.stages, topo, "pipedream")


def test_unsorted_profile_is_planned() -> None:
    prof = random_profile(8, 9, chain=False)
    shuffled = Profile(prof.model, prof.batch_size, list(reversed(prof.nodes)))
    topo = Topology.flat(3, 1e9)
    assert plan(shuffled, topo, PD).predicted_time == pytest.approx(plan(prof, topo, PD).predicted_time, rel=1e-12)


def test_filling_idle_workers_respects_memory() -> None:
    """Extra replicas of a late stage put more minibatches in flight at earlier stages."""
    for seed in range(6):
        prof = random_profile(9, 40 + seed, chain=True)
        free = plan(prof, Topology.flat(8, 1e9), PD)
        limit = 0.8 * max(s.memory_bytes for s in free.stages)
        try:
            p = plan(prof, Topology.flat(8, 1e9, limit), PD)
        except PlanError:
            continue
        assert all(s.memory_bytes <= limit for s in p.stages)
        lean = plan(prof, Topology.flat(8, 1e9, limit), PlanOptions(cost_model="pipedream", use_all_workers=False))
        assert lean.num_workers <= p.num_workers and lean.predicted_time == pytest.approx(p.predicted_time, rel=1e-12)


@pytest.mark.parametrize("path", [PROFILES / "vgg16.txt", PROFILES / "gnmt.txt"], ids=lambda p: p.stem)
def test_a_plan_without_a_memory_limit_is_every_schedule_s(path: Path) -> None:
    """``under_schedule``: the plan solved under one memory rule, given another schedule's,
    is the plan :func:`plan` makes for that schedule (stages, memory, options) when no
    memory limit applies; under a limit it is refused."""
    from pipetrain.plan.api import under_schedule
    from pipetrain.plan.stage_memory import MEMORY_SCHEDULES

    prof = load_profile(path)
    topo = parse_topology("8", "1.25e9")
    base = plan(prof, topo, PlanOptions(schedule="pipedream", microbatches=1))
    for schedule, m in itertools.product(MEMORY_SCHEDULES, (1, 4)):
        want = plan(prof, topo, PlanOptions(schedule=schedule, microbatches=m)).to_dict()
        got = under_schedule(base, prof, schedule, m).to_dict()
        for d in (want, got):
            d.pop("solve_seconds", None)
        assert got == want, (schedule, m)
    assert base.extra["options"]["schedule"] == "pipedream"  # the copy is the one changed
    limited = plan(prof, topo, PlanOptions(memory_limit=64e9))
    with pytest.raises(PlanError, match="memory limit"):
        under_schedule(limited, prof, "flush", 4)
