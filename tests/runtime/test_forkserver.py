"""Local workers are forked from a server that imported torch once (runtime/process/forkserver.py):
they still see the launcher's environment as it is at each launch, as under ``spawn``."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from pipetrain.cli import main
from pipetrain.runtime.process import forkserver

pytestmark = pytest.mark.timeout(180)


def test_worker_environment_is_the_launchers_plus_what_torchelastic_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(forkserver, "SERVER_ENV", {"A": "1", "GONE": "x", "OMP_NUM_THREADS": "1"})
    monkeypatch.setattr(os, "environ", {"A": "1", "GONE": "x", "OMP_NUM_THREADS": "1", "RANK": "3",
                                        "MASTER_PORT": "123"})
    forkserver.worker_environment({"A": "1", "NEW": "late", "OMP_NUM_THREADS": "1"})
    assert os.environ == {"A": "1", "NEW": "late", "OMP_NUM_THREADS": "1", "RANK": "3", "MASTER_PORT": "123"}


@pytest.mark.parametrize(("argv", "wanted"), [
    (["train", "--workers", "4"], True), (["train", "--workers=2"], True), (["train", "--config", "1-1"], True),
    (["compare", "--plan", "p.json"], True), (["train", "--workers", "1"], False), (["train"], False),
    (["plan", "--workers", "4"], False),
])
def test_the_server_starts_only_for_runs_of_local_workers(argv: list[str], wanted: bool,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert forkserver.wants_local_workers(argv) is wanted


def recorded_data() -> tuple[TensorDataset, TensorDataset]:
    """A tiny data set whose factory, run in every worker, records the probe variable."""
    where = os.environ.get("PIPETRAIN_TEST_PROBE_DIR")
    if where and "RANK" in os.environ:
        Path(where, f"rank{os.environ['RANK']}.txt").write_text(os.environ.get("PIPETRAIN_TEST_PROBE", "-"))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 6, generator=g), torch.randint(0, 2, (64,), generator=g)
    return TensorDataset(x, y), TensorDataset(x[:16], y[:16])


def test_a_variable_set_after_the_server_started_reaches_every_worker(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    forkserver.start_server()  # started before the variable exists, as by an earlier launch
    monkeypatch.setenv("PIPETRAIN_TEST_PROBE_DIR", str(tmp_path))
    monkeypatch.setenv("PIPETRAIN_TEST_PROBE", "set after the server")
    rc = main(["train", "--model", "mlp", "--option", "depth=2", "--option", "width=16", "--data",
               "test_forkserver:recorded_data", "--workers", "2", "--config", "1-1", "--schedule", "flush",
               "--batch-size", "16", "--steps", "1", "--loader-workers", "0", "--json"])
    assert rc == 0
    assert {p.name: p.read_text() for p in tmp_path.glob("rank*.txt")} == {
        "rank0.txt": "set after the server", "rank1.txt": "set after the server"}


@pytest.fixture(scope="module")
def server_started_first() -> None:
    """The fork server, started before any function fixture (capfd) replaces descriptors 1 and 2."""
    forkserver.start_server()


def test_workers_write_to_the_launchers_streams_of_the_launch(server_started_first: None,
                                                              capfd: pytest.CaptureFixture[str]) -> None:
    """The server keeps the descriptors it started with; a worker writes to the launcher's
    descriptors at the launch (here pytest's capture of this test, made after the server)."""
    rc = main(["train", "--model", "mlp", "--option", "depth=2", "--option", "width=16", "--workers", "2",
               "--config", "1-1", "--schedule", "flush", "--batch-size", "16", "--steps", "2", "--log-every", "1"])
    assert rc == 0
    captured = capfd.readouterr()
    assert "step 2:" in captured.out + captured.err, captured  # rank 0's progress line
