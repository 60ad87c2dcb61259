"""Weight versions of one stage: stashing by reference, out-of-place updates.

design.md's rule: every F and B carries ``version`` = the number of optimizer steps of its
stage whose result it uses; B uses its F's version (weight stashing, PipeDream SOSP'19
section 3.3); STEP applies the group's mean gradient to the *newest* version ``k`` and
creates version ``k+1``:

    W_s^(k+1) = optimizer(W_s^(k), mean over group k of grad f(W^(v(u))))

Versions are dicts ``name -> tensor``. An update never writes into an existing version: it
creates new tensors (``new = old - update``), so the tensors of version ``v`` stay valid for
as long as anything references them, and no copy is ever made to stash them. A version is
dropped from this object once no later action of the worker's list uses it (liveness
computed from the schedule); its memory is then freed as soon as the autograd graphs of its
forwards are gone, or recycled as the output buffers of the next update (so a flushed
schedule alternates between two buffers instead of allocating every step).
"""
from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable, Mapping
from typing import Protocol, cast

import torch
from torch import Tensor

__all__ = ["WeightVersions", "version_last_use"]


class _Counted(Protocol):
    """``Tensor._use_count()``: the holders of the tensor's C++ TensorImpl (absent from torch's stubs)."""

    def _use_count(self) -> int: ...


def version_last_use(uses: Iterable[tuple[int, int]]) -> dict[int, int]:
    """``(position, version)`` pairs of a worker's compute actions -> version -> last position."""
    last: dict[int, int] = {}
    for pos, v in uses:
        if pos > last.get(v, -1):
            last[v] = pos
    return last


class WeightVersions:
    """The live weight versions of one stage on one worker.

    Args:
        initial: version 0's tensors (leaves; ``requires_grad`` for trainable ones).
        last_use: version -> position of the last action (in the worker's list) that uses
            it; versions not listed are kept only while they are the newest.
        recycle: reuse the tensors of dropped versions as the next update's outputs.
    """

    def __init__(self, initial: Mapping[str, Tensor], last_use: Mapping[int, int] | None = None,
                 recycle: bool = True) -> None:
        self._versions: dict[int, dict[str, Tensor]] = {0: dict(initial)}
        self._last_use = dict(last_use or {})
        self.newest = 0
        self.peak = 1  # most versions held at once
        self.recycle = recycle
        self._spare: dict[str, Tensor] | None = None
        self._refs: dict[int, weakref.ref] = {}
        self._restored = False  # versions put back by restore: the next rebase keeps their indices
        self._track(0)

    # -- access ------------------------------------------------------------------------
    def get(self, version: int) -> dict[str, Tensor]:
        """The tensors of ``version``; a version already dropped or not yet made is an error."""
        try:
            return self._versions[version]
        except KeyError:
            held = sorted(self._versions)
            raise RuntimeError(
                f"weight version {version} is not available (held: {held}, newest {self.newest}); the schedule "
                f"uses a version before its STEP or after its last planned use") from None

    @property
    def latest(self) -> dict[str, Tensor]:
        return self._versions[self.newest]

    @property
    def live(self) -> int:
        """Versions this object holds."""
        return len(self._versions)

    def held_tensors(self) -> list[Tensor]:
        """Every tensor this object holds: the live versions' and the spare kept for recycling."""
        held = [t for v in self._versions.values() for t in v.values()]
        return held + list((self._spare or {}).values())

    def alive(self) -> int:
        """Versions whose tensors still exist anywhere (held here or by a pending autograd graph)."""
        spare_ids = {id(t) for t in (self._spare or {}).values()}
        alive = {id(t) for t in (ref() for ref in self._refs.values()) if t is not None}
        return len(alive - spare_ids)

    # -- updates -----------------------------------------------------------------------
    def spare(self) -> dict[str, Tensor] | None:
        """Tensors of a dropped version that nothing else references, to write the next
        version into (or ``None``)."""
        spare, self._spare = self._spare, None
        if spare is None or not self.recycle:
            return None
        for t in spare.values():
            # 3 = the dict, the loop variable, getrefcount's argument; _use_count counts
            # C++ holders such as autograd graphs that saved the tensor.
            if cast(_Counted, t)._use_count() != 1 or sys.getrefcount(t) > 3:
                return None
        return spare

    def unused_after(self, position: int) -> bool:
        """Whether no action after ``position`` uses the newest version: an update may then
        overwrite it in place (its forwards' graphs are gone with their backwards)."""
        return self._last_use.get(self.newest, -1) <= position

    def push(self, tensors: Mapping[str, Tensor], replace: bool = False) -> int:
        """Add the next version (made from the newest by an optimizer step); returns its index.

        ``replace``: the update was made in place, so the newest version is dropped (it is
        the same memory) and only one version is held.
        """
        if replace:
            self._versions.pop(self.newest, None)
        self.newest += 1
        self._versions[self.newest] = dict(tensors)
        self._track(self.newest)
        self.peak = max(self.peak, len(self._versions))
        return self.newest

    def release(self, position: int) -> None:
        """Drop every version other than the newest whose last use is at or before ``position``."""
        for v in list(self._versions):
            if v != self.newest and self._last_use.get(v, -1) <= position:
                dropped = self._versions.pop(v)
                if self.recycle:
                    keep = {id(t) for ver in self._versions.values() for t in ver.values()}
                    if all(id(t) not in keep for t in dropped.values()):
                        self._spare = dropped

    def rebase(self, last_use: Mapping[int, int] | None = None) -> None:
        """Start a new schedule segment: the newest version becomes version 0 (after
        :meth:`restore`: the restored versions keep their indices, once)."""
        if self._restored:
            self._restored = False
            self._last_use = dict(last_use or {})
            return
        latest = self.latest
        self._versions = {0: latest}
        self._refs = {}
        self.newest = 0
        self._last_use = dict(last_use or {})
        self._track(0)

    def _track(self, v: int) -> None:
        tensors = list(self._versions[v].values())
        if tensors:
            self._refs[v] = weakref.ref(tensors[0])

    @torch.no_grad()
    def restore(self, versions: Mapping[int, Mapping[str, Tensor]], newest: int) -> None:
        """Hold exactly ``versions`` (index -> tensors, the segment's own indices), ``newest``
        the newest: the state of a checkpoint cut inside a segment
        (:mod:`pipetrain.schedule.resume`), which the next :meth:`rebase` keeps."""
        like = self.latest
        self._versions = {v: {n: t.to(device=like[n].device, dtype=like[n].dtype).clone()
                              .requires_grad_(like[n].requires_grad) for n, t in ts.items()}
                          for v, ts in versions.items()}
        self.newest = newest
        self._refs = {}
        for v in self._versions:
            self._track(v)
        self.peak = max(self.peak, len(self._versions))
        self._spare = None
        self._restored = True

    @torch.no_grad()
    def load(self, tensors: Mapping[str, Tensor]) -> None:
        """Replace the newest version's values (checkpoint resume)."""
        cur = self.latest
        new = {}
        for name, t in cur.items():
            src = tensors.get(name)
            if src is None:
                new[name] = t
                continue
            if tuple(src.shape) != tuple(t.shape):
                from ...errors import RuntimeConfigError

                raise RuntimeConfigError(
                    f"checkpoint tensor {name!r} has shape {tuple(src.shape)} but the model's is {tuple(t.shape)}; "
                    f"resume with the same model and options")
            new[name] = src.to(device=t.device, dtype=t.dtype).clone().requires_grad_(t.requires_grad)
        self._versions[self.newest] = new
        self._track(self.newest)
