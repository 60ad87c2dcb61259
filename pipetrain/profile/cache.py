"""Measurements kept on disk: a profile or calibration measured once is not measured again.

Profiling a model and calibrating the links take seconds to minutes and give the same answer
on the same machine, so ``pipetrain profile`` and ``train --schedule auto`` keep what they
measure in a cache directory and reuse it:

- **Where**: ``$PIPETRAIN_CACHE`` when set, else ``~/.cache/pipetrain`` (:func:`cache_dir`);
  one JSON file per entry, ``KIND/HASH.json``, holding the full key and the value. Deleting
  the directory (or any file in it) is always safe.
- **Key**: what the caller says determines the measurement (model, its options, the batch,
  dtype and device, threads, optimizer, repeats...) plus the machine
  (:func:`machine_identity`: CPU model, core count, torch and pipetrain versions, a digest of
  pipetrain's own source files, GPU name on CUDA). Any difference is a miss; the key is
  stored with the value and compared on reading, so two keys never share an entry.
- **Off**: ``--no-cache`` (``MeasurementCache(enabled=False)``) measures again and leaves the
  cache alone. A cache that cannot be written is skipped with one warning, never an error;
  an entry that cannot be read counts as a miss (and is replaced).
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["CACHE_ENV", "cache_dir", "machine_identity", "source_digest", "MeasurementCache", "cached_profile",
           "model_dtype", "model_fingerprint", "graph_fingerprint"]

log = logging.getLogger("pipetrain.profile")

#: The environment variable naming the cache directory.
CACHE_ENV = "PIPETRAIN_CACHE"
#: Bumped when what a cached measurement means changes: older entries are then misses.
CACHE_FORMAT = 2

T = TypeVar("T")


def cache_dir() -> Path:
    """``$PIPETRAIN_CACHE``, else ``~/.cache/pipetrain``."""
    given = os.environ.get(CACHE_ENV, "")
    return Path(given).expanduser() if given else Path.home() / ".cache" / "pipetrain"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pipetrain")
    except PackageNotFoundError:
        return "unknown"


def source_digest(root: str | Path) -> str:
    """A digest of every ``*.py`` file under ``root`` (relative paths and contents, sorted).

    Invariant: a measurement is reused only by the code that measured it. The version alone
    does not change between commits of a source checkout, where a rehearsal cached before a
    runtime fix would otherwise go on predicting the old runtime's times.
    """
    root = Path(root)
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        try:
            h.update(path.read_bytes())
        except OSError:
            h.update(b"<unreadable>")
        h.update(b"\0")
    return h.hexdigest()[:32]


@functools.lru_cache(maxsize=1)
def _own_source_digest() -> str:
    return source_digest(Path(__file__).resolve().parent.parent)


def machine_identity(device: str = "cpu") -> dict[str, Any]:
    """What a measurement on this machine depends on besides the caller's key: the machine,
    torch, and the pipetrain code that measured it (its version and :func:`source_digest`)."""
    import torch

    ident: dict[str, Any] = {"cpu": _cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
                             "pipetrain": _version(), "source": _own_source_digest(), "format": CACHE_FORMAT}
    if str(device).startswith("cuda") and torch.cuda.is_available():
        ident["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return ident


def model_dtype(module: Any) -> str:
    """The dtype of a model's first floating-point parameter (``float32`` for none)."""
    for p in module.parameters():
        if p.is_floating_point():
            return str(p.dtype).replace("torch.", "")
    return "float32"


def model_fingerprint(module: Any, inputs: Any = None) -> str:
    """A digest of a model's structure: its modules' repr, parameter names, shapes and dtypes,
    and the inputs' shapes (a factory whose model changes changes it)."""
    import torch
    from torch.utils import _pytree as pytree

    parts = [repr(module)]
    parts += [f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in module.named_parameters()]
    parts += [f"{tuple(t.shape)}:{t.dtype}" for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def graph_fingerprint(graph: Any) -> str:
    """A digest of a captured :class:`~pipetrain.graph.types.LayerGraph`: every node's name,
    op, inputs, output shapes and parameter bytes."""
    parts = [f"{n.name}|{n.op}|{','.join(n.inputs)}|{[(t.shape, t.dtype) for t in n.outputs]}|{n.parameter_bytes}"
             for n in graph]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _canonical(value: Any) -> Any:
    """A JSON-comparable form of a key (tuples as lists, mappings with string keys)."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


class MeasurementCache:
    """Entries ``KIND/HASH.json`` under ``directory`` (module docstring).

    Args:
        directory: the cache directory (default :func:`cache_dir`, read when first used).
        enabled: False: every lookup misses and nothing is written (``--no-cache``).
    """

    def __init__(self, directory: str | Path | None = None, enabled: bool = True) -> None:
        self._directory = Path(directory) if directory is not None else None
        self.enabled = enabled
        self.hits = 0
        self.misses = 0
        #: entries read back that this object did not write: path -> when it was written
        #: (``YYYY-MM-DD HH:MM:SS``): what a result rests on from an earlier run
        self.reused: dict[Path, str] = {}
        self._written: set[Path] = set()
        self._warned = False

    @property
    def directory(self) -> Path:
        return self._directory if self._directory is not None else cache_dir()

    def key(self, kind: str, key: Mapping[str, Any], device: str = "cpu") -> dict[str, Any]:
        """The full key of an entry: the caller's, the kind and the machine."""
        return _canonical({"kind": kind, **dict(key), "machine": machine_identity(device)})

    def path(self, kind: str, full_key: Mapping[str, Any]) -> Path:
        digest = hashlib.sha256(json.dumps(full_key, sort_keys=True).encode()).hexdigest()[:32]
        return self.directory / kind / f"{digest}.json"

    def get(self, kind: str, key: Mapping[str, Any], device: str = "cpu") -> Any | None:
        """The value stored under ``key``, or None (a miss, disabled, or unreadable)."""
        _, entry = self._entry(kind, key, device)
        return None if entry is None else entry.get("value")

    def _entry(self, kind: str, key: Mapping[str, Any], device: str) -> tuple[Path | None, dict[str, Any] | None]:
        """The entry's file and the entry stored there under ``key`` (None: a miss, disabled,
        unreadable)."""
        if not self.enabled:
            return None, None
        full = self.key(kind, key, device)
        path = self.path(kind, full)
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):
            return path, None
        if not isinstance(entry, dict) or entry.get("key") != full:
            return path, None
        return path, entry

    def put(self, kind: str, key: Mapping[str, Any], value: Any, device: str = "cpu") -> Path | None:
        """Store ``value`` (JSON) under ``key``; the file, or None when disabled or not writable."""
        if not self.enabled:
            return None
        full = self.key(kind, key, device)
        path = self.path(kind, full)
        entry = {"key": full, "value": value, "written": time.strftime("%Y-%m-%d %H:%M:%S")}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump(entry, f)
            os.replace(tmp, path)
            self._written.add(path)
        except OSError as e:
            if not self._warned:
                self._warned = True
                log.warning("warning: cannot write the measurement cache %s (%s); measuring without it "
                            "(set %s to a writable directory, or pass --no-cache)",
                            self.directory, e.strerror or e, CACHE_ENV)
            return None
        return path

    def reuse_note(self) -> str:
        """One phrase on the entries read back from earlier runs ('' for none): a result
        resting on them rests on the host as it was when the oldest was measured."""
        if not self.reused:
            return ""
        n = len(self.reused)
        return (f"{n} measurement{'s' if n > 1 else ''} from the cache ({self.directory}), the oldest written "
                f"{min(self.reused.values())}; --no-cache measures again")

    def fetch(self, kind: str, key: Mapping[str, Any], make: Callable[[], T], dump: Callable[[T], Any],
              load: Callable[[Any], T], device: str = "cpu", measured: bool = True) -> tuple[T, bool]:
        """``(value, hit)``: the stored value under ``key``, else ``make()`` stored and returned.
        An entry ``load`` rejects counts as a miss. ``measured``: False for a value computed
        from measurements (a plan), which :meth:`reuse_note` does not count."""
        path, entry = self._entry(kind, key, device)
        stored = None if entry is None else entry.get("value")
        if stored is not None:
            try:
                value = load(stored)
            except Exception:  # noqa: BLE001 - a stale or damaged entry is measured again
                value = None
            if value is not None:
                self.hits += 1
                if measured and path is not None and entry is not None and path not in self._written:
                    self.reused[path] = str(entry.get("written", "at an unknown time"))
                return value, True
        self.misses += 1
        value = make()
        self.put(kind, key, dump(value), device)
        return value, False


def cached_profile(cache: MeasurementCache | None, key: Mapping[str, Any], make: Callable[[], Any],
                   device: str = "cpu") -> tuple[Any, bool]:
    """``(Profile, hit)``: the profile stored under ``key`` (kind ``profile``), else ``make()``'s."""
    from .io import profile_from_dict, profile_to_dict

    if cache is None:
        return make(), False
    return cache.fetch("profile", key, make, profile_to_dict, lambda d: profile_from_dict(d, "the cache"), device)
