"""``fashion-mnist``: Zalando's 70,000 28x28 grey clothing images in 10 classes, from IDX files.

The files (``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``,
``t10k-labels-idx1-ubyte``, each optionally ``.gz``) are read from ``data_dir`` if given, else
from :data:`DEBIAN_DIR`, where Debian's ``dataset-fashion-mnist`` package installs them. The
split is the standard one (60,000 train / 10,000 t10k eval), whatever the seed. Inputs are
``[1, 28, 28]`` float32 normalised with the train split's mean and standard deviation of the
pixel values scaled to [0, 1] (Fashion-MNIST: about 0.286 and 0.353), targets int64 0..9.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from ..errors import DataError
from .idx import read_idx
from .source import ArrayDataset, DataSource

__all__ = ["CLASSES", "DEBIAN_DIR", "FILES", "INSTALL_HINT", "find_file", "load_fashion_mnist"]

DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"
"""Where ``apt-get install dataset-fashion-mnist`` puts the four ``.gz`` IDX files."""

INSTALL_HINT = "apt-get install dataset-fashion-mnist"

FILES: dict[str, str] = {
    "train_images": "train-images-idx3-ubyte", "train_labels": "train-labels-idx1-ubyte",
    "eval_images": "t10k-images-idx3-ubyte", "eval_labels": "t10k-labels-idx1-ubyte",
}

CLASSES: tuple[str, ...] = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker",
                            "Bag", "Ankle boot")


def find_file(directory: str, stem: str) -> str | None:
    """``directory/stem`` or ``directory/stem.gz`` (also the ``stem.idx3-ubyte`` spelling), or None."""
    for name in (stem, stem + ".gz", stem.replace("-idx", ".idx"), stem.replace("-idx", ".idx") + ".gz"):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return path
    return None


def load_fashion_mnist(data_dir: str | None = None) -> DataSource:
    """Fashion-MNIST from ``data_dir`` or Debian's package directory.

    Raises:
        DataError: a given ``data_dir`` does not exist or lacks a file, or no directory has
            the files; the message names both ways to get them.
    """
    directory = data_dir if data_dir is not None else DEBIAN_DIR
    where = f"--data-dir {data_dir!r}" if data_dir is not None else f"{DEBIAN_DIR} (no --data-dir given)"
    if not os.path.isdir(directory):
        raise DataError(
            f"fashion-mnist files not found: {where} is not a directory; pass --data-dir DIR holding "
            f"train-images-idx3-ubyte[.gz] and the 3 other IDX files, or run `{INSTALL_HINT}`")
    paths = {k: find_file(directory, stem) for k, stem in FILES.items()}
    missing = [FILES[k] for k, p in paths.items() if p is None]
    if missing:
        raise DataError(
            f"fashion-mnist files not found in {where}: missing {', '.join(f + '[.gz]' for f in missing)}; pass "
            f"--data-dir DIR holding the 4 IDX files, or run `{INSTALL_HINT}`")
    arrays = {k: read_idx(p) for k, p in paths.items() if p is not None}
    for split in ("train", "eval"):
        images, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
        if images.ndim != 3 or labels.ndim != 1 or images.shape[0] != labels.shape[0]:
            raise DataError(
                f"fashion-mnist {split} files disagree: images {list(images.shape)}, labels {list(labels.shape)} "
                f"in {directory!r}; expected [N, 28, 28] images and [N] labels")
    train_x = arrays["train_images"].astype(np.float32) / 255.0
    mean, std = float(train_x.mean()), float(train_x.std()) or 1.0

    def to_images(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(((a.astype(np.float32) / 255.0 - mean) / std)[:, None, :, :].copy())

    def to_labels(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a.astype(np.int64))

    train = ArrayDataset((to_images(arrays["train_images"]),), to_labels(arrays["train_labels"]))
    eval_ = ArrayDataset((to_images(arrays["eval_images"]),), to_labels(arrays["eval_labels"]))
    h, w = arrays["train_images"].shape[1:]
    num_classes = max(int(arrays["train_labels"].max()) + 1, 10) if len(train) else 10
    return DataSource(
        name="fashion-mnist", train=train, eval=eval_, task="classification", input_shape=(1, int(h), int(w)),
        input_dtype=torch.float32, num_classes=num_classes, target_shape=(), target_dtype=torch.int64,
        description=f"fashion-mnist: {len(train)} train / {len(eval_)} eval {h}x{w} grey images, "
                    f"{num_classes} classes (from {directory})")
