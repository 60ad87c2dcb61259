"""Weightless builds and layout-independent initial weights (pipetrain.models.materialize,
pipetrain.job.model): a tensor's initial value depends only on the seed and its name, so every
layout starts from the same weights, and each process holds storage only for its own tensors."""
from __future__ import annotations

import importlib.util
import logging
import math
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from pipetrain.job import OptimizerConfig, TrainConfig
from pipetrain.job.model import build_stages, load_bundle, stage_tensor_names, unread_tensor_names
from pipetrain.models import MODEL_NAMES, TINY_OPTIONS, get_model
from pipetrain.models.loader import load_weightless
from pipetrain.models.materialize import NotWeightless, is_weightless
from pipetrain.run import resolve_run
from pipetrain.run.resolve import resolve_with_bundle

torch.set_num_threads(1)
HAS_HF = importlib.util.find_spec("transformers") is not None
ZOO = list(MODEL_NAMES) + (["hf-gpt2"] if HAS_HF else [])
SEED = 3


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", ZOO)
def test_zoo_builds_without_storage(name: str) -> None:
    bundle, _ = load_weightless(name, SEED, 2, **TINY_OPTIONS[name])
    held = [k for k, v in bundle.model.state_dict(keep_vars=True).items() if not v.is_meta]
    assert held == []
    assert not any(x.is_meta for x in bundle.example_inputs)  # the data stays real


@pytest.mark.parametrize("name", ZOO)
def test_initial_value_depends_only_on_seed_and_name(name: str) -> None:
    bundle, weightless = load_weightless(name, SEED, 2, **TINY_OPTIONS[name])
    weightless.materialize()
    full = state(bundle.model)
    keys = list(full)
    for part in (keys[0::3], keys[1::3], keys[2::3]):
        b, w = load_weightless(name, SEED, 2, **TINY_OPTIONS[name])
        w.materialize(part)
        got = b.model.state_dict()
        for k in keys:
            if k in part:
                assert torch.equal(got[k], full[k]), k
            else:
                assert got[k].is_meta, f"{k} was given storage without being asked for"
    other, w = load_weightless(name, SEED + 1, 2, **TINY_OPTIONS[name])
    w.materialize()
    weights = [k for k, v in full.items() if v.dim() >= 2 and v.is_floating_point()]
    assert weights and not any(torch.equal(other.model.state_dict()[k], full[k]) for k in weights)


def test_gpt_keeps_gpt2_initialisation() -> None:
    opts = dict(vocab=256, d_model=128, layers=3, heads=4, seq_len=16)
    bundle, w = load_weightless("gpt", SEED, 2, **opts)
    w.materialize()
    sd = bundle.model.state_dict()
    assert sd["wte.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert sd["blocks.1.fc.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert sd["blocks.2.attn.proj.weight"].std().item() == pytest.approx(0.02 / math.sqrt(6), rel=0.05)
    assert torch.equal(sd["blocks.0.attn.query.bias"], torch.zeros(128))
    assert torch.equal(sd["ln_f.weight"], torch.ones(128))
    built = get_model("gpt", 2, **opts).model.state_dict()  # buffers: their values as built
    for k in ("positions", "blocks.0.attn.causal_mask"):
        assert torch.equal(sd[k], built[k])


def test_mlp_keeps_he_initialisation() -> None:
    bundle, w = load_weightless("mlp", SEED, 2, depth=2, width=256)
    w.materialize()
    sd = bundle.model.state_dict()
    assert sd["2.weight"].std().item() == pytest.approx(math.sqrt(2 / 256), rel=0.05)
    assert torch.equal(sd["2.bias"], torch.zeros(256))


def test_materialized_lstm_runs_with_its_new_weights() -> None:
    """An LSTM's weights cannot be swapped in place (it holds weak references to them): the
    module takes the new tensors, and its forward uses them."""
    bundle, w = load_weightless("gnmt", SEED, 2, **TINY_OPTIONS["gnmt"])
    w.materialize()
    ref = get_model("gnmt", 2, **TINY_OPTIONS["gnmt"])
    ref.model.load_state_dict(bundle.model.state_dict())
    with torch.no_grad():
        assert torch.equal(bundle.model(*bundle.example_inputs), ref.model(*bundle.example_inputs))


def _factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str, body: str) -> str:
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"{module}:make"


def test_init_outside_reset_parameters_is_built_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    spec = _factory(tmp_path, monkeypatch, "mat_custom_init", """
        import torch
        from torch import nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(8, 4)
                nn.init.xavier_uniform_(self.fc.weight)

            def forward(self, x):
                return self.fc(x)

        def make():
            return Net(), torch.randn(2, 8)
    """)
    with pytest.raises(NotWeightless, match=r"tensor 'fc\.weight' is initialised by the factory with uniform_"):
        load_weightless(spec, SEED)
    cfg = TrainConfig.of(model=spec, seed=SEED)
    with caplog.at_level(logging.WARNING):
        bundle = load_bundle(cfg, 2, warn=True)
    lines = [r.getMessage() for r in caplog.records if "cannot be built without its weights" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0] and "MiB of parameters and buffers each" in lines[0]
    assert "fc.weight" in lines[0]
    from mat_custom_init import make

    torch.manual_seed(SEED)
    expected = make()[0].state_dict()
    got = bundle.model.state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_parameters_made_with_their_value(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A small parameter keeps the value it is made with; a large one must come from an init call."""
    spec = _factory(tmp_path, monkeypatch, "mat_made_values", """
        import torch
        from torch import nn

        class Scaled(nn.Module):
            def __init__(self, rows):
                super().__init__()
                self.fc = nn.Linear(8, 8)
                self.scale = nn.Parameter(torch.full((8,), 3.0))
                self.table = nn.Parameter(torch.randn(rows, 8))

            def forward(self, x):
                return self.fc(x) * self.scale + self.table[:1]

        def make(rows=1):
            return Scaled(rows), torch.randn(2, 8)
    """)
    bundle, w = load_weightless(spec, SEED, rows=1)
    w.materialize()
    assert torch.equal(bundle.model.state_dict()["scale"], torch.full((8,), 3.0))
    with pytest.raises(NotWeightless, match=r"tensor 'table' \(80000 elements\) gets its value when it is created"):
        load_weightless(spec, SEED, rows=10000)


def test_buffers_a_forward_assigns_keep_their_built_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The build runs the model for shapes (on meta); buffers it assigns are bound back."""
    spec = _factory(tmp_path, monkeypatch, "mat_assigned", """
        import torch
        from torch import nn

        class Counting(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)
                self.register_buffer("count", torch.full((), 5.0))

            def forward(self, x):
                self.count = self.count + 1
                return self.fc(x) * self.count

        def make():
            return Counting(), torch.randn(2, 4)
    """)
    model = load_bundle(TrainConfig.of(model=spec, seed=SEED), 2).model
    assert torch.equal(model.count, torch.tensor(5.0))


def _cfg(model: str, options: dict[str, Any], workers: int, config: str | None, **kw: Any) -> TrainConfig:
    return TrainConfig.of(model=model, model_options=options, workers=workers, config=config, schedule="flush",
                          batch_size=4, microbatches=2, steps=1, seed=SEED, quiet=True, **kw)


LAYOUTS = [(2, "1-1"), (4, "1-1-1-1"), (3, "2-1")]
# the Hugging Face path per stage: tests/runtime/test_hf_dir.py
MODELS = [("mlp", dict(TINY_OPTIONS["mlp"], depth=6)), ("gpt", TINY_OPTIONS["gpt"]), ("gnmt", TINY_OPTIONS["gnmt"])]


@pytest.mark.parametrize("model,options", MODELS, ids=[m for m, _ in MODELS])
def test_every_layout_starts_from_the_same_weights(model: str, options: dict[str, Any]) -> None:
    """Each rank of 1-1, 1-1-1-1 and 2-1 holds exactly its stages' tensors (the others have no
    storage), with the values one worker starts from."""
    one = state(load_bundle(_cfg(model, options, 1, None), 4).model)
    for workers, config in LAYOUTS:
        run = resolve_run(_cfg(model, options, workers, config))
        covered: set[str] = set()
        for rank in range(workers):
            mine = run.schedule.stages_of_rank(rank)
            staged = build_stages(run, mine, unread=rank == 0)
            sd = staged.bundle.model.state_dict(keep_vars=True)
            expected = stage_tensor_names(staged.captured.gm, staged.partition, mine)
            if rank == 0:
                expected |= unread_tensor_names(staged.captured.gm, staged.partition, staged.state_keys)
            held = {k for k, v in sd.items() if not v.is_meta}
            assert held == expected & set(sd), (config, rank)
            for k in held:
                assert torch.equal(sd[k], one[k]), (config, rank, k)
            covered |= held
        assert covered == set(one), config


def test_launcher_holds_no_parameter_storage() -> None:
    """A run whose layout is given resolves on the weightless model; a quick plan profiles and
    needs the weights."""
    _, bundle = resolve_with_bundle(_cfg("gpt", TINY_OPTIONS["gpt"], 2, "1-1"))
    assert all(t.is_meta for t in bundle.model.parameters())
    _, bundle = resolve_with_bundle(_cfg("mlp", TINY_OPTIONS["mlp"], 1, None))
    assert is_weightless(bundle.model)


@pytest.mark.skipif(not HAS_HF, reason="needs transformers")
def test_launcher_checks_a_model_whose_forward_needs_values() -> None:
    """Hugging Face's GPT-2 asks a mask's value in its eager forward: the launcher's checks run
    what meta allows and leave the rest to the workers, instead of refusing the model."""
    from pipetrain.run.checks import preflight

    run = preflight(_cfg("hf-gpt2", TINY_OPTIONS["hf-gpt2"], 2, "1-1"))
    assert run.world_size == 2


@pytest.mark.timeout(300)
def test_workers_train_from_the_same_weights() -> None:
    """The state after one step at a learning rate of 1e-30 (the initial weights, to far below
    their spread) is the same on 1 worker and on 1-1, 1-1-1-1 and 2-1."""
    from pipetrain.runtime import launch_local, single_config

    options = dict(TINY_OPTIONS["mlp"], depth=6)
    opt = OptimizerConfig("sgd", lr=1e-30)
    base = single_config(resolve_run(_cfg("mlp", options, 1, None, optimizer=opt))).state
    for workers, config in LAYOUTS:
        result = launch_local([resolve_run(_cfg("mlp", options, workers, config, optimizer=opt, return_state=True,
                                                timeout=60))], timeout=60)[0]
        assert result.state is not None
        for k, v in base.items():
            assert torch.allclose(result.state[k], v, rtol=0, atol=1e-12), (config, k)


def test_known_values_are_the_models_values_or_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the launcher times a weightless capture with (``initial_value``): a value made
    with the tensor (``scale``) is kept; a tensor an init method writes after its creation
    (``fc.weight``: ``torch.empty`` until ``reset_parameters``) has no known value, never the
    empty tensor's memory (NaN and denormals there made stage timings 2-10x slow)."""
    spec = _factory(tmp_path, monkeypatch, "mat_known_values", """
        import torch
        from torch import nn

        class Scaled(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(8, 8)
                self.scale = nn.Parameter(torch.full((8,), 3.0))

            def forward(self, x):
                return self.fc(x) * self.scale

        def make():
            return Scaled(), torch.randn(2, 8)
    """)
    _, w = load_weightless(spec, SEED)
    assert torch.equal(w.initial_value("scale"), torch.full((8,), 3.0))
    assert w.initial_value("fc.weight") is None and w.initial_value("fc.bias") is None


def test_a_tied_tensors_known_value_is_read_under_the_name_its_file_holds(tmp_path: Path) -> None:
    """T5 saves its tied embedding once, as ``shared.weight``; the graph reads it as
    ``lm_head.weight``: the value is the file's under either name."""
    pytest.importorskip("transformers")
    from safetensors.torch import load_file
    from transformers import T5Config, T5ForConditionalGeneration

    from pipetrain.job.model import load_captured

    config = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2, dropout_rate=0.0,
                      decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(3)
    T5ForConditionalGeneration(config).save_pretrained(tmp_path / "t5")
    stored = load_file(tmp_path / "t5" / "model.safetensors")
    assert "lm_head.weight" not in stored
    _, captured = load_captured(TrainConfig.of(model=f"hf:{tmp_path / 't5'}", model_options={"seq_len": 8}), 2)
    assert captured.tensor_values is not None
    for name in ("lm_head.weight", "shared.weight", "encoder.embed_tokens.weight"):
        got = captured.tensor_values(name)
        assert got is not None and torch.equal(got, stored["shared.weight"]), name
    for name, _ in captured.gm.named_parameters():
        got = captured.tensor_values(name)
        assert got is None or bool(torch.isfinite(got).all()), name
