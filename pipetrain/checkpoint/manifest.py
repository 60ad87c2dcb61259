"""The manifest of a checkpoint directory: what it holds, written last, checked first.

A checkpoint is complete exactly when its directory is named ``step_XXXXXXXX`` (no ``.tmp``)
and holds a readable ``manifest.json`` (rank 0 writes it only after every rank's tensor files
and DCP's ``.metadata`` are on disk, then renames the directory). Its fields::

    {"format": "pipetrain-checkpoint", "version": 1,
     "step": 120,                       # minibatches done when it was saved
     "wall_time": 1764560000.0,         # time.time() at the manifest's writing
     "world_size": 4,                   # ranks that saved it
     "info": {...},                     # the caller's manifest_info, verbatim (plan, schedule,
                                        # model name and options, optimizer, data position, ...)
     "model": {name: {"shape": [..], "dtype": "float32"}},      # newest weights and buffers
     "stash": {"3": [name, ...]},       # older weight versions held at the save
     "optimizer": {name: {key: {"shape": .., "dtype": ..} | {"value": 5}}},
     "stage_steps": {name: steps},      # optimizer steps of the stage holding each parameter
     "ranks": {"0": {"extras": {key: json value},
                     "tensor_extras": {key: {"shape": .., "dtype": ..}}}},
     "files": {"__0_0.distcp": 123456, ".metadata": 2048}}     # every other file, with its size

Invariant checked by :func:`read_manifest`: every file the manifest lists exists with exactly
the recorded size (a truncated or partly deleted checkpoint is named, never loaded).
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import RuntimeConfigError

__all__ = ["CheckpointError", "Manifest", "TensorSpec", "FORMAT", "VERSION", "MANIFEST_NAME",
           "checkpoint_name", "step_of_name", "read_manifest", "write_manifest", "check_params", "check_model"]

FORMAT = "pipetrain-checkpoint"
VERSION = 1
MANIFEST_NAME = "manifest.json"
_NAME = re.compile(r"^step_(\d{8,})$")


class CheckpointError(RuntimeConfigError):
    """A checkpoint is missing, incomplete, truncated, unreadable or from another model."""


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint of ``step``: ``step_00000120``."""
    return f"step_{step:08d}"


def step_of_name(name: str) -> int | None:
    """The step of a complete checkpoint's directory name, or ``None`` (``.tmp`` or other)."""
    m = _NAME.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one saved tensor (enough to pre-allocate it for ``dcp.load``)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": str(self.dtype).removeprefix("torch.")}

    @staticmethod
    def of(t: torch.Tensor) -> TensorSpec:
        return TensorSpec(tuple(int(s) for s in t.shape), t.dtype)

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> TensorSpec:
        dtype = getattr(torch, str(d["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {d['dtype']!r}")
        return TensorSpec(tuple(int(s) for s in d["shape"]), dtype)

    def empty(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype)


@dataclass
class Manifest:
    """A parsed ``manifest.json`` (see the module docstring for the fields)."""

    path: Path                                        # the checkpoint directory
    step: int
    wall_time: float
    world_size: int
    info: dict[str, Any]
    model: dict[str, TensorSpec]
    stash: dict[int, list[str]] = field(default_factory=dict)
    optimizer: dict[str, dict[str, TensorSpec | Any]] = field(default_factory=dict)
    stage_steps: dict[str, int] = field(default_factory=dict)
    ranks: dict[int, dict[str, Any]] = field(default_factory=dict)
    files: dict[str, int] = field(default_factory=dict)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: s.shape for n, s in self.model.items()}

    def describe_model(self) -> str:
        """``model mlp {'depth': 4}`` from the info, for messages."""
        name = self.info.get("model")
        if name is None:
            return "an unnamed model"
        return f"model {name} {self.info.get('model_options', {})}"


def _spec_or_value(d: Mapping[str, Any]) -> TensorSpec | Any:
    return d["value"] if "value" in d else TensorSpec.from_json(d)


def _spec_json(v: TensorSpec | Any) -> dict[str, Any]:
    return v.to_json() if isinstance(v, TensorSpec) else {"value": v}


def write_manifest(man: Manifest) -> None:
    """Write ``man.path/manifest.json`` atomically and durably (temporary file, fsync, rename)."""
    body = {
        "format": FORMAT, "version": VERSION, "step": man.step, "wall_time": man.wall_time,
        "world_size": man.world_size, "info": man.info,
        "model": {n: s.to_json() for n, s in man.model.items()},
        "stash": {str(v): names for v, names in man.stash.items()},
        "optimizer": {n: {k: _spec_json(v) for k, v in st.items()} for n, st in man.optimizer.items()},
        "stage_steps": man.stage_steps,
        "ranks": {str(r): d for r, d in man.ranks.items()},
        "files": man.files,
    }
    text = json.dumps(body, indent=1)
    tmp = man.path / (MANIFEST_NAME + ".part")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, man.path / MANIFEST_NAME)
    fsync_dir(man.path)


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a rename, a new file) durable; a no-op where unsupported."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_manifest(path: str | Path, check_files: bool = True) -> Manifest:
    """Parse and check a checkpoint directory's manifest.

    Raises :class:`CheckpointError` (one line) when the directory does not exist, has no
    manifest (an interrupted write), the manifest is unreadable or of another format, or
    (``check_files``) a file it lists is missing or has another size (truncated).
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist or is not a directory; pass a "
                              f"step_XXXXXXXX directory or use latest_checkpoint(root)")
    mpath = path / MANIFEST_NAME
    if not mpath.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} has no {MANIFEST_NAME}: it is incomplete (its write was "
                              f"interrupted); resume from an older one with latest_checkpoint(root)")
    try:
        raw = json.loads(mpath.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"manifest {str(mpath)!r} is unreadable ({type(e).__name__}: {e}); the checkpoint "
                              f"is damaged: resume from an older one or delete it") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        got = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise CheckpointError(f"manifest {str(mpath)!r} has format {got!r}, not {FORMAT!r}; it was not written by "
                              f"pipetrain.checkpoint")
    if not isinstance(raw.get("version"), int) or raw["version"] > VERSION:
        raise CheckpointError(f"manifest {str(mpath)!r} has version {raw.get('version')!r} but this pipetrain reads "
                              f"versions up to {VERSION}; load it with a newer pipetrain")
    try:
        man = Manifest(
            path=path, step=int(raw["step"]), wall_time=float(raw["wall_time"]), world_size=int(raw["world_size"]),
            info=dict(raw["info"]),
            model={n: TensorSpec.from_json(d) for n, d in raw["model"].items()},
            stash={int(v): list(names) for v, names in raw.get("stash", {}).items()},
            optimizer={n: {k: _spec_or_value(d) for k, d in st.items()} for n, st in raw.get("optimizer", {}).items()},
            stage_steps={n: int(s) for n, s in raw.get("stage_steps", {}).items()},
            ranks={int(r): dict(d) for r, d in raw.get("ranks", {}).items()},
            files={str(f): int(s) for f, s in raw["files"].items()},
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"manifest {str(mpath)!r} is malformed ({type(e).__name__}: {e}); the checkpoint "
                              f"is damaged: resume from an older one or delete it") from None
    if check_files:
        check_file_sizes(man)
    return man


def check_file_sizes(man: Manifest) -> None:
    """Every file the manifest lists exists with the recorded size, else a one-line error."""
    for name, size in man.files.items():
        f = man.path / name
        try:
            got = f.stat().st_size
        except OSError:
            raise CheckpointError(f"checkpoint {str(man.path)!r} is truncated: file {name!r} listed in its manifest "
                                  f"is missing; resume from an older checkpoint") from None
        if got != size:
            raise CheckpointError(f"checkpoint {str(man.path)!r} is truncated: file {name!r} has {got} bytes but its "
                                  f"manifest records {size}; resume from an older checkpoint")


def check_params(man: Manifest, expected: Mapping[str, Sequence[int]], *, complete: bool = True) -> None:
    """The checkpoint holds ``expected``'s parameter names with the same shapes.

    ``complete``: also every name of the checkpoint must be expected (the whole model);
    otherwise ``expected`` may be a subset (one rank's parameters). The first mismatch is
    named in a one-line :class:`CheckpointError`.
    """
    fix = f"load it into the model it was saved from ({man.describe_model()})"
    for name, shape in expected.items():
        spec = man.model.get(name)
        if spec is None:
            raise CheckpointError(f"checkpoint {str(man.path)!r} is from another model: it lacks parameter {name!r} "
                                  f"of this model; {fix}")
        if tuple(spec.shape) != tuple(int(s) for s in shape):
            raise CheckpointError(f"checkpoint {str(man.path)!r} is from another model: parameter {name!r} has shape "
                                  f"{tuple(spec.shape)} there but {tuple(shape)} here; {fix}")
    if complete:
        extra = [n for n in man.model if n not in expected]
        if extra:
            raise CheckpointError(f"checkpoint {str(man.path)!r} is from another model: it has parameter "
                                  f"{extra[0]!r} that this model lacks; {fix}")


def check_model(man: Manifest, model: str, model_options: Mapping[str, Any]) -> None:
    """The checkpoint's ``info`` names the same model and options (when it names any).

    Options are compared as JSON (tuples and lists alike), since that is how they were stored.
    """
    saved = man.info.get("model")
    if saved is None:
        return
    norm = json.loads(json.dumps(dict(model_options)))
    if saved != model or man.info.get("model_options", {}) != norm:
        raise CheckpointError(f"checkpoint {str(man.path)!r} is for {man.describe_model()}, not model {model} {norm}; "
                              f"resume with the same --model and --option values or another --checkpoint-dir")
