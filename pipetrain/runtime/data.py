"""Deterministic data per unit: minibatch ``t`` is ``make_batch(B, Generator().manual_seed(seed + t))``.

A unit is a microbatch (``B / m`` samples: chunk ``j`` of minibatch ``t`` for global unit
``u = t*m + j``) or, for pipedream (``m = 1``), the whole minibatch. The first stage reads a
unit's inputs and the last stage its target; both regenerate the same minibatch from the
seed, so no data travels between them. Every process, the reference emulation and
single-process training draw exactly the same samples.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import torch
from torch import Tensor

__all__ = ["UnitData", "split_batch"]

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
