"""Layout-free checkpoints across processes (gloo on 127.0.0.1): save on 4 ranks, load on 2.

The saved values are a deterministic function of (parameter, step), so the parent process
knows exactly what every rank must have written and what every reader must get back.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_harness import TIMEOUT_S, context, join_or_kill, launch

from pipetrain.checkpoint import (
    RankState,
    latest_checkpoint,
    load_for_rank,
    load_into_model,
    read_manifest,
    save_checkpoint_dir,
)
from pipetrain.models import TINY_OPTIONS, get_model

#: modules the forkserver imports once, before it forks the ranks
PRELOAD = ["pipetrain.checkpoint", "pipetrain.models"]


# --------------------------------------------------------------------------- the data


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return get_model("mlp", **TINY_OPTIONS["mlp"]).model


def _names() -> list[str]:
    return list(_model().state_dict())


def _weights(step: int) -> dict[str, torch.Tensor]:
    """The model's newest weights at ``step``."""
    return {n: t + step for n, t in _model().state_dict().items()}


def _momentum(name: str, step: int) -> torch.Tensor:
    i = _names().index(name)
    shape = _model().state_dict()[name].shape
    return torch.arange(float(torch.Size(shape).numel())).reshape(shape) * (i + 1) + step


def _save_split(world: int) -> list[list[str]]:
    """4 "stages" of consecutive parameters, one per rank."""
    names = _names()
    bounds = [0, 3, 6, 8, 10]
    assert world == 4
    return [names[bounds[r]:bounds[r + 1]] for r in range(world)]


def _rank_state(rank: int, step: int, names: list[str]) -> RankState:
    torch.manual_seed(1000 + rank)
    rng = torch.get_rng_state()
    w = _weights(step)
    return RankState(
        model={n: w[n] for n in names},
        stashed={step - 1: {n: w[n] - 1 for n in names}},
        optimizer={n: {"momentum_buffer": _momentum(n, step), "step": step * 10 + i} for i, n in enumerate(names)},
        stage_steps={n: step for n in names},
        extras={"rng": rng, "data_position": 100 * step + rank})


INFO = {"model": "mlp", "model_options": TINY_OPTIONS["mlp"], "schedule": "flush",
        "plan": {"config": "4 stages", "stages": [["fc0"], ["fc1"], ["fc2"], ["fc3"]]}}


# --------------------------------------------------------------------------- the workers


def _save_worker(rank: int, world: int, out: Path) -> None:
    root = out / "ckpt"
    split = _save_split(world)
    # step 1: every rank writes its own stage
    save_checkpoint_dir(root, 1, rank_state=_rank_state(rank, 1, split[rank]), manifest_info=INFO, keep=2,
                        sync_files=False)
    # step 2: rank 3 also holds a replica of rank 2's stage (both write: DCP keeps one copy)
    names = split[rank] + (split[2] if rank == 3 else [])
    save_checkpoint_dir(root, 2, rank_state=_rank_state(rank, 2, names), manifest_info=INFO, keep=2,
                        sync_files=False)
    # step 3: keep=2 deletes step 1
    path = save_checkpoint_dir(root, 3, rank_state=_rank_state(rank, 3, split[rank]), manifest_info=INFO, keep=2,
                               sync_files=False)
    assert path == root / "step_00000003"
    # step 4 is interrupted: every rank's tensors written, the manifest never
    sd = {f"model/{n}": t for n, t in _weights(4).items() if n in split[rank]}
    tmp = root / "step_00000004.tmp"
    tmp.mkdir(exist_ok=True)
    dist.barrier()
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=False))


def _load_worker(rank: int, world: int, out: Path) -> None:
    path = latest_checkpoint(out / "ckpt")
    assert path is not None
    shapes = {n: tuple(t.shape) for n, t in _model().state_dict().items()}
    mine = _names()[rank::world]   # another split: every other parameter
    got = load_for_rank(path, {n: shapes[n] for n in mine}, rank=rank, stash=True)
    torch.save({"step": got.step, "model": got.model, "optimizer": got.optimizer, "stashed": got.stashed,
                "stage_steps": got.stage_steps, "extras": got.extras, "info": got.info}, out / f"load_{rank}.pt")


# --------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    launch(_save_worker, 4, out, preload=PRELOAD)
    return out


def test_retention_and_incomplete_write(saved: Path) -> None:
    root = saved / "ckpt"
    assert sorted(d.name for d in root.iterdir()) == ["step_00000002", "step_00000003", "step_00000004.tmp"]
    assert any(f.suffix == ".distcp" for f in (root / "step_00000004.tmp").iterdir())
    assert latest_checkpoint(root) == root / "step_00000003"
    man = read_manifest(root / "step_00000003")
    assert man.step == 3 and man.world_size == 4 and man.info == INFO
    assert set(man.files) == {".metadata"} | {f"__{r}_0.distcp" for r in range(4)}


def test_load_into_model_after_parallel_save(saved: Path) -> None:
    for step in (2, 3):   # step 2 had a key written by two ranks
        model = _model()
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        load_into_model(saved / "ckpt" / f"step_{step:08d}", model)
        for n, t in model.state_dict().items():
            assert torch.equal(t, _weights(step)[n]), (step, n)


def test_two_ranks_with_another_split_reproduce_every_tensor(saved: Path) -> None:
    launch(_load_worker, 2, saved, preload=PRELOAD)
    parts = [torch.load(saved / f"load_{r}.pt", weights_only=False) for r in range(2)]
    model: dict[str, torch.Tensor] = {}
    optim: dict[str, Any] = {}
    stashed: dict[str, torch.Tensor] = {}
    steps: dict[str, int] = {}
    for p in parts:
        assert p["step"] == 3 and p["info"] == INFO
        assert set(p["model"]).isdisjoint(model)
        model.update(p["model"])
        optim.update(p["optimizer"])
        assert list(p["stashed"]) == [2]
        stashed.update(p["stashed"][2])
        steps.update(p["stage_steps"])
    w = _weights(3)
    assert list(sorted(model)) == sorted(w)
    split = _save_split(4)
    for n in w:
        assert torch.equal(model[n], w[n]), n
        assert torch.equal(stashed[n], w[n] - 1), n
        assert torch.equal(optim[n]["momentum_buffer"], _momentum(n, 3)), n
        i = next(s.index(n) for s in split if n in s)
        assert optim[n]["step"] == 30 + i and isinstance(optim[n]["step"], int)
        assert steps[n] == 3
    for r in range(2):   # the new rank r gets the extras the old rank r saved
        torch.manual_seed(1000 + r)
        assert parts[r]["extras"]["data_position"] == 300 + r
        assert torch.equal(parts[r]["extras"]["rng"], torch.get_rng_state())


def _killed_save(root: str, when: str) -> None:
    """Save step 2 of ``root`` and die by SIGKILL ``when`` (in a child process)."""
    import torch.distributed.checkpoint.filesystem as fs

    import pipetrain.checkpoint.store as store

    def die(*args: Any, **kwargs: Any) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if when == "during-tensor-write":   # after the first tensor's bytes, mid-file
        write = fs._write_item

        def write_then_die(*args: Any, **kwargs: Any) -> None:
            write(*args, **kwargs)
            args[1].flush()
            die()
        fs._write_item = write_then_die  # type: ignore[assignment]
    else:                               # every tensor file on disk, the manifest not yet
        store.write_manifest = die  # type: ignore[assignment]
    torch.set_num_threads(1)
    sd = {"w": torch.full((256, 256), 2.0), "b": torch.ones(3)}
    save_checkpoint_dir(root, 2, rank_state=RankState(model=sd), manifest_info={"model": "m"})


@pytest.mark.parametrize("when", ["during-tensor-write", "before-manifest"])
def test_killed_write_leaves_previous_checkpoint_in_use(tmp_path: Path, when: str) -> None:
    root = tmp_path / "ckpt"
    first = {"w": torch.full((256, 256), 1.0), "b": torch.zeros(3)}
    save_checkpoint_dir(root, 1, rank_state=RankState(model=first), manifest_info={"model": "m"})
    proc = context(PRELOAD).Process(target=_killed_save, args=(str(root), when), daemon=True)
    proc.start()
    join_or_kill([proc], TIMEOUT_S)
    assert proc.exitcode == -signal.SIGKILL
    tmp = root / "step_00000002.tmp"
    assert tmp.is_dir() and any(f.suffix == ".distcp" and f.stat().st_size > 0 for f in tmp.iterdir())
    assert not (tmp / "manifest.json").exists()
    assert latest_checkpoint(root) == root / "step_00000001"
    got = load_for_rank(root / "step_00000001", ["w", "b"]).model
    assert torch.equal(got["w"], first["w"]) and torch.equal(got["b"], first["b"])
    # the same step saved again replaces the interrupted attempt
    again = {"w": torch.full((256, 256), 3.0), "b": torch.ones(3)}
    save_checkpoint_dir(root, 2, rank_state=RankState(model=again), manifest_info={"model": "m"}, keep=1)
    assert sorted(d.name for d in root.iterdir()) == ["step_00000002"]
    assert torch.equal(load_for_rank(latest_checkpoint(root), ["w"]).model["w"], again["w"])  # type: ignore[arg-type]
