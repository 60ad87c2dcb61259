"""Each worker's predicted peak memory, known before any worker starts, and ``--memory``.

A worker holds the stages the schedule gives its rank (one, or several for ``interleaved``);
its predicted peak is the sum of theirs (:func:`~pipetrain.plan.stage_memory.stage_memory_parts`:
weights, gradients, optimizer state, activations of the units in flight). Schedules without a
memory rule of their own (``dp``, ``interleaved``, ``zerobubble``) are counted with flush's
(1F1B: at most ``min(m, workers from the stage on)`` microbatches in flight).

Without a measured profile (``--config``, ``--cut``, ``--plan``), the sizes come from the
captured graph (:func:`graph_profile`): every node's parameter bytes, and as what it saves
for the backward its outputs' bytes, from the shapes of the (weightless) capture.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import RuntimeConfigError
from ..graph.types import LayerGraph
from ..profile.types import NodeProfile, Profile
from .recompute import recompute_profile
from .stage_memory import MEMORY_SCHEDULES, MemoryParts, stage_memory_parts
from .types import Plan

__all__ = ["WorkerMemory", "check_memory", "graph_profile", "memory_json", "memory_schedule", "worker_memory"]

GIB = float(2 ** 30)


@dataclass(frozen=True)
class WorkerMemory:
    """One worker's predicted peak bytes, by kind.

    Attributes:
        rank: the worker.
        stages: the stages it runs.
        parts: weights, gradients, optimizer state and activations (bytes).
    """

    rank: int
    stages: tuple[int, ...]
    parts: MemoryParts

    @property
    def total(self) -> float:
        return self.parts.total

    def to_json(self) -> dict[str, Any]:
        p = self.parts
        return {"rank": self.rank, "stages": list(self.stages), "weights": p.weights, "gradients": p.gradients,
                "optimizer_state": p.optimizer, "activations": p.activations, "total": p.total}


def memory_schedule(schedule: str) -> str:
    """The schedule whose memory rule counts ``schedule``'s units (module docstring)."""
    return schedule if schedule in MEMORY_SCHEDULES else "flush"


def graph_profile(graph: LayerGraph, model: str, batch_size: int, scale: float,
                  optimizer_state: float) -> Profile:
    """A profile of sizes only (no times) from a captured graph whose example batch is
    ``batch_size / scale`` samples: activations are the node outputs' bytes times ``scale``."""
    nodes = []
    for n in graph.nodes:
        out = int(sum(t.nbytes for t in n.outputs) * scale)
        nodes.append(NodeProfile(n.name, n.op, 0.0, 0.0, out, int(n.parameter_bytes), list(n.inputs), n.kind,
                                 saved_bytes=None if n.kind == "input" else out, output_saved=True))
    return Profile(model, batch_size, nodes, optimizer_state_bytes_per_parameter_byte=float(optimizer_state),
                   loss_saved_bytes=0)


def worker_memory(profile: Profile, plan: Plan, ranks_of_stage: Sequence[Sequence[int]], schedule: str,
                  microbatches: int, recompute: Collection[int] = ()) -> list[WorkerMemory]:
    """Every worker's predicted peak (module docstring); ``ranks_of_stage[k]``: the ranks of
    stage ``k``; ``recompute``: the stages that recompute their forward (they hold their input
    only, :func:`~pipetrain.plan.recompute.recompute_profile`)."""
    marked = set(recompute) | {k for k, s in enumerate(plan.stages) if s.recompute}
    if marked:
        profile = recompute_profile(profile, [n for k in sorted(marked) for n in plan.stages[k].nodes])
    per_stage = stage_memory_parts(profile, plan, memory_schedule(schedule), microbatches)
    held: dict[int, list[int]] = {}
    for k, ranks in enumerate(ranks_of_stage):
        for r in ranks:
            held.setdefault(int(r), []).append(k)
    out = []
    for rank in sorted(held):
        total = MemoryParts(0.0, 0.0, 0.0, 0.0)
        for k in held[rank]:
            total = total + per_stage[k]
        out.append(WorkerMemory(rank, tuple(held[rank]), total))
    return out


def _gib(n: float) -> str:
    return f"{n / GIB:.3g} GiB"


def check_memory(workers: Sequence[WorkerMemory], limit: float, config: str, schedule: str,
                 microbatches: int) -> None:
    """Refuse a plan whose largest predicted worker peak exceeds ``limit`` bytes (``--memory``).

    Raises:
        RuntimeConfigError: one line naming the worker, its stages, the predicted bytes by
            kind, the limit and the fixes.
    """
    worst = max(workers, key=lambda w: w.total, default=None)
    if worst is None or worst.total <= limit:
        return
    p = worst.parts
    stages = ", ".join(str(k) for k in worst.stages)
    raise RuntimeConfigError(
        f"worker {worst.rank} (stage {stages} of config {config}, schedule {schedule}, {microbatches} "
        f"microbatch{'' if microbatches == 1 else 'es'}) "
        f"is predicted to peak at {worst.total:.4g} bytes ({_gib(worst.total)}: weights {_gib(p.weights)}, gradients "
        f"{_gib(p.gradients)}, optimizer state {_gib(p.optimizer)}, activations {_gib(p.activations)}), over "
        f"--memory {limit:.4g} bytes ({_gib(limit)}); add workers (a config with more stages), cut the stages "
        f"elsewhere (--config/--cut), use a schedule that holds less (flush, 2bw) or more microbatches, or raise "
        f"--memory")


def memory_json(workers: Sequence[WorkerMemory], limit: float | None, source: str) -> Mapping[str, Any]:
    """The prediction as a run records it (``plan.extra["worker_memory"]``)."""
    return {"source": source, "limit": limit, "peak": max((w.total for w in workers), default=0.0),
            "workers": [w.to_json() for w in workers]}
