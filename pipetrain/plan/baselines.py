"""Baseline plans, evaluated with the same cost model as the planner.

- ``data_parallel_plan``: one stage replicated on all N workers.
- ``uniform_plan``: a straight pipeline of ``min(N, layers)`` stages with equal layer counts.
- ``balanced_by_parameters``: a straight pipeline whose stages minimise the largest
  parameter count (DeepSpeed's default ``partition_method="parameters"``).
- ``balanced_by_time``: a straight pipeline whose stages minimise the largest forward +
  backward time (torchgpipe's ``balance_by_time``: a block partition of the layer times).

Pipelines follow the profile's topological order (every prefix of it is an ideal, so the
stages are valid cuts of a DAG); model inputs join stage 0. On a multi-level topology the
stages fill the servers in order (:func:`~pipetrain.plan.cost.infer_hierarchy`).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from ..profile.types import Profile
from .cost import DEFAULT_COST_MODEL, CostParams, data_parallel_time, evaluate_detail
from .topology import check_topology
from .types import Plan, Stage, Topology


def _greedy_blocks(weights: Sequence[float], limit: float, other: Sequence[float] | None = None,
                   other_limit: float = float("inf")) -> list[int]:
    """Sizes of the fewest contiguous blocks whose sums of ``weights`` stay within ``limit``
    and, when given, whose sums of ``other`` stay within ``other_limit`` (a single item over
    a limit makes a block of its own)."""
    sizes: list[int] = []
    cur = cur_other = 0.0
    cnt = 0
    for i, w in enumerate(weights):
        o = other[i] if other is not None else 0.0
        if cnt and (cur + w > limit or cur_other + o > other_limit):
            sizes.append(cnt)
            cur = cur_other = 0.0
            cnt = 0
        cur += w
        cur_other += o
        cnt += 1
    sizes.append(cnt)
    return sizes


def _least_limit(weights: Sequence[float], parts: int, other: Sequence[float] | None = None,
                 other_limit: float = float("inf")) -> float:
    """The smallest largest block sum of ``weights`` over partitions into at most ``parts``
    contiguous blocks whose ``other`` sums stay within ``other_limit`` (binary search on the
    limit with the greedy check; the greedy partition is the fewest blocks for a limit)."""
    lo, hi = max(weights, default=0.0), float(sum(weights))
    if len(_greedy_blocks(weights, lo, other, other_limit)) <= parts:
        return lo
    for _ in range(200):
        if hi <= lo * (1 + 1e-15) or hi - lo <= 0:
            break
        mid = 0.5 * (lo + hi)
        if not lo < mid < hi:
            break
        if len(_greedy_blocks(weights, mid, other, other_limit)) <= parts:
            hi = mid
        else:
            lo = mid
    return hi


def _split_to(sizes: list[int], parts: int) -> list[int]:
    """Split blocks (the one with most items, first such) in two until there are ``parts``:
    never raises a block's sum, as every weight is >= 0."""
    while len(sizes) < parts:
        i = max(range(len(sizes)), key=lambda j: (sizes[j], -j))
        a = sizes[i] // 2
        sizes[i:i + 1] = [sizes[i] - a, a]
    return sizes


def block_partition(weights: Sequence[float], parts: int) -> list[int]:
    """Sizes of ``parts`` non-empty contiguous blocks of ``weights`` (all >= 0) minimising the
    largest block sum. Binary search on the limit with a greedy check, then the greedy blocks
    are split (never raising a block's sum) until there are exactly ``parts``."""
    parts = max(1, min(parts, len(weights)))
    return _split_to(_greedy_blocks(weights, _least_limit(weights, parts)), parts)


LEAN_SLACK = 1.2
"""How much slower than the balanced optimum a cut by :func:`lean_block_partition` may make
its slowest block, to hold fewer bytes in its largest one."""


def lean_block_partition(weights: Sequence[float], nbytes: Sequence[float], parts: int,
                         slack: float = LEAN_SLACK) -> list[int]:
    """Sizes of ``parts`` non-empty contiguous blocks: among the partitions whose largest
    ``weights`` sum (compute) is within ``slack`` times the least possible (:func:`block_partition`'s),
    those whose largest ``nbytes`` sum (a stage's parameters) is the least; among those, the
    least largest ``weights`` sum. A model whose cheap layers hold most bytes (a language
    model's token embedding: almost no compute, a large table) so gets stages that each hold
    about their share of the weights, at a bounded cost in speed."""
    parts = max(1, min(parts, len(weights)))
    best = _least_limit(weights, parts)
    compute_limit = best * slack * (1 + 1e-12)
    most_bytes = _least_limit(nbytes, parts, weights, compute_limit)
    bytes_limit = most_bytes * (1 + 1e-12)
    compute = _least_limit(weights, parts, nbytes, bytes_limit)
    return _split_to(_greedy_blocks(weights, compute, nbytes, bytes_limit), parts)


def _straight(profile: Profile, topology: Topology, sizes: list[int], method: str, cost_model: str,
              cost_params: CostParams | None, t0: float) -> Plan:
    inputs = [n.name for n in profile.nodes if n.is_input]
    layers = [n.name for n in profile.nodes if not n.is_input]
    stages, pos = [], 0
    for k, size in enumerate(sizes):
        stages.append(Stage(nodes=(inputs if k == 0 else []) + layers[pos:pos + size], replicas=1))
        pos += size
    return _finish(profile, topology, stages, method, cost_model, cost_params, t0)


def _finish(profile: Profile, topology: Topology, stages: list[Stage], method: str, cost_model: str,
            cost_params: CostParams | None, t0: float) -> Plan:
    ev = evaluate_detail(profile, stages, topology, cost_model, cost_params=cost_params)
    for k, s in enumerate(stages):
        s.compute_time = sum(profile[n].compute_time for n in s.nodes if not profile[n].is_input)
        s.sync_time = ev.sync[k]
    from .stage_memory import stage_memory

    for s, m in zip(stages, stage_memory(profile, stages)):
        s.memory_bytes = m
    return Plan(stages=stages, model=profile.model, batch_size=profile.batch_size, predicted_time=ev.time,
                data_parallel_time=data_parallel_time(profile, topology, cost_model, cost_params),
                cost_model=cost_model, topology=topology, solve_seconds=time.perf_counter() - t0,
                extra={"method": method, "hierarchy": ev.hierarchy, "stage_terms": ev.stage_terms})


def _by(profile: Profile, topology: Topology, weight: Callable[..., Any], method: str, cost_model: str,
        cost_params: CostParams | None) -> Plan:
    t0 = time.perf_counter()
    check_topology(topology)
    layers = [n for n in profile.nodes if not n.is_input]
    sizes = block_partition([float(weight(n)) for n in layers], topology.total_workers)
    return _straight(profile, topology, sizes, method, cost_model, cost_params, t0)


def data_parallel_plan(profile: Profile, topology: Topology, cost_model: str = DEFAULT_COST_MODEL,
                       cost_params: CostParams | None = None) -> Plan:
    """One stage with every node, replicated on all workers."""
    t0 = time.perf_counter()
    check_topology(topology)
    stages = [Stage(nodes=list(profile.names), replicas=topology.total_workers)]
    return _finish(profile, topology, stages, "data_parallel", cost_model, cost_params, t0)


def uniform_plan(profile: Profile, topology: Topology, cost_model: str = DEFAULT_COST_MODEL,
                 cost_params: CostParams | None = None) -> Plan:
    """A straight pipeline of ``min(N, layers)`` stages with equal numbers of layers (the
    first stages take one more when it does not divide)."""
    t0 = time.perf_counter()
    check_topology(topology)
    n = sum(1 for nd in profile.nodes if not nd.is_input)
    k = max(1, min(topology.total_workers, n))
    sizes = [n // k + (1 if i < n % k else 0) for i in range(k)]
    return _straight(profile, topology, sizes, "uniform", cost_model, cost_params, t0)


def balanced_by_parameters(profile: Profile, topology: Topology, cost_model: str = DEFAULT_COST_MODEL,
                           cost_params: CostParams | None = None) -> Plan:
    """A straight pipeline minimising the largest stage parameter bytes (DeepSpeed)."""
    return _by(profile, topology, lambda nd: nd.parameter_bytes, "parameters", cost_model, cost_params)


def balanced_by_time(profile: Profile, topology: Topology, cost_model: str = DEFAULT_COST_MODEL,
                     cost_params: CostParams | None = None) -> Plan:
    """A straight pipeline minimising the largest stage compute time (torchgpipe)."""
    return _by(profile, topology, lambda nd: nd.forward_time + nd.backward_time, "time", cost_model, cost_params)


BASELINES: dict[str, Callable[..., Plan]] = {
    "data_parallel": data_parallel_plan,
    "uniform": uniform_plan,
    "parameters": balanced_by_parameters,
    "time": balanced_by_time,
}


def baselines(profile: Profile, topology: Topology, cost_model: str = DEFAULT_COST_MODEL,
              cost_params: CostParams | None = None) -> dict[str, Plan]:
    """Every baseline plan by name, each evaluated with ``cost_model``."""
    return {name: fn(profile, topology, cost_model, cost_params) for name, fn in BASELINES.items()}


