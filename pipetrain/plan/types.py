"""Topology and Plan types (plain dataclasses, JSON round-trip).

A plan is a list of stages in pipeline order; each stage owns a set of profile/graph node
names and is replicated over ``replicas`` workers. Workers (ranks) are laid out stage by
stage: stage 0's replicas take ranks ``0 .. r0-1``, stage 1's the next ``r1`` ranks, and so
on (:meth:`Plan.ranks_of_stage`). ``config`` is PipeDream's string, e.g. ``"15-1"``.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PLAN_VERSION = 1


@dataclass(frozen=True)
class Level:
    """One level of the hierarchy: ``workers`` units of the level below, joined at ``bandwidth`` bytes/s."""

    workers: int
    bandwidth: float


@dataclass(frozen=True)
class Topology:
    """Levels innermost first (e.g. 4 GPUs a server at 300 GB/s, then 4 servers at 1.25 GB/s)."""

    levels: tuple[Level, ...]
    memory_per_worker: float | None = None

    @property
    def total_workers(self) -> int:
        n = 1
        for lv in self.levels:
            n *= lv.workers
        return n

    @staticmethod
    def flat(workers: int, bandwidth: float, memory_per_worker: float | None = None) -> "Topology":
        return Topology((Level(workers, bandwidth),), memory_per_worker)


@dataclass
class Stage:
    """A contiguous group of nodes run by ``replicas`` workers.

    ``compute_time`` (forward+backward seconds of one minibatch), ``memory_bytes`` (per
    worker) and ``sync_time`` are the planner's predictions, filled where known.
    """

    nodes: list[str]
    replicas: int = 1
    compute_time: float | None = None
    sync_time: float | None = None
    memory_bytes: float | None = None


@dataclass
class Plan:
    """A partition of a model into replicated stages, with the planner's predictions."""

    stages: list[Stage]
    model: str = ""
    batch_size: int | None = None
    predicted_time: float | None = None
    data_parallel_time: float | None = None
    cost_model: str = ""
    topology: Topology | None = None
    solve_seconds: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    version: int = PLAN_VERSION

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def replicas(self) -> list[int]:
        return [s.replicas for s in self.stages]

    @property
    def num_workers(self) -> int:
        return sum(self.replicas)

    @property
    def config(self) -> str:
        return "-".join(str(r) for r in self.replicas)

    @property
    def speedup_over_data_parallel(self) -> float | None:
        if self.predicted_time and self.data_parallel_time:
            return self.data_parallel_time / self.predicted_time
        return None

    def ranks_of_stage(self, stage: int) -> list[int]:
        start = sum(self.replicas[:stage])
        return list(range(start, start + self.replicas[stage]))

    def stage_of_rank(self, rank: int) -> tuple[int, int]:
        """(stage index, replica index) of a rank."""
        for k, r in enumerate(self.replicas):
            if rank < r:
                return k, rank
            rank -= r
        raise IndexError(f"rank out of range for plan {self.config}")

    # -- JSON --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["config"] = self.config
        d["speedup_over_data_parallel"] = self.speedup_over_data_parallel
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Plan":
        topo = d.get("topology")
        topology = None
        if topo:
            topology = Topology(tuple(Level(**lv) for lv in topo["levels"]), topo.get("memory_per_worker"))
        stages = [Stage(**s) for s in d["stages"]]
        keys = {"model", "batch_size", "predicted_time", "data_parallel_time", "cost_model",
                "solve_seconds", "extra", "version"}
        return Plan(stages=stages, topology=topology, **{k: d[k] for k in keys if k in d})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @staticmethod
    def load(path: str | Path) -> "Plan":
        from ..errors import PlanError

        try:
            d = json.loads(Path(path).read_text())
            return Plan.from_dict(d)
        except FileNotFoundError:
            raise PlanError(f"plan file {str(path)!r} does not exist; create one with `pipetrain plan PROFILE ... --output {path}`") from None
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise PlanError(f"plan file {str(path)!r} is not a pipetrain plan ({type(e).__name__}: {e}); write it with `pipetrain plan ... --output FILE`") from None
