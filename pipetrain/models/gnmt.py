"""A GNMT-style LSTM encoder-decoder with attention (Wu et al. 2016; MLPerf's GNMT).

Two inputs, ``(src_tokens, tgt_tokens)``, both ``(B, seq_len)`` token ids; the output is
``(B, seq_len, vocab)`` logits for the next target token (teacher forcing)::

    encoder: embed -> LSTM_0 (bidirectional: 2 x hidden out) -> LSTM_1 -> LSTM_i + residual (i >= 2)
    decoder: embed -> LSTM_0 -> attention(query = LSTM_0 output, keys = values = encoder output)
             -> LSTM_1([y, ctx]) -> LSTM_i([y, ctx]) + residual (i >= 2) -> Linear(hidden, vocab)

As in MLPerf's GNMT there is no input feeding: the attention query comes from the bottom
decoder layer, so the context of every target position can be computed at once and the whole
forward is a fixed graph of leaf modules (``nn.LSTM``, ``nn.Linear``, ``nn.Embedding``) and
tensor ops, which ``torch.fx.symbolic_trace`` captures.

Attention (``attention`` option), with q the query, k_j the encoder outputs:

- ``"additive"`` (Bahdanau): score_j = v^T tanh(W_q q + W_k k_j)
- ``"dot"`` (scaled Luong):  score_j = (W_q q) . k_j / sqrt(hidden)

then weights = softmax_j(score), ctx = sum_j weights_j k_j.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .bundle import ModelBundle, TranslationBatches, make_bundle, token_loss
from .options import Options

NAME = "gnmt"
DEFAULTS: dict[str, Any] = {
    "vocab": 32320,          # shared source/target vocabulary size (MLPerf's BPE vocabulary)
    "hidden": 1024,          # LSTM hidden size and embedding size
    "layers": 4,             # LSTM layers in the encoder, and again in the decoder (>= 2)
    "seq_len": 50,           # tokens per source and per target sentence
    "bidirectional": True,   # the bottom encoder layer reads both directions
    "attention": "additive",  # "additive" (Bahdanau) or "dot" (scaled dot product)
    "dropout": 0.0,          # dropout on the inputs of the upper LSTM layers
}
DEFAULT_BATCH_SIZE = 64
ATTENTIONS = ("additive", "dot")


class Attention(nn.Module):
    """Attention of every decoder position over every encoder position (plain tensor ops)."""

    def __init__(self, hidden: int, kind: str = "additive") -> None:
        super().__init__()
        self.kind = kind
        self.query = nn.Linear(hidden, hidden, bias=False)
        if kind == "additive":
            self.key = nn.Linear(hidden, hidden, bias=True)
            self.score = nn.Linear(hidden, 1, bias=False)
        self.scale = hidden ** -0.5

    def forward(self, query: Tensor, keys: Tensor) -> Tensor:
        """``query (B, Tq, H)``, ``keys (B, Tk, H)`` -> context ``(B, Tq, H)``."""
        if self.kind == "additive":
            q = self.query(query).unsqueeze(2)            # (B, Tq, 1, H)
            k = self.key(keys).unsqueeze(1)               # (B, 1, Tk, H)
            scores = self.score(torch.tanh(q + k)).squeeze(-1)   # (B, Tq, Tk)
        else:
            scores = torch.bmm(self.query(query), keys.transpose(1, 2)) * self.scale
        weights = torch.softmax(scores, dim=-1)
        return torch.bmm(weights, keys)


class Encoder(nn.Module):
    """Embedding and a stack of LSTMs; residual connections from the third layer on."""

    def __init__(self, vocab: int, hidden: int, layers: int, bidirectional: bool, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.rnn0 = nn.LSTM(hidden, hidden, batch_first=True, bidirectional=bidirectional)
        self.rnn1 = nn.LSTM(2 * hidden if bidirectional else hidden, hidden, batch_first=True)
        self.upper = nn.ModuleList(nn.LSTM(hidden, hidden, batch_first=True) for _ in range(layers - 2))
        self.drops = nn.ModuleList(nn.Dropout(dropout) for _ in range(layers - 1)) if dropout > 0 else None

    def forward(self, src: Tensor) -> Tensor:
        x = self.rnn0(self.embed(src))[0]
        if self.drops is not None:
            x = self.drops[0](x)
        x = self.rnn1(x)[0]
        for i, rnn in enumerate(self.upper):
            if self.drops is not None:
                x = self.drops[i + 1](x)
            x = rnn(x)[0] + x
        return x


class Decoder(nn.Module):
    """Embedding, bottom LSTM, attention, upper LSTMs fed ``[y, context]``, vocabulary projection."""

    def __init__(self, vocab: int, hidden: int, layers: int, attention: str, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.rnn0 = nn.LSTM(hidden, hidden, batch_first=True)
        self.attention = Attention(hidden, attention)
        self.upper = nn.ModuleList(nn.LSTM(2 * hidden, hidden, batch_first=True) for _ in range(layers - 1))
        self.drops = nn.ModuleList(nn.Dropout(dropout) for _ in range(layers - 1)) if dropout > 0 else None
        self.classifier = nn.Linear(hidden, vocab)

    def forward(self, tgt: Tensor, memory: Tensor) -> Tensor:
        y = self.rnn0(self.embed(tgt))[0]
        ctx = self.attention(y, memory)
        for i, rnn in enumerate(self.upper):
            if self.drops is not None:
                y = self.drops[i](y)
            out = rnn(torch.cat([y, ctx], dim=-1))[0]
            y = out if i == 0 else out + y   # residual from the third decoder layer on
        return self.classifier(y)


class GNMT(nn.Module):
    """``forward(src_tokens, tgt_tokens) -> (B, T_tgt, vocab)`` logits."""

    def __init__(self, vocab: int = 32320, hidden: int = 1024, layers: int = 4, bidirectional: bool = True,
                 attention: str = "additive", dropout: float = 0.0) -> None:
        super().__init__()
        self.encoder = Encoder(vocab, hidden, layers, bidirectional, dropout)
        self.decoder = Decoder(vocab, hidden, layers, attention, dropout)

    def forward(self, src_tokens: Tensor, tgt_tokens: Tensor) -> Tensor:
        return self.decoder(tgt_tokens, self.encoder(src_tokens))


def _resolve(options: dict[str, Any]) -> Options:
    opts = Options(NAME, options, DEFAULTS)
    opts.int("vocab", minimum=2)
    opts.int("hidden")
    opts.int("layers", minimum=2)
    opts.int("seq_len")
    opts.bool("bidirectional")
    opts.choice("attention", ATTENTIONS)
    opts.float("dropout", 0.0, 1.0)
    return opts


def _build(o: dict[str, Any]) -> GNMT:
    return GNMT(o["vocab"], o["hidden"], o["layers"], o["bidirectional"], o["attention"], o["dropout"])


def build_model(**options: Any) -> GNMT:
    """The GNMT module alone (``seq_len`` only affects the example batch)."""
    return _build(_resolve(options).values)


def build(batch_size: int | None = None, **options: Any) -> ModelBundle:
    """GNMT on random token sentences; loss is token-level cross entropy."""
    o = _resolve(options).values
    return make_bundle(NAME, _build(o), token_loss, TranslationBatches(o["vocab"], o["seq_len"], o["seq_len"]),
                       batch_size, DEFAULT_BATCH_SIZE, o)
