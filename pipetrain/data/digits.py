"""``digits``: the 1,797 8x8 handwritten digits shipped inside scikit-learn (no network).

Inputs are the 64 pixel intensities scaled from 0..16 to [0, 1] as float32 (``[64]``; reshape
to ``[1, 8, 8]`` for an image model), targets the class 0..9 (int64). The train/eval split is
a seeded permutation: the eval split is the first ``ceil(0.2 * 1797) = 360`` samples of
``permutation(seed)``, the train split the other 1,437, so two loads with the same seed
give the same split and every sample is in exactly one split.
"""
from __future__ import annotations

import numpy as np
import torch

from ..errors import DataError
from .source import ArrayDataset, DataSource

__all__ = ["EVAL_SIZE", "load_digits"]

EVAL_SIZE = 360
"""Samples in the eval split (20% of 1,797, rounded up)."""


def load_digits(seed: int = 0, as_images: bool = False) -> DataSource:
    """The digits data set split by ``seed`` (1,437 train / 360 eval samples); ``as_images``
    gives inputs ``[1, 8, 8]`` (for ``resnet50`` or ``vgg16``) instead of ``[64]``."""
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError as exc:
        raise DataError(f"data set 'digits' needs scikit-learn ({exc}); install it with "
                        f"`pip install scikit-learn`") from None
    bunch = sk_load_digits()
    x = torch.from_numpy(np.asarray(bunch.data, dtype=np.float32) / 16.0)
    shape: tuple[int, ...] = (1, 8, 8) if as_images else (64,)
    x = x.reshape(-1, *shape)
    y = torch.from_numpy(np.asarray(bunch.target, dtype=np.int64))
    order = torch.from_numpy(np.random.default_rng(np.random.SeedSequence([seed, 1797])).permutation(len(y)))
    eval_idx, train_idx = order[:EVAL_SIZE].sort().values, order[EVAL_SIZE:].sort().values
    train = ArrayDataset((x[train_idx],), y[train_idx])
    eval_ = ArrayDataset((x[eval_idx],), y[eval_idx])
    return DataSource(
        name="digits", train=train, eval=eval_, task="classification", input_shape=shape,
        input_dtype=torch.float32, num_classes=10, target_shape=(), target_dtype=torch.int64,
        description=f"digits: {len(train)} train / {len(eval_)} eval 8x8 images as "
                    f"{'[1, 8, 8] images' if as_images else '64 features'} in [0, 1], 10 classes (seed {seed})")
