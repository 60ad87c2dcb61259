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


def check_structure(schedule: Schedule) -> None:
    """Checks 1 to 4 of the module docstring (everything but progress)."""
    S = schedule.num_stages
    units = schedule.steps * schedule.microbatches
    holders = {k: set(r) for k, r in enumerate(schedule.stage_ranks)}
    compute_rank: dict[tuple[int, int], int] = {}
    counts: Counter[tuple[int, Op, int]] = Counter()
    sends: Counter[TransferKey] = Counter()
    recvs: Counter[TransferKey] = Counter()
    allreduces: dict[int, dict[int, list[int]]] = defaultdict(dict)
    stashing = bool(schedule.options.get("stashing", True))
    for rank, actions in enumerate(schedule.workers):
        done: set[tuple[int, Op, int]] = set()  # (stage, op, unit) already in this list
        fver: dict[tuple[int, int], int] = {}
        nsteps: Counter[int] = Counter()
        for i, a in enumerate(actions):
            where = f"rank {rank} action {i} ({a.long})"
            if not 0 <= a.stage < S:
                raise _fail(f"{where}: stage {a.stage} does not exist ({S} stages)")
            if rank not in holders[a.stage]:
                raise _fail(f"{where}: stage {a.stage} lives on ranks {sorted(holders[a.stage])}, not {rank}")
            k, u = a.stage, a.mb
            if a.op in (Op.F, Op.B, Op.I, Op.W):
                if not 0 <= u < units:
                    raise _fail(f"{where}: unit {u} outside 0..{units - 1} (steps*microbatches)")
                other = compute_rank.setdefault((k, u), rank)
                if other != rank:
                    raise _fail(f"{where}: unit {u} of stage {k} also runs on rank {other}; "
                                "a unit stays on one replica")
                counts[(k, a.op, u)] += 1
                if a.version is None:
                    raise _fail(f"{where}: compute actions must carry a weight version")
                if a.version > nsteps[k]:
                    raise _fail(f"{where}: uses version {a.version} but only {nsteps[k]} steps of stage {k} "
                                "came before")
                if a.op is Op.F:
                    fver[(k, u)] = a.version
                    if k > 0 and (k, Op.RECV_F, u) not in done:
                        raise _fail(f"{where}: forward before its input arrives (no {k}RECV_F{u} earlier on rank "
                                    f"{rank})")
                else:
                    if (k, u) not in fver:
                        raise _fail(f"{where}: {a.op.value} before the forward {k}F{u} on rank {rank}")
                    if not stashing:  # PipeDream without stashing: the newest version when it runs
                        if a.version != nsteps[k]:
                            raise _fail(f"{where}: uses version {a.version} but stage {k}'s newest is {nsteps[k]} "
                                        f"(stashing=False: backward uses the newest version)")
                    elif a.version != fver[(k, u)]:
                        raise _fail(f"{where}: uses version {a.version} but its forward used {fver[(k, u)]} "
                                    f"(weight stashing: backward uses the forward's version)")
                    if a.op in (Op.B, Op.I) and k < S - 1 and (k, Op.RECV_B, u) not in done:
                        raise _fail(f"{where}: backward before its gradient arrives (no {k}RECV_B{u} earlier)")
                    if a.op is Op.W and (k, Op.I, u) not in done:
                        raise _fail(f"{where}: W before I of the same unit")
            elif a.op in _SEND_TO_RECV:
                producer = Op.F if a.op is Op.SEND_F else None
                if producer is Op.F and (k, Op.F, u) not in done:
                    raise _fail(f"{where}: sends an output before computing it ({k}F{u} must come first)")
                if a.op is Op.SEND_B and (k, Op.B, u) not in done and (k, Op.I, u) not in done:
                    raise _fail(f"{where}: sends a gradient before computing it ({k}B{u} must come first)")
                if a.peer is None:
                    raise _fail(f"{where}: a transfer needs a peer")
                sends[transfer_key(rank, a)] += 1
            elif a.op in _RECV_FROM_SEND:
                if a.peer is None:
                    raise _fail(f"{where}: a transfer needs a peer")
                recvs[transfer_key(rank, a)] += 1
            elif a.op is Op.ALLREDUCE:
                allreduces[k].setdefault(rank, []).append(u)
            elif a.op is Op.STEP:
                if u != nsteps[k]:
                    raise _fail(f"{where}: step {u} of stage {k} but {nsteps[k]} steps came before (number them 0, 1, "
                                "...)")
                if len(holders[k]) > 1:
                    prev = actions[i - 1] if i else None
                    if prev is None or prev.op is not Op.ALLREDUCE or prev.stage != k or prev.mb != u:
                        raise _fail(f"{where}: a replicated stage must all-reduce right before each step "
                                    f"({k}ALLREDUCE{u})")
                nsteps[k] += 1
            done.add((k, a.op, u))
    # Coverage: every unit once per stage, with F and (B or I+W).
    for k in range(S):
        for u in range(units):
            f = counts[(k, Op.F, u)]
            b, i_, w = counts[(k, Op.B, u)], counts[(k, Op.I, u)], counts[(k, Op.W, u)]
            if f != 1 or not ((b == 1 and i_ == 0 and w == 0) or (b == 0 and i_ == 1 and w == 1)):
                raise _fail(f"stage {k} unit {u}: {f} forwards, {b} backwards, {i_} I, {w} W; "
                            f"every unit needs one forward and one backward (or one I and one W) per stage")
    # Transfers pair up, and go to the rank that runs the unit there.
    for key, n in sends.items():
        stage, op, u, src, dst = key
        if recvs.get(key, 0) != n:
            raise _fail(f"rank {src} sends {op.value.replace('RECV', 'SEND')} of unit {u} to rank {dst} {n} time(s), "
                        f"but rank {dst} posts {recvs.get(key, 0)} matching {stage}{op.value}{u}<{src}")
        if compute_rank.get((stage, u)) != dst:
            raise _fail(f"rank {src} sends unit {u} to rank {dst}, but stage {stage} runs it on rank "
                        f"{compute_rank.get((stage, u))}")
    for key, n in recvs.items():
        if sends.get(key, 0) != n:
            stage, op, u, src, dst = key
            raise _fail(f"rank {dst} waits for {stage}{op.value}{u}<{src} but rank {src} sends it {sends.get(key, 0)} "
                        "time(s)")
    # Every transfer the data flow needs is present (relay: stage k to k+1 and back).
    for (k, u), rank in compute_rank.items():
        if k > 0 and recvs.get((k, Op.RECV_F, u, compute_rank.get((k - 1, u), -1), rank), 0) != 1:
            raise _fail(f"stage {k} unit {u} on rank {rank} has no RECV_F from the rank of stage {k - 1}")
        if k < S - 1 and recvs.get((k, Op.RECV_B, u, compute_rank.get((k + 1, u), -1), rank), 0) != 1:
            raise _fail(f"stage {k} unit {u} on rank {rank} has no RECV_B from the rank of stage {k + 1}")
    # Replicas all-reduce the same steps in the same order.
    for k, per_rank in allreduces.items():
        if len(holders[k]) == 1:
            raise _fail(f"stage {k} has one replica but all-reduces; ALLREDUCE is only for replicated stages")
        seqs = {r: per_rank.get(r, []) for r in holders[k]}
        ref = seqs[min(seqs)]
        for r, seq in seqs.items():
            if seq != ref:
                raise _fail(f"replicas of stage {k} all-reduce different steps: rank {min(seqs)} {ref}, rank {r} {seq}")


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
