"""Save a checkpoint from every rank in parallel; load any part of it under any layout.

Saving (:func:`save_checkpoint_dir`, a collective: every rank of ``group`` calls it at the
same step)::

    rank 0: remove a stale root/step_S.tmp/, create it      ─┐
    all:    all_gather the small summaries (a barrier too)   │ a user error found on any rank
            (shapes, JSON values, errors)                    ┘ is raised on every rank here
    all:    dcp.save -> root/step_S.tmp/__<rank>_0.distcp     each rank writes only its tensors;
                        (+ .metadata by DCP's coordinator)    DCP writes a key held twice once
    rank 0: manifest.json (file sizes, shapes, info) LAST, then rename step_S.tmp -> step_S,
            then delete old ones beyond ``keep``; broadcast success or the error to all ranks

A crash at any point before the rename leaves only a ``.tmp`` directory, which is never
picked up (:func:`~pipetrain.checkpoint.retention.latest_checkpoint`).

Loading is not a collective: each rank reads DCP's metadata and exactly the byte ranges of
the keys it asks for (``dcp.load(..., no_dist=True)`` into tensors pre-allocated from the
manifest's shapes), so a checkpoint saved by 4 ranks under one plan loads on 2 ranks under
another: resharding is matching parameter names.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn

from .manifest import (
    MANIFEST_NAME,
    CheckpointError,
    Manifest,
    TensorSpec,
    check_params,
    checkpoint_name,
    fsync_dir,
    read_manifest,
    write_manifest,
)
from .retention import TMP_SUFFIX, prune
from .state import RankState, RankSummary, flatten, model_key, optim_key, rank_key, stash_key

__all__ = ["save_checkpoint_dir", "load_for_rank", "RankLoad", "load_rank_extras", "read_state_dict", "read_tensors",
           "load_into_model", "export_state_dict", "atomic_torch_save"]


# --------------------------------------------------------------------------- saving

_SINGLE_PROCESS_WARNING = "torch.distributed is disabled"  # DCP's note when no_dist: expected here


def _group_info(group: dist.ProcessGroup | None) -> tuple[bool, int, int]:
    """(distributed, rank in group, group size); a single process when not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        return False, 0, 1
    return True, dist.get_rank(group), dist.get_world_size(group)


def _merge(summaries: Sequence[RankSummary]) -> tuple[dict[str, Any], str | None]:
    """Union of the ranks' summaries; a key written by two ranks with other shapes is an error."""
    model: dict[str, dict[str, Any]] = {}
    stash: dict[int, list[str]] = {}
    optim: dict[str, dict[str, dict[str, Any]]] = {}
    steps: dict[str, int] = {}
    for s in summaries:
        for n, spec in s.model.items():
            if n in model and model[n] != spec:
                return {}, (f"parameter {n!r} is written by two ranks with different shapes/dtypes ({model[n]} and "
                            f"{spec} on rank {s.rank}); pass writer=False on all but one replica")
            model.setdefault(n, spec)
        for v, names in s.stash.items():
            stash.setdefault(v, [])
            stash[v] += [n for n in names if n not in stash[v]]
        for n, st in s.optimizer.items():
            optim.setdefault(n, st)
        for n, k in s.stage_steps.items():
            steps.setdefault(n, k)
    return {"model": model, "stash": dict(sorted(stash.items())), "optimizer": optim, "stage_steps": steps}, None


def save_checkpoint_dir(root: str | Path, step: int, *, rank_state: RankState, manifest_info: Mapping[str, Any],
                        group: dist.ProcessGroup | None = None, keep: int | None = None,
                        sync_files: bool = True, before_manifest: Callable[[], None] | None = None) -> Path:
    """Write ``root/step_XXXXXXXX/`` from every rank of ``group`` in parallel; return its path.

    Args:
        root: the checkpoint directory (created if needed).
        step: minibatches done (the directory's name; a complete one of the same step is replaced).
        rank_state: what this rank holds (see :class:`RankState`).
        manifest_info: JSON-serializable run description stored verbatim as the manifest's
            ``info`` (rank 0's is used): model name and options, plan config and stage node
            lists, schedule, optimizer config, data position, learning-rate schedule step.
        group: the process group (default: the world); a single process needs none.
        keep: keep only this many newest complete checkpoints (``None``: all).
        sync_files: fsync every file (DCP's ``sync_files``); turn off only for tests.
        before_manifest: called on rank 0 once every rank's tensor files and DCP's metadata
            are on disk, just before the manifest is written (fault injection: a process
            that dies there leaves only the ``.tmp`` directory).

    Raises :class:`CheckpointError` on every rank alike for a user error found on any rank
    (non-serializable values, conflicting shapes, bad ``keep``).
    """
    if keep is not None and keep < 1:
        raise CheckpointError(f"keep={keep} would delete the checkpoint being written; pass keep >= 1 or None")
    if step < 0:
        raise CheckpointError(f"checkpoint step {step} is negative; pass the number of minibatches done (>= 0)")
    distributed, rank, world = _group_info(group)
    root = Path(root)
    final = root / checkpoint_name(step)
    tmp = root / (final.name + TMP_SUFFIX)
    sd, summ = flatten(rank_state, rank)
    if rank == 0:
        try:
            json.dumps(dict(manifest_info))
        except (TypeError, ValueError) as e:
            summ.error = summ.error or (f"manifest_info is not JSON-serializable ({e}); "
                                        "pass numbers, strings, lists, dicts")
        try:
            if tmp.exists():
                shutil.rmtree(tmp)  # an earlier attempt at this step that was interrupted
            tmp.mkdir(parents=True)
        except OSError as e:
            summ.error = summ.error or f"cannot create {str(tmp)!r} ({e}); pass a writable checkpoint directory"
    summaries: list[RankSummary]
    if distributed:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, summ, group=group)  # also orders rank 0's mkdir before the writes
        summaries = list(gathered)
    else:
        summaries = [summ]
    errors = [f"rank {s.rank}: {s.error}" for s in summaries if s.error]
    merged, conflict = _merge(summaries)
    if conflict:
        errors.append(conflict)
    if errors:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"checkpoint of step {step} not written: {errors[0]}")

    writer = dcp.FileSystemWriter(str(tmp), sync_files=sync_files)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        dcp.save(sd, storage_writer=writer, process_group=group, no_dist=not distributed)

    err: str | None = None
    if rank == 0:
        try:
            _finish(root, tmp, final, step, world, dict(manifest_info), merged, summaries, keep, before_manifest)
        except Exception as e:  # noqa: BLE001 - every rank must learn that the save failed
            err = f"{type(e).__name__}: {e}"
    if distributed:
        box: list[Any] = [err]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        err = box[0]
    if err is not None:
        raise RuntimeError(f"checkpoint of step {step} failed on rank 0 after the tensors were written: {err}")
    return final


def _finish(root: Path, tmp: Path, final: Path, step: int, world: int, info: dict[str, Any],
            merged: dict[str, Any], summaries: Sequence[RankSummary], keep: int | None,
            before_manifest: Callable[[], None] | None = None) -> None:
    """Rank 0, once every rank's files are on disk: manifest last, rename, retention."""
    files = {f.name: f.stat().st_size for f in sorted(tmp.iterdir()) if f.is_file() and f.name != MANIFEST_NAME}
    man = Manifest(
        path=tmp, step=step, wall_time=time.time(), world_size=world, info=info,
        model={n: TensorSpec.from_json(s) for n, s in merged["model"].items()},
        stash=merged["stash"],
        optimizer={n: {k: (d["value"] if "value" in d else TensorSpec.from_json(d)) for k, d in st.items()}
                   for n, st in merged["optimizer"].items()},
        stage_steps=merged["stage_steps"],
        ranks={s.rank: {"extras": s.extras, "tensor_extras": s.tensor_extras} for s in summaries},
        files=files)
    if before_manifest is not None:
        before_manifest()
    write_manifest(man)
    if final.exists():  # the same step saved again (e.g. after a restart): replace it
        old = root / (final.name + ".old" + TMP_SUFFIX)
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync_dir(root)
    if keep is not None:
        prune(root, keep, step)


# --------------------------------------------------------------------------- loading


@dataclass
class RankLoad:
    """What one rank loaded: its parameters' tensors under the new layout, by name."""

    manifest: Manifest
    model: dict[str, Tensor] = field(default_factory=dict)
    optimizer: dict[str, dict[str, Any]] = field(default_factory=dict)   # name -> {key: tensor | scalar}
    stage_steps: dict[str, int] = field(default_factory=dict)             # name -> steps of its old stage
    stashed: dict[int, dict[str, Tensor]] = field(default_factory=dict)   # version -> name -> tensor
    extras: dict[str, Any] = field(default_factory=dict)                  # the asked rank's extras

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def info(self) -> dict[str, Any]:
        return self.manifest.info


def read_tensors(man: Manifest, specs: Mapping[str, TensorSpec], device: torch.device | str) -> dict[str, Tensor]:
    """Read ``specs``' keys (storage keys: :func:`~pipetrain.checkpoint.state.model_key`,
    ``optim_key``, ...) from the checkpoint of ``man``, only their bytes, onto ``device``."""
    if not specs:
        return {}
    sd = {k: s.empty() for k, s in specs.items()}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
            dcp.load(sd, storage_reader=dcp.FileSystemReader(str(man.path)), no_dist=True)
    except Exception as e:  # noqa: BLE001 - DCP's errors are long and nested: one line instead
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {str(man.path)!r} could not be read ({type(e).__name__}: {first}); it is "
                              f"damaged: resume from an older checkpoint") from None
    return {k: (t.to(device) if str(device) != "cpu" else t) for k, t in sd.items()}


def load_for_rank(path: str | Path, wanted: Mapping[str, Sequence[int]] | Iterable[str], *, rank: int | None = None,
                  optimizer: bool = True, stash: bool = False,
                  device: torch.device | str = "cpu") -> RankLoad:
    """Load the tensors of the parameters ``wanted`` (this rank's under the NEW layout).

    Not a collective: each rank reads only its keys' bytes. ``wanted`` is either names, or
    ``{name: shape}`` (then shapes are checked: a checkpoint of another model names the first
    mismatch). ``optimizer``: also their optimizer state; ``stash``: also older weight
    versions held at the save (only meaningful under the same schedule); ``rank``: also the
    extras that rank saved (``{}`` if the checkpoint had fewer ranks).
    """
    man = read_manifest(path)
    if isinstance(wanted, Mapping):
        check_params(man, wanted, complete=False)
        names = list(wanted)
    else:
        names = list(wanted)
        missing = [n for n in names if n not in man.model]
        if missing:
            raise CheckpointError(f"checkpoint {str(man.path)!r} is from another model: it lacks parameter "
                                  f"{missing[0]!r} of this model; load it into the model it was saved from "
                                  f"({man.describe_model()})")
    specs: dict[str, TensorSpec] = {model_key(n): man.model[n] for n in names}
    scalars: dict[str, dict[str, Any]] = {}
    if optimizer:
        for n in names:
            for k, v in man.optimizer.get(n, {}).items():
                if isinstance(v, TensorSpec):
                    specs[optim_key(n, k)] = v
                else:
                    scalars.setdefault(n, {})[k] = v
    wanted_set = set(names)
    if stash:
        for v, vnames in man.stash.items():
            for n in vnames:
                if n in wanted_set:
                    specs[stash_key(v, n)] = man.model[n]
    extras: dict[str, Any] = {}
    if rank is not None and rank in man.ranks:
        extras.update(man.ranks[rank].get("extras", {}))
        for k, d in man.ranks[rank].get("tensor_extras", {}).items():
            specs[rank_key(rank, k)] = TensorSpec.from_json(d)
    got = read_tensors(man, specs, device)
    out = RankLoad(man, stage_steps={n: man.stage_steps[n] for n in names if n in man.stage_steps})
    out.model = {n: got[model_key(n)] for n in names}
    if optimizer:
        for n in names:
            st = dict(scalars.get(n, {}))
            st.update({k: got[optim_key(n, k)] for k, v in man.optimizer.get(n, {}).items()
                       if isinstance(v, TensorSpec)})
            if st:
                out.optimizer[n] = st
    if stash:
        for v, vnames in man.stash.items():
            mine = {n: got[stash_key(v, n)] for n in vnames if n in wanted_set}
            if mine:
                out.stashed[v] = mine
    if rank is not None and rank in man.ranks:
        for k in man.ranks[rank].get("tensor_extras", {}):
            extras[k] = got[rank_key(rank, k)]
    out.extras = extras
    return out


def load_rank_extras(path: str | Path, rank: int) -> dict[str, Any]:
    """The extras rank ``rank`` saved (JSON values and tensors); ``{}`` if it had no such rank."""
    return load_for_rank(path, [], rank=rank, optimizer=False).extras


def read_state_dict(path: str | Path) -> dict[str, Tensor]:
    """The whole model's ``{name: tensor}`` (newest weights and buffers), in the manifest's order."""
    man = read_manifest(path)
    got = read_tensors(man, {model_key(n): s for n, s in man.model.items()}, "cpu")
    return {n: got[model_key(n)] for n in man.model}


def load_into_model(path: str | Path, model: nn.Module, strict: bool = True) -> Manifest:
    """Load a checkpoint into a plain ``nn.Module`` (inference, export) via ``load_state_dict``.

    Names and shapes are checked first: a checkpoint of another model names the first
    mismatch in one line. ``strict=False`` allows the model to be a part of the saved one.
    """
    man = read_manifest(path)
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    check_params(man, expected, complete=strict)
    got = read_tensors(man, {model_key(n): man.model[n] for n in expected}, "cpu")
    model.load_state_dict({n: got[model_key(n)] for n in expected}, strict=strict)
    return man


def export_state_dict(path: str | Path, out_file: str | Path) -> Path:
    """Write the checkpoint's model state as one ``torch.save`` file of a plain ``{name: tensor}``
    dict (atomically), loadable with ``model.load_state_dict(torch.load(out_file))``."""
    out = Path(out_file)
    atomic_torch_save(read_state_dict(path), out)
    return out


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save(obj)`` to ``path`` atomically: into a temporary file next to it (``PATH.XXXX.tmp``,
    removed on failure), then ``os.replace``; creates ``path``'s folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=TMP_SUFFIX, dir=str(path.parent))
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
