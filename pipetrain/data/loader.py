"""Units of a pipeline run for one rank: only the part its stage needs, in order.

:class:`UnitLoader` is what a rank reads its data from. It is built with the units that rank
will process, in the order it processes them (the unit ids of its F actions: unit ``u`` of a
stage with ``r`` replicas goes to replica ``u mod r``), and the part of a sample its stage
needs (``"inputs"`` on the first stage, ``"targets"`` on the last, ``"both"`` for a stage that is
both). Each unit's samples come from :class:`~pipetrain.data.sampler.EpochSampler`, so they
are a pure function of ``(seed, unit)``: results do not depend on the background workers, on
the order of calls, or on which rank asks.

Where units are gathered:

- in the calling process (``num_workers=0``, the default for every data set whose items load
  fast: :func:`suggested_workers`);
- in background processes (:class:`UnitWorkers`: a ``torch.utils.data.DataLoader`` with
  ``persistent_workers=True``, ``prefetch_factor`` units ahead per worker). One set of
  workers serves every segment of a run (:func:`kept_workers`): they start once, not once
  per segment or epoch. ``unit(u)`` pulls from their stream until ``u`` arrives (keeping the
  units passed on the way in a small cache) and loads a unit that is not ahead in the stream
  (evicted, or not in the list) directly, so every call is answered correctly whatever the
  order.

Every second a loader blocks its caller (a ``unit(u)`` not yet in its cache, a
``prefetch``) is added to a :class:`WaitMeter`, by default the process's :data:`DATA_WAIT`
(what the progress line's ``data wait`` share is computed from:
:mod:`pipetrain.runtime.worker.monitor`).

The interface is the runtime's ``UnitData``: ``unit(u) -> (inputs, target)``, ``step_of(u)``,
``prefetch(steps)``; a part that was not asked for is ``()`` (inputs) or ``None`` (target).
"""
from __future__ import annotations

import statistics
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from ..errors import DataError
from .sampler import EpochSampler
from .source import Batch, Part, as_item, stack_items

__all__ = ["DATA_WAIT", "UnitLoader", "UnitWorkers", "WaitMeter", "gather", "kept_workers", "suggested_workers"]

PARTS: tuple[str, ...] = ("inputs", "targets", "both")

# suggested_workers: background workers pay off only for items that are slow to load (a file
# read, a decode), in runs that load enough of them to repay starting the workers.
SLOW_ITEM_S = 1e-3        # per item: more than handing a sample between processes costs
WORKER_START_S = 10.0     # per run: starting the workers (each a process that imports torch
#                           and the dataset's module again: a pipeline's ranks start them with spawn)
SUGGESTED_WORKERS = 2     # how many, when they pay off
PROBE_ITEMS = 8           # items timed to decide ...
PROBE_BUDGET_S = 0.5      # ... at most this long (at least one item)


def gather(dataset: Dataset, indices: Tensor, part: Part = "both") -> Batch:  # type: ignore[type-arg]
    """The batch of samples ``indices`` of ``dataset``, only ``part``: one indexing operation for
    built-in datasets (``take``), else the items stacked along a new dimension 0."""
    take = getattr(dataset, "take", None)
    if callable(take):
        return take(indices, part)  # type: ignore[no-any-return]
    items = [as_item(dataset[int(i)], f"item {int(i)} of the dataset") for i in indices]
    return stack_items(items, part)


def item_seconds(dataset: Dataset, probe: int = PROBE_ITEMS, budget_s: float = PROBE_BUDGET_S) -> float:  # type: ignore[type-arg]
    """The median seconds ``dataset[i]`` takes, over up to ``probe`` items spread over the
    dataset (fewer when they take over ``budget_s`` together; at least one)."""
    n = len(dataset)  # type: ignore[arg-type]
    count = min(probe, n)
    times: list[float] = []
    for k in range(count):
        t0 = time.perf_counter()
        try:
            dataset[k * n // count]
        except Exception:  # a broken item fails where it is loaded, with its index (gather)
            break
        times.append(time.perf_counter() - t0)
        if sum(times) > budget_s:
            break
    return statistics.median(times) if times else 0.0


def suggested_workers(dataset: Dataset, samples: int | None = None) -> int:  # type: ignore[type-arg]
    """Background workers worth starting for ``dataset`` in a run that reads ``samples`` items
    per loading rank (``None``: unknown, assumed many).

    0 (load in the calling process) for in-memory datasets with ``take`` and for datasets whose
    items load in under :data:`SLOW_ITEM_S` (a short timing of a few items,
    :func:`item_seconds`): handing such a unit between processes costs more than gathering it.
    Else :data:`SUGGESTED_WORKERS`, unless loading all ``samples`` here would take less than
    starting the workers (:data:`WORKER_START_S`).

    >>> from torch.utils.data import TensorDataset
    >>> suggested_workers(TensorDataset(torch.zeros(100, 3), torch.zeros(100)))
    0
    """
    if callable(getattr(dataset, "take", None)):
        return 0
    per_item = item_seconds(dataset)
    if per_item < SLOW_ITEM_S:
        return 0
    if samples is not None and samples * per_item < WORKER_START_S:
        return 0
    return SUGGESTED_WORKERS


class WaitMeter:
    """Seconds callers spent blocked on data loading, summed (:meth:`add`; read :attr:`seconds`)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def add(self, seconds: float) -> None:
        """Count ``seconds`` more of waiting."""
        self.seconds += seconds


DATA_WAIT = WaitMeter()
"""The process's meter: every :class:`UnitLoader` adds to it unless given another."""


def _identity(x: Any) -> Any:
    return x


class _KeyedUnits(Dataset):  # type: ignore[type-arg]
    """Item ``(u, offset)`` = ``(u, batch of unit u of a segment starting at minibatch offset)``:
    what the background workers make (the keys come from the calling process)."""

    def __init__(self, dataset: Dataset, sampler: EpochSampler, microbatches: int,  # type: ignore[type-arg]
                 part: Part) -> None:
        self.dataset, self.sampler, self.m, self.part = dataset, sampler, microbatches, part

    def load(self, unit: int, step_offset: int) -> Batch:
        return gather(self.dataset, self.sampler.indices_of_unit(unit, self.m, step_offset), self.part)

    def __getitem__(self, key: tuple[int, int]) -> tuple[int, Batch]:
        unit, step_offset = key
        return unit, self.load(unit, step_offset)


class _Keys:
    """The keys of the current stream, read by the DataLoader in the calling process."""

    def __init__(self) -> None:
        self.keys: list[tuple[int, int]] = []

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(list(self.keys))


def _sampler_key(sampler: EpochSampler) -> tuple[int, int, int, bool]:
    return sampler.num_samples, sampler.batch_size, sampler.seed, sampler.shuffle


class UnitWorkers:
    """Background processes that gather the units of one dataset, sampler, ``m`` and part,
    started on the first :meth:`stream` and kept until :meth:`close` (or garbage collection):
    ``persistent_workers=True``, so every segment and epoch of a run reuses them.

    One stream at a time: a new :meth:`stream` ends the previous one (a loader still reading
    the old one then loads its units itself).
    """

    def __init__(self, dataset: Dataset, sampler: EpochSampler, microbatches: int, part: Part,  # type: ignore[type-arg]
                 num_workers: int, prefetch_factor: int = 2) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise DataError(f"UnitWorkers needs num_workers >= 1, got {num_workers!r}; to gather in the calling "
                            f"process, give the UnitLoader no workers (num_workers=0)")
        self.num_workers = num_workers
        self._serves = (dataset, _sampler_key(sampler), microbatches, part)
        self._keys = _Keys()
        self._loader: DataLoader | None = DataLoader(  # type: ignore[type-arg]
            _KeyedUnits(dataset, sampler, microbatches, part), batch_size=None, sampler=self._keys,  # type: ignore[arg-type]
            num_workers=num_workers, prefetch_factor=prefetch_factor, collate_fn=_identity, persistent_workers=True)
        self._iter: Iterator[tuple[int, Batch]] | None = None
        self._generation = 0

    def serves(self, dataset: Dataset, sampler: EpochSampler, microbatches: int, part: Part,  # type: ignore[type-arg]
               num_workers: int | None = None) -> bool:
        """Whether these workers make the units of this dataset, sampler, ``m`` and part."""
        d, s, m, p = self._serves
        return (d is dataset and s == _sampler_key(sampler) and m == microbatches and p == part
                and num_workers in (None, self.num_workers))

    def stream(self, units: Sequence[int], step_offset: int) -> Iterator[tuple[int, Batch]]:
        """``(u, batch)`` for every unit of ``units`` (of a segment starting at minibatch
        ``step_offset``), in order; ends early when another stream starts or on :meth:`close`."""
        if self._loader is None:
            raise DataError("these background workers were closed; build a new UnitWorkers")
        self._generation += 1
        self._keys.keys = [(int(u), int(step_offset)) for u in units]
        self._iter = iter(self._loader)  # the same worker processes, from the second stream on
        return self._follow(self._generation)

    def _follow(self, generation: int) -> Iterator[tuple[int, Batch]]:
        while generation == self._generation and self._iter is not None:
            try:
                item = next(self._iter)
            except StopIteration:
                return
            yield item

    def close(self) -> None:
        """Stop the worker processes (a later stream raises)."""
        self._generation += 1
        self._iter = None
        self._loader = None  # the DataLoader's iterator shuts its workers down when it goes


# id(owner) -> (a weak reference to owner, its workers); the entry goes with the owner
_KEPT: dict[int, tuple[weakref.ref[Any], UnitWorkers]] = {}


def kept_workers(owner: Any, dataset: Dataset, sampler: EpochSampler, microbatches: int, part: Part,  # type: ignore[type-arg]
                 num_workers: int) -> UnitWorkers | None:
    """The background workers of ``owner`` (e.g. the run's :class:`~pipetrain.data.DataSource`,
    which outlives its segments' loaders; held weakly, by identity) for this dataset, sampler,
    ``m`` and part: started on the first call, the same ones on the next calls, stopped when
    ``owner`` is garbage-collected or asks for another configuration. ``None`` for
    ``num_workers == 0``."""
    if num_workers == 0:
        return None
    key = id(owner)
    kept = _KEPT.get(key)
    pool = kept[1] if kept is not None and kept[0]() is owner else None
    if pool is None or not pool.serves(dataset, sampler, microbatches, part, num_workers):
        if pool is not None:
            pool.close()
        pool = UnitWorkers(dataset, sampler, microbatches, part, num_workers)
        _KEPT[key] = (weakref.ref(owner, lambda ref: _forget(key, ref)), pool)
    return pool


def _forget(key: int, ref: weakref.ref[Any]) -> None:
    kept = _KEPT.get(key)
    if kept is not None and kept[0] is ref:  # not a newer owner that took the same id
        del _KEPT[key]


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
        num_workers: background processes of this loader's own (0: gather in the calling
            process; :func:`suggested_workers` picks a value); stopped by :meth:`close`.
        device: where unit tensors go.
        cache: units kept after they are returned (a unit read twice, e.g. inputs then
            target on a rank that is both first and last stage, is gathered once).
        prefetch_factor: units each worker prepares ahead.
        workers: background workers kept across loaders (:func:`kept_workers`), used instead
            of starting this loader's own; :meth:`close` leaves them running.
        meter: where the seconds this loader blocks its caller go (default :data:`DATA_WAIT`).

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
                 device: torch.device | str = "cpu", cache: int = 64, prefetch_factor: int = 2,
                 workers: UnitWorkers | None = None, meter: WaitMeter = DATA_WAIT) -> None:
        _check(sampler, microbatches, part, num_workers)
        if workers is not None and not workers.serves(dataset, sampler, microbatches, part,
                                                      num_workers or None):
            raise DataError(f"the background workers given serve another dataset, sampler, microbatch count, part "
                            f"or worker count than this loader's ({microbatches} microbatches, part {part!r}, "
                            f"num_workers {num_workers}); pass the workers kept_workers gives for these")
        self.sampler = sampler
        self.m = microbatches
        self.part: Part = part
        self.step_offset = step_offset
        self.device = torch.device(device)
        self.meter = meter
        self.waited = 0.0                     # seconds this loader blocked its caller
        self._own = workers is None and num_workers > 0
        self._workers = UnitWorkers(dataset, sampler, microbatches, part, num_workers, prefetch_factor) \
            if self._own else workers
        self.num_workers = self._workers.num_workers if self._workers is not None else 0
        self._keyed = _KeyedUnits(dataset, sampler, microbatches, part)
        self._units = [int(u) for u in units]
        self._ahead = set(self._units)        # units still to come from the stream
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
            if self._workers is None:
                self._stream = ((u, self._keyed.load(u, self.step_offset)) for u in self._units)
            else:
                self._stream = self._workers.stream(self._units, self.step_offset)
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

    def _waited(self, t0: float) -> None:
        dt = time.perf_counter() - t0
        self.waited += dt
        self.meter.add(dt)

    def unit(self, unit: int) -> Batch:
        """``(inputs, target)`` of ``unit`` on the loader's device; the part not loaded is
        ``()`` or ``None``."""
        hit = self._cache.get(unit)
        if hit is not None:
            return hit
        t0 = time.perf_counter()
        try:
            return self._fetch(unit)
        finally:
            self._waited(t0)

    def _fetch(self, unit: int) -> Batch:
        while unit in self._ahead:
            got = self._pull()
            if got is None:
                break
            if got[0] == unit:
                return got[1]
        batch = self._to_device(self._keyed.load(unit, self.step_offset))
        self._keep(unit, batch)
        return batch

    def prefetch(self, steps: int, limit_bytes: int = 256 << 20) -> int:
        """Gather now the units of the first ``steps`` minibatches from ``step_offset`` (benchmarks:
        no data loading inside a timed window), up to ``limit_bytes``; returns the minibatches
        whose units this rank holds."""
        t0 = time.perf_counter()
        try:
            return self._prefetch(steps, limit_bytes)
        finally:
            self._waited(t0)

    def _prefetch(self, steps: int, limit_bytes: int) -> int:
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
        """Stop this loader's own background workers (kept workers go on serving others; both
        also stop when garbage-collected)."""
        self._stream = None
        if self._own and self._workers is not None:
            self._workers.close()

    def __enter__(self) -> UnitLoader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _check(sampler: EpochSampler, microbatches: int, part: Part, num_workers: int) -> None:
    if part not in PARTS:
        raise DataError(f"part must be one of {', '.join(PARTS)}, got {part!r}")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise DataError(f"num_workers must be an integer >= 0, got {num_workers!r}")
    if microbatches < 1 or sampler.batch_size % microbatches:
        raise DataError(f"batch size {sampler.batch_size} is not divisible by microbatches {microbatches}; "
                        f"every microbatch must have the same number of samples")
