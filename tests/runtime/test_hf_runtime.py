"""A stock Hugging Face GPT-2, returned as it is by a user factory, trains through the pipeline.

``--model test_hf_runtime:gpt2`` returns ``(GPT2LMHeadModel(GPT2Config(...)), example_batch)``:
no wrapper, the default config (``use_cache=True``, ``tie_word_embeddings=True``), so its
forward returns a ``ModelOutput`` and its token embedding and LM head are one tensor. The
capture drops the key/value cache, the last stage's output is the ``ModelOutput`` (the loss
reads its logits), and the plan puts the embedding and the head on different stages, whose
copies of the tied weight are kept equal (stages/tied.py). Two workers under ``flush`` on
token data (``--data``: cross entropy of the logits against the targets) equal plain training
of the model in one process to 1e-5.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from pipetrain.graph import capture  # noqa: E402
from pipetrain.job import OptimizerConfig, TrainConfig  # noqa: E402
from pipetrain.job.model import load_bundle  # noqa: E402
from pipetrain.models import output_logits  # noqa: E402
from pipetrain.run import resolve_run  # noqa: E402
from pipetrain.runtime import launch_local  # noqa: E402

pytestmark = pytest.mark.timeout(150)

VOCAB, SEQ = 64, 8
TIMEOUT = 40
SGD = OptimizerConfig("sgd", lr=0.1, momentum=0.9)  # not Adam: the key bias's gradient is rounding noise
TOKENS_SEED = 7


def gpt2(batch_size: int = 4) -> tuple[torch.nn.Module, torch.Tensor]:
    """``--model test_hf_runtime:gpt2``: a tiny stock GPT-2 (dropout off, so runs compare exactly)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)  # first: the weights come from the seed alone, whatever the batch size
    example = torch.randint(0, VOCAB, (batch_size, SEQ))
    example[0, 0] = VOCAB - 1  # synthetic tokens are drawn below the example's largest: the whole vocabulary
    return model, example


def _tokens(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(TOKENS_SEED)
    t = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def token_data() -> tuple[Any, Any]:
    """``--data test_hf_runtime:token_data``: one minibatch of 8 token sequences (so every
    step trains on the same samples, in whatever order), next-token targets."""
    from torch.utils.data import TensorDataset

    return TensorDataset(*_tokens(8)), TensorDataset(*_tokens(8))


def cfg(**kw: Any) -> TrainConfig:
    base: dict[str, Any] = dict(model="test_hf_runtime:gpt2", workers=2, config="1-1", schedule="flush",
                                batch_size=8, microbatches=2, steps=3, optimizer=SGD, return_state=True,
                                timeout=TIMEOUT, quiet=True, loader_workers=0)
    base.update(kw)
    return TrainConfig.of(**base)


def assert_params_close(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], tol: float = 1e-5) -> None:
    assert set(ref) <= set(state), sorted(set(ref) - set(state))[:4]
    for name, t in ref.items():
        err = float((state[name].float() - t.float()).abs().max() / (t.float().abs().max() + 1e-6))
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol}"


def test_stock_gpt2_is_captured_without_its_cache() -> None:
    torch.manual_seed(0)
    model, batch = gpt2()
    assert model.config.use_cache and model.config.tie_word_embeddings
    cm = capture(model, (batch,))
    assert model.config.use_cache  # restored
    out = cm.gm(batch)
    assert list(out.keys()) == ["logits"] and output_logits(out).shape == (4, SEQ, VOCAB)
    [shared] = [s for s in cm.shared_parameters if "lm_head.weight" in s.names]
    assert set(shared.names) == {"transformer.wte.weight", "lm_head.weight"}


@pytest.fixture(scope="module")
def tokens_run() -> dict[str, Any]:
    run = resolve_run(cfg(data="test_hf_runtime:token_data"))
    [result] = launch_local([run], timeout=TIMEOUT)
    return {"run": run, "result": result}


def test_stock_gpt2_trains_on_two_workers_like_one_process(tokens_run: dict[str, Any]) -> None:
    """Cross entropy of the logits against the token targets, the tied weight on both stages."""
    run, r = tokens_run["run"], tokens_run["result"]
    assert run.plan is not None and run.plan.num_stages == 2
    # the token embedding (stage 0) and the LM head (stage 1) read one tensor: a tie across stages
    assert "embedding" in run.plan.stages[0].nodes and "linear" in run.plan.stages[1].nodes
    model = load_bundle(run.config, 8).model  # the run's initial weights (its seed and each tensor's name)
    init = model.lm_head.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = _tokens(8)
    losses = []
    for _ in range(3):   # every minibatch is the whole data set
        opt.zero_grad()
        loss = F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert r.losses == pytest.approx(losses, rel=1e-5)
    ref = {k: v.detach() for k, v in model.state_dict().items()}
    assert {"transformer.wte.weight", "lm_head.weight"} <= set(ref)
    assert_params_close(r.state, ref)
    assert torch.equal(r.state["transformer.wte.weight"], r.state["lm_head.weight"])
    assert not torch.allclose(ref["lm_head.weight"], init, atol=1e-4)  # the tied weight was trained
