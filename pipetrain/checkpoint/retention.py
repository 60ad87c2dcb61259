"""Which checkpoints of a directory count, which is the latest, and which to delete.

Under ``root`` a checkpoint is a directory ``step_XXXXXXXX``; ``step_XXXXXXXX.tmp`` is one
being written (or whose write was interrupted) and never counts. A ``step_XXXXXXXX`` whose
manifest is unreadable or whose files do not match it (truncated) is skipped with a warning,
so the latest *valid* one is the one resumed from.
"""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

from .manifest import CheckpointError, read_manifest, step_of_name

__all__ = ["complete_checkpoints", "latest_checkpoint", "require_latest", "prune"]

log = logging.getLogger(__name__)

TMP_SUFFIX = ".tmp"


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """``(step, dir)`` of every ``step_XXXXXXXX`` directory under ``root`` that has a
    ``manifest.json``, oldest first (no content check; see :func:`latest_checkpoint`)."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for d in root.iterdir():
        step = step_of_name(d.name)
        if step is not None and d.is_dir() and (d / "manifest.json").exists():
            out.append((step, d))
    return sorted(out)


def _survey(root: Path) -> tuple[Path | None, list[str]]:
    """The newest valid checkpoint, and why each newer candidate was skipped."""
    skipped: list[str] = []
    for _, d in reversed(complete_checkpoints(root)):
        try:
            read_manifest(d)
        except CheckpointError as e:
            log.warning("skipping checkpoint: %s", e)
            skipped.append(str(e))
            continue
        return d, skipped
    return None, skipped


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete and valid checkpoint under ``root``, or ``None`` if there is none
    (no directory, empty, only ``.tmp`` ones, or only damaged ones: each logged)."""
    return _survey(Path(root))[0]


def require_latest(root: str | Path) -> Path:
    """Like :func:`latest_checkpoint`, but nothing to resume is a one-line :class:`CheckpointError`."""
    root = Path(root)
    found, skipped = _survey(root)
    if found is not None:
        return found
    if not root.is_dir():
        raise CheckpointError(f"checkpoint dir {str(root)!r} does not exist: nothing to resume; start without "
                              f"resuming, or pass the directory a run saved into")
    tmp = sorted(d.name for d in root.iterdir() if d.name.endswith(TMP_SUFFIX))
    if skipped:
        raise CheckpointError(f"checkpoint dir {str(root)!r} holds no valid checkpoint: nothing to resume "
                              f"({len(skipped)} damaged, newest: {skipped[0]})")
    what = f"only {len(tmp)} incomplete ({', '.join(tmp)})" if tmp else "it is empty"
    raise CheckpointError(f"checkpoint dir {str(root)!r} holds no complete checkpoint ({what}): nothing to resume; "
                          f"start without resuming")


def prune(root: str | Path, keep: int, newest_step: int) -> list[Path]:
    """Delete all but the ``keep`` newest complete checkpoints, and ``.tmp`` directories of
    steps below ``newest_step`` (interrupted writes). Rank 0 only, after ``newest_step``'s
    checkpoint is complete. Returns what was deleted."""
    if keep < 1:
        raise CheckpointError(f"keep={keep} would delete the checkpoint just written; pass keep >= 1 (or None to "
                              f"keep all)")
    root = Path(root)
    gone: list[Path] = []
    for _, d in complete_checkpoints(root)[:-keep]:
        shutil.rmtree(d, ignore_errors=True)
        gone.append(d)
    for d in root.iterdir():
        if d.name.endswith(TMP_SUFFIX):
            step = step_of_name(d.name[: -len(TMP_SUFFIX)].removesuffix(".old"))  # .old: a replaced one
            if step is not None and step < newest_step:
                shutil.rmtree(d, ignore_errors=True)
                gone.append(d)
    return gone
