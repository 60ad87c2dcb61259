"""The ModelBundle: a model with its example minibatch, loss and synthetic data source.

Everything downstream (capture, profile, plan, run) takes a bundle. The batch generators and
loss functions here are module-level callables (dataclasses with ``__call__``), not closures,
so that a bundle's pieces can be pickled to worker processes.

Synthetic data is drawn only from the ``torch.Generator`` passed to ``make_batch``, on the
CPU, so a seeded generator gives the same batch in every process and on every run.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ModelError
from .output import output_logits

Batch = tuple[tuple[Tensor, ...], Tensor]
"""One synthetic minibatch: ``(inputs, target)``, every tensor with batch dimension 0."""


@dataclass
class ModelBundle:
    """A model ready for the pipeline: module, example minibatch, loss and data source.

    Attributes:
        model: the ``nn.Module``; ``model(*example_inputs)`` gives the output ``loss_fn`` reads.
        example_inputs: one minibatch of inputs, batch dimension 0 (what capture and the
            profiler run the model on).
        loss_fn: ``loss_fn(output, target) -> scalar Tensor``, the mean over the batch.
        make_batch: ``make_batch(batch_size, generator) -> (inputs, target)``, synthetic and
            deterministic for a seeded ``torch.Generator``.
        name: the model's name (``"resnet50"``, or the ``module:function`` spec).
        options: the model's options with every default filled in.
        default_loss: True when ``loss_fn`` is pipetrain's stand-in that goes with the
            synthetic ``make_batch`` (zoo models, wrapped ``(model, example_batch)``
            factories), so real data picks the loss from its targets
            (:func:`pipetrain.data.loss_for_bundle`); False (a bundle a user built) means the
            author's loss, which always wins.
    """

    model: nn.Module
    example_inputs: tuple[Tensor, ...]
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    make_batch: Callable[[int, torch.Generator], Batch]
    name: str
    options: dict[str, Any] = field(default_factory=dict)
    default_loss: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.example_inputs, Tensor):
            self.example_inputs = (self.example_inputs,)
        if not isinstance(self.model, nn.Module):
            raise ModelError(
                f"ModelBundle.model must be a torch.nn.Module, got {type(self.model).__name__} "
                f"(bundle {self.name!r}); pass the module itself")
        if (not isinstance(self.example_inputs, (tuple, list)) or not self.example_inputs
                or not all(isinstance(t, Tensor) for t in self.example_inputs)):
            raise ModelError(
                f"ModelBundle.example_inputs must be a non-empty tuple of tensors, got "
                f"{describe_value(self.example_inputs)} (bundle {self.name!r}); pass (tensor, ...)")
        self.example_inputs = tuple(self.example_inputs)
        if not callable(self.loss_fn) or not callable(self.make_batch):
            raise ModelError(
                f"ModelBundle.loss_fn and make_batch must be callables (bundle {self.name!r}); "
                f"got {type(self.loss_fn).__name__} and {type(self.make_batch).__name__}")

    @property
    def batch_size(self) -> int:
        """The example minibatch's size (dimension 0 of the first input)."""
        return int(self.example_inputs[0].shape[0]) if self.example_inputs[0].dim() else 1


def describe_value(value: Any) -> str:
    """A short description of a value for error messages: ``tuple(Linear, Tensor[4, 3])``."""
    if isinstance(value, Tensor):
        return f"Tensor{list(value.shape)}"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(describe_value(v) for v in value[:4])
        more = ", ..." if len(value) > 4 else ""
        return f"{type(value).__name__}({inner}{more})"
    return type(value).__name__


def check_batch_size(batch_size: Any) -> int:
    """A batch size must be a positive int; returns it."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ModelError(f"batch_size must be an integer >= 1, got {batch_size!r}; pass e.g. batch_size=32")
    return batch_size


# ---------------------------------------------------------------------------------------
# Losses: the mean over the batch (for token models, over every token of the batch, which is
# the same thing since every sample has the same number of tokens). Each takes the model's
# output as it comes (a tensor, a Hugging Face ModelOutput, a dict or tuple holding the logits).


def classification_loss(output: Any, target: Tensor) -> Tensor:
    """Cross entropy of ``(B, classes)`` logits against ``(B,)`` class ids."""
    return F.cross_entropy(output_logits(output), target)


def token_loss(output: Any, target: Tensor) -> Tensor:
    """Token-level cross entropy of ``(B, T, vocab)`` logits against ``(B, T)`` token ids."""
    return F.cross_entropy(output_logits(output).flatten(0, -2), target.flatten())


def mse_loss(output: Any, target: Tensor) -> Tensor:
    """Mean squared error (the default loss of ``(model, example_batch)`` factories)."""
    return F.mse_loss(output_logits(output), target)


# ---------------------------------------------------------------------------------------
# Synthetic batch generators.


# The synthetic tasks are learnable, so that a demo's loss falls: each draws the target
# uniformly, then makes the input depend on it through a fixed random code (the same in
# every process: it comes from its own generator with a constant seed, never from the
# caller's generator, whose stream stays one draw per tensor).
_CODE_SEED = 20180603  # PipeDream's arXiv date; any constant works


def _code(rows: int, cols: int) -> Tensor:
    return torch.randn((rows, cols), generator=torch.Generator().manual_seed(_CODE_SEED))


def _successor(vocab: int) -> Tensor:
    return torch.randperm(vocab, generator=torch.Generator().manual_seed(_CODE_SEED))


@dataclass(frozen=True)
class ClassificationBatches:
    """Inputs ``randn(B, *input_shape)`` plus a class signal, targets uniform in ``[0, num_classes)``.

    The signal: the first ``k = min(64, numel)`` input values get ``2 * code[y]`` added, with
    ``code`` a fixed random ``num_classes x k`` matrix, so the class is recoverable.
    """

    input_shape: tuple[int, ...]
    num_classes: int

    def __call__(self, batch_size: int, generator: torch.Generator) -> Batch:
        check_batch_size(batch_size)
        x = torch.randn((batch_size, *self.input_shape), generator=generator, device="cpu")
        y = torch.randint(0, self.num_classes, (batch_size,), generator=generator, device="cpu")
        flat = x.view(batch_size, -1)
        k = min(64, flat.shape[1])
        flat[:, :k] += 2.0 * _code(self.num_classes, k)[y]
        return (x,), y


@dataclass(frozen=True)
class LanguageModelBatches:
    """Next-token prediction on a learnable stream: inputs ``[:-1]``, target ``[1:]``.

    Token ``i+1`` is ``succ[token i]`` (a fixed random permutation of the vocabulary) with
    probability 3/4, otherwise uniform.
    """

    vocab: int
    seq_len: int

    def __call__(self, batch_size: int, generator: torch.Generator) -> Batch:
        check_batch_size(batch_size)
        noise = torch.randint(0, self.vocab, (batch_size, self.seq_len + 1), generator=generator, device="cpu")
        keep = torch.rand((batch_size, self.seq_len + 1), generator=generator, device="cpu") < 0.75
        succ = _successor(self.vocab)
        tokens = noise.clone()
        for i in range(1, self.seq_len + 1):
            tokens[:, i] = torch.where(keep[:, i], succ[tokens[:, i - 1]], noise[:, i])
        return (tokens[:, :-1].contiguous(),), tokens[:, 1:].contiguous()


@dataclass(frozen=True)
class TranslationBatches:
    """Sequence to sequence with teacher forcing: inputs ``(src, tgt[:-1])``, target ``tgt[1:]``.

    The translation is learnable: ``tgt[j] = succ[src[j mod src_len]]`` for a fixed random
    permutation ``succ``, after a first token drawn uniformly.
    """

    vocab: int
    src_len: int
    tgt_len: int

    def __call__(self, batch_size: int, generator: torch.Generator) -> Batch:
        check_batch_size(batch_size)
        src = torch.randint(0, self.vocab, (batch_size, self.src_len), generator=generator, device="cpu")
        first = torch.randint(0, self.vocab, (batch_size, 1), generator=generator, device="cpu")
        idx = torch.arange(self.tgt_len) % self.src_len
        tgt = torch.cat([first, _successor(self.vocab)[src[:, idx]]], dim=1)
        return (src, tgt[:, :-1].contiguous()), tgt[:, 1:].contiguous()


@dataclass(frozen=True)
class MaskedTranslationBatches(TranslationBatches):
    """:class:`TranslationBatches` with the source's attention mask (all ones) between the
    source and the decoder's tokens: inputs ``(src, mask, tgt[:-1])``, the positional order of a
    Hugging Face encoder-decoder's forward (``input_ids, attention_mask, decoder_input_ids``)."""

    def __call__(self, batch_size: int, generator: torch.Generator) -> Batch:
        (src, tgt_in), target = super().__call__(batch_size, generator)
        return (src, torch.ones_like(src), tgt_in), target


@dataclass(frozen=True)
class TensorSpec:
    """Per-sample shape and dtype of one tensor; ``high`` bounds integer values to ``[0, high)``."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    high: int = 1

    def sample(self, batch_size: int, generator: torch.Generator) -> Tensor:
        """A random tensor of shape ``(batch_size, *shape)``."""
        size = (batch_size, *self.shape)
        if self.dtype == torch.bool:
            return torch.randint(0, 2, size, generator=generator, device="cpu").bool()
        if self.dtype.is_floating_point or self.dtype.is_complex:
            return torch.randn(size, generator=generator, device="cpu").to(self.dtype)
        return torch.randint(0, self.high, size, generator=generator, device="cpu").to(self.dtype)

    @staticmethod
    def like(t: Tensor) -> TensorSpec:
        """The spec of an example tensor (integers: ``high = max + 1``, at least 1)."""
        high = 1
        if t.numel() and not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool):
            high = max(int(t.max().item()) + 1, 1)
        return TensorSpec(tuple(t.shape[1:]), t.dtype, high)


@dataclass(frozen=True)
class RandomLikeBatches:
    """Random tensors shaped like a factory's example batch, and a random target (MSE)."""

    inputs: tuple[TensorSpec, ...]
    target: TensorSpec

    def __call__(self, batch_size: int, generator: torch.Generator) -> Batch:
        check_batch_size(batch_size)
        inputs = tuple(spec.sample(batch_size, generator) for spec in self.inputs)
        return inputs, self.target.sample(batch_size, generator)


def example_inputs(make_batch: Callable[[int, torch.Generator], Batch], batch_size: int) -> tuple[Tensor, ...]:
    """The example minibatch of a bundle: ``make_batch`` with a generator seeded with 0."""
    return make_batch(batch_size, torch.Generator().manual_seed(0))[0]


def make_bundle(name: str, model: nn.Module, loss_fn: Callable[[Tensor, Tensor], Tensor],
                make_batch: Callable[[int, torch.Generator], Batch], batch_size: int | None,
                default_batch_size: int, options: dict[str, Any]) -> ModelBundle:
    """Assemble a zoo bundle; the example minibatch is ``make_batch(batch_size, seed 0)``.

    ``batch_size=None`` takes the model's ``default_batch_size``.
    """
    size = default_batch_size if batch_size is None else check_batch_size(batch_size)
    return ModelBundle(model=model, example_inputs=example_inputs(make_batch, size),
                       loss_fn=loss_fn, make_batch=make_batch, name=name, options=dict(options), default_loss=True)
