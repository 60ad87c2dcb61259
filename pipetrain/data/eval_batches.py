"""The eval split in fixed order and fixed-size batches, every sample counted exactly once.

Batch ``i`` holds eval samples ``[i*B, (i+1)*B)``. The tail (``n % B`` samples) is either kept
as a smaller last batch (``pad=False``) or padded to ``B`` rows by repeating its last sample
(``pad=True``, for pipelines whose buffers or captured graphs need one batch size); either way
:attr:`EvalBatch.count` says how many leading rows are real, and the metric helpers
(:mod:`pipetrain.data.metrics`) count only those, so an epoch's sums cover each of the ``n``
eval samples once. Nothing is dropped.

For a pipeline, the first stage reads ``batch(i, "inputs")`` and the last stage
``batch(i, "targets")``; both compute the same indices, so no data travels between them.
:meth:`EvalBatch.split` cuts a batch into microbatches with their real-row counts.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.data import Dataset

from ..errors import DataError
from .loader import gather
from .source import Inputs, Part

__all__ = ["EvalBatch", "EvalBatches"]


@dataclass(frozen=True)
class EvalBatch:
    """One eval batch: ``inputs`` and ``target`` (``()`` / ``None`` when not loaded) of ``rows``
    rows, the first ``count`` of them real samples (the rest repeat the last real one)."""

    inputs: Inputs
    target: Tensor | None
    count: int
    rows: int

    def split(self, parts: int) -> list[EvalBatch]:
        """``parts`` equal microbatches (``rows`` must be divisible), each with its real rows."""
        if parts < 1 or self.rows % parts:
            raise DataError(f"eval batch of {self.rows} rows is not divisible into {parts} microbatches; use an "
                            f"eval batch size that is a multiple of the microbatches, with pad=True")
        size = self.rows // parts
        out = []
        for j in range(parts):
            lo = j * size
            out.append(EvalBatch(tuple(x[lo:lo + size] for x in self.inputs),
                                 None if self.target is None else self.target[lo:lo + size],
                                 max(min(self.count - lo, size), 0), size))
        return out


class EvalBatches:
    """The eval split as fixed batches (see the module docstring).

    Args:
        dataset: the eval split.
        batch_size: rows per batch ``B``.
        pad: pad the tail to ``B`` rows (True) or keep it as a smaller last batch (False).

    Example:
        >>> from pipetrain.data.source import ArrayDataset
        >>> ev = EvalBatches(ArrayDataset((torch.zeros(10, 2),), torch.zeros(10, dtype=torch.long)), 4, pad=True)
        >>> len(ev), [b.count for b in ev], [b.rows for b in ev]
        (3, [4, 4, 2], [4, 4, 4])
    """

    def __init__(self, dataset: Dataset, batch_size: int, pad: bool = False) -> None:  # type: ignore[type-arg]
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise DataError(f"eval batch size must be an integer >= 1, got {batch_size!r}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.pad = pad
        self.num_samples = len(dataset)  # type: ignore[arg-type]
        if self.num_samples == 0:
            raise DataError("the eval split is empty; give it at least one sample")

    def __len__(self) -> int:
        return -(-self.num_samples // self.batch_size)

    def indices(self, i: int) -> tuple[Tensor, int]:
        """The sample indices of batch ``i`` (padded rows repeat the last real one) and the real count."""
        if not 0 <= i < len(self):
            raise IndexError(f"eval batch {i} out of range [0, {len(self)})")
        lo = i * self.batch_size
        hi = min(lo + self.batch_size, self.num_samples)
        idx = torch.arange(lo, hi, dtype=torch.int64)
        if self.pad and hi - lo < self.batch_size:
            idx = torch.cat([idx, idx[-1:].expand(self.batch_size - (hi - lo))])
        return idx, hi - lo

    def batch(self, i: int, part: Part = "both") -> EvalBatch:
        """Batch ``i``, only ``part``."""
        idx, count = self.indices(i)
        inputs, target = gather(self.dataset, idx, part)
        return EvalBatch(inputs, target, count, int(idx.numel()))

    def __iter__(self) -> Iterator[EvalBatch]:
        for i in range(len(self)):
            yield self.batch(i)
