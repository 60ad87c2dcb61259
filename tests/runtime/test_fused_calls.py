"""An exported graph's ``aten.linear`` and ``aten.embedding`` calls, and ``nn.Embedding``
modules, feed the stage's gradient sink (fused.py), so a
Hugging Face model's weight gradients are accumulated in place as ``nn.Linear``'s are."""
from __future__ import annotations

import pytest
import torch

from pipetrain.graph import capture
from pipetrain.runtime.engine.fused import AccumulatingEmbedding, FusedEmbeddingCall, FusedLinearCall, GradSink, install

transformers = pytest.importorskip("transformers")


def _loss(gm: torch.fx.GraphModule, x: torch.Tensor) -> torch.Tensor:
    out = gm(x)
    logits = out[0] if isinstance(out, (tuple, list)) else getattr(out, "logits", out)
    return logits.float().pow(2).mean()


def test_exported_linear_calls_accumulate_the_autograd_gradients() -> None:
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4)
    torch.manual_seed(0)
    x = torch.randint(0, 64, (2, 8))
    gm = capture(transformers.LlamaForCausalLM(cfg), (x,)).gm
    names = {n for n, _ in gm.named_parameters()}
    _loss(gm, x).backward()
    expected = {n: 3 * p.grad for n, p in gm.named_parameters() if p.grad is not None}
    gm.zero_grad(set_to_none=True)

    sink = GradSink()
    sink.buffers = {n: torch.full_like(p, float("nan")) for n, p in gm.named_parameters()}  # written first, not added
    fed = set(install(gm, names, sink))
    calls = [n for n in gm.graph.nodes if isinstance(n.target, FusedLinearCall)]
    embeddings = [n for n in gm.graph.nodes if isinstance(n.target, FusedEmbeddingCall)]
    assert len(calls) == 15 and len(embeddings) == 1  # q, k, v, o, gate, up, down per layer and the head
    assert len(fed) == 16  # and the token embedding
    for _ in range(3):
        _loss(gm, x).backward()
    for n, want in expected.items():
        got = sink.buffers[n] if n in fed else gm.get_parameter(n).grad
        assert n not in fed or gm.get_parameter(n).grad is None  # autograd returned no weight gradient
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


class _Tokens(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 8, padding_idx=3)
        self.head = torch.nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x) * 2.0)


def test_embedding_modules_add_their_rows_into_the_sink_without_the_padding_row() -> None:
    torch.manual_seed(0)
    x = torch.tensor([[3, 1, 1, 7], [0, 3, 49, 1]])  # repeated rows and the padding index
    gm = capture(_Tokens(), (x,)).gm
    names = {n for n, _ in gm.named_parameters()}
    gm(x).pow(2).mean().backward()
    expected = {n: 2 * p.grad for n, p in gm.named_parameters()}
    gm.zero_grad(set_to_none=True)

    sink = GradSink()
    sink.buffers = {n: torch.full_like(p, float("nan")) for n, p in gm.named_parameters()}
    fed = set(install(gm, names, sink))
    assert isinstance(gm.get_submodule("emb"), AccumulatingEmbedding) and "emb.weight" in fed
    for _ in range(2):
        gm(x).pow(2).mean().backward()
    assert gm.get_parameter("emb.weight").grad is None
    assert sink.buffers["emb.weight"][3].eq(0).all()  # the padding row: no gradient
    for n, want in expected.items():
        torch.testing.assert_close(sink.buffers[n], want, rtol=1e-5, atol=1e-7)
