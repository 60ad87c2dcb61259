"""Baselines: data parallelism, uniform, by parameters (DeepSpeed), by time (torchgpipe)."""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from pipetrain.plan import PlanOptions, baselines, evaluate, parse_topology, plan
from pipetrain.plan.baselines import LEAN_SLACK, block_partition, lean_block_partition
from pipetrain.plan.types import Topology
from pipetrain.profile.io import load_profile

#: The published PipeDream profiles, carried by the tests (MIT; see data/profiles/NOTICE).
PROFILES = Path(__file__).resolve().parents[1] / "data" / "profiles"


@pytest.mark.parametrize("weights,parts", [
    ([1, 2, 3, 4, 5, 6, 7, 8, 9], 3), ([5, 0, 0, 5, 1, 1, 1, 9], 4), ([3, 3, 3], 3), ([0, 0, 0, 0, 1], 2),
    ([2, 7, 1, 8, 2, 8], 2),
])
def test_block_partition_is_optimal(weights: list[float], parts: int) -> None:
    sizes = block_partition(weights, parts)
    assert len(sizes) == parts and all(s > 0 for s in sizes) and sum(sizes) == len(weights)

    def cost(sz: list[int]) -> float:
        out, pos = 0.0, 0
        for s in sz:
            out = max(out, sum(weights[pos:pos + s]))
            pos += s
        return out

    best = min(cost([b - a for a, b in zip((0,) + c, c + (len(weights),))])
               for c in itertools.combinations(range(1, len(weights)), parts - 1))
    assert cost(sizes) == best


def _block_sums(values: list[float], sizes: list[int]) -> list[float]:
    bounds = [0, *itertools.accumulate(sizes)]
    return [sum(values[a:b]) for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("seed", range(40))
def test_lean_block_partition_equals_brute_force(seed: int) -> None:
    """Compute within the slack of the balanced optimum, then the fewest bytes in the largest
    block, then the least compute: the same three figures as every partition enumerated."""
    import random

    rng = random.Random(seed)
    n, parts = rng.randint(2, 9), rng.randint(1, 4)
    compute = [float(rng.choice([0, 0.1, 1, 2, 3, 5])) for _ in range(n)]
    nbytes = [float(rng.choice([0, 1, 4, 10, 30])) for _ in range(n)]
    parts = min(parts, n)
    sizes = lean_block_partition(compute, nbytes, parts)
    assert len(sizes) == parts and all(s > 0 for s in sizes) and sum(sizes) == n
    every = [[b - a for a, b in zip((0,) + c, c + (n,))] for c in itertools.combinations(range(1, n), parts - 1)]
    best = min(max(_block_sums(compute, sz)) for sz in every)
    allowed = [sz for sz in every if max(_block_sums(compute, sz)) <= best * LEAN_SLACK + 1e-9]
    least_bytes = min(max(_block_sums(nbytes, sz)) for sz in allowed)
    lean = [sz for sz in allowed if max(_block_sums(nbytes, sz)) <= least_bytes + 1e-9]
    got_compute, got_bytes = max(_block_sums(compute, sizes)), max(_block_sums(nbytes, sizes))
    assert got_bytes == pytest.approx(least_bytes)
    assert got_compute == pytest.approx(min(max(_block_sums(compute, sz)) for sz in lean))


def test_a_cheap_large_table_gets_a_stage_share_of_the_bytes() -> None:
    """An embedding (no compute, many bytes) followed by equal layers: the balanced-compute
    cut gives the first block the table and as many layers as the others; the lean cut moves
    layers off it, within the slack."""
    compute = [0.0] + [1.0] * 20
    nbytes = [24.0] + [4.0] * 20
    assert max(_block_sums(nbytes, block_partition(compute, 4))) == 44.0
    sizes = lean_block_partition(compute, nbytes, 4)
    assert sizes == [3, 6, 6, 6] and max(_block_sums(nbytes, sizes)) == 32.0
    assert max(_block_sums(compute, sizes)) <= 5.0 * LEAN_SLACK


@pytest.mark.parametrize("name", ["vgg16", "resnet50", "gnmt"])
def test_baselines_shapes_and_planner_wins(name: str) -> None:
    prof = load_profile(PROFILES / f"{name}.txt")
    topo = Topology.flat(8, 1.25e9)
    base = baselines(prof, topo, "pipedream")
    assert set(base) == {"data_parallel", "uniform", "parameters", "time"}
    assert base["data_parallel"].config == "8"
    for key in ("uniform", "parameters", "time"):
        b = base[key]
        assert b.config == "-".join(["1"] * 8)
        assert b.predicted_time == evaluate(prof, b.stages, topo, "pipedream")
        # straight pipelines in topological order, inputs in stage 0
        assert [n for s in b.stages for n in s.nodes] == [n.name for n in prof.nodes if n.is_input] + \
            [n.name for n in prof.nodes if not n.is_input]
    ours = plan(prof, topo, PlanOptions(cost_model="pipedream"))
    for b in base.values():
        assert ours.predicted_time <= b.predicted_time * (1 + 1e-9)
    # balanced by time has the smallest largest-stage compute of the straight splits
    worst = {k: max(s.compute_time for s in base[k].stages) for k in ("uniform", "parameters", "time")}
    assert worst["time"] <= min(worst.values()) * (1 + 1e-12)
    assert base["data_parallel"].predicted_time == pytest.approx(ours.data_parallel_time, rel=1e-12)


def test_baselines_on_hierarchy() -> None:
    prof = load_profile(PROFILES / "vgg16.txt")
    topo = parse_topology("4,4", "300e9,1.25e9")
    base = baselines(prof, topo, "pipedream")
    assert len(base["time"].extra["hierarchy"]) == 4  # four servers of four stages
    assert base["data_parallel"].extra["hierarchy"][0]["replicas"] == 4
