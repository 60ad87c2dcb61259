"""Cost models: the predicted time per minibatch of a plan, per element and in total.

Terms. A plan on a topology with levels ``0..h-1`` (innermost first) is a tree: the top
level is a pipeline of *elements*, each replicated ``m`` times over units of that level; an
element of level ``l >= 1`` is itself a pipeline of elements of level ``l-1`` inside one
unit; an element of level 0 is a stage (a set of nodes) replicated over ``r`` workers. For a
flat topology (one level) this is PipeDream's list of stages with replica counts.

Every cost model here is *decomposable*: the plan's steady-state time is the maximum of
one term per element, and an element's term depends only on the element's own contents, its
replica count, and the bytes of the two cuts at its ends. That is what lets the dynamic
program (:mod:`pipetrain.plan.partition`) be exact.

``pipedream`` (PipeDream, SOSP'19, section 3.1, exactly as published). For an element with
base time ``E`` (a stage: forward + backward seconds of its nodes; a block: the time of
its inner pipeline), parameter bytes ``P``, replicas ``m``, level bandwidth ``B`` and ``U``
workers in each unit of the level (1 at level 0)::

    sync(m)  = 4 (m - 1) P / (m B U)              (0 when m = 1; / U as in the published
                                                   hierarchical optimizer)
    t        = max(E, sync(m)) / m
    cut term = 2 X / (B m)  for the cut X bytes at each end of the element

so between two elements ``k, k+1`` of one level the cut costs ``2 X_k / (B min(m_k, m_{k+1}))``
and the predicted time per minibatch is ``T = max(all t, all cut terms)``. Data parallelism
(one stage on all N workers) gives ``T_dp = max(C, sync(N)) / N``.

``pipetrain`` (the default; more faithful to a run, to be calibrated): communication runs
on its own stream and overlaps compute; gradient all-reduce (ring) overlaps the backward
pass; per-message latency ``alpha``; pipeline fill is amortised over ``minibatches``::

    allreduce(m) = 2 (m-1)/m * P/(B U) + 2 (m-1) alpha            (ring; 0 when m = 1)
    exposed(m)   = max(allreduce(m) - overlap * Bw, 0)            Bw: backward seconds
    comm         = (X_in + X_out) / B + 2 alpha (#non-empty cuts)  per replica per minibatch
    t            = max(E + exposed(m), comm) / m
    T_ss         = max of t over all elements
    L            = total compute + sum over cuts of 2 (X / B_cut + alpha)   (one minibatch's
                   latency through the pipeline; B_cut: slowest link the cut crosses)
    T            = T_ss (1 - 1/M) + L / M        M = minibatches between pipeline fills

For both, the least replica count that brings an element's term under a limit has a closed
form (:meth:`CostModel.min_replicas`): PipeDream's term is decreasing for ``m >= 2``;
pipetrain's ring latency can make it rise again, which the closed form handles by solving
the quadratic in ``m`` exactly.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import PlanError
from ..profile.types import Profile
from .topology import check_topology, unit_workers
from .types import Plan, Stage, Topology

COST_MODELS = ("pipetrain", "pipedream")
#: The most element terms :meth:`CostModel.tabulate` keeps (pairs x replica counts above 1):
#: 64 MB of float64; beyond it the replica search uses the closed form.
TABLE_ELEMENTS = 8_000_000
#: The most replicas :meth:`CostModel.tabulate` tabulates: a table costs one evaluation of
#: every pair's term per count, the closed-form search two or three per step over about 35
#: steps, so beyond this the table takes longer than the search it saves
#: (``benchmarks/plan_speed.py``: 64 workers on a 500-layer chain 0.43 s closed, 1.04 s tabulated).
TABLE_REPLICAS = 16
DEFAULT_COST_MODEL = "pipetrain"


@dataclass(frozen=True)
class CostParams:
    """Constants of the ``pipetrain`` cost model (ignored by ``pipedream``).

    Attributes:
        latency: seconds per message (one p2p transfer, one ring all-reduce step).
        overlap: fraction of a stage's backward time that gradient all-reduce can hide behind
            (1.0: fully overlapped except what exceeds the backward pass; 0.0: no overlap).
        minibatches: minibatches between two pipeline fills (the fill is amortised over them).
        allreduce_bandwidth: per-link bytes/s of the ring all-reduce (a calibration's
            ``allreduce_bus_bandwidth``); None: the level's bandwidth (divided by its unit size).
        allreduce_latency: seconds per ring step of an all-reduce (a ring over m ranks takes
            ``2 (m-1)`` steps); None: ``latency``.

    :func:`pipetrain.plan.calibrated.calibrated_params` fills these from a measured
    :class:`~pipetrain.cluster.calibration.Calibration`.
    """

    latency: float = 20e-6
    overlap: float = 1.0
    minibatches: int = 100
    allreduce_bandwidth: float | None = None
    allreduce_latency: float | None = None

    def __post_init__(self) -> None:
        if not self.latency >= 0 or not 0.0 <= self.overlap <= 1.0 or int(self.minibatches) < 1:
            raise PlanError(
                f"cost parameters latency={self.latency}, overlap={self.overlap}, minibatches={self.minibatches} "
                f"are invalid; need latency >= 0, 0 <= overlap <= 1, minibatches >= 1"
            )
        if self.allreduce_bandwidth is not None and not 0 < self.allreduce_bandwidth < float("inf"):
            raise PlanError(f"cost parameter allreduce_bandwidth={self.allreduce_bandwidth} must be positive finite "
                            f"bytes/s or None (the level's bandwidth)")
        if self.allreduce_latency is not None and not 0 <= self.allreduce_latency < float("inf"):
            raise PlanError(f"cost parameter allreduce_latency={self.allreduce_latency} must be >= 0 seconds or None "
                            f"(the point-to-point latency)")

    @property
    def ring_step_latency(self) -> float:
        """Seconds per ring step of an all-reduce."""
        return self.latency if self.allreduce_latency is None else self.allreduce_latency


@dataclass(frozen=True)
class LevelCtx:
    """What a term needs to know about its level: bandwidth and workers per unit."""

    bandwidth: float
    unit: int


class CostModel:
    """A decomposable cost model: element terms, replica search, and the amortised total."""

    name = ""

    def term(self, lv: LevelCtx, E: Any, Bw: Any, P: Any, Xs: Any, Xe: Any, m: Any) -> np.ndarray:
        """Steady-state time per minibatch of elements (vectorised over all arguments)."""
        raise NotImplementedError

    def sync(self, lv: LevelCtx, P: float, m: int) -> float:
        """Seconds of weight synchronisation of an element with ``m`` replicas."""
        raise NotImplementedError

    def total(self, steady: float, latency_sum: float) -> float:
        """The time per minibatch reported for a plan with this steady-state time."""
        return steady

    def prepare(self, lv: LevelCtx, E: np.ndarray, Bw: np.ndarray, P: np.ndarray, Xs: np.ndarray,
                Xe: np.ndarray) -> dict[str, Any]:
        """Precompute what :meth:`min_replicas` needs that does not depend on the limit."""
        return {"lv": lv, "E": np.asarray(E, float), "Bw": np.asarray(Bw, float), "P": np.asarray(P, float),
                "Xs": np.asarray(Xs, float), "Xe": np.asarray(Xe, float)}

    def term_at(self, prep: dict[str, Any], idx: np.ndarray, m: np.ndarray) -> np.ndarray:
        """:meth:`term` of the prepared elements ``idx`` with replicas ``m``."""
        return self.term(prep["lv"], prep["E"][idx], prep["Bw"][idx], prep["P"][idx], prep["Xs"][idx],
                         prep["Xe"][idx], m)

    def tabulate(self, prep: dict[str, Any], max_replicas: int) -> None:
        """Keep every prepared element's term at ``2..max_replicas`` replicas in ``prep``
        (``"table"``, one row per count) when ``max_replicas`` is at most
        :data:`TABLE_REPLICAS` and the table at most :data:`TABLE_ELEMENTS` values;
        :meth:`min_replicas` then reads it, exactly and without the closed form, and
        :meth:`limits` lists the values a plan's time can take (None without a table)."""
        n = len(prep["E"])
        if not 2 <= max_replicas <= TABLE_REPLICAS or n * (max_replicas - 1) > TABLE_ELEMENTS:
            return
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            table = np.empty((max_replicas - 1, n))
            for row, m in enumerate(range(2, max_replicas + 1)):
                table[row] = self.term_at(prep, slice(None), np.float64(m))  # type: ignore[arg-type]
        prep["table"] = table
        # row k: the least term at 2..k+2 replicas (NaN where every one is NaN), for min_replicas
        prep["table_least"] = np.fmin.accumulate(table, axis=0)

    def limits(self, prep: dict[str, Any], lo: float = 0.0, hi: float = math.inf) -> np.ndarray | None:
        """Every finite term of the tabulated elements at 1 to ``max_replicas`` replicas in
        ``[lo, hi)``, sorted and distinct: a plan's time (the largest of its terms) is one of
        them. None when :meth:`tabulate` did not tabulate. (The bounds are applied before the
        sort: a solve's bracket held 27-30% of a 6-layer decoder's 2.5-2.8 million terms.)"""
        table = prep.get("table")
        if table is None:
            return None
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            one = self.term_at(prep, slice(None), np.float64(1.0))  # type: ignore[arg-type]
        values = np.concatenate([one, table.ravel()])
        return np.unique(values[np.isfinite(values) & (values >= lo) & (values < hi)])

    def min_replicas(self, prep: dict[str, Any], tau: float, exact: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """For each prepared element: whether 1 replica meets ``term <= tau``, and the least
        ``m >= 2`` that does (``inf`` when none does).

        From the table when :meth:`tabulate` kept one (exact; ``inf`` past its largest count).
        Else the closed form (:meth:`_guess`), exact in real arithmetic; ``exact`` also checks
        it against :meth:`term` in floating point and moves ``m`` by one where they disagree.
        """
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            ok1 = self._ok1(prep, tau)
            least = prep.get("table_least")
            if least is not None:  # the counts that fit are a suffix of 2..max_replicas
                fits = least <= tau
                return ok1, np.where(fits[-1], float(len(fits) + 2) - fits.sum(axis=0), np.inf)
            m = self._guess(prep, tau)
            m = np.where(np.isfinite(m), np.maximum(m, 2.0), np.inf)
            if not exact:
                return ok1, m
            idx = np.nonzero(np.isfinite(m))[0]
            for _ in range(8):
                if not len(idx):
                    break
                idx = idx[~(self.term_at(prep, idx, m[idx]) <= tau)]
                m[idx] += 1.0
            m[idx] = np.inf  # still failing after the fix-ups: treat as infeasible
            idx = np.nonzero(np.isfinite(m) & (m > 2.0))[0]
            for _ in range(3):
                if not len(idx):
                    break
                idx = idx[self.term_at(prep, idx, m[idx] - 1.0) <= tau]
                m[idx] -= 1.0
                idx = idx[m[idx] > 2.0]
        return ok1, m

    def _ok1(self, prep: dict[str, Any], tau: float) -> np.ndarray:
        return self.term_at(prep, slice(None), 1.0) <= tau  # type: ignore[arg-type]

    def _guess(self, prep: dict[str, Any], tau: float) -> np.ndarray:
        raise NotImplementedError


class PipeDreamCost(CostModel):
    """PipeDream's published cost model (see the module docstring)."""

    name = "pipedream"

    def term(self, lv: LevelCtx, E: Any, Bw: Any, P: Any, Xs: Any, Xe: Any, m: Any) -> np.ndarray:
        m = np.asarray(m, dtype=float)
        D = np.maximum(E, 2.0 * np.maximum(Xs, Xe) / lv.bandwidth)
        s = 4.0 * np.asarray(P, dtype=float) / (lv.bandwidth * lv.unit)
        return np.asarray(np.maximum(D / m, s * (m - 1.0) / (m * m)))

    def sync(self, lv: LevelCtx, P: float, m: int) -> float:
        return 4.0 * (m - 1) * P / (m * lv.bandwidth * lv.unit) if m > 1 else 0.0

    def prepare(self, lv: LevelCtx, E: np.ndarray, Bw: np.ndarray, P: np.ndarray, Xs: np.ndarray,
                Xe: np.ndarray) -> dict[str, Any]:
        prep = super().prepare(lv, E, Bw, P, Xs, Xe)
        prep["D"] = np.maximum(prep["E"], 2.0 * np.maximum(prep["Xs"], prep["Xe"]) / lv.bandwidth)
        prep["s"] = 4.0 * prep["P"] / (lv.bandwidth * lv.unit)
        prep["s2"] = prep["s"] * prep["s"]
        return prep

    def _ok1(self, prep: dict[str, Any], tau: float) -> np.ndarray:
        return np.asarray(prep["D"] <= tau)  # term(1) = max(D, 0)

    def _guess(self, prep: dict[str, Any], tau: float) -> np.ndarray:
        D, s = prep["D"], prep["s"]
        m_a = np.ceil(D / tau)
        # s (m-1) / m^2 <= tau  <=>  tau m^2 - s m + s >= 0: m >= larger root (decreasing for m >= 2)
        disc = prep["s2"] - (4.0 * tau) * s
        m_b = np.where(disc > 0, np.ceil((s + np.sqrt(np.maximum(disc, 0.0))) / (2.0 * tau)), 2.0)
        out = np.maximum(m_a, m_b)
        return np.where(np.isnan(out), np.inf, out)


@dataclass
class PipetrainCost(CostModel):
    """The default model: overlapped communication, ring all-reduce, latency, fill."""

    params: CostParams = CostParams()
    name = "pipetrain"

    def _ring_bandwidth(self, lv: LevelCtx) -> float:
        """Bytes/s of the ring all-reduce's transfer term: the calibrated per-link figure when
        given (it already includes every worker of a unit), else ``B U`` of the level."""
        bw = self.params.allreduce_bandwidth
        return float(bw) if bw is not None else lv.bandwidth * lv.unit

    def _allreduce(self, lv: LevelCtx, P: Any, m: Any) -> np.ndarray:
        a = 2.0 * np.asarray(P, dtype=float) / self._ring_bandwidth(lv)
        return np.where(m > 1.0, a * (1.0 - 1.0 / m) + 2.0 * self.params.ring_step_latency * (m - 1.0), 0.0)

    def _comm(self, lv: LevelCtx, Xs: Any, Xe: Any) -> np.ndarray:
        lat = 2.0 * self.params.latency
        xs, xe = np.asarray(Xs), np.asarray(Xe)
        return np.asarray((xs + xe) / lv.bandwidth + lat * ((xs > 0) * 1.0 + (xe > 0) * 1.0))

    def term(self, lv: LevelCtx, E: Any, Bw: Any, P: Any, Xs: Any, Xe: Any, m: Any) -> np.ndarray:
        m = np.asarray(m, dtype=float)
        exposed = np.maximum(self._allreduce(lv, P, m) - self.params.overlap * np.asarray(Bw, dtype=float), 0.0)
        return np.asarray(np.maximum(np.asarray(E, dtype=float) + exposed, self._comm(lv, Xs, Xe)) / m)

    def sync(self, lv: LevelCtx, P: float, m: int) -> float:
        return float(self._allreduce(lv, P, np.float64(m)))

    def total(self, steady: float, latency_sum: float) -> float:
        M = self.params.minibatches
        return steady * (1.0 - 1.0 / M) + latency_sum / M

    def prepare(self, lv: LevelCtx, E: np.ndarray, Bw: np.ndarray, P: np.ndarray, Xs: np.ndarray,
                Xe: np.ndarray) -> dict[str, Any]:
        prep = super().prepare(lv, E, Bw, P, Xs, Xe)
        prep["comm"] = self._comm(lv, prep["Xs"], prep["Xe"])
        prep["EC"] = np.maximum(prep["E"], prep["comm"])
        prep["a"] = 2.0 * prep["P"] / self._ring_bandwidth(lv)
        prep["c"] = self.params.overlap * prep["Bw"]
        return prep

    def _ok1(self, prep: dict[str, Any], tau: float) -> np.ndarray:
        return np.asarray(prep["EC"] <= tau)  # term(1) = max(E, comm)

    def _guess(self, prep: dict[str, Any], tau: float) -> np.ndarray:
        al = self.params.ring_step_latency
        E, a, c = prep["E"], prep["a"], prep["c"]
        m0 = np.maximum(np.ceil(prep["EC"] / tau), 2.0)
        m0 = np.where(np.isnan(m0), np.inf, m0)
        fin = np.isfinite(m0)
        ok0 = np.zeros(m0.shape, dtype=bool)
        ok0[fin] = self.term_at(prep, np.nonzero(fin)[0], m0[fin]) <= tau
        # E + a (1 - 1/m) + 2 alpha (m - 1) - c <= tau m, times m:
        # (tau - 2 alpha) m^2 - (E - c + a - 2 alpha) m + a >= 0 holds from the larger root on
        qa = tau - 2.0 * al
        if qa <= 0:
            return np.where(ok0, m0, np.inf)
        qb = E - c + a - 2.0 * al
        disc = qb * qb - 4.0 * qa * a
        root = (qb + np.sqrt(np.maximum(disc, 0.0))) / (2.0 * qa)
        out = np.where(ok0, m0, np.maximum(m0, np.ceil(root)))
        return np.where(np.isnan(out), np.inf, out)


def get_cost_model(name: str, params: CostParams | None = None) -> CostModel:
    """The cost model called ``name`` (``pipetrain`` or ``pipedream``)."""
    if name == "pipedream":
        return PipeDreamCost()
    if name == "pipetrain":
        return PipetrainCost(params or CostParams())
    raise PlanError(f"unknown cost model {name!r}; choose one of {', '.join(COST_MODELS)}")


# -- evaluating a given plan ----------------------------------------------------------------
@dataclass
class StageArrays:
    """Per-stage totals and per-cut bytes of a list of stages (validated)."""

    compute: list[float]
    backward: list[float]
    params: list[float]
    act: list[float]
    cuts: list[float]  # cuts[k] = bytes crossing the cut before stage k; cuts[0] = cuts[P] = 0


def stage_arrays(profile: Profile, stages: Sequence[Sequence[str]]) -> StageArrays:
    """Check that ``stages`` partition the profile in pipeline order and total their costs.

    Raises PlanError when a node is missing, unknown or in two stages, an input node is not in
    stage 0, a stage holds no layer, or an edge goes from a later stage to an earlier one.
    """
    where: dict[str, int] = {}
    for k, nodes in enumerate(stages):
        if not nodes:
            raise PlanError(f"stage {k} has no nodes; every stage needs at least one layer; remove it")
        for name in nodes:
            if name in where:
                raise PlanError(f"node {name!r} is in stages {where[name]} and {k}; "
                                "each node belongs to exactly one stage")
            where[name] = k
    names = set(profile.names)
    unknown = [n for n in where if n not in names]
    if unknown:
        raise PlanError(f"stages name nodes not in the profile ({', '.join(unknown[:5])}); plan and profile disagree; "
                        "re-plan with this profile")
    missing = [n for n in profile.names if n not in where]
    if missing:
        raise PlanError(f"{len(missing)} nodes are in no stage ({', '.join(missing[:5])}); "
                        "every node must belong to a stage")
    P = len(stages)
    comp = [0.0] * P
    bwd = [0.0] * P
    par = [0.0] * P
    act = [0.0] * P
    layers = [0] * P
    for nd in profile.nodes:
        k = where[nd.name]
        if nd.is_input and k != 0:
            raise PlanError(f"input node {nd.name!r} is in stage {k}; model inputs belong to stage 0; move it")
        for src in nd.inputs:
            if where[src] > k:
                raise PlanError(f"edge {src} -> {nd.name} goes from stage {where[src]} back to stage {k}; "
                                "stages must follow the data flow")
        if not nd.is_input:
            comp[k] += nd.forward_time + nd.backward_time
            bwd[k] += nd.backward_time
            layers[k] += 1
        par[k] += nd.parameter_bytes
        act[k] += nd.activation_bytes
    for k in range(P):
        if layers[k] == 0:
            raise PlanError(f"stage {k} holds only model inputs; every stage needs a layer; "
                            "merge it into the next stage")
    # X_k: outputs of nodes in stages < k read by nodes in stages >= k. Model inputs count too:
    # they live in stage 0 and the runtime relays them to a later reader (docs/traffic.md), so
    # X_k is exactly the activation bytes of one minibatch the runtime sends across cut k.
    last_reader: dict[str, int] = {}
    for nd in profile.nodes:
        for src in dict.fromkeys(nd.inputs):
            last_reader[src] = max(last_reader.get(src, -1), where[nd.name])
    cuts = [0.0] * (P + 1)
    for nd in profile.nodes:
        if nd.name not in last_reader:
            continue
        for k in range(where[nd.name] + 1, last_reader[nd.name] + 1):
            cuts[k] += nd.activation_bytes
    return StageArrays(comp, bwd, par, act, cuts)


def infer_hierarchy(replicas: Sequence[int], topology: Topology) -> list[dict[str, Any]]:
    """The natural hierarchy of a flat list of stage replica counts on a multi-level topology.

    Stages are packed in order: a stage whose replica count is a multiple of the workers in a
    unit of the top level takes whole units (replicated over them); consecutive smaller stages
    share one unit. Recursively the same inside each unit. Raises PlanError when a stage's
    replica count cannot be laid out (e.g. 6 replicas on servers of 4).
    """
    units = unit_workers(topology)
    h = len(topology.levels)

    def pack(ids: list[int], reps: dict[int, int], level: int) -> list[dict[str, Any]]:
        if level == 0:
            return [{"replicas": reps[k], "stage": k} for k in ids]
        U = units[level]
        out: list[dict[str, Any]] = []
        group: list[int] = []
        used = 0

        def flush() -> None:
            nonlocal group, used
            if group:
                out.append({"replicas": 1, "children": pack(group, reps, level - 1)})
            group, used = [], 0

        for k in ids:
            r = reps[k]
            if r >= U and r % U == 0:
                flush()
                out.append({"replicas": r // U, "children": pack([k], {k: U}, level - 1)})
            elif r < U:
                if used + r > U:
                    flush()
                group.append(k)
                used += r
            else:
                raise PlanError(
                    f"stage {k} has {r} replicas, which is neither below nor a multiple of the {U} workers of a "
                    f"level-{level} unit; "
                    f"give it a multiple of {U} replicas or plan on a flat topology"
                )
        flush()
        return out

    return pack(list(range(len(replicas))), {k: int(r) for k, r in enumerate(replicas)}, h - 1)


def check_hierarchy(hier: Sequence[dict[str, Any]], replicas: Sequence[int], topology: Topology) -> None:
    """Raise PlanError unless ``hier`` covers the stages in order within every level's budget."""
    h = len(topology.levels)
    seen: list[int] = []
    flat: dict[int, int] = {}

    def walk(elems: Sequence[dict[str, Any]], level: int, mult: int) -> None:
        budget = topology.levels[level].workers
        total = sum(int(e["replicas"]) for e in elems)
        if total > budget or any(int(e["replicas"]) < 1 for e in elems):
            raise PlanError(f"a level-{level} pipeline uses {total} units but the level has {budget}; "
                            "fix the plan's hierarchy")
        for e in elems:
            if level == 0:
                if "stage" not in e:
                    raise PlanError("the plan's hierarchy is deeper than the topology; re-plan on this topology")
                seen.append(int(e["stage"]))
                flat[int(e["stage"])] = mult * int(e["replicas"])
            else:
                if "children" not in e:
                    raise PlanError(f"the plan's hierarchy has {h - level} levels, the topology {h}; "
                                    "re-plan on this topology")
                walk(e["children"], level - 1, mult * int(e["replicas"]))

    walk(hier, h - 1, 1)
    if seen != list(range(len(replicas))):
        raise PlanError(f"the plan's hierarchy lists stages {seen}, not 0..{len(replicas) - 1} in order; re-plan")
    for k, r in enumerate(replicas):
        if flat[k] != int(r):
            raise PlanError(f"stage {k} has {r} replicas but its hierarchy gives {flat[k]}; re-plan")


@dataclass
class Evaluation:
    """The result of :func:`evaluate_detail`: the time and its parts."""

    time: float
    steady: float
    latency_sum: float
    stage_terms: list[float]     # per stage, its level-0 term (before outer replication)
    level_terms: list[list[float]]  # per level, the term of each element in pipeline order
    sync: list[float]            # per stage, level-0 sync seconds
    cuts: list[float]
    hierarchy: list[dict[str, Any]]


def evaluate_detail(profile: Profile, stages: Plan | Sequence[Stage], topology: Topology | None = None,
                    cost_model: str | CostModel = "pipedream", hierarchy: Sequence[dict[str, Any]] | None = None,
                    cost_params: CostParams | None = None) -> Evaluation:
    """Evaluate a cost model on given stages (see :func:`evaluate`), with the breakdown."""
    if isinstance(stages, Plan):
        if hierarchy is None:
            hierarchy = stages.extra.get("hierarchy")
        if topology is None:
            topology = stages.topology
        stage_list = stages.stages
    else:
        stage_list = list(stages)
    if topology is None:
        raise PlanError("evaluate needs a topology; pass topology=parse_topology(...)")
    check_topology(topology)
    model = cost_model if isinstance(cost_model, CostModel) else get_cost_model(cost_model, cost_params)
    arr = stage_arrays(profile, [s.nodes for s in stage_list])
    replicas = [int(s.replicas) for s in stage_list]
    h = len(topology.levels)
    if hierarchy is None:
        if h == 1:
            hierarchy = [{"replicas": r, "stage": k} for k, r in enumerate(replicas)]
        else:
            hierarchy = infer_hierarchy(replicas, topology)
    check_hierarchy(hierarchy, replicas, topology)
    units = unit_workers(topology)
    level_terms: list[list[float]] = [[] for _ in range(h)]
    stage_terms = [0.0] * len(stage_list)
    sync = [0.0] * len(stage_list)
    boundary_level = [0] * (len(stage_list) + 1)  # outermost level at which each cut is a boundary

    def span(e: dict[str, Any]) -> tuple[int, int]:
        if "stage" in e:
            return e["stage"], e["stage"]
        return span(e["children"][0])[0], span(e["children"][-1])[1]

    def elem(e: dict[str, Any], level: int) -> tuple[float, float, float]:
        """(term, compute, backward) of element ``e`` at ``level``."""
        lv = LevelCtx(topology.levels[level].bandwidth, units[level])
        m = int(e["replicas"])
        first, last = span(e)
        for c in (first, last + 1):
            boundary_level[c] = max(boundary_level[c], level)
        P = sum(arr.params[first:last + 1])
        C = sum(arr.compute[first:last + 1])
        Bw = sum(arr.backward[first:last + 1])
        if level == 0:
            E, share = arr.compute[first], arr.backward[first]
        else:
            E = max(elem(c, level - 1)[0] for c in e["children"])
            share = E * (Bw / C) if C > 0 else 0.0
        Xs, Xe = arr.cuts[first], arr.cuts[last + 1]
        if isinstance(model, PipeDreamCost):
            # exactly the published formula: max(compute, sync) / r and 2 X / (B r) per cut
            t = max(max(E, model.sync(lv, P, m)) / m, 2.0 * Xs / (lv.bandwidth * m), 2.0 * Xe / (lv.bandwidth * m))
        else:
            t = float(model.term(lv, E, share, P, Xs, Xe, m))
        level_terms[level].append(t)
        if level == 0:
            stage_terms[first] = t
            sync[first] = model.sync(lv, P, m)
        return t, C, Bw

    steady = max(elem(e, h - 1)[0] for e in hierarchy)
    latency = sum(arr.compute)
    alpha = getattr(getattr(model, "params", None), "latency", 0.0)
    for k in range(1, len(stage_list)):
        if arr.cuts[k] > 0:
            latency += 2.0 * (arr.cuts[k] / topology.levels[boundary_level[k]].bandwidth + alpha)
    return Evaluation(model.total(steady, latency), steady, latency, stage_terms, level_terms, sync, arr.cuts,
                      list(hierarchy))


def evaluate(profile: Profile, stages: Plan | Sequence[Stage], topology: Topology | None = None,
             cost_model: str | CostModel = "pipedream", hierarchy: Sequence[dict[str, Any]] | None = None,
             cost_params: CostParams | None = None) -> float:
    """Predicted seconds per minibatch of ``stages`` under ``cost_model`` on ``topology``.

    ``stages`` is a Plan or a list of Stage (nodes and replicas, in pipeline order). On a
    multi-level topology the plan's hierarchy (``Plan.extra["hierarchy"]``) says which
    stages share a unit; without one, :func:`infer_hierarchy` packs the stages in order.
    For a flat topology and ``pipedream`` this is exactly::

        T = max( max_k max(compute_k, sync_k(r_k)) / r_k,  max_k 2 X_k / (B min(r_k, r_k+1)) )

    Raises PlanError if the stages do not partition the profile along the data flow.
    """
    return evaluate_detail(profile, stages, topology, cost_model, hierarchy, cost_params).time


def data_parallel_time(profile: Profile, topology: Topology, cost_model: str | CostModel = "pipedream",
                       cost_params: CostParams | None = None) -> float:
    """Time per minibatch of data parallelism: one stage replicated on every worker."""
    stage = Stage(nodes=list(profile.names), replicas=topology.total_workers)
    return evaluate(profile, [stage], topology, cost_model, cost_params=cost_params)
