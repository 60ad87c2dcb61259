"""Mixtures of experts as they come from Hugging Face (Mixtral, Qwen2-MoE): the experts run as a
capture can take them (pipetrain.models.experts, pipetrain.graph.ops.grouped_mm) and equal
transformers' ``eager`` experts; ``hf:DIR`` reads per-expert tensors fused as
``from_pretrained`` fuses them; two stages train as one worker does; ``--save-hf`` writes a
directory ``from_pretrained`` loads."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
# transformers 5's experts implementations (ExpertsInterface) and checkpoint conversions
pytest.importorskip("transformers.integrations.moe")
pytest.importorskip("transformers.core_model_loading")

from test_hf_dir import weights  # noqa: E402

from pipetrain.errors import ModelError  # noqa: E402
from pipetrain.graph.ops import backward_loop, grouped_mm, kernel_takes, mm_loop  # noqa: E402
from pipetrain.job import OptimizerConfig, TrainConfig  # noqa: E402
from pipetrain.job.model import build_stages, load_bundle  # noqa: E402
from pipetrain.models.experts import EXPERTS, register  # noqa: E402
from pipetrain.run import resolve_run  # noqa: E402
from pipetrain.run.checks import preflight  # noqa: E402
from pipetrain.runtime import launch_local, train_one_process  # noqa: E402

pytestmark = pytest.mark.timeout(240)
TIMEOUT = 90
EXPERTS_COUNT = 11  # more than 10: the per-expert tensors must be fused in numeric order (2 before 10)


def moe(tmp: Path, kind: str = "mixtral") -> Path:
    """A tiny mixture of experts written by ``save_pretrained`` (weights from seed 11)."""
    import transformers

    common: dict[str, Any] = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                  num_experts_per_tok=2)
    torch.manual_seed(11)
    if kind == "mixtral":
        model: Any = transformers.MixtralForCausalLM(
            transformers.MixtralConfig(num_local_experts=EXPERTS_COUNT, **common))
    else:
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            num_experts=EXPERTS_COUNT, moe_intermediate_size=16, shared_expert_intermediate_size=16, **common))
    path = tmp / kind
    model.save_pretrained(path)
    return path


def cfg(model: str, workers: int = 1, config: str | None = None, **kw: Any) -> TrainConfig:
    base: dict[str, Any] = dict(model=model, model_options={"seq_len": 16}, workers=workers, config=config,
                                schedule="flush", batch_size=4, microbatches=2, steps=3, return_state=True,
                                timeout=TIMEOUT, quiet=True, optimizer=OptimizerConfig("sgd", lr=0.1, momentum=0.9))
    base.update(kw)
    return TrainConfig.of(**base)


def test_grouped_mm_multiplies_each_experts_rows_by_its_weight() -> None:
    torch.manual_seed(0)
    x = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 5, 3, dtype=torch.float64, requires_grad=True)
    offsets = torch.tensor([2, 2, 6, 7], dtype=torch.int32)  # expert 1 gets no rows
    out = grouped_mm(x, w, offsets)
    expected = torch.cat([x[0:2] @ w[0], x[2:6] @ w[2], x[6:7] @ w[3]])
    assert torch.allclose(out, expected)
    assert torch.autograd.gradcheck(lambda a, b: grouped_mm(a, b, offsets), (x, w))
    short = grouped_mm(x, w, torch.tensor([1, 2, 3, 4], dtype=torch.int32))  # rows past the last offset
    assert torch.equal(short[4:], torch.zeros(3, 3, dtype=torch.float64))
    # a shape for every dtype on meta, where torch's own grouped_mm takes bfloat16 only
    meta = grouped_mm(x.detach().float().to("meta"), w.detach().float().to("meta"), offsets.to("meta"))
    assert meta.shape == (7, 3) and meta.dtype == torch.float32


@pytest.mark.parametrize("width", [32, 6])  # 6 floats: strides torch's grouped kernel refuses, so the loop
def test_grouped_mm_on_torchs_kernel_equals_the_loop(width: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(40, width, requires_grad=True)
    w = torch.randn(5, width, 12, requires_grad=True)
    offsets = torch.tensor([7, 7, 20, 31, 36], dtype=torch.int32)  # expert 1 gets no rows; 4 rows past the end
    assert kernel_takes(x.detach(), w.detach()) == (width % 4 == 0)
    out = grouped_mm(x, w, offsets)
    grad = torch.randn_like(out)
    gx, gw = torch.autograd.grad(out, (x, w), grad)
    with torch.no_grad():
        assert torch.allclose(out, mm_loop(x, w, offsets), atol=1e-5)
        loop_gx, loop_gw = backward_loop(x, w, offsets, grad)
    assert torch.allclose(gx, loop_gx, atol=1e-5) and torch.allclose(gw, loop_gw, atol=1e-5)
    assert torch.equal(out[36:], torch.zeros(4, 12)) and torch.equal(gx[36:], torch.zeros(4, width))
    assert torch.equal(gw[1], torch.zeros(width, 12))


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_the_experts_implementation_equals_transformers_eager(tmp_path: Path, kind: str) -> None:
    from transformers import AutoModelForCausalLM

    assert register()
    model = AutoModelForCausalLM.from_pretrained(moe(tmp_path, kind))
    tokens = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(1))
    got: dict[str, tuple[torch.Tensor, list[torch.Tensor]]] = {}
    for impl in ("eager", EXPERTS):
        model.set_experts_implementation(impl)
        model.zero_grad()
        logits = model(input_ids=tokens).logits
        logits.square().mean().backward()
        got[impl] = logits.detach(), [p.grad.clone() for p in model.parameters()]
    (ref, ref_grads), (out, grads) = got["eager"], got[EXPERTS]
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, ref_grads, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_per_expert_tensors_are_read_fused_as_from_pretrained_fuses_them(tmp_path: Path, kind: str) -> None:
    from transformers import AutoModelForCausalLM

    path = moe(tmp_path, kind)
    assert any(".experts.10." in n for n in weights(path)), "the directory holds one tensor per expert"
    reference = AutoModelForCausalLM.from_pretrained(path).state_dict()
    state = load_bundle(cfg(f"hf:{path}"), 4).model.state_dict()
    assert set(state) == set(reference)
    for name, t in reference.items():
        assert torch.equal(state[name], t), name
    run = resolve_run(cfg(f"hf:{path}", 2, "1-1"))
    staged = build_stages(run, [1], shipped=True)
    fused = "model.layers.1.mlp.experts.gate_up_proj"
    assert torch.equal(staged.holder.get_parameter(fused), reference[fused])
    assert staged.holder.get_parameter("model.layers.0.mlp.experts.gate_up_proj").is_meta  # stage 0's


@pytest.mark.parametrize("schedule", ["flush", "zerobubble"])
def test_two_stages_of_a_mixture_of_experts_train_as_one_worker(tmp_path: Path, schedule: str) -> None:
    path = moe(tmp_path)
    one = train_one_process(resolve_run(cfg(f"hf:{path}")))
    [two] = launch_local([resolve_run(cfg(f"hf:{path}", 2, "1-1", schedule=schedule))], timeout=TIMEOUT)
    assert two.losses == pytest.approx(one.losses, rel=1e-5)
    for name, t in one.state.items():
        err = float((two.state[name] - t).abs().max() / (t.abs().max() + 1e-6))
        assert err <= 1e-5, f"{name}: relative error {err:.2e}"
    start = load_bundle(cfg(f"hf:{path}"), 4).model.state_dict()
    assert not torch.allclose(one.state["model.layers.1.mlp.experts.down_proj"],
                              start["model.layers.1.mlp.experts.down_proj"], atol=1e-4)  # the experts trained


def test_save_hf_of_a_mixture_of_experts_loads_in_from_pretrained(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path, out, ck = moe(tmp_path), tmp_path / "out", tmp_path / "ck.pt"
    launch_local([resolve_run(cfg(f"hf:{path}", 2, "1-1", save=str(ck), save_hf=str(out), return_state=False))],
                 timeout=TIMEOUT)
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    saved = torch.load(ck, weights_only=True)
    got = model.state_dict()
    assert set(got) == set(saved)
    for name, t in saved.items():
        assert torch.equal(got[name], t), name


def test_a_conversion_that_fails_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.core_model_loading import MergeModulelist

    def broken(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise ValueError("no such layout")

    monkeypatch.setattr(MergeModulelist, "convert", broken)
    path = moe(tmp_path)
    with pytest.raises(ModelError) as e:
        preflight(cfg(f"hf:{path}"))
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"--model hf:{path}: transformers converts 'model.layers.0.") and (
        "as it loads MixtralForCausalLM, and that conversion fails here (ValueError: no such layout)" in line), line
