"""Naming the peer that is gone: what a worker was waiting for when its wait broke.

A worker killed by a signal (SIGKILL, the out-of-memory killer, a lost machine) runs no
handler and posts no :class:`~pipetrain.runtime.process.failures.FailureRecord`. The others learn of
it only through a broken wait: a receive whose connection closed, a collective that failed,
or, for a peer that is hung rather than dead, the process group's timeout (``--timeout``;
every receive, collective and rendezvous is bounded by it). Two things name the dead rank:

- in a worker, :func:`naming_peer` turns the broken wait into one line naming the action it
  was waiting for and its peer (``rank 0 lost rank 1 while waiting for RECV_F 1F3 from
  rank 1: ...``), which the worker posts as its failure;
- in the launcher, :func:`killed_rank` finds, among the processes torchelastic saw fail, one
  killed by a signal other than the agent's own SIGTERM that posted no record: that rank
  died first and the others' broken waits followed from it.
"""
from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ...errors import PipetrainError
from .failures import FailureBoard, WorkerFailure

__all__ = ["PeerLost", "naming_peer", "waiting_for", "killed_rank"]

# Signals the elastic agent itself sends when it stops the surviving workers.
_AGENT_SIGNALS = {signal.SIGTERM, signal.SIGINT}


class PeerLost(RuntimeError):
    """A wait of this worker broke: the message names the action and the peer it waited on."""

    def __init__(self, rank: int, peer: int | None, waiting: str, cause: BaseException) -> None:
        text = str(cause).strip()
        first = text.splitlines()[0] if text else type(cause).__name__
        who = f"lost rank {peer}" if peer is not None else "lost a peer"
        super().__init__(f"rank {rank} {who} while waiting for {waiting}: {type(cause).__name__}: {first}")
        self.rank, self.peer, self.waiting = rank, peer, waiting


def waiting_for(executor: Any, actions: Sequence[Any]) -> tuple[str, int | None]:
    """(description, peer rank or None) of the action ``executor`` was executing."""
    pos = getattr(executor, "position", None)
    if pos is None or not 0 <= pos < len(actions):
        return "the end of the segment (send completion or barrier)", None
    a = actions[pos]
    peer = getattr(a, "peer", None)
    op = getattr(getattr(a, "op", None), "name", str(getattr(a, "op", "")))
    long = getattr(a, "long", str(a))
    if op in ("RECV_F", "RECV_B") and peer is not None:
        return f"{long} from rank {peer}", int(peer)
    if op in ("SEND_F", "SEND_B") and peer is not None:
        return f"{long} to rank {peer}", int(peer)
    if op in ("ALLREDUCE", "STEP"):
        return f"{long} (an all-reduce with the stage's replicas or all ranks)", None
    return str(long), None


@contextlib.contextmanager
def naming_peer(rank: int, executor: Any, actions: Sequence[Any]) -> Iterator[None]:
    """Re-raise a broken wait inside the block as :class:`PeerLost` (user errors pass as they are)."""
    try:
        yield
    except (PipetrainError, PeerLost, KeyboardInterrupt):
        raise
    except Exception as e:  # noqa: BLE001 - gloo/NCCL raise RuntimeError or DistBackendError
        text = str(e).lower()
        broken = any(w in text for w in ("connection", "closed", "timed out", "timeout", "reset by peer",
                                          "broken pipe", "socket", "gloo", "nccl"))
        if not broken:
            raise
        waiting, peer = waiting_for(executor, actions)
        raise PeerLost(rank, peer, waiting, e) from e


def killed_rank(failures: Mapping[int, Any], board: FailureBoard | None) -> WorkerFailure | None:
    """The rank torchelastic saw die by a signal (not the agent's SIGTERM) without posting a
    record: the root cause of the others' failures. ``failures``: rank -> ProcessFailure."""
    dead = []
    for rank, f in failures.items():
        code = int(getattr(f, "exitcode", 0) or 0)
        if code >= 0:
            continue
        try:
            sig = signal.Signals(-code)
        except ValueError:
            continue
        if sig in _AGENT_SIGNALS:
            continue
        if board is not None and board.of_rank(int(rank)) is not None:
            continue
        dead.append((getattr(f, "timestamp", 0), int(rank), sig.name))
    if not dead:
        return None
    _, rank, name = min(dead)
    return WorkerFailure(rank, f"the process died from signal {name} without reporting an error (killed, e.g. by "
                               f"SIGKILL or the out-of-memory killer); the other workers stopped when their waits on "
                               f"it broke")


def restart_store(timeout: float) -> tuple[Any, int, int] | None:
    """(store, rank, world size) for ``init_process_group`` in a restarted elastic worker, else ``None``.

    torchelastic hands restarted workers the same agent store (``MASTER_ADDR:MASTER_PORT``,
    ``TORCHELASTIC_USE_AGENT_STORE``) without a per-attempt prefix, so the process group's
    rendezvous would read the addresses the dead attempt's ranks published there and fail
    ("Connection refused"). A prefix per attempt (``TORCHELASTIC_RESTART_COUNT``) keeps the
    attempts apart. Bounded by ``timeout``.
    """
    import os
    from datetime import timedelta

    import torch.distributed as dist

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if attempt == 0 or not all(k in os.environ for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")):
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=world,
                         is_master=not agent and rank == 0, timeout=timedelta(seconds=timeout),
                         wait_for_workers=False)
    return dist.PrefixStore(f"pipetrain/attempt{attempt}", base), rank, world
