"""``load_model(spec)``: a built-in model by name, a user factory ``package.module:function``,
or a Hugging Face model directory ``hf:DIR`` (:mod:`pipetrain.models.pretrained`).

A factory returns either a :class:`ModelBundle` or ``(model, example_batch)``. The second form
is wrapped into a bundle: the model is run once on the example batch (which must work), the
loss is the MSE of the output against a random target of the output's shape, and
``make_batch`` draws random tensors with the example's shapes and dtypes (integer inputs:
uniform in ``[0, max + 1)`` of the example's values). Every failure is a one-line ModelError
naming the spec.
"""
from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import ModelError, PipetrainError
from .bundle import (
    ModelBundle,
    RandomLikeBatches,
    TensorSpec,
    check_batch_size,
    describe_value,
    example_inputs,
    mse_loss,
)
from .materialize import NotWeightless, WeightlessModel, build_weightless, on_device_of
from .output import output_logits
from .pretrained import HF_PREFIX, build_hf
from .registry import get_model

SPEC_FORMAT = "a built-in model name or 'package.module:function'"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def import_user_module(module_name: str) -> ModuleType:
    """Import ``module_name``; if its top-level package is not found, look in the current
    directory too (as ``python -m`` would): the ``pipetrain`` console script does not put
    the working directory on ``sys.path``, yet ``--model mymodel:make`` in a project
    directory is the common case. The directory is appended, so it never shadows packages."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        top = module_name.split(".")[0]
        cwd = os.getcwd()
        if exc.name != top or cwd in sys.path or "" in sys.path or not (
                os.path.isfile(os.path.join(cwd, top + ".py")) or os.path.isdir(os.path.join(cwd, top))):
            raise
        sys.path.append(cwd)
        return importlib.import_module(module_name)


def _import_factory(spec: str) -> Callable[..., Any]:
    module_name, _, func_name = spec.partition(":")
    if not module_name or not func_name or ":" in func_name:
        raise ModelError(f"model spec {spec!r} must be {SPEC_FORMAT}, e.g. 'mypkg.models:make_model'")
    try:
        module = import_user_module(module_name)
    except Exception as exc:  # ImportError, or any error raised while the module runs
        raise ModelError(
            f"cannot import module {module_name!r} of model spec {spec!r} ({_first_line(exc)}); "
            f"check the module name and that its directory is on PYTHONPATH") from None
    fn = getattr(module, func_name, None)
    if fn is None or not callable(fn):
        found = "has no attribute" if fn is None else f"has a non-callable {type(fn).__name__}"
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        raise ModelError(
            f"module {module_name!r} {found} {func_name!r} (model spec {spec!r}); "
            f"its functions: {', '.join(names) or 'none'}")
    return fn


def _call_factory(fn: Callable[..., Any], spec: str, batch_size: int | None, options: dict[str, Any]) -> Any:
    """Call ``fn(**options)``, adding ``batch_size=`` when the factory accepts it."""
    kwargs = dict(options)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = None
    if params is not None:
        var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        accepted = [n for n, p in params.items()
                    if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
        unknown = [k for k in options if k not in accepted and not var_kw]
        if unknown:
            raise ModelError(
                f"model factory {spec!r} takes no option {unknown[0]!r}; "
                f"its parameters: {', '.join(accepted) or 'none'}")
        if batch_size is not None and ("batch_size" in accepted or var_kw):
            kwargs["batch_size"] = batch_size
    try:
        return fn(**kwargs)
    except PipetrainError:
        raise
    except Exception as exc:
        raise ModelError(f"model factory {spec!r} raised {_first_line(exc)}; fix the factory or its options") \
            from None


def _shapes(inputs: tuple[Tensor, ...]) -> str:
    return ", ".join(f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in inputs)


def wrap_model(model: nn.Module, example_batch: Any, name: str) -> ModelBundle:
    """Turn ``(model, example_batch)`` into a bundle with an MSE loss and random batches.

    The model's output may be a tensor or hold the logits (a Hugging Face ``ModelOutput``, a
    dict with ``"logits"``, a tuple whose first element is the logits: see
    :func:`~pipetrain.models.output.output_logits`); the loss reads the logits. The model runs
    once on the example batch (without gradients; the CPU random state and
    the module's buffers, e.g. batch-norm statistics, are restored afterwards; a weightless
    model runs on a meta copy of the batch) to learn the output's shape and dtype.
    """
    if isinstance(example_batch, Tensor):
        inputs: tuple[Tensor, ...] = (example_batch,)
    elif (isinstance(example_batch, (tuple, list)) and example_batch
          and all(isinstance(t, Tensor) for t in example_batch)):
        inputs = tuple(example_batch)
    else:
        raise ModelError(
            f"model factory {name!r} must return (nn.Module, example_batch) with example_batch a tensor or a "
            f"tuple of tensors, got example_batch {describe_value(example_batch)}; return e.g. "
            f"(model, torch.randn(32, 784))")
    if any(t.dim() == 0 for t in inputs) or len({t.shape[0] for t in inputs}) != 1:
        raise ModelError(
            f"every tensor of the example batch of {name!r} must have the same batch dimension 0, got shapes "
            f"{_shapes(inputs)}; give each input a leading batch dimension")
    saved = {k: b.detach().clone() for k, b in model.named_buffers()}
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            output = model(*on_device_of(model, inputs))
            try:   # a Hugging Face ModelOutput, a dict or tuple holding the logits: those count
                output = output_logits(output)
            except ModelError:
                pass
    except Exception as exc:
        raise ModelError(
            f"model {name!r} fails on its own example batch (input shapes {_shapes(inputs)}): {_first_line(exc)}; "
            f"check that the example batch has the shape and dtype the model's first layer expects") from None
    finally:
        with torch.no_grad():
            for k, b in model.named_buffers():
                if k in saved:
                    b.copy_(saved[k])
    batch = int(inputs[0].shape[0])
    if not isinstance(output, Tensor) or not output.dtype.is_floating_point:
        got = describe_value(output) if not isinstance(output, Tensor) else f"a {output.dtype} tensor"
        raise ModelError(
            f"model {name!r} returns {got}, but the default MSE loss needs one floating-point tensor; "
            f"return a ModelBundle with your own loss_fn and make_batch instead")
    if output.dim() == 0 or output.shape[0] != batch:
        raise ModelError(
            f"model {name!r} output shape {list(output.shape)} does not keep the batch dimension 0 "
            f"(batch {batch}); return a ModelBundle with your own loss_fn and make_batch instead")
    batches = RandomLikeBatches(tuple(TensorSpec.like(t) for t in inputs),
                                TensorSpec(tuple(output.shape[1:]), output.dtype))
    return ModelBundle(model=model, example_inputs=inputs, loss_fn=mse_loss, make_batch=batches, name=name,
                       default_loss=True)


def _check_spec(spec: Any, batch_size: int | None) -> None:
    if not isinstance(spec, str) or not spec:
        raise ModelError(f"model spec must be {SPEC_FORMAT}, got {spec!r}")
    if batch_size is not None:
        check_batch_size(batch_size)


def _construct(spec: str, batch_size: int | None, options: dict[str, Any]) -> Any:
    """What the spec builds: a zoo bundle, a Hugging Face directory's, or a factory's own result."""
    if spec.startswith(HF_PREFIX):
        return build_hf(spec, batch_size, options)
    if ":" not in spec:
        return get_model(spec, batch_size, **options)
    return _call_factory(_import_factory(spec), spec, batch_size, options)


def _model_of(result: Any, spec: str) -> nn.Module:
    """The module of a factory's result (a bundle or ``(model, example_batch)``)."""
    if isinstance(result, ModelBundle):
        return result.model
    if isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[0], nn.Module):
        return result[0]
    raise ModelError(
        f"model factory {spec!r} must return (nn.Module, example_batch) or a ModelBundle, got "
        f"{describe_value(result)}; return e.g. (model, torch.randn(32, 784))")


def _finish(result: Any, spec: str, batch_size: int | None, options: dict[str, Any]) -> ModelBundle:
    """The bundle of a factory's result, its options and example batch filled in."""
    model = _model_of(result, spec)
    bundle = result if isinstance(result, ModelBundle) else wrap_model(model, result[1], spec)
    if ":" not in spec or spec.startswith(HF_PREFIX):
        return bundle
    if not bundle.options:
        bundle.options = dict(options)
    if batch_size is not None and bundle.batch_size != batch_size:
        try:
            bundle.example_inputs = example_inputs(bundle.make_batch, batch_size)
        except PipetrainError:
            raise
        except Exception as exc:
            raise ModelError(f"make_batch of model {spec!r} failed for batch_size={batch_size}: "
                             f"{_first_line(exc)}; fix the bundle's make_batch") from None
    return bundle


def load_model(spec: str, batch_size: int | None = None, **options: Any) -> ModelBundle:
    """A bundle from a built-in name (see :func:`get_model`) or a ``package.module:function`` factory.

    The factory is called with ``**options`` (and ``batch_size=`` if it has such a parameter)
    and returns a :class:`ModelBundle` or ``(model, example_batch)``. When ``batch_size`` is
    given and differs from the factory's example batch, the example inputs are redrawn with
    the bundle's ``make_batch`` at that size. Example:

        >>> bundle = load_model("mypkg.models:make_model", batch_size=32)   # doctest: +SKIP
    """
    _check_spec(spec, batch_size)
    return _finish(_construct(spec, batch_size, options), spec, batch_size, options)


def load_weightless(spec: str, seed: int, batch_size: int | None = None,
                    **options: Any) -> tuple[ModelBundle, WeightlessModel]:
    """:func:`load_model` with the model's parameters and buffers on ``meta``
    (:func:`pipetrain.models.materialize.build_weightless`): the bundle, whose example batch
    and data are real, and the :class:`~pipetrain.models.materialize.WeightlessModel` that
    gives any of its tensors their initial value from ``seed`` and their name.

    A ``(model, example_batch)`` factory's model runs once on a meta copy of the batch (for
    its output's shape): one whose forward cannot (it adds CPU tensors of its own to its
    activations) is built whole.

    Raises:
        NotWeightless: the factory's initialisation cannot be reproduced tensor by tensor,
            or the factory (or that forward) fails on meta tensors (the message says why);
            build it with :func:`load_model` instead, which gives a failing factory's own error.
    """
    _check_spec(spec, batch_size)
    try:
        result, weightless = build_weightless(lambda: _construct(spec, batch_size, options),
                                              lambda r: _model_of(r, spec), seed)
        bundle = _finish(result, spec, batch_size, options)
        weightless.rebind()  # buffers the forward for shapes assigned
    except NotWeightless:
        raise
    except Exception as exc:  # noqa: BLE001 - the whole build (load_model) reports a real failure itself
        raise NotWeightless(f"it fails with its tensors on the meta device: {_first_line(exc)}") from None
    return bundle, weightless

