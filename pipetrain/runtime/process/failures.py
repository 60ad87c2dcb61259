"""Worker failures as structured records, not text.

A rank that fails writes a :class:`FailureRecord` (rank, exception type, whether it is a
user error, its first line, and the rank whose failure caused it, if any) as JSON into a
key-value store every rank and the launcher can read (:class:`FailureBoard`):

- local runs: a ``TCPStore`` the launcher hosts for the run (its :class:`BoardAddress`, the
  store's and the launcher process's, travels to the workers), so the launcher reads the
  records after the workers exit. The store ends with its launcher: a board whose host is
  gone holds no records and is not asked (torch prints a C++ stack for each request to a
  store that is gone);
- under an outer ``torchrun``: the process group's store.

The first *root* failure (one not caused by another rank) is also written to a single key
with ``compare_set``, so every rank and the launcher agree on which failure started it all:
a rank whose transfer breaks because its peer died finds that record and reports it as the
cause instead of a bare connection error; the launcher reports it as the run's failure.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, NamedTuple

from ...errors import PipetrainError
from .orphans import process_alive

__all__ = ["BoardAddress", "FailureRecord", "FailureBoard", "WorkerFailure", "connect_board"]

_ROOT_KEY = "pipetrain/failure/{}/root"      # formatted with the restart attempt
_RANK_KEY = "pipetrain/failure/{}/rank{}"


class WorkerFailure(RuntimeError):
    """A worker process failed; ``rank`` is the one that failed first, ``message`` its error
    (``Type: first line``; the first line alone for user errors, ``user_error`` True)."""

    def __init__(self, rank: int, message: str, user_error: bool = False) -> None:
        super().__init__(f"rank {rank} failed: {message}")
        self.rank = rank
        self.message = message
        self.user_error = user_error

    @classmethod
    def of(cls, record: FailureRecord) -> WorkerFailure:
        return cls(record.rank, record.message if record.user_error else f"{record.type}: {record.message}",
                   record.user_error)


@dataclass(frozen=True)
class FailureRecord:
    """One rank's failure: what it raised, and the rank that failed first when that caused it."""

    rank: int
    type: str                  # the exception's class name
    user_error: bool           # a PipetrainError: bad input, reported as its message alone
    message: str               # the first line of the exception's message
    caused_by: int | None = None   # the root failure's rank, if this one followed from it

    @classmethod
    def of(cls, rank: int, exc: BaseException, caused_by: int | None = None) -> FailureRecord:
        text = str(exc).strip()
        return cls(rank, type(exc).__name__, isinstance(exc, PipetrainError),
                   text.splitlines()[0] if text else "", caused_by)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> FailureRecord:
        return cls(**json.loads(text))


class BoardAddress(NamedTuple):
    """A local launch's failure board: the store's address and the launcher process hosting it."""

    host: str
    port: int
    launcher_pid: int


class FailureBoard:
    """Failure records in a ``torch.distributed`` store (module docstring). Never raises:
    a store that is gone means no record. ``host_pid``: the process hosting the store, if
    known; once it has ended the store is not asked."""

    def __init__(self, store: Any, attempt: int | None = None, host_pid: int | None = None) -> None:
        self.store = store
        self.host_pid = host_pid
        # Records are kept per restart attempt (torchelastic's TORCHELASTIC_RESTART_COUNT), so
        # that a restarted group never reports the failure of the attempt before it as its own.
        if attempt is None:
            attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        self.attempt = attempt
        self._root_key = _ROOT_KEY.format(attempt)

    def _rank_key(self, rank: int) -> str:
        return _RANK_KEY.format(self.attempt, rank)

    def host_gone(self) -> bool:
        """Whether the process hosting the store has ended (never, when it is not known)."""
        return self.host_pid is not None and not process_alive(self.host_pid)

    @classmethod
    def latest(cls, store: Any, attempts: int, world: int) -> FailureBoard:
        """The board of the last attempt that recorded a failure (the launcher's view after a run)."""
        for attempt in reversed(range(attempts)):
            board = cls(store, attempt)
            try:
                keys = [board._root_key] + [board._rank_key(r) for r in range(world)]
                if any(store.check([k]) for k in keys):
                    return board
            except Exception:  # noqa: BLE001 - a store that is gone: no records
                break
        return cls(store, 0)

    def post(self, record: FailureRecord) -> None:
        """Record a failure (and make it the root if it is the first root failure)."""
        if self.host_gone():
            return
        try:
            self.store.set(self._rank_key(record.rank), record.to_json())
            if record.caused_by is None:
                self.store.compare_set(self._root_key, "", record.to_json())
        except Exception:  # noqa: BLE001 - reporting must not mask the failure itself
            pass

    def root(self, wait_s: float = 0.0) -> FailureRecord | None:
        """The first root failure, waiting up to ``wait_s`` for one to appear."""
        deadline = time.monotonic() + wait_s
        while not self.host_gone():
            try:
                if self.store.check([self._root_key]):
                    text = self.store.get(self._root_key)
                    if text:
                        return FailureRecord.from_json(text)
            except Exception:  # noqa: BLE001
                return None
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
        return None

    def of_rank(self, rank: int) -> FailureRecord | None:
        if self.host_gone():
            return None
        try:
            key = self._rank_key(rank)
            return FailureRecord.from_json(self.store.get(key)) if self.store.check([key]) else None
        except Exception:  # noqa: BLE001
            return None


def connect_board(address: BoardAddress | None, timeout: float = 30.0) -> FailureBoard | None:
    """A board on the launcher's store at ``address``, else on the default process group's."""
    import torch.distributed as dist

    try:
        if address is not None:
            store = dist.TCPStore(address.host, address.port, is_master=False, timeout=timedelta(seconds=timeout))
            return FailureBoard(store, host_pid=address.launcher_pid)
        return FailureBoard(dist.distributed_c10d._get_default_store())
    except Exception:  # noqa: BLE001 - no store: failures are reported by the launcher only
        return None
