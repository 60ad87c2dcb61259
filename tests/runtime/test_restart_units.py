"""Fast unit tests of the restart and failure helpers (no processes started)."""
from __future__ import annotations

import signal
from types import SimpleNamespace
from typing import Any

import pytest

from pipetrain.job.segments import checkpoint_due
from pipetrain.runtime.process.peers import PeerLost, killed_rank, naming_peer, waiting_for
from pipetrain.schedule.action import Action, Op


class _Board:
    def __init__(self, posted: set[int]) -> None:
        self.posted = posted

    def of_rank(self, rank: int) -> Any:
        return object() if rank in self.posted else None


def _failure(code: int, ts: int = 0) -> Any:
    return SimpleNamespace(exitcode=code, timestamp=ts)


def test_killed_rank_names_the_signal_death_not_the_agents_sigterm() -> None:
    failures = {0: _failure(1, 5), 1: _failure(-int(signal.SIGTERM), 6), 2: _failure(-int(signal.SIGKILL), 7)}
    dead = killed_rank(failures, _Board({0}))  # type: ignore[arg-type]
    assert dead is not None and dead.rank == 2 and "signal SIGKILL" in str(dead)
    assert killed_rank({0: _failure(1), 1: _failure(-int(signal.SIGTERM))}, _Board({0})) is None  # type: ignore[arg-type]
    # a rank that posted a record before dying by a signal is not the silent one
    assert killed_rank({3: _failure(-int(signal.SIGKILL))}, _Board({3})) is None  # type: ignore[arg-type]


def test_a_broken_receive_names_the_action_and_the_peer() -> None:
    recv = Action(1, Op.RECV_F, 3, peer=0)
    executor = SimpleNamespace(position=0)
    assert waiting_for(executor, [recv])[1] == 0
    lost = r"rank 1 lost rank 0 while waiting for 1RECV_F3<0 from rank 0: RuntimeError: .*Connection closed by peer"
    with pytest.raises(PeerLost, match=lost) as e, naming_peer(1, executor, [recv]):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234")
    assert e.value.peer == 0
    # other errors pass through unchanged
    with pytest.raises(ValueError, match="unrelated"), naming_peer(1, executor, [recv]):
        raise ValueError("unrelated")


def test_checkpoint_due_at_multiples_and_the_end() -> None:
    assert [s for s in range(0, 11) if checkpoint_due(4, s, 10)] == [4, 8, 10]
    assert [s for s in range(0, 11) if checkpoint_due(None, s, 10)] == [10]
