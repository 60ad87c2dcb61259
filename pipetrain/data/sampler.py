"""Which samples every minibatch and every unit of a run reads: deterministic in (seed, epoch).

A run's minibatch ``t`` (global step, counted from 0 across epochs) belongs to epoch
``e = t // steps_per_epoch`` and is slice ``k = t % steps_per_epoch`` of that epoch's order::

    order(e)   = permutation of range(num_samples) drawn from SeedSequence([seed, e])
    batch(t)   = order(e)[k*B : (k+1)*B]            (the last partial minibatch is dropped)
    unit(u, m) = batch(u // m)[j*B/m : (j+1)*B/m],  j = u % m

which matches the runtime's units: unit ``u`` of a run is chunk ``u % m`` of minibatch
``u // m`` (``m = 1`` for pipedream, whose unit is the whole minibatch), and a stage with
``r`` replicas runs unit ``u`` on replica ``u mod r``. Every process computes the same
indices from ``(seed, epoch)`` alone, so the replicas of a stage read disjoint shards that
together cover each minibatch, and every epoch reshuffles. ``shuffle=False`` keeps the
dataset's order in every epoch.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..errors import DataError

__all__ = ["EpochSampler"]


class EpochSampler:
    """Sample indices of minibatches and units, reshuffled every epoch with the seed.

    Args:
        num_samples: size of the train split.
        batch_size: samples per minibatch ``B``.
        seed: the shuffle seed.
        shuffle: reshuffle every epoch (False: dataset order).

    Example:
        >>> s = EpochSampler(10, batch_size=4, seed=0)
        >>> s.steps_per_epoch, len(s.minibatch(0)), s.epoch_of(2)
        (2, 4, 1)
    """

    def __init__(self, num_samples: int, batch_size: int, seed: int = 0, shuffle: bool = True) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise DataError(f"batch size must be an integer >= 1, got {batch_size!r}")
        if num_samples < batch_size:
            raise DataError(f"the train split has {num_samples} samples, fewer than one minibatch of {batch_size}; "
                            f"use a batch size <= {num_samples} or more data")
        self.num_samples = int(num_samples)
        self.batch_size = batch_size
        self.seed = int(seed)
        self.shuffle = shuffle
        self._order: tuple[int, Tensor] | None = None   # (epoch, order) cache: one epoch at a time

    @property
    def steps_per_epoch(self) -> int:
        """Whole minibatches per epoch: ``num_samples // batch_size`` (the tail is dropped)."""
        return self.num_samples // self.batch_size

    def epoch_of(self, step: int) -> int:
        """The epoch of minibatch ``step``."""
        return step // self.steps_per_epoch

    def order(self, epoch: int) -> Tensor:
        """The permutation of the train split that epoch ``epoch`` reads (int64)."""
        if self._order is not None and self._order[0] == epoch:
            return self._order[1]
        if self.shuffle:
            rng = np.random.default_rng(np.random.SeedSequence([self.seed, epoch]))
            order = torch.from_numpy(rng.permutation(self.num_samples).astype(np.int64))
        else:
            order = torch.arange(self.num_samples, dtype=torch.int64)
        self._order = (epoch, order)
        return order

    def minibatch(self, step: int) -> Tensor:
        """The ``B`` sample indices of minibatch ``step`` (global, counted across epochs)."""
        if step < 0:
            raise DataError(f"minibatch index must be >= 0, got {step}")
        k = step % self.steps_per_epoch
        return self.order(self.epoch_of(step))[k * self.batch_size:(k + 1) * self.batch_size]

    def indices_of_unit(self, unit: int, microbatches: int, step_offset: int = 0) -> Tensor:
        """The sample indices of unit ``unit``: chunk ``unit % m`` of minibatch ``step_offset + unit // m``.

        Raises:
            DataError: ``batch_size`` is not divisible by ``microbatches``.
        """
        m = microbatches
        if m < 1 or self.batch_size % m:
            raise DataError(f"batch size {self.batch_size} is not divisible by microbatches {m}; every "
                            f"microbatch must have the same number of samples")
        size = self.batch_size // m
        j = unit % m
        return self.minibatch(step_offset + unit // m)[j * size:(j + 1) * size]
