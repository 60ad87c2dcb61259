"""``load_data(spec)``: a data set by name, ``text:PATH``, or a user factory ``package.module:function``.

=================  ==========================================================================
spec               data
=================  ==========================================================================
``digits``         scikit-learn's 1,797 8x8 digits, 64 features, 10 classes, split by seed
``fashion-mnist``  IDX files from ``data_dir`` or Debian's ``dataset-fashion-mnist``, 60k/10k
``shakespeare``    the complete works, char-level, eval = last 10%
``text:PATH``      any UTF-8 text file, char-level, eval = last 10%
``synthetic``      the model's own random batches (``make_batch``): throughput runs
``pkg.mod:fn``     a user factory returning ``(train_dataset, eval_dataset)``
``PATH``           an existing file: as ``text:PATH``; a directory: IDX files as ``fashion-mnist``
=================  ==========================================================================

Nothing is downloaded: every built-in data set comes from an installed package.
"""
from __future__ import annotations

import difflib
import os

import torch

from ..errors import DataError
from .digits import load_digits
from .fashion import load_fashion_mnist
from .source import DataSource
from .text import load_text, load_text_file, shakespeare_text
from .user import load_factory

__all__ = ["DATA_NAMES", "DATA_FORMS", "load_data", "synthetic_source"]

DATA_NAMES: tuple[str, ...] = ("digits", "fashion-mnist", "shakespeare", "synthetic")
"""The built-in data sets."""

DATA_FORMS = "text:PATH (a UTF-8 text file) or package.module:function (returning (train_dataset, eval_dataset))"


def synthetic_source() -> DataSource:
    """The marker for the model's synthetic batches: ``synthetic=True``, no splits."""
    return DataSource(name="synthetic", train=None, eval=None, task="synthetic", input_shape=(),
                      input_dtype=torch.float32, synthetic=True,
                      description="synthetic: the model's own random batches (make_batch), no eval split")


def load_data(spec: str, *, data_dir: str | None = None, seed: int = 0, seq_len: int | None = None) -> DataSource:
    """The data set named by ``spec`` with its train and eval splits.

    Args:
        spec: a name of :data:`DATA_NAMES`, ``text:PATH``, ``package.module:function``, or the
            path of a text file or of a directory of IDX files.
        data_dir: where ``fashion-mnist`` finds its IDX files (default: Debian's directory).
        seed: the split seed (``digits``; the other splits are fixed).
        seq_len: tokens per sample of text data (default 128).

    Raises:
        DataError: unknown name (the message lists the valid names and forms), a missing path,
            missing files, or a user factory that returns the wrong thing.

    Example:
        >>> src = load_data("digits", seed=0)
        >>> src.num_train, src.num_eval, src.input_shape, src.num_classes
        (1437, 360, (64,), 10)
    """
    if not isinstance(spec, str) or not spec.strip():
        raise DataError(f"data spec must be one of {', '.join(DATA_NAMES)} or {DATA_FORMS}; got {spec!r}")
    spec = spec.strip()
    if spec == "digits":
        return load_digits(seed)
    if spec == "fashion-mnist":
        return load_fashion_mnist(data_dir)
    if spec == "shakespeare":
        return load_text("shakespeare", shakespeare_text(), seq_len, origin="the shakespeare package")
    if spec == "synthetic":
        return synthetic_source()
    if spec.startswith("text:"):
        return load_text_file(spec[len("text:"):], seq_len)
    if ":" in spec and not os.path.exists(spec):
        return load_factory(spec)
    path = os.path.expanduser(spec)
    if os.path.isfile(path):
        return load_text_file(path, seq_len)
    if os.path.isdir(path):
        return load_fashion_mnist(path)
    if os.sep in spec or spec.startswith((".", "~")) or os.path.splitext(spec)[1]:
        raise DataError(f"data path {spec!r} does not exist; pass an existing text file or IDX directory, or a "
                        f"name: {', '.join(DATA_NAMES)}")
    hint = difflib.get_close_matches(spec, DATA_NAMES, n=1)
    did_you_mean = f" (did you mean {hint[0]!r}?)" if hint else ""
    raise DataError(f"unknown data set {spec!r}{did_you_mean}; valid names: {', '.join(DATA_NAMES)}, or {DATA_FORMS}")
