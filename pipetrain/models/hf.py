"""Hugging Face GPT-2 (``hf-gpt2``), built offline from a ``GPT2Config`` (no download).

The model is ``transformers.GPT2LMHeadModel`` configured for pipelines: no KV cache
(``use_cache=False``), untied token embedding and LM head (``tie_word_embeddings=False``) so
no weight is shared between stages, no dropout, and eager attention (plain ops). A thin
wrapper makes ``forward(input_ids)`` return the logits tensor only. Options use the names of
the built-in ``gpt`` model, with the same defaults, so ``hf-gpt2`` and ``gpt`` have the same
shape. Hugging Face's forward has data-dependent Python control flow, so
``torch.fx.symbolic_trace`` fails on it; ``torch.export`` captures it.

A stock Hugging Face model a user factory returns as it comes (``use_cache`` at its default,
GPT-2, or an encoder-decoder such as T5 or BART whose decoder stack holds its own config) is
captured with the cache off on every config it holds (:mod:`pipetrain.graph.capture`).
"""
from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from ..errors import ModelError
from .bundle import LanguageModelBatches, ModelBundle, make_bundle, token_loss
from .options import Options

NAME = "hf-gpt2"
DEFAULTS: dict[str, Any] = {
    "vocab": 8192,      # GPT2Config.vocab_size
    "d_model": 256,     # n_embd
    "layers": 8,        # n_layer
    "heads": 4,         # n_head (d_model must be a multiple)
    "seq_len": 128,     # n_positions; the inputs have exactly this many tokens
}
DEFAULT_BATCH_SIZE = 16


class LogitsOnly(nn.Module):
    """``forward(input_ids) -> logits``: a causal LM whose output object is reduced to logits."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.lm(input_ids=input_ids).logits


def _resolve(options: dict[str, Any]) -> Options:
    opts = Options(NAME, options, DEFAULTS)
    opts.int("vocab", minimum=2)
    opts.int("d_model")
    opts.int("layers")
    heads = opts.int("heads")
    opts.int("seq_len")
    if opts.values["d_model"] % heads:
        raise opts.fail("d_model", f"a multiple of heads={heads}")
    return opts


def _build(o: dict[str, Any]) -> LogitsOnly:
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as exc:
        raise ModelError(f"model {NAME!r} needs the transformers package ({exc}); "
                         f"install it with `pip install transformers` or pick a built-in model") from None
    # attn_implementation goes through PreTrainedConfig's **kwargs, which GPT2Config's
    # dataclass signature (all mypy sees) does not show.
    config = GPT2Config(  # type: ignore[call-arg]
        vocab_size=o["vocab"], n_positions=o["seq_len"], n_embd=o["d_model"], n_layer=o["layers"],
        n_head=o["heads"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
        tie_word_embeddings=False, bos_token_id=o["vocab"] - 1, eos_token_id=o["vocab"] - 1,
        attn_implementation="eager",
    )
    return LogitsOnly(GPT2LMHeadModel(config))


def build_model(**options: Any) -> LogitsOnly:
    """The wrapped GPT-2 module alone."""
    return _build(_resolve(options).values)


def build(batch_size: int | None = None, **options: Any) -> ModelBundle:
    """GPT-2 on random token sequences; loss is next-token cross entropy."""
    o = _resolve(options).values
    return make_bundle(NAME, _build(o), token_loss, LanguageModelBatches(o["vocab"], o["seq_len"]),
                       batch_size, DEFAULT_BATCH_SIZE, o)
