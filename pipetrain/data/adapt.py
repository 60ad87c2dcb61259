"""Built-in models adapt their input and output sizes to the data; a model that cannot fit says so.

:func:`model_options_for` gives the zoo options that make a model read the data's samples and
predict its classes or tokens:

=====================  ==================================================================
model                  options from the data
=====================  ==================================================================
``mlp``                ``in_features`` (and ``input_shape`` for images: a Flatten first),
                       ``num_classes``: ``digits`` -> 64 inputs, 10 classes
``alexnet``, ``vgg16``, ``in_channels``, ``image_size``, ``num_classes``: Fashion-MNIST ->
``resnet50``           1, 28, 10 (samples must be ``[C, H, H]`` images)
``gpt``, ``hf-gpt2``   ``vocab`` = the vocabulary size, ``seq_len``
=====================  ==================================================================

Options the user gives explicitly are meant to override these: build with
``{**model_options_for(name, source), **user_options}``. A user factory
(``package.module:function``) gets no options; :func:`check_fits` then compares its example
inputs with the data's samples and probes one forward pass.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..errors import DataError, PipetrainError
from ..models.bundle import ModelBundle
from ..models.materialize import is_weightless, meta_limit, on_device_of
from ..models.output import output_logits
from .loader import gather
from .loss import loss_for_bundle
from .source import DataSource

__all__ = ["IMAGE_MODELS", "TOKEN_MODELS", "check_fits", "model_options_for"]

IMAGE_MODELS: tuple[str, ...] = ("alexnet", "vgg16", "resnet50")
TOKEN_MODELS: tuple[str, ...] = ("gpt", "hf-gpt2")


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def model_options_for(model_name: str, source: DataSource) -> dict[str, Any]:
    """The options of zoo model ``model_name`` that fit ``source`` (``{}`` for synthetic data and
    for user factories).

    Raises:
        DataError: the model cannot read the data (e.g. an image model on flat features, a
            language model on images); the message names both shapes and a model that fits.
    """
    if source.synthetic or ":" in model_name:
        return {}
    shapes = source.input_shapes
    if model_name == "gnmt":
        raise DataError(f"model 'gnmt' reads (source, target) token pairs and no data set of pipetrain gives them; "
                        f"train it on --data synthetic, or pick gpt for {source.name!r}")
    if model_name in TOKEN_MODELS:
        if source.task != "language" or len(shapes) != 1 or len(shapes[0]) != 1:
            raise DataError(
                f"model {model_name!r} reads token sequences [seq_len] with next-token targets, but data "
                f"{source.name!r} gives {source.task} samples {_shape(shapes[0])}; use --data shakespeare or "
                f"text:PATH, or a model such as mlp")
        opts: dict[str, Any] = {"seq_len": int(shapes[0][0])}
        if source.vocab_size is not None:
            opts["vocab"] = int(source.vocab_size)
        return opts
    if len(shapes) != 1 or source.task == "language":
        raise DataError(
            f"model {model_name!r} reads one input of numbers, but data {source.name!r} gives {source.task} samples "
            f"{', '.join(_shape(s) for s in shapes)}; use gpt for text, or a model factory of your own")
    shape = tuple(int(d) for d in shapes[0])
    outputs = source.num_classes
    if source.task == "regression":
        outputs = max(math.prod(source.target_shape), 1)
    if model_name == "mlp":
        opts = {"in_features": math.prod(shape)}
        if len(shape) > 1:
            opts["input_shape"] = shape
        if outputs is not None:
            opts["num_classes"] = int(outputs)
        return opts
    if model_name in IMAGE_MODELS:
        if len(shape) != 3 or shape[1] != shape[2]:
            raise DataError(
                f"model {model_name!r} reads square images [channels, size, size], but data {source.name!r} gives "
                f"samples {_shape(shape)}; use --model mlp for flat features, or data of images such as "
                f"fashion-mnist")
        opts = {"in_channels": shape[0], "image_size": shape[1]}
        if outputs is not None:
            opts["num_classes"] = int(outputs)
        return opts
    return {}


def check_fits(bundle: ModelBundle, source: DataSource, probe: bool = True) -> None:
    """Check that ``bundle`` can train on ``source``, before any worker starts.

    Compares the number, per-sample shapes and kinds (integer or floating point) of the
    model's example inputs with the data's; with ``probe``, runs the model on the first two
    train samples (no gradients; buffers and the random state restored) and the loss on its
    output, and checks that the logits cover every class or token id of the data.

    Raises:
        DataError: one line naming the model's shape and the data's.
    """
    if source.synthetic:
        return
    model_shapes = [tuple(int(d) for d in t.shape[1:]) for t in bundle.example_inputs]
    data_shapes = [tuple(s) for s in source.input_shapes]
    model_desc = ", ".join(f"{_shape(s)} {str(t.dtype).replace('torch.', '')}"
                           for s, t in zip(model_shapes, bundle.example_inputs))
    data_desc = ", ".join(f"{_shape(s)} {str(d).replace('torch.', '')}"
                          for s, d in zip(data_shapes, source.input_dtypes))
    kinds_ok = all(t.dtype.is_floating_point == d.is_floating_point
                   for t, d in zip(bundle.example_inputs, source.input_dtypes))
    if model_shapes != data_shapes or not kinds_ok:
        raise DataError(
            f"samples of data {source.name!r} do not fit model {bundle.name!r}: the model reads inputs "
            f"{model_desc} per sample, the data gives {data_desc}; pick a model built for this data (built-in "
            f"models adapt with model_options_for) or reshape the data in your dataset")
    if not probe or source.train is None:
        return
    inputs, maybe_target = gather(source.train, torch.arange(min(2, source.num_train)), "both")
    assert maybe_target is not None  # part="both" loads the target
    target = maybe_target
    inputs = tuple(x.to(bundle.example_inputs[k].dtype) if x.dtype != bundle.example_inputs[k].dtype else x
                   for k, x in enumerate(inputs))
    model: nn.Module = bundle.model
    saved = {k: b.detach().clone() for k, b in model.named_buffers()}
    training = model.training
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            output = model(*on_device_of(model, inputs))  # a weightless model runs for shapes on meta
            logits = output_logits(output)
            loss_for_bundle(bundle, source)(output, on_device_of(model, target))
    except PipetrainError:
        raise
    except Exception as exc:
        if is_weightless(model) and meta_limit(exc):
            return  # the forward needs values: the workers run it on their stages' own
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise DataError(
            f"model {bundle.name!r} fails on samples of data {source.name!r} (inputs {data_desc}, target "
            f"{_shape(tuple(target.shape[1:]))} {str(target.dtype).replace('torch.', '')}): {type(exc).__name__}: "
            f"{first}; check the model's output against the data's targets") from None
    finally:
        model.train(training)
        with torch.no_grad():
            for k, b in model.named_buffers():
                if k in saved:
                    b.copy_(saved[k])
    classes = source.vocab_size if source.task == "language" else source.num_classes
    if classes is not None and logits.shape[-1] < classes and not source.target_dtype.is_floating_point:
        raise DataError(
            f"model {bundle.name!r} predicts {logits.shape[-1]} classes but data {source.name!r} has {classes}; "
            f"build it with num_classes={classes} (vocab={classes} for language models), e.g. through "
            f"model_options_for")
