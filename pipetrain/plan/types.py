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
    def flat(workers: int, bandwidth: float, memory_per_worker: float | None = None) -> Topology:
        return Topology((Level(workers, bandwidth),), memory_per_worker)


@dataclass
class Stage:
    """A contiguous group of nodes run by ``replicas`` workers.

    ``compute_time`` (forward+backward seconds of one minibatch), ``memory_bytes`` (per
    worker) and ``sync_time`` are the planner's predictions, filled where known.
    ``recompute``: the stage keeps only its input per unit in flight and recomputes its
    forward in the backward (the planner sets it where the stage would not fit otherwise).
    """

    nodes: list[str]
    replicas: int = 1
    compute_time: float | None = None
    sync_time: float | None = None
    memory_bytes: float | None = None
    recompute: bool = False


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
        for s in d["stages"]:  # "recompute" only where a stage recomputes
            if not s["recompute"]:
                del s["recompute"]
        d["config"] = self.config
        d["speedup_over_data_parallel"] = self.speedup_over_data_parallel
        return d

    @staticmethod
    def from_dict(d: dict[str, Any], source: str = "<dict>") -> Plan:
        """Build a Plan from its JSON form (:meth:`to_dict`), checking its shape.

        Raises:
            PlanError: ``d`` is not a plan (not an object, no ``stages``, a profile instead,
                a stage without a node list or with a replica count < 1), naming ``source``.
        """
        from ..errors import PlanError

        hint = "write plans with `pipetrain plan PROFILE --output PLAN.json` (or Plan.save)"
        if not isinstance(d, dict):
            raise PlanError(f"{source}: a plan must be a JSON object, got {type(d).__name__}; {hint}")
        if "stages" not in d:
            if "nodes" in d:
                raise PlanError(
                    f"{source} is a profile, not a plan (it has 'nodes' but no 'stages'); make a plan from it "
                    f"with `pipetrain plan {source} --output plan.json` and pass that"
                )
            raise PlanError(f"{source}: missing field 'stages'; this is not a pipetrain plan; {hint}")
        version = d.get("version", PLAN_VERSION)
        if version != PLAN_VERSION:
            raise PlanError(f"{source}: plan version {version!r} is not supported (this pipetrain reads version "
                            f"{PLAN_VERSION}); make the plan again with `pipetrain plan`")
        raw = d["stages"]
        if not isinstance(raw, list) or not raw:
            raise PlanError(f"{source}: field 'stages' must be a non-empty list of stages, got {raw!r:.80}; {hint}")
        fields = {"nodes", "replicas", "compute_time", "sync_time", "memory_bytes", "recompute"}
        stages = []
        for k, s in enumerate(raw):
            if not isinstance(s, dict):
                raise PlanError(f"{source}: stage {k} must be an object with 'nodes' and 'replicas', "
                                f"got {type(s).__name__}; {hint}")
            unknown = sorted(set(s) - fields)
            if unknown:
                raise PlanError(f"{source}: stage {k} has unknown field {unknown[0]!r}; a stage has "
                                f"{', '.join(sorted(fields))}; remove it")
            nodes = s.get("nodes")
            if not isinstance(nodes, list) or not nodes or not all(isinstance(n, str) for n in nodes):
                raise PlanError(f"{source}: stage {k} has nodes={nodes!r:.80}; every stage needs a non-empty list "
                                f"of node names; fix the plan")
            r = s.get("replicas", 1)
            if isinstance(r, bool) or not isinstance(r, int) or r < 1:
                raise PlanError(f"{source}: stage {k} has replicas={r!r}; a replica count must be an integer "
                                f">= 1; fix the plan")
            if not isinstance(s.get("recompute", False), bool):
                raise PlanError(f"{source}: stage {k} has recompute={s['recompute']!r}; it must be true or false; "
                                f"fix the plan")
            stages.append(Stage(**s))
        topo = d.get("topology")
        topology = None
        if topo:
            try:
                topology = Topology(tuple(Level(**lv) for lv in topo["levels"]), topo.get("memory_per_worker"))
            except (KeyError, TypeError, AttributeError) as e:
                raise PlanError(f"{source}: field 'topology' is malformed ({type(e).__name__}: {e}); it needs "
                                "'levels': [{'workers': N, 'bandwidth': B}, ...]; "
                                "fix it or drop the field") from None
        keys = {"model", "batch_size", "predicted_time", "data_parallel_time", "cost_model",
                "solve_seconds", "extra", "version"}
        extra = d.get("extra", {})
        if not isinstance(extra, dict):
            raise PlanError(f"{source}: field 'extra' must be an object, got {type(extra).__name__}; fix the plan")
        return Plan(stages=stages, topology=topology, **{k: d[k] for k in keys if k in d})

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON to ``path`` (PlanError if the path cannot be written)."""
        from ..errors import PlanError

        try:
            Path(path).write_text(json.dumps(self.to_dict(), indent=1))
        except OSError as e:
            raise PlanError(f"cannot write plan {str(path)!r}: {e.strerror or e}; choose a writable file path "
                            f"(does the directory exist?)") from None

    @staticmethod
    def load(path: str | Path) -> Plan:
        """Read a plan written by :meth:`save`; a one-line PlanError for any unreadable or malformed file."""
        from ..errors import PlanError

        p = Path(path)
        if p.is_dir():
            raise PlanError(f"plan file {str(path)!r} is a directory; pass the plan JSON file written by "
                            f"`pipetrain plan PROFILE ... --output FILE`")
        try:
            text = p.read_text()
        except FileNotFoundError:
            raise PlanError(f"plan file {str(path)!r} does not exist; "
                            f"create one with `pipetrain plan PROFILE ... --output {path}`") from None
        except (OSError, UnicodeDecodeError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise PlanError(f"cannot read plan file {str(path)!r} ({why}); pass a plan JSON written by "
                            f"`pipetrain plan ... --output FILE`") from None
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"plan file {str(path)!r} is not JSON ({e}); "
                            "write it with `pipetrain plan ... --output FILE`") from None
        return Plan.from_dict(d, str(path))
