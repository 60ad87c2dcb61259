"""Bad input with real data: one line each, before any worker starts (exit 2); a target never
reached ends at the epoch limit and says so (exit 0). Issue 10."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from pipetrain.cli import main

pytestmark = pytest.mark.timeout(120)

SMALL = ["--model", "mlp", "--option", "depth=2", "--option", "width=16"]


def not_a_pair() -> TensorDataset:
    return TensorDataset(torch.zeros(4, 3), torch.zeros(4, dtype=torch.long))


def wrong_width() -> tuple[TensorDataset, TensorDataset]:
    """Samples of 7 features: the factory model below reads 5."""
    return (TensorDataset(torch.zeros(8, 7), torch.zeros(8, dtype=torch.long)),
            TensorDataset(torch.zeros(4, 7), torch.zeros(4, dtype=torch.long)))


def five_inputs(batch_size: int = 4) -> tuple[torch.nn.Module, torch.Tensor]:
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
    return model, torch.randn(batch_size, 5)


@pytest.mark.parametrize("args, message", [
    (["--data", "digitz"], r"unknown data set 'digitz' \(did you mean 'digits'\?\); valid names: digits"),
    (["--data", "fashion-mnist", "--data-dir", "/nonexistent/fmnist"], r"/nonexistent/fmnist"),
    (["--data", "./no/such/file.txt"], r"data path './no/such/file.txt' does not exist"),
    (["--data", "test_train_data_errors:not_a_pair"],
     r"data factory 'test_train_data_errors:not_a_pair' must return a pair of datasets"),
    (["--data", "test_train_data_errors:wrong_width", "--model", "test_train_data_errors:five_inputs"],
     r"samples of data 'test_train_data_errors:wrong_width' do not fit model"),
    (["--data", "digits", "--model", "alexnet"], r"model 'alexnet' reads square images"),
    (["--data", "digits", "--steps", "5", "--epochs", "2"], r"give --steps or --epochs, not both"),
    (["--epochs", "2"], r"--epochs needs real data with an eval split"),
    (["--target-accuracy", "0.9"], r"--target-accuracy needs real data"),
    (["--data", "digits", "--target-accuracy", "90"], r"--target-accuracy is a fraction in \(0, 1\], got 90"),
    (["--data", "digits", "--batch-size", "2000", "--epochs", "1"], r"fewer than one minibatch of 2000"),
    (["--data", "digits", "--microbatches", "4", "--schedule", "flush", "--batch-size", "32",
      "--eval-batch-size", "30"], r"--eval-batch-size 30 is not a multiple of the microbatch size 8"),
    (["--checkpoint-every", "5"], r"--checkpoint-every needs --checkpoint-dir"),
    (["--data", "digits", "--eval-every", "0", "--target-loss", "0.5"], r"--eval-every 0 turns them off"),
])
def test_bad_data_input_is_one_line(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    model = [] if "--model" in args else SMALL
    rc = main(["train", *model, "--workers", "2", "--config", "1-1", *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert re.search(message, err), err


def test_log_dir_that_is_a_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    f = tmp_path / "logs"
    f.write_text("x")
    rc = main(["train", *SMALL, "--data", "digits", "--workers", "2", "--config", "1-1", "--log-dir", str(f)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and re.search(r"--log-dir .* is an existing file", err), err


def test_target_never_reached_ends_at_epoch_limit(capfd: pytest.CaptureFixture[str]) -> None:
    rc = main(["train", *SMALL, "--data", "digits", "--workers", "2", "--config", "1-1", "--schedule", "pipedream",
               "--batch-size", "64", "--epochs", "1", "--target-accuracy", "0.999", "--json"])
    assert rc == 0
    captured = capfd.readouterr()
    res = json.loads(captured.out.strip().splitlines()[-1])
    assert res["reached"] is False and res["steps_to_accuracy"] is None and res["epochs"] == 1.0
    assert res["target_summary"].startswith("target accuracy 0.999 not reached in 1 epoch")
    assert res["target_summary"] in captured.err                        # said in one line
