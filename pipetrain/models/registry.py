"""Built-in models by name: ``get_model(name, batch_size=None, **options) -> ModelBundle``.

Each zoo module (``mlp``, ``alexnet``, ``vgg``, ``resnet``, ``gnmt``, ``gpt``, ``hf``) has
``DEFAULTS`` (its options), ``DEFAULT_BATCH_SIZE``, ``build_model(**options)`` (the module
alone) and ``build(batch_size, **options)`` (the bundle). This table maps names to them;
``hf`` is imported only when asked for, since it imports transformers.
"""
from __future__ import annotations

import difflib
import importlib
from types import ModuleType
from typing import Any

from torch import nn

from ..errors import ModelError
from .bundle import ModelBundle, check_batch_size

MODEL_NAMES: tuple[str, ...] = ("mlp", "alexnet", "vgg16", "resnet50", "gnmt", "gpt")
"""The built-in zoo (the paper's models plus an MLP and a small GPT)."""

EXTRA_MODEL_NAMES: tuple[str, ...] = ("hf-gpt2",)
"""Models that need an optional package (``hf-gpt2``: transformers)."""

_MODULES: dict[str, str] = {
    "mlp": "mlp", "alexnet": "alexnet", "vgg16": "vgg", "resnet50": "resnet", "gnmt": "gnmt", "gpt": "gpt",
    "hf-gpt2": "hf",
}

TINY_OPTIONS: dict[str, dict[str, Any]] = {
    "mlp": {"depth": 4, "width": 16, "in_features": 8, "num_classes": 5},
    "alexnet": {"image_size": 64, "num_classes": 10, "width_mult": 1 / 16, "dropout": 0.0},
    "vgg16": {"image_size": 32, "num_classes": 10, "width_mult": 1 / 16, "dropout": 0.0},
    "resnet50": {"layers": (1, 1, 1, 1), "width": 4, "image_size": 32, "num_classes": 10, "norm": "group"},
    "gnmt": {"vocab": 64, "hidden": 16, "layers": 3, "seq_len": 6},
    "gpt": {"vocab": 64, "d_model": 32, "layers": 2, "heads": 4, "seq_len": 16},
    "hf-gpt2": {"vocab": 64, "d_model": 32, "layers": 2, "heads": 4, "seq_len": 16},
}
"""Options that make each model tiny (well under a second for forward and backward on a
CPU), deterministic (no dropout, no batch norm) and still the same architecture: for tests
of the graph, profiler, planner and runtime. ``get_model(name, **TINY_OPTIONS[name])``."""


def _zoo_module(name: str) -> ModuleType:
    if not isinstance(name, str) or name not in _MODULES:
        hint = difflib.get_close_matches(str(name), list(_MODULES), n=1)
        did_you_mean = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ModelError(
            f"unknown model {name!r}{did_you_mean}; valid names: {', '.join(MODEL_NAMES + EXTRA_MODEL_NAMES)} "
            f"(or a 'package.module:function' spec with load_model)")
    return importlib.import_module(f"{__package__}.{_MODULES[name]}")


def default_options(name: str) -> dict[str, Any]:
    """The options of model ``name`` with their defaults (``{"depth": 16, ...}`` for ``mlp``)."""
    return dict(_zoo_module(name).DEFAULTS)


def default_batch_size(name: str) -> int:
    """The batch size ``get_model(name)`` uses when none is given."""
    return int(_zoo_module(name).DEFAULT_BATCH_SIZE)


def get_model(name: str, batch_size: int | None = None, **options: Any) -> ModelBundle:
    """Build a zoo model with its example minibatch, loss and synthetic data.

    Args:
        name: one of :data:`MODEL_NAMES` or :data:`EXTRA_MODEL_NAMES`.
        batch_size: size of ``example_inputs``; ``None`` takes the model's default
            (mlp 64, alexnet 128, vgg16 64, resnet50 64, gnmt 64, gpt 16, hf-gpt2 16).
        **options: the model's options (see :func:`default_options`); unknown names and bad
            values raise :class:`~pipetrain.errors.ModelError`.

    Parameters are initialised from torch's global generator: seed it with
    ``torch.manual_seed`` for a reproducible model. Example:

        >>> bundle = get_model("mlp", batch_size=4, depth=2, width=8)
        >>> bundle.model(*bundle.example_inputs).shape
        torch.Size([4, 8])
    """
    module = _zoo_module(name)
    if batch_size is not None:
        check_batch_size(batch_size)
    try:
        bundle: ModelBundle = module.build(batch_size, **options)
    except (MemoryError, RuntimeError) as exc:
        # Options (or a batch) far too large: torch's allocator fails deep inside a layer's init.
        text = str(exc)
        if not isinstance(exc, MemoryError) and "alloc" not in text.lower() and "out of memory" not in text.lower():
            raise
        first = next((ln.strip() for ln in text.splitlines() if "allocate" in ln), text.strip()[:200])
        raise ModelError(
            f"model {name!r} with options {options or 'default'} and batch_size={batch_size} does not fit in memory "
            f"({type(exc).__name__}: {first}); choose smaller options or a smaller batch"
        ) from None
    return bundle


def build_model(name: str, **options: Any) -> nn.Module:
    """The zoo model's ``nn.Module`` alone, without example data (cheap under ``torch.device("meta")``)."""
    return _zoo_module(name).build_model(**options)
