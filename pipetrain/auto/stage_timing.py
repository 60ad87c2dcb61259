"""Stage times measured as a whole, and a per-node profile corrected by them.

A per-node profile times every layer on its own (warm caches, its own allocations); a stage
runs its layers one after the other, and on a CPU its forward + backward is not the sum of
its layers' times (measured here: the convolutions of a small VGG take 1.8x their per-node
sum as one stage, its fully connected layers 1.2x). The planner balances stages by those sums,
so the error moves the best cut. :func:`stage_seconds` times a stage's own subgraph as the
runtime runs it; :func:`refine_profile` scales each stage's nodes so that they add up to the
stage's measured time (the forward/backward split within a stage stays the profile's), and
:func:`refined_plan` re-plans on the corrected profile until the stages stop changing.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from ..plan.types import Plan
from ..profile.types import Profile

__all__ = ["node_values", "stage_function", "stage_seconds", "refine_profile", "refined_plan"]


def node_values(gm: Any, inputs: Sequence[Any]) -> dict[str, Any]:
    """Every node's output for ``inputs`` (one forward of the whole graph, no gradient)."""
    import torch

    values: dict[str, Any] = {}

    class Keep(torch.fx.Interpreter):
        def run_node(self, n: Any) -> Any:
            out = super().run_node(n)
            values[n.name] = out
            return out

    with torch.no_grad():
        Keep(gm).run(*inputs)
    return values


def stage_function(gm: Any, nodes: Sequence[str], values: dict[str, Any]) -> Callable[[], float]:
    """A function that runs one forward + backward of the stage made of ``nodes`` (its own
    ``torch.fx`` subgraph; inputs as received, requiring grad when floating point and not a
    model input; the output's gradient all ones) and returns its seconds."""
    import torch

    wanted = set(nodes)
    inputs = {n.name for n in gm.graph.nodes if n.op == "placeholder"}
    g = torch.fx.Graph()
    env: dict[str, Any] = {}
    ins: list[str] = []
    outs: list[Any] = []
    for n in gm.graph.nodes:
        if n.name not in wanted or n.op in ("placeholder", "output"):
            continue
        for a in n.all_input_nodes:
            if a.name not in env:
                env[a.name] = g.placeholder(a.name)
                ins.append(a.name)
        env[n.name] = g.node_copy(n, lambda a: env[a.name])
        if any(u.name not in wanted for u in n.users):  # read outside the stage (or the model's output)
            outs.append(env[n.name])
    if not outs:
        return lambda: 0.0
    g.output(tuple(outs))
    sub = torch.fx.GraphModule(gm, g)

    def once() -> float:
        args = [values[a].detach().requires_grad_(bool(getattr(values[a], "is_floating_point", lambda: False)())
                                                  and a not in inputs) if isinstance(values[a], torch.Tensor)
                else values[a] for a in ins]
        t = time.perf_counter()
        res = [o for o in sub(*args) if isinstance(o, torch.Tensor) and o.requires_grad]
        if res:
            torch.autograd.backward(res, [torch.ones_like(o) for o in res])
        return time.perf_counter() - t

    return once


def stage_seconds(gm: Any, inputs: Sequence[Any], stages: Sequence[Sequence[str]], repeats: int = 3,
                  values: dict[str, Any] | None = None) -> list[float]:
    """Median forward + backward seconds of each stage run as a whole, on ``inputs``."""
    vals = values if values is not None else node_values(gm, inputs)
    out = []
    for nodes in stages:
        once = stage_function(gm, nodes, vals)
        once()
        out.append(statistics.median(once() for _ in range(max(1, repeats))))
    return out


def refine_profile(profile: Profile, stages: Sequence[Sequence[str]], seconds: Sequence[float]) -> Profile:
    """``profile`` with the nodes of each stage scaled so that they add up to its measured seconds."""
    factor: dict[str, float] = {}
    for nodes, secs in zip(stages, seconds):
        summed = sum(profile[n].compute_time for n in nodes if not profile[n].is_input)
        f = secs / summed if summed > 0 and secs > 0 else 1.0
        for n in nodes:
            factor[n] = f
    refined = [replace(n, forward_time=n.forward_time * factor.get(n.name, 1.0),
                       backward_time=n.backward_time * factor.get(n.name, 1.0)) for n in profile.nodes]
    return Profile(profile.model, profile.batch_size, refined, profile.device, profile.optimizer,
                   profile.optimizer_state_bytes_per_parameter_byte)


def refined_plan(profile: Profile, gm: Any, inputs: Sequence[Any], plan_fn: Callable[[Profile], Plan],
                 rounds: int = 2, repeats: int = 3) -> tuple[Plan, Profile]:
    """Plan, time the plan's stages as a whole, correct the profile, re-plan; at most ``rounds``
    corrections, stopping when the stages do not change. Returns the last plan and profile."""
    vals = node_values(gm, inputs)
    prof = profile
    chosen = plan_fn(prof)
    for _ in range(max(0, rounds)):
        lists = [list(s.nodes) for s in chosen.stages]
        if len(lists) < 2:
            break
        prof = refine_profile(prof, lists, stage_seconds(gm, inputs, lists, repeats, vals))
        again = plan_fn(prof)
        if [list(s.nodes) for s in again.stages] == lists and again.replicas == chosen.replicas:
            chosen = again
            break
        chosen = again
    return chosen, prof
