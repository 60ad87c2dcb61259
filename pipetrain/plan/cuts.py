"""Plans without a profile: cut a captured model by estimated compute or at named nodes.

These are the planner's answers when there is no measured profile, used by ``pipetrain
train`` for ``--config 2-1-1`` (balanced by estimated compute), ``--cut NAME,...`` (stages
begin where the user says), ``dp`` and ``interleaved``. Both are deterministic functions of
the captured graph, so any process computes the same plan.

- :func:`estimate_node_costs`: a multiply-add estimate per node, from shapes and weights.
- :func:`split_by_config`: contiguous stages of balanced estimated compute, holding about
  their share of the parameters (:func:`~pipetrain.plan.baselines.lean_block_partition`).
- :func:`split_at_cuts`: stage ``k+1`` begins at the node or module named ``cuts[k]``.

Input nodes always go to stage 0 (design.md).
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..errors import RuntimeConfigError
from .baselines import lean_block_partition
from .types import Plan, Stage

if TYPE_CHECKING:
    from ..graph.capture import CapturedModel

__all__ = ["estimate_node_costs", "split_by_config", "split_at_cuts", "node_modules", "stage_first_nodes"]


def estimate_node_costs(captured: CapturedModel) -> dict[str, float]:
    """A deterministic compute estimate per node (multiply-adds of the example batch).

    Nodes with weights cost ``2 * weights * rows`` where ``rows`` is the output's element
    count over its channel size (dimension 1 for convolutions, the last otherwise); lookups
    (embeddings) and weight-free nodes cost their output's element count.
    """
    costs: dict[str, float] = {}
    for n in captured.graph.nodes:
        if n.is_input:
            costs[n.name] = 0.0
            continue
        numel = sum(t.numel for t in n.outputs) or 1
        weights = n.parameter_bytes / 4.0
        op = n.op.lower()
        if weights and "embedding" not in op and n.outputs and n.outputs[0].shape:
            shape = n.outputs[0].shape
            ch = shape[1] if op.startswith("conv") and len(shape) > 1 else shape[-1]
            rows = max(1.0, n.outputs[0].numel / max(1, ch))
            costs[n.name] = 2.0 * weights * rows + numel
        else:
            costs[n.name] = float(numel)
    return costs


def split_by_config(captured: CapturedModel, replicas: Sequence[int], model: str = "",
                    batch_size: int | None = None) -> Plan:
    """A plan cutting the graph into ``len(replicas)`` contiguous stages of balanced compute
    that each hold about their share of the parameters.

    Deterministic (estimated multiply-adds, :func:`estimate_node_costs`, and the nodes'
    parameter bytes), so every process computes the same plan without a profile: among the
    cuts whose slowest stage is within :data:`~pipetrain.plan.baselines.LEAN_SLACK` of the
    balanced optimum, the one whose largest stage holds the fewest parameter bytes
    (:func:`~pipetrain.plan.baselines.lean_block_partition`; a language model's token
    embedding costs almost no compute and holds a large table). Input nodes go to stage 0.

    Example:
        >>> split_by_config(captured, [2, 1]).config   # doctest: +SKIP
        '2-1'
    """
    reps = [int(r) for r in replicas]
    costs = estimate_node_costs(captured)
    compute = [n.name for n in captured.graph.nodes if not n.is_input]
    inputs = [n.name for n in captured.graph.nodes if n.is_input]
    if len(compute) < len(reps):
        raise RuntimeConfigError(
            f"the model has {len(compute)} layers, too few for {len(reps)} stages; use at most {len(compute)} stages")
    nbytes = {n.name: float(n.parameter_bytes) for n in captured.graph.nodes}
    sizes = lean_block_partition([costs[n] for n in compute], [nbytes[n] for n in compute], len(reps))
    bounds = [0, *itertools.accumulate(sizes)]
    stages = []
    for k, r in enumerate(reps):
        nodes = compute[bounds[k]:bounds[k + 1]]
        stages.append(Stage(nodes=(inputs + nodes) if k == 0 else nodes, replicas=r))
    est = [sum(costs[n] for n in compute[bounds[k]:bounds[k + 1]]) for k in range(len(reps))]
    held = [sum(nbytes[n] for n in compute[bounds[k]:bounds[k + 1]]) for k in range(len(reps))]
    return Plan(stages=stages, model=model, batch_size=batch_size, cost_model="estimated multiply-adds",
                extra={"source": "split_by_config", "estimated_stage_costs": est, "stage_parameter_bytes": held})


def node_modules(node: Any) -> list[str]:
    """Qualified names of the modules a captured fx node belongs to (outermost first).

    From fx's ``nn_module_stack`` metadata, plus the target of a ``call_module`` node.
    """
    stack = node.meta.get("nn_module_stack") or {}
    names = [v[0] if isinstance(v, tuple) else str(v) for v in stack.values()]
    if node.op == "call_module" and str(node.target) not in names:
        names.append(str(node.target))
    return names


def _matches(node: Any, cut: str) -> bool:
    if node.name == cut:
        return True
    return any(q == cut or q.startswith(cut + ".") for q in node_modules(node))


def split_at_cuts(captured: CapturedModel, cuts: Sequence[str], replicas: Sequence[int], model: str = "",
                  batch_size: int | None = None) -> Plan:
    """A plan whose stage ``k+1`` begins at the first node named ``cuts[k]``, or belonging to
    the module ``cuts[k]`` (``blocks.4``: the first node of that block; ``16``: child 16 of an
    ``nn.Sequential``), in graph order. Input nodes go to stage 0.

    This is how a run is told the cut (``pipetrain train --cut``), e.g. to train on exactly
    the split another framework uses.
    """
    reps = [int(r) for r in replicas]
    if len(reps) != len(cuts) + 1:
        raise RuntimeConfigError(
            f"{len(cuts)} cut names make {len(cuts) + 1} stages but the configuration has {len(reps)}; "
            f"give one cut name fewer than the stages")
    fx_nodes = {n.name: n for n in captured.gm.graph.nodes}
    compute = [n.name for n in captured.graph.nodes if not n.is_input]
    inputs = [n.name for n in captured.graph.nodes if n.is_input]
    bounds = [0]
    for cut in cuts:
        pos = next((i for i, name in enumerate(compute)
                    if name in fx_nodes and _matches(fx_nodes[name], cut)), None)
        if pos is None:
            mods = sorted({m for n in compute if n in fx_nodes for m in node_modules(fx_nodes[n])}, key=len)[:6]
            raise RuntimeConfigError(
                f"--cut {cut!r} names no node or module of the captured model; use a node name (e.g. "
                f"{compute[min(1, len(compute) - 1)]!r}) or a module name (e.g. {', '.join(repr(m) for m in mods)})")
        if pos <= bounds[-1]:
            raise RuntimeConfigError(
                f"--cut {','.join(cuts)}: {cut!r} (node {compute[pos]!r}) does not come after the previous stage's "
                f"first node; list cuts in model order, each leaving every stage at least one node")
        bounds.append(pos)
    bounds.append(len(compute))
    stages = []
    for k, r in enumerate(reps):
        nodes = compute[bounds[k]:bounds[k + 1]]
        stages.append(Stage(nodes=(inputs + nodes) if k == 0 else nodes, replicas=r))
    return Plan(stages=stages, model=model, batch_size=batch_size, cost_model="explicit cut",
                extra={"source": "split_at_cuts", "cuts": list(cuts)})


def stage_first_nodes(plan: Plan, input_names: Sequence[str] = ()) -> list[str]:
    """The first non-input node of each stage of a plan (what a cut is reported as)."""
    skip = set(input_names)
    return [next((n for n in s.nodes if n not in skip), s.nodes[0] if s.nodes else "") for s in plan.stages]
