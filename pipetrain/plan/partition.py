"""The partitioner: a dynamic program over ideals, levels and replica counts.

Notation: states ``0..K-1`` are ideals sorted by size (:mod:`pipetrain.plan.dag`), state 0 the
empty set and ``K-1`` the whole model; an *element* ``(a, z, m)`` covers ``state z - state a``
with ``m`` replicas. Every cost model is a maximum of per-element terms
(:mod:`pipetrain.plan.cost`), so PipeDream's recurrence (SOSP'19, section 3.1)::

    A(i -> j, m) = min over s, m' of max( A(i -> s, m - m'), 2 C_s / B, T(s+1 -> j, m') )

generalises from layer ranges to pairs of ideals, with the cut terms charged by the
elements on both sides of each cut.

Inner levels (all but the outermost). For every pair of states ``a < z`` and budget
``b <= w_l`` the table ``T_l[b][a, z]`` holds the best time of a level-``l`` pipeline on
``z - a`` that uses at most ``b`` units of level ``l`` (a "sub-pipeline inside a server")::

    T_l[b][a, z] = min( min_{r <= b} term_l(a, z, r),
                        min_{a < y < z, r < b} max(T_l[b - r][a, y], term_l(y, z, r)) )

where a level-0 term's base time is the stage's compute and a level-``l`` term's base time is
``T_{l-1}[w_{l-1}][a, z]``: the sub-pipeline becomes one "layer" of the level above, whose
replication syncs over the outer bandwidth. Vectorised over ``a`` and ``y`` for each ``z``:
``O(K^3 w^2)`` work, which bounds ``K`` for hierarchical problems (see ``max_work``).

Outermost level: binary search on the time. For a limit ``tau`` the least number of
outermost units that cover the suffix after state ``a`` with every term ``<= tau`` is::

    W(a) = min_{z > a} r_min(a, z, tau) + W(z),      W(K-1) = 0

with ``r_min`` from :meth:`CostModel.min_replicas`; ``tau`` is feasible iff ``W(0) <= N``.
Working from the right makes the PipeDream memory rule exact: a stage's in-flight
minibatches grow with the workers after it, and the suffix with the fewest workers is best
for every stage before it. ``O(K^2)`` work per step. Two searches:

- Tabulated (``N <= TABLE_REPLICAS`` and pairs x ``(N - 1)`` at most ``TABLE_ELEMENTS``):
  every pair's term at every replica count is computed once, ``r_min`` is read off that
  table, and since a plan's time is its largest term, the optimum is one of the tabulated
  values: a bisection over those between the lower bound (total compute / N) and the best
  plan found so far is exact, in ``log2`` of their count steps (5-16 on a Hugging Face
  BERT's 1,101 states on 2 workers).
- Otherwise ``r_min`` comes in closed form, and the search moves ``tau`` geometrically
  between the lower bound and the value of the best plan found so far, and stops when they
  agree to ``rel_tol``; the answer is the value of an actual plan, so it is exact up to
  ``rel_tol`` (about 35 steps).

Ties: among plans within the optimum, a last pass picks per state the lexicographically
smallest (workers, stages, cut bytes) suffix: fewest workers (a plan may leave workers idle
when more replicas cannot lower the bottleneck; PipeDream's optimizer likewise uses up to N),
then fewest stages, then least communication; remaining ties go to the smallest index.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import PlanError
from .cost import CostModel, LevelCtx
from .dag import Dag, States
from .stage_memory import MemoryModel, max_units_array
from .topology import unit_workers
from .types import Topology

TAU_INF = 1e300


@dataclass
class Problem:
    """Everything the DP needs, fixed for one solve."""

    dag: Dag
    states: States
    model: CostModel
    topology: Topology
    straight: bool = False
    memory: MemoryModel | None = None
    limit: float | None = None
    num_stages: int | None = None
    rel_tol: float = 1e-10
    levels: list[LevelCtx] = field(init=False)
    budgets: list[int] = field(init=False)

    def __post_init__(self) -> None:
        units = unit_workers(self.topology)
        self.levels = [LevelCtx(lv.bandwidth, units[i]) for i, lv in enumerate(self.topology.levels)]
        self.budgets = [lv.workers for lv in self.topology.levels]

    @property
    def total_workers(self) -> int:
        return self.topology.total_workers

    @property
    def h(self) -> int:
        return len(self.levels)


@dataclass
class InnerTable:
    """``T[b][a, z]`` with the choices that reach it (``split`` -1: a single element)."""

    T: np.ndarray
    split: np.ndarray
    rep: np.ndarray


@dataclass
class Element:
    """A solved element: states ``a < z``, replicas, level, and its children (inner levels)."""

    a: int
    z: int
    replicas: int
    level: int
    term: float
    children: list[Element] = field(default_factory=list)


# -- pair quantities ------------------------------------------------------------------------
def _pairs(states: States) -> tuple[np.ndarray, np.ndarray]:
    """All pairs ``a < z`` of comparable states, sorted by ``a`` then ``z``."""
    pa, pz = np.nonzero(states.sub)
    return pa, pz


def _stage_memory_ok(prob: Problem, ys: np.ndarray, z: int, r: int) -> np.ndarray:
    """Conservative memory check of stages ``(y, z)`` with ``r`` replicas inside a hierarchy:
    the workers after the stage are unknown there, so count all N (more than the truth)."""
    st = prob.states
    mem = prob.memory
    assert mem is not None and prob.limit is not None
    units = mem.units(prob.total_workers, r)
    params = st.params[z] - st.params[ys]
    act = st.act[z] - st.act[ys]
    need = (mem.copies(units) + 1.0 + mem.optimizer_state) * params + units * (act + st.cut[ys]) / (
        mem.units_per_minibatch)
    return np.asarray(need <= prob.limit)


def inner_table(prob: Problem, level: int, E: np.ndarray, BwE: np.ndarray) -> InnerTable:
    """Best time of every sub-pipeline ``(a, z)`` at ``level`` with up to ``w_level`` units."""
    st = prob.states
    K = st.k
    w = prob.budgets[level]
    lv = prob.levels[level]
    rs = [1] if prob.straight else list(range(1, w + 1))
    T = np.full((w + 1, K, K), np.inf)
    split = np.full((w + 1, K, K), -1, dtype=np.int32)
    rep = np.zeros((w + 1, K, K), dtype=np.int32)
    X = st.cut
    for z in range(1, K):
        ys = np.nonzero(st.sub[:, z])[0]
        if not len(ys):
            continue
        Ey, By, Py = E[ys, z], BwE[ys, z], st.params[z] - st.params[ys]
        tcol: dict[int, np.ndarray] = {}
        for r in rs:
            t = prob.model.term(lv, Ey, By, Py, X[ys], X[z], r)
            if level == 0 and prob.limit is not None:
                t = np.where(_stage_memory_ok(prob, ys, z, r), t, np.inf)
            tcol[r] = np.asarray(t, dtype=float)
        if ys[-1] == len(ys) - 1:  # states 0..len-1 (always so for chains): views, no copies
            n_ = len(ys)
            sub_T = {b: T[b][:n_, :n_] for b in range(1, w)}
        else:
            sub_T = {b: T[b][np.ix_(ys, ys)] for b in range(1, w)}
        best = np.full(len(ys), np.inf)
        bsplit = np.full(len(ys), -1, dtype=np.int32)
        brep = np.zeros(len(ys), dtype=np.int32)
        rows = np.arange(len(ys))
        for b in range(1, w + 1):
            if b in tcol:  # a single element with b replicas
                better = tcol[b] < best
                best = np.where(better, tcol[b], best)
                bsplit[better] = -1
                brep[better] = b
            for r in rs:
                if r >= b:
                    break
                M = np.maximum(sub_T[b - r], tcol[r][None, :])
                j = M.argmin(axis=1)
                v = M[rows, j]
                better = v < best
                if better.any():
                    best = np.where(better, v, best)
                    bsplit[better] = ys[j[better]]
                    brep[better] = r
            T[b][ys, z] = best
            split[b][ys, z] = bsplit
            rep[b][ys, z] = brep
    return InnerTable(T, split, rep)


def expand(prob: Problem, tables: list[InnerTable], level: int, budget: int, a: int, z: int) -> list[Element]:
    """The level-``level`` pipeline that ``tables[level]`` chose for ``(a, z)`` within ``budget``."""
    tab = tables[level]
    out: list[Element] = []
    while True:
        s = int(tab.split[budget][a, z])
        r = int(tab.rep[budget][a, z])
        if r <= 0:
            raise PlanError("internal error: no sub-pipeline recorded; please report this with the profile")
        out.append(Element(s if s >= 0 else a, z, r, level, math.nan))
        if s < 0:
            break
        budget -= r
        z = s
    out.reverse()
    for e in out:
        if level > 0:
            e.children = expand(prob, tables, level - 1, prob.budgets[level - 1], e.a, e.z)
    return out


# -- the outermost level: search on the time limit ----------------------------------------
@dataclass
class TopLevel:
    """Pair arrays of the outermost level (1-D over comparable pairs, sorted by ``a``)."""

    pa: np.ndarray
    pz: np.ndarray
    E: np.ndarray
    Bw: np.ndarray
    P: np.ndarray
    Xs: np.ndarray
    Xe: np.ndarray
    Q: np.ndarray | None  # most in-flight units that fit in memory (flat problems), per pair
    starts: np.ndarray     # pairs of state a are pa[starts[a]:starts[a+1]]
    prep: dict[str, Any] = field(default_factory=dict)  # the cost model's limit-independent arrays


def top_level(prob: Problem, E: np.ndarray, BwE: np.ndarray) -> TopLevel:
    """The outermost level's candidate stages: every finite (state a, state z) pair with its
    per-worker compute ``E``, overlappable backward ``BwE``, bytes and memory-feasible depth."""
    st = prob.states
    pa, pz = _pairs(st)
    e = E[pa, pz]
    keep = np.isfinite(e)
    pa, pz, e = pa[keep], pz[keep], e[keep]
    Q = None
    if prob.h == 1 and prob.limit is not None:
        assert prob.memory is not None
        Q = max_units_array(prob.memory, st.params[pz] - st.params[pa], st.act[pz] - st.act[pa], st.cut[pa], prob.limit)
    starts = np.searchsorted(pa, np.arange(st.k + 1))
    top = TopLevel(pa, pz, e, BwE[pa, pz], st.params[pz] - st.params[pa], st.cut[pa], st.cut[pz], Q, starts)
    top.prep = prob.model.prepare(prob.levels[-1], top.E, top.Bw, top.P, top.Xs, top.Xe)
    prob.model.tabulate(top.prep, prob.budgets[-1])
    return top


def _replicas(prob: Problem, top: TopLevel, tau: float, exact: bool) -> tuple[np.ndarray, np.ndarray]:
    """Per pair: can one replica meet ``tau``, and the least ``m >= 2`` that can (``inf``: none)."""
    ok1, m2 = prob.model.min_replicas(top.prep, tau, exact)
    if prob.straight:
        m2 = np.full_like(m2, np.inf)
    m2 = np.where(m2 <= prob.budgets[-1], m2, np.inf)
    return ok1, m2


def _with_memory(ok1: np.ndarray, m2: np.ndarray, q: np.ndarray | None, Wz: np.ndarray) -> np.ndarray:
    """Least replicas meeting both the time (``ok1``/``m2``) and memory: the stage's in-flight
    units ``1 + ceil(Wz / r)`` (``Wz`` workers after it) must not exceed ``q``."""
    if q is None:
        return np.where(ok1, 1.0, m2)
    with np.errstate(divide="ignore", invalid="ignore"):
        r_mem = np.where(np.isinf(q) | (Wz == 0) & (q >= 1), 1.0,
                         np.where(q >= 2, np.ceil(Wz / np.maximum(q - 1.0, 1.0)), np.inf))
    r_mem = np.where(q < 1, np.inf, r_mem)
    one = ok1 & (r_mem <= 1.0)
    return np.where(one, 1.0, np.maximum(np.maximum(m2, r_mem), 2.0))


def feasible(prob: Problem, top: TopLevel, tau: float, tiebreak: bool = False) -> list[tuple[int, int, int]] | None:
    """A plan with every term ``<= tau`` and at most N outermost units, or None.

    Returns the outermost elements ``(a, z, replicas)``. With ``tiebreak`` the suffix of each
    state is the lexicographically least (units, stages, cut bytes); otherwise least units.
    """
    ok1, m2 = _replicas(prob, top, tau, exact=tiebreak)
    if prob.num_stages is None:
        return _feasible_any_stages(prob, top, ok1, m2, tiebreak)
    return _feasible_exact_stages(prob, top, ok1, m2, tiebreak, prob.num_stages)


def _feasible_any_stages(prob: Problem, top: TopLevel, ok1: np.ndarray, m2: np.ndarray,
                         tiebreak: bool) -> list[tuple[int, int, int]] | None:
    """:func:`feasible` for any number of stages: ``W[a]`` = least units covering the suffix of ``a``."""
    st = prob.states
    K = st.k
    N = prob.budgets[-1]
    cut = st.cut
    W = np.full(K, np.inf)
    W[K - 1] = 0.0
    nst = np.zeros(K)
    byt = np.zeros(K)
    choice = np.full(K, -1, dtype=np.int64)
    reps = np.zeros(K, dtype=np.int64)
    # without a memory limit a pair's replicas do not depend on W: taken for every pair at once
    fixed = _with_memory(ok1, m2, None, W) if top.Q is None else None
    starts = top.starts.tolist()
    for a in range(K - 2, -1, -1):
        lo, hi = starts[a], starts[a + 1]
        if lo == hi:
            continue
        zs = top.pz[lo:hi]
        Wz = W[zs]
        if fixed is not None:
            r = fixed[lo:hi]
        else:
            assert top.Q is not None
            r = _with_memory(ok1[lo:hi], m2[lo:hi], top.Q[lo:hi], Wz)
        tot = r + Wz
        i = int(tot.argmin())
        best = tot[i]
        if not best <= N:
            continue
        if tiebreak:
            cand = np.nonzero(tot == best)[0]
            s = nst[zs[cand]]
            cand = cand[s == s.min()]
            b = byt[zs[cand]] + np.where(zs[cand] == K - 1, 0.0, cut[zs[cand]])
            i = int(cand[np.argmin(b)])
            byt[a] = b.min()
        W[a] = best
        choice[a] = lo + i
        reps[a] = int(r[i])
        nst[a] = nst[zs[i]] + 1
    if not W[0] <= N:
        return None
    out = []
    a = 0
    while a != K - 1:
        p = choice[a]
        out.append((a, int(top.pz[p]), int(reps[a])))
        a = int(top.pz[p])
    return out


def _feasible_exact_stages(prob: Problem, top: TopLevel, ok1: np.ndarray, m2: np.ndarray, tiebreak: bool,
                           S: int) -> list[tuple[int, int, int]] | None:
    """:func:`feasible` with exactly ``S`` stages: ``W[a, s]`` = least units covering the
    suffix of ``a`` with ``s`` stages."""
    st = prob.states
    K = st.k
    N = prob.budgets[-1]
    cut = st.cut
    W2 = np.full((K, S + 1), np.inf)
    W2[K - 1, 0] = 0.0
    byt2 = np.zeros((K, S + 1))
    ch = np.full((K, S + 1), -1, dtype=np.int64)
    rp = np.zeros((K, S + 1), dtype=np.int64)
    for a in range(K - 2, -1, -1):
        lo, hi = top.starts[a], top.starts[a + 1]
        if lo == hi:
            continue
        zs = top.pz[lo:hi]
        Wz = W2[zs, :S]  # [pair, s-1]
        q = None if top.Q is None else top.Q[lo:hi, None]
        r = _with_memory(ok1[lo:hi, None], m2[lo:hi, None], q, np.where(np.isfinite(Wz), Wz, 0.0))
        r = np.broadcast_to(r, Wz.shape)
        tot = np.where(np.isfinite(Wz), r + Wz, np.inf)
        best = tot.min(axis=0)
        for s in range(1, S + 1):
            if not best[s - 1] <= N:
                continue
            cand = np.nonzero(tot[:, s - 1] == best[s - 1])[0]
            if tiebreak:
                b = byt2[zs[cand], s - 1] + np.where(zs[cand] == K - 1, 0.0, cut[zs[cand]])
                i = int(cand[np.argmin(b)])
                byt2[a, s] = b.min()
            else:
                i = int(cand[0])
            W2[a, s] = best[s - 1]
            ch[a, s] = lo + i
            rp[a, s] = int(r[i, s - 1])
    if not W2[0, S] <= N:
        return None
    out = []
    a, s = 0, S
    while a != K - 1:
        p = ch[a, s]
        out.append((a, int(top.pz[p]), int(rp[a, s])))
        a, s = int(top.pz[p]), s - 1
    return out


def _value(prob: Problem, top: TopLevel, E: np.ndarray, BwE: np.ndarray, elems: list[tuple[int, int, int]]) -> float:
    st = prob.states
    lv = prob.levels[-1]
    a = np.array([e[0] for e in elems])
    z = np.array([e[1] for e in elems])
    m = np.array([e[2] for e in elems], dtype=float)
    t = prob.model.term(lv, E[a, z], BwE[a, z], st.params[z] - st.params[a], st.cut[a], st.cut[z], m)
    return float(np.max(t))


@dataclass
class Solution:
    """The DP's answer: outermost elements (with children), the value, and search facts."""

    elements: list[Element]
    value: float
    steps: int
    lower_bound: float


def prepare(prob: Problem) -> tuple[list[InnerTable], np.ndarray, np.ndarray]:
    """Inner tables for levels ``0..h-2`` and the outermost level's base times."""
    st = prob.states
    C2 = st.compute[None, :] - st.compute[:, None]
    B2 = st.backward[None, :] - st.backward[:, None]
    E = np.where(st.sub, C2, np.inf)
    BwE = np.where(st.sub, B2, 0.0)
    tables: list[InnerTable] = []
    for level in range(prob.h - 1):
        tab = inner_table(prob, level, E, BwE)
        tables.append(tab)
        E = tab.T[prob.budgets[level]]
        with np.errstate(divide="ignore", invalid="ignore"):
            BwE = np.where(np.isfinite(E) & (C2 > 0), E * B2 / np.where(C2 > 0, C2, 1.0), 0.0)
    return tables, E, BwE


def _search_values(prob: Problem, top: TopLevel, E: np.ndarray, BwE: np.ndarray, values: np.ndarray,
                   best: list[tuple[int, int, int]], hi: float) -> tuple[list[tuple[int, int, int]], float, int]:
    """Bisection over ``values``, every time a plan can take (:meth:`CostModel.limits`; a
    plan's time is its largest term) from the lower bound to below ``hi``, the time of the
    plan ``best``, sorted: the least feasible one is the optimum, found in ``log2`` of their
    count steps without a tolerance. Returns the best plan, its time and the steps taken."""
    steps = 0
    cand = values
    while len(cand):
        i = len(cand) // 2
        e = feasible(prob, top, float(cand[i]))
        steps += 1
        if e is None:
            cand = cand[i + 1:]
        else:
            best, hi = e, _value(prob, top, E, BwE, e)
            cand = cand[:i]
            cand = cand[cand < hi]
    return best, hi, steps


def _search_geometric(prob: Problem, top: TopLevel, E: np.ndarray, BwE: np.ndarray, best: list[tuple[int, int, int]],
                      hi: float, lo: float) -> tuple[list[tuple[int, int, int]], float, float, int]:
    """The search without a table: ``tau`` moves geometrically between the lower bound ``lo``
    and ``hi``, the time of the plan ``best``, until they agree to ``rel_tol``. Returns the
    best plan, its time, the last lower bound and the steps taken."""
    steps = 0
    if lo <= 0.0:
        # zero-compute corner: try zero, else search from a tiny positive limit
        e0 = feasible(prob, top, 0.0)
        steps += 1
        if e0 is not None:
            best, hi = e0, _value(prob, top, E, BwE, e0)
        lo = hi * 1e-12
    while hi > lo * (1.0 + prob.rel_tol) and hi > 0:
        mid = math.sqrt(lo * hi) if hi / lo > 4.0 else 0.5 * (lo + hi)
        if not lo < mid < hi:
            break
        e = feasible(prob, top, mid)
        steps += 1
        if e is None:
            lo = mid
        else:
            best = e
            hi = _value(prob, top, E, BwE, e)
    return best, hi, lo, steps


def solve(prob: Problem) -> Solution | None:
    """The optimal plan (up to ``rel_tol``), or None if no plan meets the memory limit."""
    tables, E, BwE = prepare(prob)
    top = top_level(prob, E, BwE)
    elems = feasible(prob, top, TAU_INF)
    steps = 1
    if elems is None:
        return None
    hi = _value(prob, top, E, BwE, elems)
    lo = float(prob.states.compute[-1]) / prob.total_workers
    lo = min(lo, hi)
    best = elems
    values = prob.model.limits(top.prep, lo * (1.0 - 1e-9), hi)  # lo: the rounding of an exact bound
    if values is not None:
        best, hi, more = _search_values(prob, top, E, BwE, values, best, hi)
    else:
        best, hi, lo, more = _search_geometric(prob, top, E, BwE, best, hi, lo)
    steps += more
    final = feasible(prob, top, hi, tiebreak=True)
    steps += 1
    if final is not None and _value(prob, top, E, BwE, final) <= hi:
        best = final
    value = _value(prob, top, E, BwE, best)
    lv = prob.levels[-1]
    out: list[Element] = []
    for a, z, m in best:
        t = float(prob.model.term(lv, E[a, z], BwE[a, z], prob.states.params[z] - prob.states.params[a],
                                  prob.states.cut[a], prob.states.cut[z], m))
        el = Element(a, z, m, prob.h - 1, t)
        if prob.h > 1:
            el.children = expand(prob, tables, prob.h - 2, prob.budgets[-2], a, z)
        out.append(el)
    return Solution(out, value, steps, lo)


def leaves(elements: list[Element], mult: int = 1) -> list[tuple[int, int, int]]:
    """Level-0 stages ``(a, z, total replicas)`` of a solved hierarchy, in pipeline order."""
    out: list[tuple[int, int, int]] = []
    for e in elements:
        if e.level == 0:
            out.append((e.a, e.z, mult * e.replicas))
        else:
            out.extend(leaves(e.children, mult * e.replicas))
    return out


def hierarchy_dict(elements: list[Element], counter: list[int] | None = None) -> list[dict[str, Any]]:
    """The JSON form of a solved hierarchy (``Plan.extra["hierarchy"]``)."""
    counter = counter if counter is not None else [0]
    out: list[dict[str, Any]] = []
    for e in elements:
        if e.level == 0:
            out.append({"replicas": e.replicas, "stage": counter[0]})
            counter[0] += 1
        else:
            out.append({"replicas": e.replicas, "children": hierarchy_dict(e.children, counter)})
    return out


# -- giving idle workers something to do -------------------------------------------------
def element_term(prob: Problem, el: Element, replicas: int) -> float:
    """The term of a solved element with ``replicas`` (children's terms must be current)."""
    st = prob.states
    lv = prob.levels[el.level]
    C = st.compute[el.z] - st.compute[el.a]
    B = st.backward[el.z] - st.backward[el.a]
    if el.level == 0:
        E, Bw = C, B
    else:
        E = max(c.term for c in el.children)
        Bw = E * B / C if C > 0 else 0.0
    return float(prob.model.term(lv, E, Bw, st.params[el.z] - st.params[el.a], st.cut[el.a], st.cut[el.z], replicas))


def fill_idle(prob: Problem, elements: list[Element], level: int | None = None) -> None:
    """Give units a pipeline leaves idle to its elements, in place, never raising any term.

    Inner pipelines first. Then, repeatedly, the element with the largest term that one
    more replica strictly lowers gets it (ties: the earliest). The plan's time cannot grow
    (every term is a function of its own element's replicas) and other stages gain slack;
    under the cost model it is a tie with the fewest-workers plan, which
    ``PlanOptions(use_all_workers=False)`` keeps.
    """
    import heapq

    level = prob.h - 1 if level is None else level
    for el in elements:
        if level > 0:
            fill_idle(prob, el.children, level - 1)
        el.term = element_term(prob, el, el.replicas)
    if prob.straight:
        return
    idle = prob.budgets[level] - sum(el.replicas for el in elements)
    heap = [(-el.term, i) for i, el in enumerate(elements)]
    heapq.heapify(heap)
    while idle > 0 and heap:
        _, i = heapq.heappop(heap)
        el = elements[i]
        new = element_term(prob, el, el.replicas + 1)
        if new < el.term:
            el.replicas += 1
            if not _memory_fits(prob, elements, level):
                el.replicas -= 1  # more workers after earlier stages: more minibatches in flight there
                continue
            el.term = new
            idle -= 1
            heapq.heappush(heap, (-new, i))


def _memory_fits(prob: Problem, elements: list[Element], level: int) -> bool:
    """Whether every stage of a flat plan still fits the memory limit (PipeDream rule:
    a stage holds ceil(workers from it on / replicas) minibatches). Inside a hierarchy the
    planner's bound ceil(N / r) only falls when r grows, so nothing to check there."""
    if prob.limit is None or prob.h > 1 or prob.memory is None:
        return True
    st = prob.states
    after = 0
    for el in reversed(elements):
        after += el.replicas
        need = prob.memory.bytes(st.params[el.z] - st.params[el.a], st.act[el.z] - st.act[el.a],
                                 st.cut[el.a], after, el.replicas)
        if need > prob.limit:
            return False
    return True
