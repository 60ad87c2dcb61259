"""Checkpoints: the whole model's state_dict under the original names, plus a trainer sidecar.

Files written by ``--save PATH`` (each atomically: a temporary file, then ``os.replace``):

- ``PATH``: ``torch.save`` of a plain ``{name: tensor}`` dict with exactly the keys of the
  original ``model.state_dict()`` (parameters at their newest version, gathered from replica 0
  of every stage, and buffers), loadable in one process with ``model.load_state_dict``;
- ``PATH.trainer``: ``{"format": "pipetrain-trainer", "version": 1, "step": minibatches done,
  "model": spec, "model_options": {...}, "optimizer": {...}, "optimizer_state": {param name:
  {...}}, "stage_steps": {param name: optimizer steps of its stage}}``.

A distributed run (:func:`save_final`, every rank) does not gather the model to one rank:
every rank writes its own part into a layout-free checkpoint ``PATH.parts/step_S/`` (the
store of :mod:`pipetrain.checkpoint`, DCP, as ``--checkpoint-dir`` does), then rank 0 exports
the plain ``PATH`` from it (read back from disk, one tensor file) and writes ``PATH.trainer``
with ``"version": 2`` and ``"checkpoint": "PATH.parts/step_S"`` (relative to ``PATH``'s
folder) instead of the optimizer state: :func:`load_checkpoint` reads that state from the
parts. One-process runs write version 1 (everything in ``PATH.trainer``); ``--resume``
accepts both versions.

``--save-hf DIR`` (``hf:`` models; :func:`save_hf_final`, :func:`save_hf_whole`) writes the
weights as a Hugging Face directory instead: every rank its own safetensors shard, rank 0 the
index and the config, so that ``from_pretrained(DIR)`` loads the trained model.

Optimizer state is keyed by parameter name (not by stage), so a run may resume under a
different plan; a tied tensor's state is keyed by every one of its names. ``--resume PATH``
continues from ``step``: data, learning-rate schedule and
optimizer state pick up where they stopped (for flushed schedules this equals an
uninterrupted run; asynchronous schedules restart their pipeline, i.e. drain at the save).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ...checkpoint.store import atomic_torch_save
from ...errors import RuntimeConfigError

__all__ = ["TrainerState", "save_checkpoint", "save_final", "save_hf_final", "save_hf_whole", "load_checkpoint",
           "trainer_path", "parts_dir", "check_resumable", "torch_optimizer_state", "load_torch_optimizer_state"]

FORMAT = "pipetrain-trainer"
VERSION = 1


def trainer_path(path: str | Path) -> Path:
    """The sidecar of a checkpoint: ``PATH.trainer``."""
    return Path(str(path) + ".trainer")


@dataclass
class TrainerState:
    """What ``--resume`` needs besides the weights."""

    step: int
    model: str
    model_options: dict[str, Any]
    optimizer: dict[str, Any]
    optimizer_state: dict[str, dict[str, Any]]
    stage_steps: dict[str, int]


def save_checkpoint(path: str | Path, state_dict: Mapping[str, Tensor], trainer: TrainerState) -> None:
    """Write ``PATH`` (the state_dict) and ``PATH.trainer``, each atomically."""
    path = Path(path)
    atomic_torch_save({k: v.detach().cpu() for k, v in state_dict.items()}, path)
    atomic_torch_save({"format": FORMAT, "version": VERSION, "step": trainer.step, "model": trainer.model,
                       "model_options": dict(trainer.model_options), "optimizer": dict(trainer.optimizer),
                       "optimizer_state": trainer.optimizer_state, "stage_steps": dict(trainer.stage_steps)},
                      trainer_path(path))


def load_checkpoint(path: str | Path) -> tuple[dict[str, Tensor], TrainerState]:
    """Read a checkpoint written by :func:`save_checkpoint`."""
    path = Path(path)
    if not path.exists():
        raise RuntimeConfigError(f"checkpoint {str(path)!r} does not exist; write one with --save {path}")
    side = trainer_path(path)
    if not side.exists():
        raise RuntimeConfigError(
            f"checkpoint {str(path)!r} has no trainer state {side.name!r} next to it; --resume needs both files "
            f"written by --save")
    state = _read(path, weights_only=True)
    raw = _read(side, weights_only=False)
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise RuntimeConfigError(f"{side} is not a pipetrain trainer state (written by --save)")
    if raw.get("version") == 2:  # a distributed run's --save: the optimizer state is in the parts
        optimizer_state, stage_steps = _parts_optimizer(side.parent / str(raw["checkpoint"]))
    else:
        optimizer_state, stage_steps = dict(raw["optimizer_state"]), dict(raw["stage_steps"])
    return state, TrainerState(int(raw["step"]), str(raw["model"]), dict(raw["model_options"]),
                               dict(raw["optimizer"]), optimizer_state, stage_steps)


def _read(path: Path, weights_only: bool) -> Any:
    """``torch.load`` of one file of a ``--save`` checkpoint; a file that cannot be read (truncated,
    corrupt, not a torch file) is a one-line error naming it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only)
    except Exception as e:  # noqa: BLE001 - torch's reasons are long and varied: one line naming the file
        text = str(e).strip()
        first = text.splitlines()[0].split(". ")[0].rstrip(".") if text else ""
        reason = f"{type(e).__name__}: {first}" if first else type(e).__name__
        raise RuntimeConfigError(f"cannot read checkpoint {str(path)!r}: {reason}; the file is truncated or corrupt: "
                                 f"pass a complete checkpoint written by --save (PATH and PATH.trainer)") from None


def parts_dir(path: str | Path) -> Path:
    """Where a distributed ``--save PATH`` writes its per-rank parts: ``PATH.parts``."""
    return Path(str(path) + ".parts")


def _parts_optimizer(ck: Path) -> tuple[dict[str, dict[str, Any]], dict[str, int]]:
    """The optimizer state (every parameter) and step counts of a layout-free checkpoint."""
    from ...checkpoint import read_manifest
    from ...checkpoint.manifest import TensorSpec
    from ...checkpoint.state import optim_key
    from ...checkpoint.store import read_tensors

    if not ck.exists():
        raise RuntimeConfigError(f"the parts {str(ck)!r} of this --save checkpoint are missing; copy PATH.parts "
                                 f"along with PATH and PATH.trainer, or save again")
    man = read_manifest(ck)
    specs = {optim_key(n, k): v for n, st in man.optimizer.items() for k, v in st.items() if isinstance(v, TensorSpec)}
    got = read_tensors(man, specs, "cpu")
    out: dict[str, dict[str, Any]] = {}
    for n, st in man.optimizer.items():
        out[n] = {k: (got[optim_key(n, k)] if isinstance(v, TensorSpec) else v) for k, v in st.items()}
    return out, dict(man.stage_steps)


def save_final(view: Any, path: str | Path, step: int, original_keys: list[str]) -> Path:
    """``--save PATH`` of a distributed run, on every rank (a collective; module docstring).

    Every rank writes its part of ``PATH.parts/step_S`` in parallel (only the newest
    checkpoint is kept there); rank 0 then exports ``PATH`` with exactly ``original_keys``
    (the model's ``state_dict`` keys, in order) and writes ``PATH.trainer`` (version 2).
    Returns ``PATH``.
    """
    import os

    from ...checkpoint import read_state_dict, save_checkpoint_dir
    from .periodic import manifest_info, rank_state

    path = Path(path)
    ck = save_checkpoint_dir(parts_dir(path), step, rank_state=rank_state(view, step),
                             manifest_info=manifest_info(view.run, step), keep=1)
    if view.rank == 0:
        sd = read_state_dict(ck)
        missing = [k for k in original_keys if k not in sd]
        if missing:
            raise RuntimeError(f"the saved parts {ck} lack {len(missing)} tensors of the model (first {missing[0]!r})")
        atomic_torch_save({k: sd[k] for k in original_keys}, path)
        cfg = view.run.config
        atomic_torch_save({"format": FORMAT, "version": 2, "step": step, "model": cfg.model.name,
                           "model_options": dict(cfg.model.options), "optimizer": cfg.to_dict()["optimizer"],
                           "checkpoint": os.path.relpath(ck, path.parent)}, trainer_path(path))
    return path


def torch_optimizer_state(optimizer: torch.optim.Optimizer, names: list[str]) -> dict[str, dict[str, Any]]:
    """A torch.optim optimizer's state keyed by parameter name (``names`` in param order)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    out: dict[str, dict[str, Any]] = {}
    for name, p in zip(names, params):
        st = optimizer.state.get(p)
        if not st:
            continue
        d: dict[str, Any] = {}
        for k, v in st.items():
            if k == "step":
                d[k] = int(v.item()) if isinstance(v, Tensor) else int(v)
            elif isinstance(v, Tensor):
                d[k] = v.detach().cpu().clone()
        out[name] = d
    return out


def load_torch_optimizer_state(optimizer: torch.optim.Optimizer, names: list[str],
                               state: Mapping[str, Mapping[str, Any]]) -> None:
    """Put name-keyed state (from a checkpoint) into a torch.optim optimizer."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for name, p in zip(names, params):
        st = state.get(name)
        if not st:
            continue
        d: dict[str, Any] = {}
        for k, v in st.items():
            if k == "step":
                d[k] = torch.tensor(float(v))
            elif isinstance(v, Tensor):
                d[k] = v.to(p.device).clone()
        optimizer.state[p] = d


def check_resumable(path: str, trainer: TrainerState, cfg: Any) -> None:
    """A checkpoint continues only the same model (and options) with the same optimizer.

    ``cfg`` is the run's :class:`~pipetrain.job.config.TrainConfig`. Raises a one-line
    RuntimeConfigError naming what differs and the flags to pass.
    """
    model, options = cfg.model.name, dict(cfg.model.options)
    if trainer.model != model or trainer.model_options != options:
        raise RuntimeConfigError(
            f"checkpoint {path} is for model {trainer.model} {trainer.model_options}, not {model} {options}; "
            f"resume with the same --model and --option values")
    if trainer.optimizer.get("name") != cfg.optimizer.name:
        raise RuntimeConfigError(
            f"checkpoint {path} was trained with {trainer.optimizer.get('name')}, not {cfg.optimizer.name}; "
            f"resume with --optimizer {trainer.optimizer.get('name')}")


def _hf_source(cfg: Any) -> Path:
    from ...models.pretrained import hf_directory

    return hf_directory(cfg.model.name)


def _dtype_name(tensors: Any) -> str | None:
    """The one floating dtype of ``tensors`` as config.json spells it (``float32``), else None."""
    kinds = {str(t.dtype).removeprefix("torch.") for t in tensors if t.is_floating_point()}
    return kinds.pop() if len(kinds) == 1 else None


def save_hf_whole(cfg: Any, state: Mapping[str, Tensor], original_keys: list[str]) -> Path:
    """``--save-hf DIR`` of a one-process run: the model's tensors in one shard and its index
    (:func:`save_hf_final`'s directory for one rank)."""
    from ...models.pretrained import hf_weight_names, shard_name, write_index, write_shard

    source, out = _hf_source(cfg), Path(cfg.checkpoint.save_hf)
    stored = hf_weight_names(source, original_keys)
    tensors = {stored[k]: state[k] for k in stored}
    total = write_shard(out, 1, 1, tensors)
    write_index(out, source, dict.fromkeys(tensors, shard_name(1, 1)), total, _dtype_name(tensors.values()))
    return out


def save_hf_final(view: Any, original_keys: list[str]) -> Path:
    """``--save-hf DIR`` of a distributed run, on every rank (a collective).

    Every rank writes the tensors it holds (the first replica of each of its stages; rank 0
    also the tensors no stage reads) into its own shard ``model-0000N-of-0000M.safetensors``,
    under the names the ``hf:`` directory stores them by (a tied tensor once, as
    ``save_pretrained`` writes it); a tensor two ranks hold (tied across stages) is written by
    the lower rank. Only names and sizes cross processes, never a tensor. Rank 0 then writes
    the index and copies config.json (and generation_config.json). Returns ``DIR``.
    """
    import torch.distributed as dist

    from ...models.pretrained import hf_weight_names, shard_name, write_index, write_shard
    from .periodic import rank_state

    source, out = _hf_source(view.cfg), Path(view.cfg.checkpoint.save_hf)
    stored = hf_weight_names(source, original_keys)  # the model's name -> the directory's
    names = list(stored.values())
    held = rank_state(view, 0).model
    mine = {stored[k]: held[k] for k in stored if k in held}
    gathered: list[Any] = [None] * view.world
    dist.all_gather_object(gathered, (sorted(mine), _dtype_name(mine.values())))
    owner: dict[str, int] = {}
    for rank, (held_names, _) in enumerate(gathered):
        for n in held_names:
            owner.setdefault(n, rank)
    missing = [n for n in names if n not in owner]
    if missing:
        raise RuntimeError(f"--save-hf: no rank holds {len(missing)} tensors of the model (first {missing[0]!r})")
    writers = sorted(set(owner.values()))
    shard_of = {r: shard_name(i + 1, len(writers)) for i, r in enumerate(writers)}
    total = 0
    if view.rank in shard_of:
        total = write_shard(out, writers.index(view.rank) + 1, len(writers),
                            {n: t for n, t in mine.items() if owner[n] == view.rank})
    totals: list[Any] = [None] * view.world
    dist.all_gather_object(totals, total)  # every shard is on disk before the index names it
    if view.rank == 0:
        dtypes = {d for _, d in gathered if d is not None}
        write_index(out, source, {n: shard_of[owner[n]] for n in names}, sum(totals),
                    dtypes.pop() if len(dtypes) == 1 else None)
    dist.barrier()
    return out
