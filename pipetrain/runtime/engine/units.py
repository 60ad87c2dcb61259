"""The data of a run's units: synthetic minibatches from the model, or real data through :mod:`pipetrain.data`.

Real data (``--data digits`` etc.) is described by a :class:`~pipetrain.job.data.DataSpec` in the resolved run
(the description, never the tensors: workers reload the data themselves, deterministically
from the seed) and read by each rank through :func:`unit_source`: only the part its stage
needs (inputs on the first stage, targets on the last), only the units its own F actions
name (so the replicas of a stage read disjoint shards), reshuffled every epoch with the seed
(:class:`pipetrain.data.EpochSampler`).

Synthetic data: minibatch ``t`` is ``make_batch(B, Generator().manual_seed(seed + t))``.

A unit is a microbatch (``B / m`` samples: chunk ``j`` of minibatch ``t`` for global unit
``u = t*m + j``) or, for pipedream (``m = 1``), the whole minibatch. The first stage reads a
unit's inputs and the last stage its target; both regenerate the same minibatch from the
seed, so no data travels between them. Every process, the reference emulation and
single-process training draw exactly the same samples.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ...job.data import DataSpec
from ...schedule.action import Op, Schedule

__all__ = ["DataSpec", "NoData", "UnitData", "split_batch", "stage_part", "unit_source", "units_of"]

Batch = tuple[tuple[Tensor, ...], Tensor]


def split_batch(batch: Batch, parts: int) -> list[Batch]:
    """``parts`` equal chunks of a minibatch along dimension 0 (views, no copy)."""
    inputs, target = batch
    ins = [x.chunk(parts, dim=0) if isinstance(x, Tensor) and x.dim() > 0 else [x] * parts for x in inputs]
    tgt = target.chunk(parts, dim=0) if isinstance(target, Tensor) and target.dim() > 0 else [target] * parts
    return [(tuple(i[j] for i in ins), tgt[j]) for j in range(parts)]


class UnitData:
    """The inputs and target of every unit of a run.

    Args:
        make_batch: the bundle's ``make_batch(batch_size, generator)``.
        batch_size: samples per minibatch.
        units_per_step: microbatches per minibatch (1 for pipedream).
        seed: base seed; minibatch ``t`` uses ``seed + t``.
        step_offset: minibatch index of unit 0 (resumed runs, timed segments after warm-up).
        device: where unit tensors go.
    """

    def __init__(self, make_batch: Callable[[int, torch.Generator], Batch], batch_size: int, units_per_step: int,
                 seed: int, step_offset: int = 0, device: torch.device | str = "cpu", cache: int = 3) -> None:
        self.make_batch = make_batch
        self.batch_size = batch_size
        self.m = units_per_step
        self.seed = seed
        self.step_offset = step_offset
        self.device = torch.device(device)
        self._cache: OrderedDict[int, list[Batch]] = OrderedDict()
        self._cache_size = cache

    def step_of(self, unit: int) -> int:
        """The minibatch (global step index) a unit belongs to."""
        return self.step_offset + unit // self.m

    def cached_batches(self) -> list[list[Batch]]:
        """The minibatches (as their units) this source holds now (the tensor ledger's data)."""
        return list(self._cache.values())

    def minibatch(self, step: int) -> Batch:
        """The whole minibatch ``step`` (on the CPU)."""
        return self.make_batch(self.batch_size, torch.Generator().manual_seed(self.seed + step))

    def prefetch(self, steps: int, limit_bytes: int = 256 << 20) -> int:
        """Make the first ``steps`` minibatches now (benchmarks: no data generation inside the
        timed window), as many as fit in ``limit_bytes``; returns how many were made."""
        made, used = 0, 0
        for t in range(self.step_offset, self.step_offset + steps):
            if t in self._cache:
                made += 1
                continue
            self._cache_size = max(self._cache_size, made + 1)
            chunks = self._load(t)
            used += sum(x.numel() * x.element_size() for c in chunks[:1] for x in (*c[0], c[1])
                        if isinstance(x, Tensor)) * self.m
            made += 1
            if used >= limit_bytes:
                break
        return made

    def _load(self, step: int) -> list[Batch]:
        batch = self.minibatch(step)
        if self.device.type != "cpu":
            batch = (tuple(_to(x, self.device) for x in batch[0]), _to(batch[1], self.device))
        chunks = split_batch(batch, self.m)
        self._cache[step] = chunks
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return chunks

    def unit(self, unit: int) -> Batch:
        """``(inputs, target)`` of a unit, on the run's device."""
        step = self.step_of(unit)
        chunks = self._cache.get(step)
        if chunks is None:
            chunks = self._load(step)
        return chunks[unit % self.m]


def _to(x: Any, device: torch.device) -> Any:
    return x.to(device, non_blocking=True) if isinstance(x, Tensor) else x


# --------------------------------------------------------------------------- real data


class NoData:
    """The data of a rank whose stages read none (middle stages): only ``step_of``."""

    def __init__(self, units_per_step: int, step_offset: int = 0) -> None:
        self.m = units_per_step
        self.step_offset = step_offset

    def step_of(self, unit: int) -> int:
        return self.step_offset + unit // self.m

    def prefetch(self, steps: int) -> int:
        return 0

    def cached_batches(self) -> list[Any]:
        return []

    def unit(self, unit: int) -> Any:
        raise RuntimeError(f"unit {unit}: this rank's stages read no data (neither first nor last stage)")


def stage_part(schedule: Schedule, stages: Sequence[int]) -> str | None:
    """What of a sample the given stages read: ``inputs`` (first stage), ``targets`` (last),
    ``both``, or ``None`` (middle stages only)."""
    first = 0 in stages
    last = schedule.num_stages - 1 in stages
    return "both" if first and last else "inputs" if first else "targets" if last else None


def units_of(actions: Sequence[Any], stages: Sequence[int]) -> list[int]:
    """The units of the F actions of ``stages`` in ``actions``, in order, each once."""
    want = set(stages)
    seen: dict[int, None] = {}
    for a in actions:
        if a.op is Op.F and a.stage in want:
            seen.setdefault(a.mb, None)
    return list(seen)


def unit_source(source: Any, spec: DataSpec, schedule: Schedule, rank: int, batch_size: int, microbatches: int,
                step_offset: int, device: torch.device) -> Any:
    """The :class:`~pipetrain.data.UnitLoader` of ``rank`` for one segment of real data.

    It loads only the part its stages need (:func:`stage_part`) of only the units its own
    first/last-stage F actions name (:func:`units_of`): the replicas of a stage read disjoint
    shards. Unit ``u`` of the segment is chunk ``u % m`` of minibatch ``step_offset + u // m``
    (:class:`~pipetrain.data.EpochSampler`, seeded with the run's seed). A rank that reads
    nothing gets :class:`NoData`.
    """
    from ...data import EpochSampler, UnitLoader, kept_workers

    mine = schedule.stages_of_rank(rank)
    ends = [k for k in mine if k in (0, schedule.num_stages - 1)]
    part = stage_part(schedule, mine)
    if part is None:
        return NoData(microbatches, step_offset)
    sampler = EpochSampler(source.num_train, batch_size, seed=spec.seed)
    units = units_of(schedule.workers[rank], ends)
    # background workers (--loader-workers): one set per rank for the whole run, kept with its source
    workers = kept_workers(source, source.train, sampler, microbatches, part, spec.loader_workers)  # type: ignore[arg-type]
    return UnitLoader(source.train, sampler, microbatches, units, part=part, step_offset=step_offset,  # type: ignore[arg-type]
                      device=device, workers=workers)
