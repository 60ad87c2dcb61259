"""Real data through the pipeline: a user's Dataset factory, disjoint shards across replicas,
evaluation through the pipeline equal to one process on the same weights."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

from pipetrain.cli import main
from pipetrain.data import EvalBatches, load_data
from pipetrain.job.config import TrainConfig
from pipetrain.metrics import EvalAccumulator
from pipetrain.models import load_model
from pipetrain.run import train

pytestmark = pytest.mark.timeout(180)

SMALL = ["--model", "mlp", "--option", "depth=4", "--option", "width=64"]


def _json(capsys: pytest.CaptureFixture[str]) -> dict:
    out = capsys.readouterr().out.strip().splitlines()
    return json.loads(out[-1])


# -- a user's data: a factory in this module (workers import it: tests/ is on sys.path) -----------

class Blobs(Dataset):  # type: ignore[type-arg]
    """Two Gaussian blobs in 6 dimensions; ``__getitem__`` records which indices a rank read."""

    def __init__(self, n: int, seed: int, split: str) -> None:
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, 2, (n,), generator=g)
        self.x = torch.randn(n, 6, generator=g) * 0.5 + (self.y.float()[:, None] * 2 - 1)
        self.split = split

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        where = os.environ.get("PIPETRAIN_TEST_RECORD")
        if where and "RANK" in os.environ:
            with open(os.path.join(where, f"{self.split}-rank{os.environ['RANK']}.txt"), "a") as f:
                f.write(f"{i}\n")
        return self.x[i], self.y[i]


def make_blobs() -> tuple[Dataset, Dataset]:  # type: ignore[type-arg]
    return Blobs(256, 0, "train"), Blobs(64, 1, "eval")


def test_user_factory_trains_and_replicas_read_disjoint_shards(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A user Dataset factory on a 2-1 pipedream pipeline: stage 0's two replicas read disjoint
    halves of every epoch, which together are what the last stage reads the targets of."""
    monkeypatch.setenv("PIPETRAIN_TEST_RECORD", str(tmp_path))
    rc = main(["train", *SMALL, "--optimizer", "adam", "--lr", "0.01", "--batch-size", "16",
               "--data", "test_train_data_eval:make_blobs", "--workers", "3", "--config", "2-1", "--schedule",
               "pipedream", "--epochs", "1", "--loader-workers", "0", "--json"])
    assert rc == 0
    res = _json(capsys)
    assert res["steps"] == 16 and res["eval_accuracy"] > 0.8   # separable blobs (measured 1.0)

    def read(name: str, checks: int = 0) -> list[int]:
        p = tmp_path / name
        got = [int(x) for x in p.read_text().split()] if p.exists() else []
        assert got[:checks] == [0] * checks   # load_data's checks of item 0 (pipetrain.data.user)
        return got[checks:]

    # Each rank that reads data loads it (the factory's item 0 checked twice), then its units.
    a, b, last = (read(f"train-rank{r}.txt", checks=2) for r in range(3))
    assert len(a) == len(b) == 128 and len(last) == 256
    assert not set(a) & set(b)
    assert sorted(a + b) == sorted(last) == list(range(256))   # one epoch: every sample once
    # evaluation: the first stage's replicas split the eval units too
    ea, eb = read("eval-rank0.txt"), read("eval-rank1.txt")
    assert ea and eb and set(ea) | set(eb) == set(range(64))


# -- evaluation through the pipeline equals one process on the same weights -----------------------

def _single_process_eval(options: dict, state: dict[str, torch.Tensor], batch: int) -> EvalAccumulator:
    bundle = load_model("mlp", batch_size=batch, **options)
    bundle.model.load_state_dict(state)
    bundle.model.eval()
    src = load_data("digits", seed=0)
    acc = EvalAccumulator(kind="classification")
    with torch.no_grad():
        for eb in EvalBatches(src.eval, 50):
            acc.update(bundle.model(*eb.inputs), eb.target)
    return acc


def test_pipeline_eval_equals_one_process() -> None:
    """flush on 2 stages with 4 microbatches: each eval batch of 24 rows travels as 4 units, the
    last batch padded (360 = 15 * 24); the result equals the model evaluated in one process."""
    cfg = TrainConfig.of(model="mlp", model_options={"depth": 3, "width": 32}, data="digits", workers=2,
                         config="1-1", schedule="flush", microbatches=4, steps=20, batch_size=24, eval_batch_size=48,
                         eval_every=10, optimizer="adam", lr=0.003, return_state=True, quiet=True)
    res = train(cfg)
    assert res is not None and res.state is not None and len(res.eval_history) == 2
    opts = res.run["config"]["model"]["options"]
    one = _single_process_eval(opts, res.state, 24)
    last = res.eval_history[-1]
    assert last["eval_samples"] == one.samples == 360
    assert last["accuracy"] == one.accuracy
    assert math.isclose(last["loss"], one.loss, rel_tol=1e-5)
    # flush is synchronous: one process on the same minibatches evaluates the same at every boundary
    single = train(cfg.replace(workers=1, config=None, microbatches=None))
    assert single is not None and single.state is not None
    assert [h["step"] for h in single.eval_history] == [h["step"] for h in res.eval_history] == [10, 20]
    for a, b in zip(single.eval_history, res.eval_history):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5, abs_tol=1e-6)
    for k, v in single.state.items():
        torch.testing.assert_close(res.state[k], v, rtol=1e-5, atol=1e-5)


