"""The model zoo: built-in models as :class:`ModelBundle` s, and user model factories.

``get_model(name, batch_size=None, **options)`` builds ``mlp``, ``alexnet``, ``vgg16``,
``resnet50``, ``gnmt``, ``gpt`` (:data:`MODEL_NAMES`) or ``hf-gpt2``;
``load_model(spec, ...)`` also accepts ``package.module:function``. Every model is traceable
by ``torch.fx.symbolic_trace`` (except ``hf-gpt2``: ``torch.export``) and
:data:`TINY_OPTIONS` gives each a tiny configuration for tests.
"""
from __future__ import annotations

from .bundle import ModelBundle, classification_loss, mse_loss, token_loss
from .loader import load_model, wrap_model
from .output import output_logits
from .registry import (
    EXTRA_MODEL_NAMES,
    MODEL_NAMES,
    TINY_OPTIONS,
    build_model,
    default_batch_size,
    default_options,
    get_model,
)

__all__ = [
    "EXTRA_MODEL_NAMES", "MODEL_NAMES", "ModelBundle", "TINY_OPTIONS", "build_model", "classification_loss",
    "default_batch_size", "default_options", "get_model", "load_model", "mse_loss", "output_logits", "token_loss",
    "wrap_model",
]
