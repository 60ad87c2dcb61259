"""Errors with their context, printed once: the model's own exceptions, file errors, Ctrl-C,
damaged checkpoints (docs/errors.md, "Where an error happened").

Every CLI case checks the exit code, that stderr holds exactly the one expected line (no
traceback) and that the line names the context: the step, stage, rank, unit and node of an
exception in the model's forward or loss (on 1 worker as on 2), the file of a checkpoint
that cannot be read, the last complete checkpoint after Ctrl-C. The model factories of this
module are imported by the workers by name (``--model test_error_context:bad_embed``).
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipetrain.checkpoint import (
    CheckpointError,
    RankState,
    latest_checkpoint,
    remove_partial,
    resume_point,
    save_checkpoint_dir,
    set_aside,
)
from pipetrain.errors import RuntimeConfigError
from pipetrain.models.bundle import ModelBundle, mse_loss
from pipetrain.runtime.checkpoints.export import load_checkpoint

CLI = os.path.join(os.path.dirname(os.path.abspath(sys.executable)), "pipetrain")
SEED, BAD, WIDTH = 0, 3, 8   # minibatch BAD (seed SEED + BAD) makes the model's code raise
HINT = "; the model's own code raised this (--debug prints the traceback)"


def _line(marker: str) -> int:
    """The line of this file that carries ``marker`` in a comment."""
    lines = Path(__file__).read_text().splitlines()
    found = [i for i, text in enumerate(lines, 1) if text.rstrip().endswith(f"# {marker}")]
    assert len(found) == 1, marker
    return found[0]


# --------------------------------------------------------------------------- models that raise


class EmbedNet(nn.Module):
    """An embedding looked up with the input's first feature: 50 at minibatch BAD, out of range."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, WIDTH)
        self.fc2 = nn.Linear(WIDTH, WIDTH)
        self.embedding = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc2(torch.relu(self.fc1(x)))
        idx = x[:, 0].long()
        return self.head(self.embedding(idx)) + h[:, :4]  # embedding-call


class IndexNet(nn.Module):
    """Indexes a column with the input's first feature: a line of fx's generated code raises."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, WIDTH)
        self.fc2 = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        col = x[0, 0].long()
        return self.fc2(h[:, col][:, None] * h)


def features(batch_size: int, generator: torch.Generator) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Random inputs whose first feature is 1 (50 at minibatch BAD), random regression targets."""
    x = torch.randn(batch_size, WIDTH, generator=generator)
    x[:, 0] = 50.0 if generator.initial_seed() == SEED + BAD else 1.0
    return (x,), torch.randn(batch_size, 4, generator=generator)


def classes(batch_size: int, generator: torch.Generator) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Random inputs, class 0 targets (class 50 at minibatch BAD: out of range for 4 classes)."""
    x = torch.randn(batch_size, WIDTH, generator=generator)
    y = torch.full((batch_size,), 50 if generator.initial_seed() == SEED + BAD else 0, dtype=torch.long)
    return (x,), y


def class_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)  # loss-call


def broken_batches(batch_size: int, generator: torch.Generator) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """A data source that fails at minibatch BAD (not the model's forward: a crash, exit 1)."""
    if generator.initial_seed() == SEED + BAD:
        raise RuntimeError(f"no minibatch {BAD}")
    return features(batch_size, generator)


def _bundle(model: nn.Module, batches: object, loss: object, name: str, batch_size: int) -> ModelBundle:
    example = batches(batch_size, torch.Generator().manual_seed(SEED))[0]  # type: ignore[operator]
    return ModelBundle(model=model, example_inputs=example, loss_fn=loss, make_batch=batches,  # type: ignore[arg-type]
                       name=f"test_error_context:{name}")


def bad_embed(batch_size: int = 8) -> ModelBundle:
    return _bundle(EmbedNet(), features, mse_loss, "bad_embed", batch_size)


def bad_index(batch_size: int = 8) -> ModelBundle:
    return _bundle(IndexNet(), features, mse_loss, "bad_index", batch_size)


def bad_loss(batch_size: int = 8) -> ModelBundle:
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 4))
    return _bundle(model, classes, class_loss, "bad_loss", batch_size)


def bad_data(batch_size: int = 8) -> ModelBundle:
    return _bundle(EmbedNet(), broken_batches, mse_loss, "bad_data", batch_size)


# --------------------------------------------------------------------------- running the CLI


def _cli(args: list[str], timeout: float = 150) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, "train", *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, env=dict(os.environ, OMP_NUM_THREADS="1"))


def _one_line(p: subprocess.CompletedProcess[str], code: int) -> str:
    """The one line on stderr of a run that exited with ``code`` (no traceback, nothing else)."""
    assert p.returncode == code, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert "Traceback" not in p.stderr
    return lines[0]


RUN = ["--batch-size", "8", "--steps", "6", "--seed", str(SEED), "--log-every", "0"]
TWO = ["--workers", "2", "--schedule", "flush", "--microbatches", "2", "--timeout", "60", *RUN]


@pytest.mark.parametrize("model, cut, where", [
    ("bad_embed", "embedding", "node 'embedding'"),
    ("bad_index", "getitem", "node 'getitem_1'"),             # fx prints its generated code here: held back
    ("bad_loss", "2", f"the loss function (test_error_context.py:{_line('loss-call')})"),
])
def test_an_exception_in_the_models_code_on_two_workers_names_where(model: str, cut: str, where: str) -> None:
    p = _cli(["--model", f"test_error_context:{model}", "--cut", cut, *TWO])
    message = {"bad_embed": "IndexError: index out of range in self",
               "bad_index": "IndexError: index 50 is out of bounds for dimension 1 with size 8",
               "bad_loss": "IndexError: Target 50 is out of bounds."}[model]
    # unit: the executor's index in the segment (2 per minibatch): minibatch BAD's first
    assert _one_line(p, 2) == f"error: step {BAD}, stage 1 (rank 1), unit {2 * BAD}, {where}: {message}{HINT}"


@pytest.mark.parametrize("model, where, message", [
    ("bad_embed", f"node 'embedding' (test_error_context.py:{_line('embedding-call')})",
     "IndexError: index out of range in self"),
    ("bad_loss", f"the loss function (test_error_context.py:{_line('loss-call')})",
     "IndexError: Target 50 is out of bounds."),
])
def test_an_exception_in_the_models_code_on_one_worker_names_where(model: str, where: str, message: str) -> None:
    p = _cli(["--model", f"test_error_context:{model}", "--workers", "1", *RUN])
    assert _one_line(p, 2) == f"error: step {BAD}, stage 0 (rank 0), unit {BAD}, {where}: {message}{HINT}"


def test_debug_prints_the_traceback_before_the_line() -> None:
    p = _cli(["--model", "test_error_context:bad_embed", "--workers", "1", *RUN, "--debug"])
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert "in forward" in p.stderr and "IndexError: index out of range in self" in p.stderr
    assert lines[-1].startswith(f"error: step {BAD}, stage 0 (rank 0), unit {BAD}, node 'embedding'")


def test_a_failure_outside_the_models_forward_is_one_line_with_exit_code_1() -> None:
    """The data source raising is not the model's forward or loss: exit 1, still one line."""
    p = _cli(["--model", "test_error_context:bad_data", "--workers", "1", *RUN])
    assert _one_line(p, 1) == f"error: RuntimeError: no minibatch {BAD} (--debug prints the traceback)"


# --------------------------------------------------------------------------- files


def test_resume_of_a_truncated_checkpoint_names_the_file(tmp_path: Path) -> None:
    ckpt = tmp_path / "ck.pt"
    torch.save({"w": torch.ones(1000)}, ckpt)
    torch.save({"format": "pipetrain-trainer"}, str(ckpt) + ".trainer")
    ckpt.write_bytes(ckpt.read_bytes()[:300])
    expected = (f"cannot read checkpoint {str(ckpt)!r}: RuntimeError: PytorchStreamReader failed reading zip "
                f"archive: failed finding central directory; the file is truncated or corrupt: pass a complete "
                f"checkpoint written by --save (PATH and PATH.trainer)")
    with pytest.raises(RuntimeConfigError) as e:
        load_checkpoint(ckpt)
    assert str(e.value) == expected
    p = _cli(["--model", "mlp", "--workers", "1", "--steps", "1", "--resume", str(ckpt)])
    assert _one_line(p, 2) == f"error: {expected}"


def test_text_data_given_a_directory_says_it_is_a_directory(tmp_path: Path) -> None:
    p = _cli(["--model", "gpt", "--data", f"text:{tmp_path}", "--workers", "1", "--steps", "1"])
    assert _one_line(p, 2) == (f"error: text file {str(tmp_path)!r} is a directory; pass --data text:PATH with a "
                               f"UTF-8 file (e.g. one file of {tmp_path}), not a folder")


def test_missing_fashion_mnist_files_are_reported_once_before_any_worker(tmp_path: Path) -> None:
    p = _cli(["--model", "mlp", "--data", "fashion-mnist", "--data-dir", str(tmp_path), "--workers", "2",
              "--steps", "1"])
    line = _one_line(p, 2)
    assert line.startswith(f"error: fashion-mnist files not found in --data-dir {str(tmp_path)!r}: missing "
                           f"train-images-idx3-ubyte[.gz]")


# --------------------------------------------------------------------------- damaged checkpoints


def _save(root: Path, step: int) -> Path:
    return save_checkpoint_dir(root, step, rank_state=RankState(model={"w": torch.full((4,), float(step))}),
                               manifest_info={"model": "m"}, sync_files=False)


def _damage(ck: Path) -> None:
    data = next(f for f in ck.iterdir() if f.suffix == ".distcp")
    data.write_bytes(data.read_bytes()[:10])


def test_resume_point_uses_an_older_checkpoint_with_one_warning(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    old, new = _save(tmp_path, 2), _save(tmp_path, 4)
    _damage(new)
    with caplog.at_level(logging.WARNING, logger="pipetrain"):
        assert resume_point(tmp_path) == old
        assert latest_checkpoint(tmp_path) == old  # quiet: the launcher's warning is the one
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].startswith(f"the latest checkpoint {new} is damaged: resuming from the older {old} "
                                  f"(checkpoint {str(new)!r} is truncated: file '__0_0.distcp' has 10 bytes")


def test_resume_point_refuses_a_damaged_latest_checkpoint_without_an_older_one(tmp_path: Path) -> None:
    new = _save(tmp_path, 4)
    _damage(new)
    with pytest.raises(CheckpointError) as e:
        resume_point(tmp_path)
    size = json.loads((new / "manifest.json").read_text())["files"]["__0_0.distcp"]
    assert str(e.value) == (f"the latest checkpoint in {str(tmp_path)!r} is damaged and no older one is complete, "
                            f"so there is nothing to resume (checkpoint {str(new)!r} is truncated: file "
                            f"'__0_0.distcp' has 10 bytes but its manifest records {size}); pass --checkpoint-dir "
                            f"elsewhere or --restart to start over")


def test_partial_checkpoints_are_removed_and_restart_sets_checkpoints_aside(tmp_path: Path) -> None:
    good = _save(tmp_path, 2)
    (tmp_path / "step_00000004.tmp").mkdir()               # a write interrupted
    replaced = _save(tmp_path, 6)
    replaced.rename(tmp_path / "step_00000006.old.tmp")    # interrupted between the renames of a replacement
    assert remove_partial(tmp_path) == [tmp_path / "step_00000004.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002", "step_00000006"]
    aside = set_aside(tmp_path)
    assert aside is not None and aside.parent == tmp_path and aside.name.startswith("set-aside-")
    assert sorted(p.name for p in aside.iterdir()) == ["step_00000002", "step_00000006"]
    assert latest_checkpoint(tmp_path) is None and set_aside(tmp_path) is None
    assert good.name in {p.name for p in aside.iterdir()}


def test_a_damaged_checkpoint_dir_on_the_command_line(tmp_path: Path) -> None:
    """Damaged latest with a good older one: one warning, resumed from the older one. Damaged
    everywhere: one line, exit 2, nothing trained. --restart: starts over, the old ones set aside."""
    ck = tmp_path / "ck"
    args = ["--model", "mlp", "--option", "depth=2", "--option", "width=8", "--workers", "2", "--config", "1-1",
            "--schedule", "flush", "--batch-size", "8", "--steps", "4", "--checkpoint-dir", str(ck),
            "--checkpoint-every", "2", "--log-every", "0", "--timeout", "60"]
    assert _cli(args).returncode == 0
    _damage(ck / "step_00000004")
    p = _cli(args)
    assert p.returncode == 0, p.stderr
    out = p.stdout + p.stderr
    assert out.count("is damaged") == 1
    assert f"the latest checkpoint {ck / 'step_00000004'} is damaged: resuming from the older " \
           f"{ck / 'step_00000002'}" in out
    assert f"resuming from {ck / 'step_00000002'} (step 2" in out
    assert latest_checkpoint(ck) == ck / "step_00000004"   # written again by the resumed run
    for step in (2, 4):
        _damage(ck / f"step_0000000{step}")
    p = _cli(args)
    line = _one_line(p, 2)
    assert line.startswith(f"error: the latest checkpoint in {str(ck)!r} is damaged and no older one is complete")
    assert line.endswith("; pass --checkpoint-dir elsewhere or --restart to start over")
    p = _cli([*args, "--restart"])
    assert p.returncode == 0, p.stderr
    aside = [d for d in ck.iterdir() if d.name.startswith("set-aside-")]
    assert len(aside) == 1 and sorted(d.name for d in aside[0].iterdir()) == ["step_00000002", "step_00000004"]
    assert latest_checkpoint(ck) == ck / "step_00000004" and "resuming from" not in p.stdout + p.stderr


# --------------------------------------------------------------------------- Ctrl-C


def _group_gone(pgid: int, wait_s: float) -> bool:
    """Whether no process of group ``pgid`` is left, waiting up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def test_ctrl_c_stops_every_worker_and_leaves_no_partial_checkpoint(tmp_path: Path) -> None:
    """SIGINT to the process group of a 4-worker run (as Ctrl-C in a terminal) after its first
    checkpoint: exit 130 within seconds, no process left, no ``.tmp`` directory, one line naming
    the last complete checkpoint."""
    ck = tmp_path / "ck"
    p = subprocess.Popen([CLI, "train", "--model", "mlp", "--option", "depth=4", "--option", "width=16",
                          "--workers", "4", "--config", "1-1-1-1", "--schedule", "flush", "--microbatches", "4",
                          "--batch-size", "8", "--steps", "100000", "--checkpoint-dir", str(ck),
                          "--checkpoint-every", "1", "--log-every", "0", "--timeout", "60"],
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        deadline = time.monotonic() + 240
        while latest_checkpoint(ck) is None and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert p.poll() is None and latest_checkpoint(ck) is not None, "no checkpoint before the deadline"
        os.killpg(p.pid, signal.SIGINT)
        t0 = time.monotonic()
        _, err = p.communicate(timeout=60)
        assert time.monotonic() - t0 < 30
        assert _group_gone(p.pid, 15), "a process of the run is left"
    finally:
        if p.poll() is None or not _group_gone(p.pid, 0.1):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.communicate(timeout=30)
    assert p.returncode == 130, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    latest = latest_checkpoint(ck)
    assert latest is not None
    assert not [d.name for d in ck.iterdir() if d.name.endswith(".tmp")]
    assert lines[0].startswith("interrupted: stopped by SIGINT: every worker has exited")
    assert lines[0].endswith(f"; the last complete checkpoint is {latest}: the same command resumes from it")
