"""What a data set is to pipetrain: two splits of ``(input, target)`` samples and their shapes.

A :class:`DataSource` holds a train split and an eval split (``torch.utils.data.Dataset`` s
whose item ``i`` is ``(input, target)``; ``input`` a tensor, or a tuple of tensors for models
with several inputs) plus what a model must know to fit them: the task, the per-sample input
shapes and dtypes, the number of classes or the vocabulary. Built-in data sets store their
samples in an :class:`ArrayDataset`, whose :meth:`~ArrayDataset.take` gathers a whole batch
by one indexing operation instead of stacking items one by one.

The synthetic source (``load_data("synthetic")``) has no splits: ``synthetic`` is True and
the runtime keeps drawing batches from the model's ``make_batch``.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor
from torch.utils.data import Dataset

from ..errors import DataError

__all__ = [
    "ArrayDataset", "Batch", "DataSource", "Inputs", "Item", "Part", "Task", "as_item", "describe_value",
    "source_from_example", "stack_items",
]

Task = Literal["classification", "language", "regression", "synthetic"]
"""``classification``: integer class per sample; ``language``: integer token ids per position;
``regression``: floating-point targets; ``synthetic``: the model's own random batches."""

Part = Literal["inputs", "targets", "both"]
"""Which half of a sample a pipeline stage needs: the first stage reads inputs, the last stage
targets, a stage that is both (one stage, or data parallelism) reads both."""

Inputs = tuple[Tensor, ...]
Item = tuple[Inputs, Tensor]
"""One sample normalized: a tuple of input tensors and a target tensor (no batch dimension)."""
Batch = tuple[Inputs, Tensor | None]
"""A batch as the runtime consumes it: ``(inputs, target)`` with batch dimension 0; a part not
loaded is ``()`` (inputs) or ``None`` (target)."""


def describe_value(value: Any) -> str:
    """A short description for error messages: ``tuple(Tensor[8, 8] float32, int)``."""
    if isinstance(value, Tensor):
        return f"Tensor{list(value.shape)} {str(value.dtype).replace('torch.', '')}"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(describe_value(v) for v in value[:4])
        return f"{type(value).__name__}({inner}{', ...' if len(value) > 4 else ''})"
    return type(value).__name__


def as_item(item: Any, where: str) -> Item:
    """Normalize one dataset item to ``((input, ...), target)``.

    Accepts ``(Tensor, Tensor)`` and ``((Tensor, ...), Tensor)``; a Python int or float target
    becomes a 0-d tensor (int64 or float32), a numpy array a tensor.

    Raises:
        DataError: the item is not an ``(input, target)`` pair of tensors; ``where`` names it.
    """
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise DataError(
            f"{where} must be an (input, target) pair, got {describe_value(item)}; make __getitem__ return "
            f"(input_tensor, target_tensor)")
    x, y = item
    inputs = tuple(x) if isinstance(x, (tuple, list)) else (x,)
    inputs = tuple(_tensor(v) for v in inputs)
    target = _tensor(y)
    if not inputs or not all(isinstance(v, Tensor) for v in inputs) or not isinstance(target, Tensor):
        raise DataError(
            f"{where} must be (input, target) with tensors (input may be a tuple of tensors), got "
            f"{describe_value(item)}; convert the sample's parts with torch.as_tensor")
    return inputs, target


def _tensor(v: Any) -> Any:
    if isinstance(v, Tensor):
        return v
    if isinstance(v, bool):
        return v
    if isinstance(v, int):
        return torch.tensor(v, dtype=torch.int64)
    if isinstance(v, float):
        return torch.tensor(v, dtype=torch.float32)
    if type(v).__module__ == "numpy":
        return torch.as_tensor(v)
    return v


def stack_items(items: Sequence[Item], part: Part = "both") -> Batch:
    """Stack normalized items into a batch (batch dimension 0), keeping only ``part``."""
    inputs: Inputs = ()
    target: Tensor | None = None
    if part in ("inputs", "both"):
        inputs = tuple(torch.stack([it[0][k] for it in items]) for k in range(len(items[0][0])))
    if part in ("targets", "both"):
        target = torch.stack([it[1] for it in items])
    return inputs, target


class ArrayDataset(Dataset):  # type: ignore[type-arg]
    """Samples held as whole tensors: item ``i`` is ``((inputs[0][i], ...), target[i])``.

    Args:
        inputs: one tensor per model input, all with the same length along dimension 0.
        target: the targets, same length.
    """

    def __init__(self, inputs: Sequence[Tensor], target: Tensor) -> None:
        self.inputs = tuple(inputs)
        self.target = target
        n = int(target.shape[0])
        if any(int(x.shape[0]) != n for x in self.inputs):
            raise DataError(f"every input tensor must have {n} samples like the target, got "
                            f"{[int(x.shape[0]) for x in self.inputs]}")

    def __len__(self) -> int:
        return int(self.target.shape[0])

    def __getitem__(self, i: int) -> Item:
        return tuple(x[i] for x in self.inputs), self.target[i]

    def take(self, indices: Tensor, part: Part = "both") -> Batch:
        """The batch of samples ``indices`` (int64), gathered by one index per tensor."""
        inputs = tuple(x[indices] for x in self.inputs) if part in ("inputs", "both") else ()
        target = self.target[indices] if part in ("targets", "both") else None
        return inputs, target


@dataclass(frozen=True)
class DataSource:
    """A data set ready for training: splits, task and shapes.

    Attributes:
        name: the spec it was loaded from (``"digits"``, ``"text:/path"``, ``"pkg.mod:fn"``).
        train: the train split (``None`` only when ``synthetic``).
        eval: the eval split, fixed for a given seed (``None`` only when ``synthetic``).
        task: see :data:`Task`.
        input_shape: per-sample shape of the first input (no batch dimension).
        input_dtype: dtype of the first input.
        num_classes: classes of a classification task (``None`` when unknown, e.g. user data).
        vocab_size: token vocabulary of a language task.
        seq_len: tokens per sample of a language task.
        description: one line for logs (``digits: 1437 train / 360 eval 8x8 images, 10 classes``).
        input_shapes: per-sample shape of every input (several for multi-input models).
        input_dtypes: dtype of every input.
        target_shape: per-sample shape of the target (``()`` for a class id).
        target_dtype: dtype of the target; integers mean cross entropy, floats MSE.
        vocabulary: the characters of a char-level vocabulary, index = token id.
        synthetic: the model's own ``make_batch`` gives the data (no splits).
    """

    name: str
    train: Dataset | None  # type: ignore[type-arg]
    eval: Dataset | None  # type: ignore[type-arg]
    task: Task
    input_shape: tuple[int, ...]
    input_dtype: torch.dtype
    num_classes: int | None = None
    vocab_size: int | None = None
    seq_len: int | None = None
    description: str = ""
    input_shapes: tuple[tuple[int, ...], ...] = ()
    input_dtypes: tuple[torch.dtype, ...] = ()
    target_shape: tuple[int, ...] = ()
    target_dtype: torch.dtype = torch.int64
    vocabulary: str | None = None
    synthetic: bool = False

    def __post_init__(self) -> None:
        if not self.input_shapes:
            object.__setattr__(self, "input_shapes", (tuple(self.input_shape),))
        if not self.input_dtypes:
            object.__setattr__(self, "input_dtypes", (self.input_dtype,))

    @property
    def num_train(self) -> int:
        """Samples in the train split (0 for synthetic data)."""
        return 0 if self.train is None else len(self.train)  # type: ignore[arg-type]

    @property
    def num_eval(self) -> int:
        """Samples in the eval split (0 for synthetic data)."""
        return 0 if self.eval is None else len(self.eval)  # type: ignore[arg-type]


def source_from_example(name: str, train: Dataset, eval: Dataset, description: str = "",  # type: ignore[type-arg]
                        **fields: Any) -> DataSource:
    """A :class:`DataSource` whose shapes, dtypes and task are read from ``train[0]``.

    Integer targets give ``classification`` (0-d target) or ``language`` (a sequence of token
    ids); floating-point targets give ``regression``.
    """
    inputs, target = as_item(train[0], f"item 0 of the train split of {name!r}")
    if target.dtype.is_floating_point or target.dtype.is_complex:
        task: Task = "regression"
    elif target.dim() == 0:
        task = "classification"
    else:
        task = "language"
    return DataSource(
        name=name, train=train, eval=eval, task=task, input_shape=tuple(inputs[0].shape),
        input_dtype=inputs[0].dtype, input_shapes=tuple(tuple(x.shape) for x in inputs),
        input_dtypes=tuple(x.dtype for x in inputs), target_shape=tuple(target.shape), target_dtype=target.dtype,
        description=description or f"{name}: {len(train)} train / {len(eval)} eval samples",  # type: ignore[arg-type]
        **fields)
