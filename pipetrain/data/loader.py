"""Units of a pipeline run for one rank: only the part its stage needs, prefetched in order.

:class:`UnitLoader` is what a rank reads its data from. It is built with the units that rank
will process, in the order it processes them (the unit ids of its F actions: unit ``u`` of a
stage with ``r`` replicas goes to replica ``u mod r``), and the part of a sample its stage
needs (``"inputs"`` on the first stage, ``"targets"`` on the last, ``"both"`` for a stage that is
both). Each unit's samples come from :class:`~pipetrain.data.sampler.EpochSampler`, so they
are a pure function of ``(seed, unit)``: results do not depend on ``num_workers``, on the
order of calls, or on which rank asks.

With ``num_workers > 0`` a ``torch.utils.data.DataLoader`` gathers the units in background
processes, ``prefetch_factor`` units ahead per worker, and yields them in the given order.
``unit(u)`` pulls from that stream until ``u`` arrives (keeping the units passed on the way
in a small cache) and loads a unit that is not ahead in the stream (evicted, or not in the
list) directly, so every call is answered correctly whatever the order.

The interface is the runtime's ``UnitData``: ``unit(u) -> (inputs, target)``, ``step_of(u)``,
``prefetch(steps)``; a part that was not asked for is ``()`` (inputs) or ``None`` (target).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from ..errors import DataError
from .sampler import EpochSampler
from .source import Batch, Part, as_item, stack_items

__all__ = ["UnitLoader", "gather", "suggested_workers"]

PARTS: tuple[str, ...] = ("inputs", "targets", "both")


def gather(dataset: Dataset, indices: Tensor, part: Part = "both") -> Batch:  # type: ignore[type-arg]
    """The batch of samples ``indices`` of ``dataset``, only ``part``: one indexing operation for
    built-in datasets (``take``), else the items stacked along a new dimension 0."""
    take = getattr(dataset, "take", None)
    if callable(take):
        return take(indices, part)  # type: ignore[no-any-return]
    items = [as_item(dataset[int(i)], f"item {int(i)} of the dataset") for i in indices]
    return stack_items(items, part)


def suggested_workers(dataset: Dataset) -> int:  # type: ignore[type-arg]
    """Background workers worth starting for ``dataset``: 0 for in-memory datasets with ``take``
    (one indexing operation per unit is faster than a hand-off between processes), else 2
    (user datasets whose ``__getitem__`` may read files or decode)."""
    return 0 if callable(getattr(dataset, "take", None)) else 2


class _Units(Dataset):  # type: ignore[type-arg]
    """Item ``i`` = ``(units[i], batch of unit units[i])``: what the DataLoader's workers make."""

    def __init__(self, dataset: Dataset, sampler: EpochSampler, microbatches: int,  # type: ignore[type-arg]
                 units: Sequence[int], part: Part, step_offset: int) -> None:
        self.dataset, self.sampler, self.m = dataset, sampler, microbatches
        self.units, self.part, self.step_offset = units, part, step_offset

    def __len__(self) -> int:
        return len(self.units)

    def load(self, unit: int) -> Batch:
        idx = self.sampler.indices_of_unit(unit, self.m, self.step_offset)
        return gather(self.dataset, idx, self.part)

    def __getitem__(self, i: int) -> tuple[int, Batch]:
        u = int(self.units[i])
        return u, self.load(u)


def _identity(x: Any) -> Any:
    return x


class UnitLoader:
    """The ``(inputs, target)`` of every unit a rank processes, from a real data set.

    Args:
        dataset: the train split.
        sampler: minibatch and unit indices (``batch_size`` = the run's minibatch).
        microbatches: units per minibatch ``m`` (1 for pipedream).
        units: the units this rank will ask for, in order (e.g. ``range(i, total, r)`` for
            replica ``i`` of ``r``).
        part: ``"inputs"`` (first stage), ``"targets"`` (last stage) or ``"both"``.
        step_offset: minibatch of unit 0 (resumed runs, timed segments after a warm-up).
        num_workers: background processes gathering units (0: in the calling process;
            :func:`suggested_workers` picks a value).
        device: where unit tensors go.
        cache: units kept after they are returned (a unit read twice, e.g. inputs then
            target on a rank that is both first and last stage, is gathered once).
        prefetch_factor: units each worker prepares ahead.

    Example:
        >>> from pipetrain.data import load_data, EpochSampler
        >>> src = load_data("digits")
        >>> sampler = EpochSampler(src.num_train, 32)
        >>> loader = UnitLoader(src.train, sampler, 4, range(0, 400, 2), "inputs")
        >>> inputs, target = loader.unit(2)
        >>> inputs[0].shape, target
        (torch.Size([8, 64]), None)
    """

    def __init__(self, dataset: Dataset, sampler: EpochSampler, microbatches: int,  # type: ignore[type-arg]
                 units: Sequence[int], part: Part = "both", step_offset: int = 0, num_workers: int = 0,
                 device: torch.device | str = "cpu", cache: int = 64, prefetch_factor: int = 2) -> None:
        if part not in PARTS:
            raise DataError(f"part must be one of {', '.join(PARTS)}, got {part!r}")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise DataError(f"num_workers must be an integer >= 0, got {num_workers!r}")
        if microbatches < 1 or sampler.batch_size % microbatches:
            raise DataError(f"batch size {sampler.batch_size} is not divisible by microbatches {microbatches}; "
                            f"every microbatch must have the same number of samples")
        self.sampler = sampler
        self.m = microbatches
        self.part: Part = part
        self.step_offset = step_offset
        self.device = torch.device(device)
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self._units = _Units(dataset, sampler, microbatches, units, part, step_offset)
        self._ahead = set(int(u) for u in units)    # units still to come from the stream
        self._stream: Iterator[tuple[int, Batch]] | None = None
        self._cache: OrderedDict[int, Batch] = OrderedDict()
        self._cache_size = max(int(cache), 1)

    @property
    def batch_size(self) -> int:
        """Samples per minibatch."""
        return self.sampler.batch_size

    def cached_batches(self) -> list[Batch]:
        """The units' batches this loader holds now (what the tensor ledger counts as data)."""
        return list(self._cache.values())

    def step_of(self, unit: int) -> int:
        """The minibatch (global step) a unit belongs to."""
        return self.step_offset + unit // self.m

    def epoch_of(self, unit: int) -> int:
        """The epoch a unit belongs to."""
        return self.sampler.epoch_of(self.step_of(unit))

    def indices(self, unit: int) -> Tensor:
        """The train-split sample indices of ``unit``."""
        return self.sampler.indices_of_unit(unit, self.m, self.step_offset)

    def _open(self) -> Iterator[tuple[int, Batch]]:
        if self._stream is None:
            if self.num_workers == 0:
                self._stream = (self._units[i] for i in range(len(self._units)))
            else:
                loader = DataLoader(self._units, batch_size=None, shuffle=False, num_workers=self.num_workers,
                                    prefetch_factor=self.prefetch_factor, collate_fn=_identity,
                                    persistent_workers=False)
                self._stream = iter(loader)
        return self._stream

    def _keep(self, unit: int, batch: Batch) -> None:
        self._cache[unit] = batch
        self._cache.move_to_end(unit)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

    def _to_device(self, batch: Batch) -> Batch:
        if self.device.type == "cpu":
            return batch
        inputs, target = batch
        return (tuple(x.to(self.device, non_blocking=True) for x in inputs),
                None if target is None else target.to(self.device, non_blocking=True))

    def _pull(self) -> tuple[int, Batch] | None:
        try:
            u, batch = next(self._open())
        except StopIteration:
            self._ahead.clear()
            return None
        self._ahead.discard(u)
        batch = self._to_device(batch)
        self._keep(u, batch)
        return u, batch

    def unit(self, unit: int) -> Batch:
        """``(inputs, target)`` of ``unit`` on the loader's device; the part not loaded is
        ``()`` or ``None``."""
        hit = self._cache.get(unit)
        if hit is not None:
            return hit
        while unit in self._ahead:
            got = self._pull()
            if got is None:
                break
            if got[0] == unit:
                return got[1]
        batch = self._to_device(self._units.load(unit))
        self._keep(unit, batch)
        return batch

    def prefetch(self, steps: int, limit_bytes: int = 256 << 20) -> int:
        """Gather now the units of the first ``steps`` minibatches from ``step_offset`` (benchmarks:
        no data loading inside a timed window), up to ``limit_bytes``; returns the minibatches
        whose units this rank holds."""
        used, last = 0, self.step_offset - 1
        self._cache_size = max(self._cache_size, len(self._cache))
        while self._ahead:
            got = self._pull()
            if got is None:
                break
            u, (inputs, target) = got
            if self.step_of(u) >= self.step_offset + steps:
                break
            self._cache_size = max(self._cache_size, len(self._cache))
            last = self.step_of(u)
            used += sum(x.numel() * x.element_size() for x in (*inputs, *(() if target is None else (target,))))
            if used >= limit_bytes:
                break
        return max(last - self.step_offset + 1, 0)

    def close(self) -> None:
        """Stop the background workers (also done when the loader is garbage-collected)."""
        self._stream = None

    def __enter__(self) -> UnitLoader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
