"""Which checkpoints of a directory count, which is the latest, and which to delete.

Under ``root`` a checkpoint is a directory ``step_XXXXXXXX``; ``step_XXXXXXXX.tmp`` is one
being written (or whose write was interrupted) and never counts. A ``step_XXXXXXXX`` whose
manifest is unreadable or whose files do not match it (truncated) is *damaged*: skipped, so
the latest *valid* one is the one resumed from (:func:`latest_checkpoint`, quiet).

What a run resumes from is decided once, by the launcher, with :func:`resume_point`: a damaged
latest checkpoint with a valid older one is reported in one warning and the older one is
used; a damaged latest one with no valid older one stops the run (resuming nothing would
silently start over). After an interrupted run, :func:`remove_partial` deletes the
directories a write left half done; ``--restart`` moves a directory's checkpoints aside
(:func:`set_aside`) so that the new run's own are the only ones there.
"""
from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from .manifest import MANIFEST_NAME, CheckpointError, read_manifest, step_of_name

__all__ = ["complete_checkpoints", "latest_checkpoint", "require_latest", "prune", "Survey", "survey",
           "resume_point", "remove_partial", "set_aside"]

log = logging.getLogger(__name__)

TMP_SUFFIX = ".tmp"
#: ``step_XXXXXXXX.old.tmp``: the complete checkpoint a new write of the same step replaces
#: (renamed away, then deleted once the new one is in place; store._finish).
OLD_SUFFIX = ".old" + TMP_SUFFIX
#: The folder ``--restart`` moves a directory's checkpoints into (formatted with the time).
SET_ASIDE = "set-aside-{}"


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


@dataclass
class Survey:
    """A directory's newest valid checkpoint (``None``: none) and the damaged ones newer than
    it, newest first, each with why (the one-line :class:`CheckpointError` text)."""

    latest: Path | None = None
    damaged: list[tuple[Path, str]] = field(default_factory=list)


def survey(root: str | Path) -> Survey:
    """The newest valid checkpoint under ``root`` and the damaged ones skipped to reach it."""
    out = Survey()
    for _, d in reversed(complete_checkpoints(root)):
        try:
            read_manifest(d)
        except CheckpointError as e:
            out.damaged.append((d, str(e)))
            continue
        out.latest = d
        break
    return out


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete and valid checkpoint under ``root``, or ``None`` if there is none
    (no directory, empty, only ``.tmp`` ones, or only damaged ones)."""
    return survey(root).latest


def resume_point(root: str | Path) -> Path | None:
    """The checkpoint a run with ``--checkpoint-dir root`` resumes from (``None``: start at step 0).

    A damaged newest checkpoint with a valid older one: one warning, and the older one.
    A damaged newest one and no valid older one: :class:`CheckpointError`, since starting
    over would throw the damaged run's progress away without asking.
    """
    found = survey(root)
    if not found.damaged:
        return found.latest
    newest, why = found.damaged[0]
    why = why.split("; ")[0]  # what is wrong with it, without its own advice
    if found.latest is None:
        raise CheckpointError(f"the latest checkpoint in {str(root)!r} is damaged and no older one is complete, so "
                              f"there is nothing to resume ({why}); pass --checkpoint-dir elsewhere or --restart to "
                              f"start over")
    more = f" (and {len(found.damaged) - 1} more damaged)" if len(found.damaged) > 1 else ""
    log.warning("the latest checkpoint %s is damaged%s: resuming from the older %s (%s)", newest, more,
                found.latest, why)
    return found.latest


def remove_partial(root: str | Path) -> list[Path]:
    """Delete the checkpoint directories under ``root`` that a write left half done (``.tmp``),
    once no process writes there any more (after an interrupted run). A replaced checkpoint
    (``step_X.old.tmp``) whose ``step_X`` is gone is complete: it is put back instead.
    Returns what was deleted."""
    root = Path(root)
    if not root.is_dir():
        return []
    gone: list[Path] = []
    for d in sorted(root.iterdir()):
        if not d.name.endswith(TMP_SUFFIX) or not d.is_dir():
            continue
        if d.name.endswith(OLD_SUFFIX):
            final = root / d.name[: -len(OLD_SUFFIX)]
            if not final.exists() and (d / MANIFEST_NAME).exists():
                d.rename(final)
                continue
        shutil.rmtree(d, ignore_errors=True)
        gone.append(d)
    return gone


def set_aside(root: str | Path) -> Path | None:
    """Move every checkpoint directory under ``root`` (complete, damaged or partial) into
    ``root/set-aside-TIME/`` (``--restart``): kept, but no longer resumed from, kept or pruned
    by a run there. Returns that folder, or ``None`` when there was nothing to move."""
    root = Path(root)
    if not root.is_dir():
        return None
    moving = [d for d in sorted(root.iterdir()) if d.is_dir() and step_of_name(d.name.split(".")[0]) is not None]
    if not moving:
        return None
    target = root / SET_ASIDE.format(time.strftime("%Y%m%d-%H%M%S"))
    n = 0
    while target.exists():
        n += 1
        target = root / (SET_ASIDE.format(time.strftime("%Y%m%d-%H%M%S")) + f"-{n}")
    target.mkdir()
    for d in moving:
        d.rename(target / d.name)
    return target


def require_latest(root: str | Path) -> Path:
    """Like :func:`latest_checkpoint`, but nothing to resume is a one-line :class:`CheckpointError`."""
    root = Path(root)
    found = survey(root)
    if found.latest is not None:
        return found.latest
    skipped = [why for _, why in found.damaged]
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
