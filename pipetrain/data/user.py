"""A user's data: ``package.module:function`` returning ``(train_dataset, eval_dataset)``.

Each split is a map-style ``torch.utils.data.Dataset`` (``__len__`` and ``__getitem__``) whose
items are ``(input, target)`` pairs: ``input`` a tensor or a tuple of tensors (one per model
input), ``target`` a tensor (an int or float is taken as a 0-d tensor). The first item of each
split is checked here, so a wrong factory fails before any worker starts, with one line:

- the function cannot be imported or raises;
- it does not return a pair of datasets (or an ``IterableDataset``: the sampler needs indices);
- a split is empty;
- an item is not ``(input, target)`` with tensors;
- the two splits' items differ in shape or dtype.

The task follows the targets (see :func:`~pipetrain.data.source.source_from_example`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import IterableDataset

from ..errors import DataError, PipetrainError
from ..models.loader import import_user_module
from .source import DataSource, as_item, describe_value, source_from_example

__all__ = ["FACTORY_FORM", "load_factory"]

FACTORY_FORM = "'package.module:function' returning (train_dataset, eval_dataset)"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def _import(spec: str) -> Callable[..., Any]:
    module_name, _, func_name = spec.partition(":")
    if not module_name or not func_name or ":" in func_name:
        raise DataError(f"data spec {spec!r} must be {FACTORY_FORM}, e.g. 'mypkg.data:make_datasets'")
    try:
        module = import_user_module(module_name)
    except Exception as exc:  # ImportError, or any error raised while the module runs
        raise DataError(f"cannot import module {module_name!r} of data spec {spec!r} ({_first_line(exc)}); check "
                        f"the module name and that its directory is on PYTHONPATH") from None
    fn = getattr(module, func_name, None)
    if fn is None or not callable(fn):
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise DataError(f"module {module_name!r} has no function {func_name!r} (data spec {spec!r}); its "
                        f"functions: {', '.join(names) or 'none'}")
    return fn  # type: ignore[no-any-return]


def _is_dataset(value: Any) -> bool:
    return (hasattr(value, "__getitem__") and hasattr(value, "__len__") and not isinstance(value, IterableDataset)
            and not isinstance(value, (str, bytes)))


def load_factory(spec: str) -> DataSource:
    """Call the factory of ``spec`` and validate what it returns (see the module docstring).

    Raises:
        DataError: one line naming the spec, what was wrong and the fix.
    """
    fn = _import(spec)
    try:
        result = fn()
    except PipetrainError:
        raise
    except Exception as exc:
        raise DataError(f"data factory {spec!r} raised {_first_line(exc)}; fix the factory") from None
    if not (isinstance(result, (tuple, list)) and len(result) == 2 and all(_is_dataset(d) for d in result)):
        raise DataError(
            f"data factory {spec!r} must return a pair of datasets (train_dataset, eval_dataset), got "
            f"{describe_value(result)}; return e.g. (TensorDataset(x_train, y_train), TensorDataset(x_eval, y_eval))")
    train, eval_ = result
    for split, ds in (("train", train), ("eval", eval_)):
        if len(ds) == 0:
            raise DataError(f"the {split} dataset of data factory {spec!r} is empty; return at least one "
                            f"(input, target) sample in each split")
    first = {split: as_item(ds[0], f"item 0 of the {split} dataset of {spec!r}")
             for split, ds in (("train", train), ("eval", eval_))}

    def signature(item: Any) -> str:
        inputs, target = item
        return f"inputs {describe_value(inputs)}, target {describe_value(target)}"

    if signature(first["train"]) != signature(first["eval"]):
        raise DataError(f"the splits of data factory {spec!r} differ: train has {signature(first['train'])}, eval "
                        f"has {signature(first['eval'])}; give both splits samples of one shape and dtype")
    return source_from_example(spec, train, eval_,
                               description=f"{spec}: {len(train)} train / {len(eval_)} eval samples "
                                           f"({signature(first['train'])})")
