"""Cost models by hand, the closed-form replica search, topology parsing."""
from __future__ import annotations

import random

import numpy as np
import pytest

from pipetrain.errors import PlanError
from pipetrain.plan import CostParams, Stage, Topology, evaluate, parse_quantity, parse_topology
from pipetrain.plan.cost import LevelCtx, PipeDreamCost, PipetrainCost, evaluate_detail, infer_hierarchy
from pipetrain.profile.types import NodeProfile, Profile


def toy() -> Profile:
    """in -> a -> b -> c, plus a skip edge a -> c."""
    return Profile("toy", 16, [
        NodeProfile("in", "Input", 0.5, 0.0, 1000, 0, [], "input"),        # input: no cost, no bytes
        NodeProfile("a", "L", 0.010, 0.020, 4_000_000, 8_000_000, ["in"]),
        NodeProfile("b", "L", 0.004, 0.008, 2_000_000, 1_000_000, ["a"]),
        NodeProfile("c", "L", 0.001, 0.002, 500_000, 40_000_000, ["b", "a"]),
    ])


def test_pipedream_formula_by_hand() -> None:
    prof, B = toy(), 1e9
    stages = [Stage(["in", "a"], 3), Stage(["b"], 2), Stage(["c"], 1)]
    # compute: 0.03, 0.012, 0.003 s; parameters 8e6, 1e6, 4e7 bytes
    t0 = max(0.03, 4 * 2 * 8e6 / (3 * B)) / 3     # sync 0.021333 < compute
    t1 = max(0.012, 4 * 1 * 1e6 / (2 * B)) / 2
    t2 = 0.003
    # cuts: after stage 0, a's output (read by b and c) 4e6; after stage 1, b's 2e6 plus a's 4e6 (skip)
    c0 = 2 * 4e6 / (B * min(3, 2))
    c1 = 2 * 6e6 / (B * min(2, 1))
    assert evaluate(prof, stages, Topology.flat(6, B), "pipedream") == max(t0, t1, t2, c0, c1)
    assert max(t0, t1, t2, c0, c1) == c1  # the skip connection makes the last cut the bottleneck
    # data parallelism: max(C, sync(N)) / N
    dp = [Stage(["in", "a", "b", "c"], 6)]
    assert evaluate(prof, dp, Topology.flat(6, B), "pipedream") == max(0.045, 4 * 5 * 4.9e7 / (6 * B)) / 6


def test_pipetrain_formula_by_hand() -> None:
    prof, B = toy(), 1e9
    cp = CostParams(latency=1e-4, overlap=1.0, minibatches=10)
    stages = [Stage(["in", "a", "b"], 2), Stage(["c"], 1)]
    ev = evaluate_detail(prof, stages, Topology.flat(3, B), "pipetrain", cost_params=cp)
    X = 6e6  # a and b feed c
    allreduce = 2 * (1 / 2) * 9e6 / B + 2 * 1 * 1e-4
    exposed = max(allreduce - 0.028, 0.0)
    t0 = max(0.042 + exposed, X / B + 2e-4) / 2
    t1 = max(0.003, X / B + 2e-4)
    steady = max(t0, t1)
    latency = 0.045 + 2 * (X / B + 1e-4)
    assert ev.steady == pytest.approx(steady, rel=1e-12)
    assert ev.latency_sum == pytest.approx(latency, rel=1e-12)
    assert ev.time == pytest.approx(steady * 0.9 + latency / 10, rel=1e-12)


@pytest.mark.parametrize("model", [PipeDreamCost(), PipetrainCost(CostParams(latency=3e-5, overlap=0.7))])
def test_min_replicas_matches_a_scan(model) -> None:
    rnd = random.Random(5)
    n = 400
    lv = LevelCtx(rnd.choice([1e9, 1e10]), rnd.choice([1, 4]))
    E = np.array([rnd.uniform(1e-4, 0.5) for _ in range(n)])
    Bw = E * np.array([rnd.uniform(0.3, 0.7) for _ in range(n)])
    P = np.array([rnd.choice([0.0, 1e5, 1e7, 1e8, 5e8]) for _ in range(n)])
    Xs = np.array([rnd.choice([0.0, 1e6, 1e8]) for _ in range(n)])
    Xe = np.array([rnd.choice([0.0, 1e6, 1e8]) for _ in range(n)])
    prep = model.prepare(lv, E, Bw, P, Xs, Xe)
    ms = np.arange(2, 600, dtype=float)
    for tau in (1e-3, 7e-3, 0.03, 0.2):
        ok1, m2 = model.min_replicas(prep, tau)
        for i in range(n):
            t = model.term(lv, E[i], Bw[i], P[i], Xs[i], Xe[i], ms)
            feas = ms[t <= tau]
            want = feas[0] if len(feas) else np.inf
            if want < 599 or np.isinf(want):
                assert m2[i] == want or (np.isinf(want) and m2[i] > 599), (i, tau)
            assert ok1[i] == (model.term(lv, E[i], Bw[i], P[i], Xs[i], Xe[i], 1.0) <= tau)


@pytest.mark.parametrize("model", [PipeDreamCost(), PipetrainCost(CostParams(latency=3e-5, overlap=0.7))])
def test_min_replicas_and_limits_from_the_table_match_a_scan(model) -> None:
    """Tabulated (up to 6 replicas): the least count that meets each limit, ``inf`` past the
    table or where every term is NaN; and the bracketed, distinct limits a plan can take."""
    rnd = random.Random(7)
    n, top = 300, 6
    lv = LevelCtx(1e9, rnd.choice([1, 4]))
    E = np.array([rnd.uniform(1e-4, 0.5) for _ in range(n)])
    E[0] = np.nan
    Bw = E * 0.5
    P = np.array([rnd.choice([0.0, 1e5, 1e7, 1e8, 5e8]) for _ in range(n)])
    Xs = np.array([rnd.choice([0.0, 1e6, 1e8]) for _ in range(n)])
    Xe = np.array([rnd.choice([0.0, 1e6, 1e8]) for _ in range(n)])
    prep = model.prepare(lv, E, Bw, P, Xs, Xe)
    model.tabulate(prep, top)
    ms = np.arange(2, top + 1, dtype=float)
    every = np.array([model.term(lv, E[i], Bw[i], P[i], Xs[i], Xe[i], np.arange(1, top + 1, dtype=float))
                      for i in range(n)]).ravel()
    for tau in (1e-3, 7e-3, 0.03, 0.2):
        _, m2 = model.min_replicas(prep, tau)
        for i in range(n):
            feas = ms[model.term(lv, E[i], Bw[i], P[i], Xs[i], Xe[i], ms) <= tau]
            assert m2[i] == (feas[0] if len(feas) else np.inf), (i, tau)
    for lo, hi in ((0.0, np.inf), (7e-3, 0.03)):
        want = np.unique(every[np.isfinite(every) & (every >= lo) & (every < hi)])
        assert np.array_equal(model.limits(prep, lo, hi), want)


def test_infer_hierarchy() -> None:
    topo = parse_topology("4,4", "300e9,1.25e9")
    h = infer_hierarchy([12, 2, 1, 1], topo)
    assert h == [{"replicas": 3, "children": [{"replicas": 4, "stage": 0}]},
                 {"replicas": 1, "children": [{"replicas": 2, "stage": 1}, {"replicas": 1, "stage": 2},
                                              {"replicas": 1, "stage": 3}]}]
    with pytest.raises(PlanError, match="neither below nor a multiple"):
        infer_hierarchy([6, 10], topo)


@pytest.mark.parametrize("text,value", [
    ("1.25e9", 1.25e9), ("10Gbit", 1.25e9), ("10Gbps", 1.25e9), ("25Gb", 3.125e9), ("300GB", 3e11),
    ("300GB/s", 3e11), ("16GiB", 16 * 2**30), ("2e3", 2000.0),
])
def test_parse_quantity(text: str, value: float) -> None:
    assert parse_quantity(text) == pytest.approx(value)


def test_parse_topology_levels() -> None:
    t = parse_topology("4,4", "300e9,10Gbit", "16GB")
    assert [lv.workers for lv in t.levels] == [4, 4] and t.total_workers == 16
    assert t.levels[1].bandwidth == 1.25e9 and t.memory_per_worker == 16e9
    with pytest.raises(PlanError, match="positive"):
        parse_topology("4", "1e9", "0")
