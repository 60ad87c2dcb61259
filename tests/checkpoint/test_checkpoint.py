"""Checkpoint directories in one process: round trips, retention, and every user error's line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from pipetrain.checkpoint import (
    CheckpointError,
    RankState,
    check_model,
    complete_checkpoints,
    export_state_dict,
    latest_checkpoint,
    load_for_rank,
    load_into_model,
    read_manifest,
    require_latest,
    save_checkpoint_dir,
)
from pipetrain.errors import PipetrainError


def _net(width: int = 8) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, width), nn.BatchNorm1d(width), nn.Linear(width, 3))
    net(torch.randn(5, 4))   # the batch norm's running stats become non-trivial buffers
    return net


def _save(root: Path, step: int, net: nn.Module, **kw: object) -> Path:
    return save_checkpoint_dir(root, step, rank_state=RankState(model=net.state_dict()),
                               manifest_info={"model": "net", "model_options": {}}, sync_files=False, **kw)  # type: ignore[arg-type]


def test_round_trip_into_a_plain_model_and_export(tmp_path: Path) -> None:
    net = _net()
    path = _save(tmp_path, 7, net)
    assert path.name == "step_00000007" and latest_checkpoint(tmp_path) == path
    other = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    man = load_into_model(path, other)
    assert man.step == 7
    for (n, a), (m, b) in zip(net.state_dict().items(), other.state_dict().items()):
        assert n == m and torch.equal(a, b), n
    out = export_state_dict(path, tmp_path / "export" / "net.pt")
    exported = torch.load(out, weights_only=True)
    assert list(exported) == list(net.state_dict())
    assert all(torch.equal(exported[n], t) for n, t in net.state_dict().items())


def test_optimizer_scalars_stash_and_extras_round_trip(tmp_path: Path) -> None:
    w = {"a": torch.randn(3, 2), "b": torch.randn(4)}
    state = RankState(model=w, stashed={5: {"a": w["a"] * 2}},
                      optimizer={"a": {"exp_avg": torch.ones(3, 2), "step": 6, "lr_scale": 0.5}},
                      stage_steps={"a": 6, "b": 6},
                      extras={"position": [3, 4], "rng": torch.arange(4, dtype=torch.uint8)})
    path = save_checkpoint_dir(tmp_path, 6, rank_state=state, manifest_info={}, sync_files=False)
    got = load_for_rank(path, {"a": (3, 2)}, rank=0, stash=True)
    assert list(got.model) == ["a"] and torch.equal(got.model["a"], w["a"])
    assert got.optimizer["a"]["step"] == 6 and got.optimizer["a"]["lr_scale"] == 0.5
    assert torch.equal(got.optimizer["a"]["exp_avg"], torch.ones(3, 2))
    assert torch.equal(got.stashed[5]["a"], w["a"] * 2) and got.stage_steps == {"a": 6}
    assert got.extras["position"] == [3, 4] and torch.equal(got.extras["rng"], torch.arange(4, dtype=torch.uint8))
    assert load_for_rank(path, ["b"], rank=9, optimizer=False).extras == {}   # no such old rank


def test_keep_removes_older_complete_ones_and_stale_tmp(tmp_path: Path) -> None:
    (tmp_path / "step_00000001.tmp").mkdir()   # an interrupted write, older than what follows
    for step in (2, 4, 6):
        _save(tmp_path, step, _net(), keep=2)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [4, 6]
    assert sorted(d.name for d in tmp_path.iterdir()) == ["step_00000004", "step_00000006"]
    with pytest.raises(CheckpointError, match=r"keep=0 would delete the checkpoint being written; pass keep >= 1"):
        _save(tmp_path, 8, _net(), keep=0)


def test_another_model_names_the_first_mismatch(tmp_path: Path) -> None:
    path = _save(tmp_path, 1, _net())
    with pytest.raises(CheckpointError, match=r"is from another model: parameter '0.weight' has shape \(8, 4\) there "
                                              r"but \(16, 4\) here; load it into the model it was saved from "
                                              r"\(model net \{\}\)"):
        load_into_model(path, _net(width=16))
    with pytest.raises(CheckpointError, match=r"from another model: it lacks parameter 'extra.weight' of this model"):
        load_for_rank(path, ["0.weight", "extra.weight"])
    with pytest.raises(CheckpointError, match=r"from another model: it has parameter '2.weight' that this model lacks"):
        load_into_model(path, nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)))
    with pytest.raises(CheckpointError, match=r"parameter '2.bias' has shape \(3,\) there but \(4,\) here"):
        load_for_rank(path, {"2.bias": (4,)})
    man = read_manifest(path)
    check_model(man, "net", {})
    with pytest.raises(CheckpointError, match=r"is for model net \{\}, not model gpt \{'layers': \[1, 2\]\}; "
                                              r"resume with the same --model and --option values"):
        check_model(man, "gpt", {"layers": (1, 2)})


def test_truncated_or_missing_file_is_named_and_skipped(tmp_path: Path) -> None:
    old = _save(tmp_path, 1, _net())
    new = _save(tmp_path, 2, _net())
    data = new / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:100])
    size = json.loads((new / "manifest.json").read_text())["files"]["__0_0.distcp"]
    with pytest.raises(CheckpointError, match=rf"is truncated: file '__0_0.distcp' has 100 bytes but its manifest "
                                              rf"records {size}; resume from an older checkpoint"):
        read_manifest(new)
    assert latest_checkpoint(tmp_path) == old   # the damaged newer one is skipped (with a warning)
    data.unlink()
    with pytest.raises(CheckpointError, match=r"is truncated: file '__0_0.distcp' listed in its manifest is missing"):
        load_into_model(new, _net())


def test_incomplete_checkpoint_without_manifest(tmp_path: Path) -> None:
    path = _save(tmp_path, 3, _net())
    (path / "manifest.json").unlink()
    assert latest_checkpoint(tmp_path) is None
    with pytest.raises(CheckpointError, match=r"has no manifest.json: it is incomplete \(its write was interrupted\)"):
        load_for_rank(path, ["0.weight"])


def test_unreadable_or_foreign_manifest(tmp_path: Path) -> None:
    path = _save(tmp_path, 3, _net())
    (path / "manifest.json").write_text('{"format": "pipetrain-checkpoint", "vers')
    with pytest.raises(CheckpointError, match=r"manifest .* is unreadable \(JSONDecodeError: .*\); the checkpoint is "
                                              r"damaged"):
        read_manifest(path)
    assert latest_checkpoint(tmp_path) is None
    (path / "manifest.json").write_text('{"format": "something-else"}')
    with pytest.raises(CheckpointError, match=r"has format 'something-else', not 'pipetrain-checkpoint'"):
        load_into_model(path, _net())
    (path / "manifest.json").write_text('{"format": "pipetrain-checkpoint", "version": 1, "step": 3}')
    with pytest.raises(CheckpointError, match=r"is malformed \(KeyError: 'wall_time'\)"):
        read_manifest(path)
    (path / "manifest.json").write_text('{"format": "pipetrain-checkpoint", "version": 99}')
    with pytest.raises(CheckpointError, match=r"has version 99 but this pipetrain reads versions up to 1"):
        read_manifest(path)


def test_nothing_to_resume_says_so(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "absent") is None
    with pytest.raises(CheckpointError, match=r"does not exist: nothing to resume"):
        require_latest(tmp_path / "absent")
    with pytest.raises(CheckpointError, match=r"holds no complete checkpoint \(it is empty\): nothing to resume"):
        require_latest(tmp_path)
    (tmp_path / "step_00000005.tmp").mkdir()
    with pytest.raises(CheckpointError, match=r"no complete checkpoint \(only 1 incomplete \(step_00000005.tmp\)\)"):
        require_latest(tmp_path)
    path = _save(tmp_path, 6, _net())
    assert require_latest(tmp_path) == path
    with pytest.raises(CheckpointError, match=r"does not exist or is not a directory"):
        read_manifest(tmp_path / "step_00000099")


def test_values_that_cannot_be_stored_are_refused_before_writing(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"rank 0: rank 0's extra 'gen' is a Generator, neither a tensor nor "
                                              r"JSON-serializable"):
        save_checkpoint_dir(tmp_path, 1, rank_state=RankState(extras={"gen": torch.Generator()}), manifest_info={})
    with pytest.raises(CheckpointError, match=r"optimizer state 'fn' of parameter 'w' is a object, neither a tensor "
                                              r"nor JSON-serializable; store it as a tensor or a number"):
        save_checkpoint_dir(tmp_path, 1, rank_state=RankState(model={"w": torch.ones(1)},
                                                              optimizer={"w": {"fn": object()}}), manifest_info={})
    with pytest.raises(CheckpointError, match=r"manifest_info is not JSON-serializable"):
        save_checkpoint_dir(tmp_path, 1, rank_state=RankState(), manifest_info={"t": torch.ones(1)})
    assert latest_checkpoint(tmp_path) is None and list(tmp_path.iterdir()) == []   # nothing left behind
    assert issubclass(CheckpointError, PipetrainError)


def test_a_non_writer_replica_saves_only_its_extras(tmp_path: Path) -> None:
    state = RankState(model={"w": torch.ones(2)}, optimizer={"w": {"m": torch.ones(2)}}, stage_steps={"w": 1},
                      extras={"position": 5}, writer=False)
    path = save_checkpoint_dir(tmp_path, 1, rank_state=state, manifest_info={}, sync_files=False)
    man = read_manifest(path)
    assert man.model == {} and man.optimizer == {} and man.stage_steps == {}
    assert man.ranks[0]["extras"] == {"position": 5}
    with pytest.raises(CheckpointError, match=r"it lacks parameter 'w' of this model"):
        load_for_rank(path, ["w"])


def test_functional_adam_resumes_exactly_on_another_split(tmp_path: Path) -> None:
    """Weights + FunctionalOptimizer state saved under a 2-stage split, loaded under a 3-stage
    split: the next steps equal an uninterrupted run's (Adam's integer step included)."""
    from pipetrain.job.config import OptimizerConfig
    from pipetrain.runtime.engine.optim import FunctionalOptimizer

    net = _net()
    net.eval()   # batch norm from its running stats: the loss is a function of the weights only
    torch.manual_seed(1)
    x, y = torch.randn(6, 4), torch.randn(6, 3)
    names = [n for n, _ in net.named_parameters()]

    def grads(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        w = {n: t.detach().requires_grad_() for n, t in w.items()}
        loss = ((torch.func.functional_call(net, w, (x,)) - y) ** 2).mean()
        return dict(zip(w, torch.autograd.grad(loss, list(w.values()))))

    def run(w: dict[str, torch.Tensor], opts: list[tuple[list[str], FunctionalOptimizer]], steps: int) -> None:
        for _ in range(steps):
            g = grads(w)
            for part, opt in opts:
                w.update(opt.apply({n: w[n] for n in part}, {n: g[n] for n in part}, lr=0.01))

    cfg = OptimizerConfig(name="adam", lr=0.01)
    start = {n: p.detach().clone() for n, p in net.named_parameters()}
    ref = dict(start)
    run(ref, [(names, FunctionalOptimizer(cfg))], 4)

    old_split = [names[:2], names[2:]]
    w = dict(start)
    opts = [(part, FunctionalOptimizer(cfg)) for part in old_split]
    run(w, opts, 2)
    state = RankState(model=w, optimizer={n: s for _, o in opts for n, s in o.state_dict()["state"].items()},
                      stage_steps={n: o.steps for part, o in opts for n in part})
    path = save_checkpoint_dir(tmp_path, 2, rank_state=state, manifest_info={}, sync_files=False)

    new_split = [names[:1], names[1:5], names[5:]]
    w2: dict[str, torch.Tensor] = {}
    opts2 = []
    for part in new_split:
        got = load_for_rank(path, {n: tuple(start[n].shape) for n in part})
        assert all(isinstance(st["step"], int) for st in got.optimizer.values())
        opt = FunctionalOptimizer(cfg)
        opt.load_state_dict({"steps": max(got.stage_steps.values()), "state": got.optimizer})
        w2.update(got.model)
        opts2.append((part, opt))
    run(w2, opts2, 2)
    for n in names:
        torch.testing.assert_close(w2[n], ref[n], rtol=0, atol=1e-6)
