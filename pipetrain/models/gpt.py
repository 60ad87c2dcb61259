"""A GPT-style decoder-only Transformer language model (pre-LN, as GPT-2 / nanoGPT).

``forward(tokens)`` with ``tokens (B, seq_len)`` returns ``(B, seq_len, vocab)`` logits::

    x = wte(tokens) + wpe(positions)
    for each block:  x = x + attn(ln_1(x));  x = x + mlp(ln_2(x))      (pre-LN residuals)
    logits = lm_head(ln_f(x))

Causal self-attention is written with plain tensor ops and ``nn.Linear``:
``softmax(mask(Q K^T / sqrt(d_head))) V`` (Vaswani et al. 2017, eq. 1), with the causal mask
a ``(seq_len, seq_len)`` buffer of each attention layer. Nothing in ``forward`` depends on
the input's shape, so the traced graph is a chain of tensor ops; in exchange the inputs must
have exactly ``seq_len`` tokens. The token embedding and the LM head are separate weights
(untied), so no parameter is shared between pipeline stages.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from .bundle import LanguageModelBatches, ModelBundle, make_bundle, token_loss
from .options import Options

NAME = "gpt"
DEFAULTS: dict[str, Any] = {
    "vocab": 8192,      # vocabulary size
    "d_model": 256,     # embedding / residual width
    "layers": 8,        # Transformer blocks
    "heads": 4,         # attention heads (d_model must be a multiple)
    "seq_len": 128,     # tokens per sequence (the inputs must have exactly this many)
    "dropout": 0.0,     # embedding, attention and residual dropout
}
DEFAULT_BATCH_SIZE = 16


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with separate Q, K, V projections."""

    causal_mask: Tensor  # a buffer (registered in __init__)

    def __init__(self, d_model: int, heads: int, seq_len: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.d_head = d_model // heads
        self.scale = 1.0 / math.sqrt(self.d_head)
        self.query = nn.Linear(d_model, d_model)
        self.key = nn.Linear(d_model, d_model)
        self.value = nn.Linear(d_model, d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.attn_drop = nn.Dropout(dropout) if dropout > 0 else None
        self.resid_drop = nn.Dropout(dropout) if dropout > 0 else None
        # True above the diagonal: position i may not attend to j > i.
        self.register_buffer("causal_mask", torch.ones(seq_len, seq_len, dtype=torch.bool).triu(1))

    def _split(self, x: Tensor) -> Tensor:
        return x.unflatten(-1, (self.heads, self.d_head)).transpose(1, 2)   # (B, heads, T, d_head)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self._split(self.query(x)), self._split(self.key(x)), self._split(self.value(x))
        att = torch.matmul(q, k.transpose(-2, -1)) * self.scale
        att = torch.softmax(att.masked_fill(self.causal_mask, float("-inf")), dim=-1)
        if self.attn_drop is not None:
            att = self.attn_drop(att)
        y = torch.matmul(att, v).transpose(1, 2).flatten(2)   # (B, T, d_model)
        y = self.proj(y)
        return y if self.resid_drop is None else self.resid_drop(y)


class Block(nn.Module):
    """Pre-LN Transformer block: attention and a 4x GELU MLP, each with a residual."""

    def __init__(self, d_model: int, heads: int, seq_len: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads, seq_len, dropout)
        self.ln_2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.gelu = nn.GELU()
        self.fc_proj = nn.Linear(4 * d_model, d_model)
        self.mlp_drop = nn.Dropout(dropout) if dropout > 0 else None

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        h = self.fc_proj(self.gelu(self.fc(self.ln_2(x))))
        if self.mlp_drop is not None:
            h = self.mlp_drop(h)
        return x + h


class GPT(nn.Module):
    """``forward(tokens (B, seq_len)) -> logits (B, seq_len, vocab)``."""

    def __init__(self, vocab: int = 8192, d_model: int = 256, layers: int = 8, heads: int = 4,
                 seq_len: int = 128, dropout: float = 0.0) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(seq_len, d_model)
        self.register_buffer("positions", torch.arange(seq_len))
        self.drop = nn.Dropout(dropout) if dropout > 0 else None
        self.blocks = nn.ModuleList(Block(d_model, heads, seq_len, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2's initialisation (Radford et al. 2019): weights N(0, 0.02), the residual
        projections' scaled by 1/sqrt(2 * layers), biases zero; layer norms keep their own."""
        layers = len(self.blocks)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers))
            elif p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)
            elif name.endswith("bias") and "ln" not in name:
                nn.init.zeros_(p)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.wte(tokens) + self.wpe(self.positions)   # (B, T, d) + (T, d)
        if self.drop is not None:
            x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _resolve(options: dict[str, Any]) -> Options:
    opts = Options(NAME, options, DEFAULTS)
    opts.int("vocab", minimum=2)
    opts.int("d_model")
    opts.int("layers")
    heads = opts.int("heads")
    opts.int("seq_len")
    opts.float("dropout", 0.0, 1.0)
    if opts.values["d_model"] % heads:
        raise opts.fail("d_model", f"a multiple of heads={heads}")
    return opts


def _build(o: dict[str, Any]) -> GPT:
    return GPT(o["vocab"], o["d_model"], o["layers"], o["heads"], o["seq_len"], o["dropout"])


def build_model(**options: Any) -> GPT:
    """The GPT module alone."""
    return _build(_resolve(options).values)


def build(batch_size: int | None = None, **options: Any) -> ModelBundle:
    """GPT on random token sequences; loss is next-token cross entropy."""
    o = _resolve(options).values
    return make_bundle(NAME, _build(o), token_loss, LanguageModelBatches(o["vocab"], o["seq_len"]),
                       batch_size, DEFAULT_BATCH_SIZE, o)
