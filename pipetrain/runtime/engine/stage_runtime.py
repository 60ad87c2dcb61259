"""One stage as a worker holds it: module, weight versions, optimizer, gradient accumulation.

The stage module keeps only shapes (meta tensors); its weights live in
:class:`~pipetrain.runtime.engine.versions.WeightVersions`, bound per call by
``torch.func.functional_call``. Weight gradients of one group (the units a STEP averages)
accumulate into:

- fresh autograd tensors, added in place (one replica, unfused);
- :class:`~pipetrain.runtime.engine.fused.GradSink` buffers, written by the backward of fused
  ``Linear`` layers (``--fused-grads``);
- flat all-reduce buffers, one per dtype, for a replicated stage (the last element of each
  carries the group's unit count, so STEP divides by the total over the replicas).

A replicated stage's all-reduce overlaps the group's last backward, in buckets as DDP's
(``bucket_cap_mb``, the first bucket 1 MiB): the flat buffer holds first the parameters
only fused layers write (:func:`~pipetrain.runtime.engine.fused.exclusive_writes`), in the
order the backward finishes them, cut into buckets, then every other parameter and the
count. During the last backward of the group each bucket starts its all-reduce as soon as
the sink has had every write of its parameters; ALLREDUCE starts the rest. A sum is the same
whichever piece of the buffer carries it, so the numbers do not change.

STEP takes the group's mean (design.md's gradient accounting), optionally clips it, and the
optimizer makes the next version from the newest (:meth:`StageRuntime.apply`), or the group
is dropped and the version advances unchanged (:meth:`StageRuntime.drop_group`).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ...graph.held import on_meta
from ...job.config import LRSchedule
from ...stages.partition import StageModule
from .comm import Comm
from .fused import GradSink, exclusive_writes, install
from .optim import FunctionalOptimizer, clip_coefficient, sum_of_squares
from .precision import autocast
from .versions import WeightVersions

if TYPE_CHECKING:
    from ...job.resolved import ResolvedRun

__all__ = ["FIRST_BUCKET_BYTES", "StageRuntime", "stage_runtimes"]

#: The first all-reduce bucket's cap, as DDP's (``dist._DEFAULT_FIRST_BUCKET_BYTES``): the
#: backward's first finished parameters start their all-reduce early.
FIRST_BUCKET_BYTES = 1 << 20


class StageRuntime:
    """Everything a worker keeps for one of its stages: module, versions, optimizer, gradients."""

    def __init__(self, stage: StageModule, optimizer: FunctionalOptimizer, replicas: int,
                 device: torch.device, fuse_linear: bool = False, recompute: bool = False,
                 precision: str = "fp32", bucket_bytes: int = 0) -> None:
        self.stage = stage
        self.device = device
        self.precision = precision  # the forward's compute precision (precision.py); weights stay fp32
        self.index = stage.index
        self.replicas = replicas
        # activation recomputation: every unit keeps only its input and recomputes its forward
        # in its backward (recompute.py)
        self.recompute = recompute
        self.optimizer = optimizer
        mod = stage.module.to(device)
        named = dict(mod.named_parameters())
        initial = {n: named[n].detach().requires_grad_(named[n].requires_grad) for n in stage.param_names}
        self.trainable = [n for n in stage.param_names if named[n].requires_grad]
        # The module keeps only shapes (meta tensors): the weights live in the versions, so a
        # dropped version's memory is really freed. functional_call binds a version per call.
        # Every name of a tensor (a tie inside the stage: emb.weight and head.weight) gets the
        # same meta parameter, so functional_call binds the version's tensor to all of them.
        metas: dict[int, torch.nn.Parameter] = {}
        for n, p in list(mod.named_parameters(remove_duplicate=False)):
            meta = metas.get(id(p))
            if meta is None:
                meta = metas[id(p)] = on_meta(p)
            owner, _, leaf = n.rpartition(".")
            sub = mod.get_submodule(owner) if owner else mod
            setattr(sub, leaf, meta)
        self.versions = WeightVersions(initial)
        # The stage's buffers (running statistics it updates, constants): a wire sharing their
        # memory is copied before it is sent (own_wires).
        self._buffer_storage = {b.untyped_storage().data_ptr() for b in mod.buffers()} - {0}
        self.lr_total = 1  # horizon of the LR schedule, in this stage's steps
        self._acc: dict[str, Tensor] = {}
        self.acc_count = 0
        # Replicated stages accumulate straight into flat all-reduce buffers (one per dtype;
        # the last element of each carries the unit count).
        self.flats: dict[torch.dtype, Tensor] = {}
        self.views: dict[str, Tensor] = {}
        # Linear layers write their weight gradients straight into the accumulators
        # (fused.py); the sink's "touched" set is the group's, shared with the flat views.
        self.sink = GradSink()
        self._touched: set[str] = self.sink.touched
        self.fused: set[str] = set(install(mod, set(self.trainable), self.sink)) if fuse_linear else set()
        self.pending: list[Any] = []
        # buckets of the flat buffers (module docstring): (dtype, start, end) and their names
        self._buckets: list[tuple[torch.dtype, int, int]] = []
        self._bucket_names: list[list[str]] = []
        self._bucket_of: dict[str, int] = {}
        self._tails: dict[torch.dtype, int] = {}
        self._writes: dict[str, int] = {}
        self._waiting: list[int] = []
        self._launched: set[int] = set()
        self._comm: Comm | None = None
        if replicas > 1:
            written = exclusive_writes(mod, self.fused) if bucket_bytes > 0 and self.fused else {}
            self._writes = {n: c for n, (c, _) in written.items()}
            by_dtype: dict[torch.dtype, list[str]] = {}
            for n in self.trainable:
                by_dtype.setdefault(initial[n].dtype, []).append(n)
            for dt, names in by_dtype.items():
                early = sorted((n for n in names if n in written), key=lambda n: -written[n][1])
                names = early + [n for n in names if n not in written]
                total = sum(initial[n].numel() for n in names)
                flat = torch.zeros(total + 1, dtype=dt, device=device)
                off = 0
                for n in names:
                    k = initial[n].numel()
                    self.views[n] = flat[off:off + k].view_as(initial[n])
                    if n in written:
                        self._bucket(dt, n, off, off + k, flat.element_size(), bucket_bytes)
                    off += k
                self._tails[dt] = sum(initial[n].numel() for n in early)
                self.flats[dt] = flat
        for n in self.fused:
            self.sink.buffers[n] = self.views[n] if self.views else torch.zeros_like(initial[n])

    def compute_scope(self) -> AbstractContextManager[object]:
        """The context every forward of this stage (and its recompute) runs in: autocast for bf16."""
        return autocast(self.precision, self.device)

    # -- gradient accumulation ------------------------------------------------------------
    def accumulate(self, grads: Sequence[Tensor | None]) -> None:
        """Add one unit's weight gradients (aligned with :attr:`trainable`) to the group."""
        self.acc_count += 1
        fused = self.fused
        for n, g in zip(self.trainable, grads):
            if g is None:
                continue
            if n in fused:  # the backward already added the Linear's part; add any other part
                self.sink.add(n, g)
            elif self.views:
                v = self.views[n]
                if n in self._touched:
                    v.add_(g)
                else:
                    v.copy_(g)
                    self._touched.add(n)
            else:
                cur = self._acc.get(n)
                if cur is None:
                    self._acc[n] = g  # fresh tensor from autograd: owned, no copy
                else:
                    cur.add_(g)

    def _bucket(self, dt: torch.dtype, name: str, start: int, end: int, size: int, cap: int) -> None:
        """Put ``name`` (elements ``start:end`` of the ``dt`` flat buffer) in the current bucket,
        or open a new one when the current is full (DDP's caps: at most 1 MiB first, then ``cap``)."""
        last = self._buckets[-1] if self._buckets else None
        limit = min(FIRST_BUCKET_BYTES, cap) if len(self._buckets) == 1 else cap
        if last is None or last[0] != dt or (last[2] - last[1]) * size >= limit:
            self._buckets.append((dt, start, end))
            self._bucket_names.append([name])
        else:
            self._buckets[-1] = (dt, last[1], end)
            self._bucket_names[-1].append(name)
        self._bucket_of[name] = len(self._buckets) - 1

    def arm_last_backward(self, comm: Comm) -> None:
        """The backward about to run is the group's last: start each bucket's all-reduce as its
        parameters' last writes land (module docstring)."""
        if not self._buckets:
            return
        self._comm = comm
        self._waiting = [len(ns) for ns in self._bucket_names]
        self.sink.arm(self._writes, self._written)

    def _written(self, name: str) -> None:
        b = self._bucket_of.get(name)
        if b is None:
            return
        self._waiting[b] -= 1
        if self._waiting[b] == 0:
            self._launch(b)

    def _launch(self, b: int) -> None:
        assert self._comm is not None
        dt, start, end = self._buckets[b]
        work = self._comm.allreduce_launch(self.index, self.flats[dt][start:end])
        if work is not None:
            self.pending.append(work)
        self._launched.add(b)

    def start_allreduce(self, comm: Comm) -> None:
        self.sink.disarm()
        for n, v in self.views.items():
            if n not in self._touched:
                v.zero_()
        self._comm = comm
        for dt, flat in self.flats.items():  # what no bucket holds (all of it without buckets)
            flat[-1] = float(self.acc_count)
            comm.allreduce_count(self.index, flat)
            work = comm.allreduce_launch(self.index, flat[self._tails[dt]:])
            if work is not None:
                self.pending.append(work)
        for b in range(len(self._buckets)):
            if b not in self._launched:
                self._launch(b)
        self._launched = set()

    def mean_gradients(self) -> dict[str, Tensor | None]:
        """Finish the group: wait for the all-reduce, divide by the group's unit count."""
        for w in self.pending:
            w.wait()
        self.pending = []
        if self.views:
            count = float(next(iter(self.flats.values()))[-1].item()) if self.flats else float(self.acc_count)
            if count <= 0:
                raise RuntimeError(f"stage {self.index}: STEP with no accumulated units")
            for flat in self.flats.values():
                if count != 1:
                    flat[:-1].div_(count)
            grads: dict[str, Tensor | None] = {n: self.views.get(n) for n in self.trainable}
        else:
            count = float(self.acc_count)
            if count <= 0:
                raise RuntimeError(f"stage {self.index}: STEP with no accumulated units")
            grads = {n: ((self.sink.buffers[n] if n in self._touched else None) if n in self.fused
                         else self._acc.get(n)) for n in self.trainable}
            if count != 1:
                for g in grads.values():
                    if g is not None:
                        g.div_(count)
        return grads

    def apply(self, grads: dict[str, Tensor | None], base_lr: float, schedule: LRSchedule,
              clip: float | None = None, coef: float | None = None, position: int | None = None) -> None:
        """Optimizer step on the newest version -> a new version; resets the group."""
        if coef is None and clip is not None:  # per-stage clipping (asynchronous schedules)
            coef = clip_coefficient(math.sqrt(sum_of_squares(grads.values())), clip)
        if coef is not None and coef < 1.0:
            for g in grads.values():
                if g is not None:
                    g.mul_(coef)
        lr = schedule.lr(base_lr, self.optimizer.steps, self.lr_total)
        # In place when no later action of this segment uses the newest version (flushed
        # schedules, the last stage of 1F1B): torch.optim's update, one version held. Else
        # out of place (weight stashing), into the tensors of a dropped version if any.
        in_place = position is not None and self.versions.unused_after(position)
        out = self.versions.latest if in_place else self.versions.spare()
        new = self.optimizer.apply(self.versions.latest, grads, lr, out=out)
        self.versions.push(new, replace=in_place)
        self._end_group()

    def drop_group(self, position: int | None) -> None:
        """End the gradient group without applying it (``--skip-nonfinite``): the weights and
        optimizer state stay; the version advances with the same tensors (STEP k makes
        version k+1, as the schedule's actions expect)."""
        self._end_group()
        in_place = position is not None and self.versions.unused_after(position)
        self.versions.push(dict(self.versions.latest), replace=in_place)

    def _end_group(self) -> None:
        self._acc = {}
        self._touched.clear()
        self.acc_count = 0
        self.sink.disarm()
        self._launched = set()

    def own_wires(self, wires: list[Tensor]) -> list[Tensor]:
        """``wires`` with every tensor that shares memory with one of the stage's buffers
        copied: a send completes asynchronously, and the stage's next forward may update the
        buffer (a running statistic written in place) before it does."""
        if not self._buffer_storage:
            return wires
        held = self._buffer_storage
        return [w.clone() if w.untyped_storage().data_ptr() in held else w for w in wires]

    # -- what the stage holds ---------------------------------------------------------------
    def gradient_buffers(self) -> list[Tensor]:
        """Every tensor gradients accumulate in: the unfused accumulators, the flat all-reduce
        buffers and the fused layers' sink buffers."""
        return list(self._acc.values()) + list(self.flats.values()) + list(self.sink.buffers.values())


def stage_runtimes(run: ResolvedRun, modules: Mapping[int, StageModule], device: torch.device,
                   bucket_bytes: int) -> dict[int, StageRuntime]:
    """The runtimes of a rank's stage ``modules`` as ``run`` trains them: its optimizer, each
    stage's replica count, fused ``Linear`` gradients (split backwards too: the sink's phase
    tells a layer which half runs, split_backward.py), recomputation and precision;
    ``bucket_bytes``: the all-reduce buckets of replicated stages (0: one after the backward)."""
    cfg = run.config
    return {k: StageRuntime(m, FunctionalOptimizer(cfg.optimizer), len(run.schedule.stage_ranks[k]), device,
                            fuse_linear=cfg.performance.fused_grads, recompute=k in run.recompute_stages,
                            precision=cfg.training.precision, bucket_bytes=bucket_bytes)
            for k, m in modules.items()}
