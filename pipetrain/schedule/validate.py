"""Validation of a schedule: structural checks, then a dry run with blocking semantics.

:func:`validate` raises :class:`~pipetrain.errors.ScheduleError` on the first violation of:

1. Placement: each action's stage is held by its rank; each (stage, unit) runs on one rank.
2. Coverage: every stage runs F and B (or I and W) of every unit ``0 .. steps*microbatches-1``
   exactly once, forward first.
3. Data: the RECV_F of a forward precedes it and its SEND_F follows it; same for RECV_B /
   SEND_B around the backward (or I) on the same rank; every SEND is matched by the RECV of
   the receiving stage, between the right peers (``0SEND_F3>1`` with ``1RECV_F3<0``).
4. Versions: F and B (I, W) carry a version; B's equals its F's (weight stashing; with the
   schedule option ``stashing=False``, B's is its stage's newest when it runs instead); a
   version is never used before it exists (at most the number of that stage's STEPs earlier
   in the list); STEPs of a stage are numbered 0, 1, 2...; a replicated stage all-reduces
   right before each step and all its replicas all-reduce the same steps in the same order.
5. Progress: executing the lists (a RECV waits for its SEND, SENDs are buffered, an
   ALLREDUCE waits for every replica) finishes; otherwise "schedule deadlocks at ..." with
   the grid, each stuck action marked ``*``.
"""
from __future__ import annotations

from collections import Counter, defaultdict

from ..errors import ScheduleError
from .action import Action, Op, Schedule

_SEND_TO_RECV = {Op.SEND_F: (Op.RECV_F, 1), Op.SEND_B: (Op.RECV_B, -1)}
_RECV_FROM_SEND = {Op.RECV_F: (Op.SEND_F, -1), Op.RECV_B: (Op.SEND_B, 1)}


#: ``(receiving stage, RECV op, unit, sender, receiver)``: one transfer, seen from either end.
TransferKey = tuple[int, Op, int, int, int]


def transfer_key(rank: int, a: Action) -> TransferKey:
    """Identify a transfer from either end: ``(receiving stage, RECV op, unit, sender, receiver)``."""
    if a.op in _SEND_TO_RECV:
        op, d = _SEND_TO_RECV[a.op]
        return (a.stage + d, op, a.mb, rank, int(a.peer if a.peer is not None else -1))
    if a.op in _RECV_FROM_SEND:
        return (a.stage, a.op, a.mb, int(a.peer if a.peer is not None else -1), rank)
    raise ValueError(f"{a} is not a transfer")


def deadlock_error(schedule: Schedule, pcs: list[int], why: dict[int, str] | None = None) -> ScheduleError:
    """The error for a run stuck at ``pcs[rank]`` on every unfinished rank, with the marked grid."""
    stuck = {r: pc for r, pc in enumerate(pcs) if pc < len(schedule.workers[r])}
    parts = []
    for r, pc in stuck.items():
        a = schedule.workers[r][pc]
        parts.append(f"rank {r}: {a.long}" + (f" ({why[r]})" if why and r in why else ""))
    return ScheduleError(
        "schedule deadlocks at " + "; ".join(parts)
        + "; reorder the lists so every RECV's SEND can run first (stuck actions marked *):\n"
        + schedule.grid(compute_only=True, mark=stuck)
    )


def _fail(msg: str) -> ScheduleError:
    return ScheduleError(f"invalid schedule: {msg}")


class _RankList:
    """What one rank's list holds up to the action being checked."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.done: set[tuple[int, Op, int]] = set()  # (stage, op, unit) already in this list
        self.fver: dict[tuple[int, int], int] = {}   # (stage, unit) -> its forward's version
        self.nsteps: Counter[int] = Counter()        # stage -> STEPs so far


class _StructureCheck:
    """Checks 1 to 4 of the module docstring: each action as it is read, then across ranks."""

    def __init__(self, schedule: Schedule) -> None:
        self.S = schedule.num_stages
        self.units = schedule.steps * schedule.microbatches
        self.holders = {k: set(r) for k, r in enumerate(schedule.stage_ranks)}
        self.stashing = bool(schedule.options.get("stashing", True))
        self.compute_rank: dict[tuple[int, int], int] = {}
        self.counts: Counter[tuple[int, Op, int]] = Counter()
        self.sends: Counter[TransferKey] = Counter()
        self.recvs: Counter[TransferKey] = Counter()
        self.allreduces: dict[int, dict[int, list[int]]] = defaultdict(dict)

    # ------------------------------------------------------------------ one action at a time

    def read_rank(self, rank: int, actions: list[Action]) -> None:
        r = _RankList(rank)
        for i, a in enumerate(actions):
            where = f"rank {rank} action {i} ({a.long})"
            self._placement(r, a, where)
            if a.op in (Op.F, Op.B, Op.I, Op.W):
                self._compute(r, a, where)
            elif a.op in _SEND_TO_RECV:
                self._send(r, a, where)
            elif a.op in _RECV_FROM_SEND:
                if a.peer is None:
                    raise _fail(f"{where}: a transfer needs a peer")
                self.recvs[transfer_key(rank, a)] += 1
            elif a.op is Op.ALLREDUCE:
                self.allreduces[a.stage].setdefault(rank, []).append(a.mb)
            elif a.op is Op.STEP:
                self._step(r, a, actions[i - 1] if i else None, where)
            r.done.add((a.stage, a.op, a.mb))

    def _placement(self, r: _RankList, a: Action, where: str) -> None:
        if not 0 <= a.stage < self.S:
            raise _fail(f"{where}: stage {a.stage} does not exist ({self.S} stages)")
        if r.rank not in self.holders[a.stage]:
            raise _fail(f"{where}: stage {a.stage} lives on ranks {sorted(self.holders[a.stage])}, not {r.rank}")

    def _compute(self, r: _RankList, a: Action, where: str) -> None:
        k, u = a.stage, a.mb
        if not 0 <= u < self.units:
            raise _fail(f"{where}: unit {u} outside 0..{self.units - 1} (steps*microbatches)")
        other = self.compute_rank.setdefault((k, u), r.rank)
        if other != r.rank:
            raise _fail(f"{where}: unit {u} of stage {k} also runs on rank {other}; "
                        "a unit stays on one replica")
        self.counts[(k, a.op, u)] += 1
        if a.version is None:
            raise _fail(f"{where}: compute actions must carry a weight version")
        if a.version > r.nsteps[k]:
            raise _fail(f"{where}: uses version {a.version} but only {r.nsteps[k]} steps of stage {k} "
                        "came before")
        if a.op is Op.F:
            r.fver[(k, u)] = a.version
            if k > 0 and (k, Op.RECV_F, u) not in r.done:
                raise _fail(f"{where}: forward before its input arrives (no {k}RECV_F{u} earlier on rank "
                            f"{r.rank})")
        else:
            self._after_forward(r, a, where)

    def _after_forward(self, r: _RankList, a: Action, where: str) -> None:
        """B, I or W of a unit: after its forward, on the right version, after its inputs."""
        k, u = a.stage, a.mb
        if (k, u) not in r.fver:
            raise _fail(f"{where}: {a.op.value} before the forward {k}F{u} on rank {r.rank}")
        if not self.stashing:  # PipeDream without stashing: the newest version when it runs
            if a.version != r.nsteps[k]:
                raise _fail(f"{where}: uses version {a.version} but stage {k}'s newest is {r.nsteps[k]} "
                            f"(stashing=False: backward uses the newest version)")
        elif a.version != r.fver[(k, u)]:
            raise _fail(f"{where}: uses version {a.version} but its forward used {r.fver[(k, u)]} "
                        f"(weight stashing: backward uses the forward's version)")
        if a.op in (Op.B, Op.I) and k < self.S - 1 and (k, Op.RECV_B, u) not in r.done:
            raise _fail(f"{where}: backward before its gradient arrives (no {k}RECV_B{u} earlier)")
        if a.op is Op.W and (k, Op.I, u) not in r.done:
            raise _fail(f"{where}: W before I of the same unit")

    def _send(self, r: _RankList, a: Action, where: str) -> None:
        k, u = a.stage, a.mb
        if a.op is Op.SEND_F and (k, Op.F, u) not in r.done:
            raise _fail(f"{where}: sends an output before computing it ({k}F{u} must come first)")
        if a.op is Op.SEND_B and (k, Op.B, u) not in r.done and (k, Op.I, u) not in r.done:
            raise _fail(f"{where}: sends a gradient before computing it ({k}B{u} must come first)")
        if a.peer is None:
            raise _fail(f"{where}: a transfer needs a peer")
        self.sends[transfer_key(r.rank, a)] += 1

    def _step(self, r: _RankList, a: Action, prev: Action | None, where: str) -> None:
        k, u = a.stage, a.mb
        if u != r.nsteps[k]:
            raise _fail(f"{where}: step {u} of stage {k} but {r.nsteps[k]} steps came before (number them 0, 1, "
                        "...)")
        replicated = len(self.holders[k]) > 1
        if replicated and (prev is None or prev.op is not Op.ALLREDUCE or prev.stage != k or prev.mb != u):
            raise _fail(f"{where}: a replicated stage must all-reduce right before each step "
                        f"({k}ALLREDUCE{u})")
        r.nsteps[k] += 1

    # ------------------------------------------------------------------ across ranks

    def check_coverage(self) -> None:
        """Every unit once per stage, with F and (B or I+W)."""
        for k in range(self.S):
            for u in range(self.units):
                f = self.counts[(k, Op.F, u)]
                b, i_, w = self.counts[(k, Op.B, u)], self.counts[(k, Op.I, u)], self.counts[(k, Op.W, u)]
                if f != 1 or not ((b == 1 and i_ == 0 and w == 0) or (b == 0 and i_ == 1 and w == 1)):
                    raise _fail(f"stage {k} unit {u}: {f} forwards, {b} backwards, {i_} I, {w} W; "
                                f"every unit needs one forward and one backward (or one I and one W) per stage")

    def check_transfers(self) -> None:
        """Transfers pair up, and go to the rank that runs the unit there."""
        sends, recvs = self.sends, self.recvs
        for key, n in sends.items():
            stage, op, u, src, dst = key
            if recvs.get(key, 0) != n:
                raise _fail(f"rank {src} sends {op.value.replace('RECV', 'SEND')} of unit {u} to rank {dst} "
                            f"{n} time(s), but rank {dst} posts {recvs.get(key, 0)} matching "
                            f"{stage}{op.value}{u}<{src}")
            if self.compute_rank.get((stage, u)) != dst:
                raise _fail(f"rank {src} sends unit {u} to rank {dst}, but stage {stage} runs it on rank "
                            f"{self.compute_rank.get((stage, u))}")
        for key, n in recvs.items():
            if sends.get(key, 0) != n:
                stage, op, u, src, dst = key
                raise _fail(f"rank {dst} waits for {stage}{op.value}{u}<{src} but rank {src} sends it "
                            f"{sends.get(key, 0)} time(s)")

    def check_relays(self) -> None:
        """Every transfer the data flow needs is present (relay: stage k to k+1 and back)."""
        compute_rank, recvs = self.compute_rank, self.recvs
        for (k, u), rank in compute_rank.items():
            if k > 0 and recvs.get((k, Op.RECV_F, u, compute_rank.get((k - 1, u), -1), rank), 0) != 1:
                raise _fail(f"stage {k} unit {u} on rank {rank} has no RECV_F from the rank of stage {k - 1}")
            if k < self.S - 1 and recvs.get((k, Op.RECV_B, u, compute_rank.get((k + 1, u), -1), rank), 0) != 1:
                raise _fail(f"stage {k} unit {u} on rank {rank} has no RECV_B from the rank of stage {k + 1}")

    def check_allreduces(self) -> None:
        """Replicas all-reduce the same steps in the same order."""
        for k, per_rank in self.allreduces.items():
            if len(self.holders[k]) == 1:
                raise _fail(f"stage {k} has one replica but all-reduces; ALLREDUCE is only for replicated stages")
            seqs = {r: per_rank.get(r, []) for r in self.holders[k]}
            ref = seqs[min(seqs)]
            for r, seq in seqs.items():
                if seq != ref:
                    raise _fail(f"replicas of stage {k} all-reduce different steps: rank {min(seqs)} {ref}, "
                                f"rank {r} {seq}")


def check_structure(schedule: Schedule) -> None:
    """Checks 1 to 4 of the module docstring (everything but progress)."""
    check = _StructureCheck(schedule)
    for rank, actions in enumerate(schedule.workers):
        check.read_rank(rank, actions)
    check.check_coverage()
    check.check_transfers()
    check.check_relays()
    check.check_allreduces()


def dry_run(schedule: Schedule) -> None:
    """Execute the lists with blocking semantics; raise "schedule deadlocks at ..." if stuck."""
    W = schedule.num_workers
    pcs = [0] * W
    posted: Counter[TransferKey] = Counter()
    lists = schedule.workers
    progress = True
    while progress:
        progress = False
        for rank in range(W):
            while pcs[rank] < len(lists[rank]):
                a = lists[rank][pcs[rank]]
                if a.op in _SEND_TO_RECV:
                    posted[transfer_key(rank, a)] += 1
                elif a.op in _RECV_FROM_SEND:
                    key = transfer_key(rank, a)
                    if not posted[key]:
                        break
                    posted[key] -= 1
                elif a.op is Op.ALLREDUCE:
                    group = schedule.stage_ranks[a.stage]
                    if not all(pcs[g] < len(lists[g]) and lists[g][pcs[g]] == a for g in group):
                        break
                    for g in group:
                        if g != rank:
                            pcs[g] += 1
                pcs[rank] += 1
                progress = True
    if any(pc < len(lists[r]) for r, pc in enumerate(pcs)):
        why: dict[int, str] = {}
        for r, pc in enumerate(pcs):
            if pc < len(lists[r]):
                a = lists[r][pc]
                if a.op in _RECV_FROM_SEND:
                    why[r] = f"waits for rank {a.peer}"
                elif a.op is Op.ALLREDUCE:
                    why[r] = f"waits for ranks {[g for g in schedule.stage_ranks[a.stage] if g != r]}"
        raise deadlock_error(schedule, pcs, why)


def validate(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` is well formed and runs to the end."""
    check_structure(schedule)
    dry_run(schedule)
