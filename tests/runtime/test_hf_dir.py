"""Pretrained weights per stage: ``--model hf:DIR`` (a directory ``save_pretrained`` wrote) and
``--init-from PATH``; every rank reads only its own tensors, bad input is one line."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from pipetrain.errors import ModelError  # noqa: E402
from pipetrain.job import OptimizerConfig, TrainConfig  # noqa: E402
from pipetrain.job.model import build_stages, load_bundle, load_captured, stage_tensor_names  # noqa: E402
from pipetrain.models import TINY_OPTIONS  # noqa: E402
from pipetrain.models.pretrained import TensorFiles  # noqa: E402
from pipetrain.run import resolve_run  # noqa: E402
from pipetrain.run.checks import preflight  # noqa: E402
from pipetrain.runtime import launch_local, train_one_process  # noqa: E402

pytestmark = pytest.mark.timeout(240)
TIMEOUT = 60
SEQ = 16


def llama(tmp: Path, name: str = "llama", tie: bool = False, **save: Any) -> Path:
    """A tiny ``LlamaForCausalLM`` written by ``save_pretrained`` (weights from seed 11)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=tie)
    torch.manual_seed(11)
    path = tmp / name
    LlamaForCausalLM(config).save_pretrained(path, **save)
    return path


def weights(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def cfg(model: str, workers: int = 1, config: str | None = None, **kw: Any) -> TrainConfig:
    base: dict[str, Any] = dict(model=model, model_options={"seq_len": SEQ}, workers=workers, config=config,
                                schedule="flush", batch_size=4, microbatches=2, steps=2, return_state=True,
                                timeout=TIMEOUT, quiet=True, optimizer=OptimizerConfig("sgd", lr=0.1, momentum=0.9))
    base.update(kw)
    return TrainConfig.of(**base)


@pytest.mark.parametrize("layout", ["single", "sharded", "tied"])
def test_model_starts_from_the_directory_weights(tmp_path: Path, layout: str) -> None:
    path = (llama(tmp_path, max_shard_size="20KB") if layout == "sharded" else
            llama(tmp_path, tie=layout == "tied"))
    files = weights(path)
    if layout == "sharded":
        assert len(list(path.glob("model-*-of-*.safetensors"))) > 1 and (path / "model.safetensors.index.json").exists()
    model = load_bundle(cfg(f"hf:{path}"), 4).model
    assert type(model).__name__ == "LlamaForCausalLM"
    state = model.state_dict()
    for name, t in files.items():
        assert torch.equal(state[name], t), name
    if layout == "tied":  # the file holds the embedding once; the head is the same tensor
        assert "lm_head.weight" not in files and model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("shipped", [True, False], ids=["launchers-capture", "own-capture"])
def test_each_rank_reads_only_its_own_tensors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shipped: bool) -> None:
    path = llama(tmp_path)
    run = resolve_run(cfg(f"hf:{path}", 2, "1-1"))
    read: list[str] = []
    original = TensorFiles.read

    def spy(self: TensorFiles, name: str) -> torch.Tensor | None:
        read.append(name)
        return original(self, name)

    monkeypatch.setattr(TensorFiles, "read", spy)
    staged = build_stages(run, [1], shipped=shipped)
    mine = stage_tensor_names(staged.captured.gm, staged.partition, [1])
    persistent = set(weights(path))
    assert persistent & mine and set(read) <= mine  # stage 1's tensors, and only those
    assert set(read) >= persistent & mine
    assert staged.holder.get_parameter("model.embed_tokens.weight").is_meta  # stage 0's: never allocated here


@pytest.mark.parametrize("kind", ["llama", "tied", "t5"])
def test_workers_take_the_launchers_capture_and_build_the_same_stages(tmp_path: Path, kind: str) -> None:
    """A run whose every value comes from the files carries the launcher's capture; built from
    it, every stage has the same nodes, wires and tensor values as built from the model."""
    path = t5(tmp_path) if kind == "t5" else llama(tmp_path, tie=kind == "tied")
    run = resolve_run(cfg(f"hf:{path}", 2, "1-1"))
    assert run.model is not None
    for k in (0, 1):
        a, b = build_stages(run, [k]), build_stages(run, [k], shipped=False)
        assert [n.name for n in a.captured.gm.graph.nodes] == [n.name for n in b.captured.gm.graph.nodes]
        assert a.partition.stage_of == b.partition.stage_of and a.partition.tied == b.partition.tied
        assert a.partition.param_stage == b.partition.param_stage
        assert [c.names for c in a.codecs] == [c.names for c in b.codecs]
        assert [repr(c.specs) for c in a.codecs] == [repr(c.specs) for c in b.codecs]
        assert a.state_keys == b.state_keys and a.param_names == b.param_names
        mine = stage_tensor_names(b.captured.gm, b.partition, [k])
        sa, sb = a.state_dict(), b.state_dict()
        for name in mine & set(sb):
            assert not sa[name].is_meta and torch.equal(sa[name], sb[name]), name
        for name in set(sb) - mine:
            assert sa[name].is_meta == sb[name].is_meta, name


def test_a_worker_of_a_shipped_model_imports_neither_transformers_nor_export(tmp_path: Path) -> None:
    """What makes a worker small: it rebuilds the launcher's capture from plain data."""
    import pickle
    import subprocess
    import sys

    run = resolve_run(cfg(f"hf:{llama(tmp_path)}", 2, "1-1"))
    (tmp_path / "run.pkl").write_bytes(pickle.dumps(run))
    code = ("import pickle, sys; from pipetrain.job.model import build_stages; "
            "run = pickle.load(open(sys.argv[1], 'rb')); staged = build_stages(run, [1]); "
            "print(len(staged.state_keys), 'transformers' in sys.modules, 'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run.pkl")], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out[1:] == ["False", "False"] and int(out[0]) > 0


def test_a_model_initialised_by_its_own_code_is_captured_by_each_worker() -> None:
    assert resolve_run(cfg("gpt", 2, "1-1", model_options=dict(TINY_OPTIONS["gpt"]))).model is None


def test_training_at_a_negligible_rate_keeps_the_directory_weights(tmp_path: Path) -> None:
    path = llama(tmp_path)
    files = weights(path)
    [r] = launch_local([resolve_run(cfg(f"hf:{path}", 2, "1-1", optimizer=OptimizerConfig("sgd", lr=1e-12)))],
                       timeout=TIMEOUT)
    assert set(files) <= set(r.state)  # named as in the directory
    for name, t in files.items():
        assert torch.allclose(r.state[name], t, rtol=0, atol=1e-9), name


def t5(tmp: Path) -> Path:
    """A tiny ``T5ForConditionalGeneration`` (an encoder-decoder) written by ``save_pretrained``."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
                      decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(11)
    path = tmp / "t5"
    T5ForConditionalGeneration(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("kind", ["llama", "t5"])
def test_flush_on_two_stages_equals_one_worker(tmp_path: Path, kind: str) -> None:
    path = llama(tmp_path) if kind == "llama" else t5(tmp_path)
    [two] = launch_local([resolve_run(cfg(f"hf:{path}", 2, "1-1"))], timeout=TIMEOUT)
    one = train_one_process(resolve_run(cfg(f"hf:{path}")))
    assert two.losses == pytest.approx(one.losses, rel=1e-5)
    for name, t in one.state.items():
        err = float((two.state[name] - t).abs().max() / (t.abs().max() + 1e-6))
        assert err <= 1e-5, f"{name}: relative error {err:.2e}"
    files = weights(path)
    head = "lm_head.weight" if "lm_head.weight" in files else "shared.weight"  # T5 ties its head to the embedding
    assert not torch.allclose(one.state[head], files[head], atol=1e-4)  # it trained


def test_an_encoder_decoder_translates_with_its_source_mask(tmp_path: Path) -> None:
    bundle = load_bundle(cfg(f"hf:{t5(tmp_path)}"), 4)
    src, mask, tgt = bundle.example_inputs  # T5's forward(input_ids, attention_mask, decoder_input_ids)
    assert src.shape == tgt.shape == (4, SEQ) and torch.equal(mask, torch.ones_like(src))


def test_schedule_auto_plans_on_the_capture_the_workers_run(tmp_path: Path) -> None:
    """The automatic choice's plan names the nodes of the workers' capture (weightless, on
    meta), which for a Hugging Face Llama differs from a capture of the built model."""
    path = llama(tmp_path)
    run = resolve_run(cfg(f"hf:{path}", 2, schedule="auto", microbatches=None))
    assert run.plan is not None and run.plan.extra.get("auto")
    _, captured = load_captured(run.config, run.batch_size // run.microbatches)
    names = {n.name for n in captured.gm.graph.nodes}
    assert {n for s in run.plan.stages for n in s.nodes} <= names


def test_the_launchers_planner_profiles_without_building_the_model(tmp_path: Path) -> None:
    """No --config: the launcher profiles its weightless capture a few tensors at a time (it
    stays weightless), ships it, and the planner's run equals one worker."""
    from pipetrain.models.materialize import is_weightless
    from pipetrain.run.resolve import resolve_with_bundle

    path = llama(tmp_path)
    run, bundle = resolve_with_bundle(cfg(f"hf:{path}", 2))
    assert "from a quick profile" in run.plan_note, run.plan_note
    assert is_weightless(bundle.model) and run.model is not None
    [two] = launch_local([run], timeout=TIMEOUT)
    one = train_one_process(resolve_run(cfg(f"hf:{path}")))
    assert two.losses == pytest.approx(one.losses, rel=1e-5)
    for name, t in one.state.items():
        assert float((two.state[name] - t).abs().max() / (t.abs().max() + 1e-6)) <= 1e-5, name


def _one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


def test_not_a_model_directory_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ModelError) as e:
        preflight(cfg(f"hf:{tmp_path / 'nowhere'}"))
    assert "does not exist, so it is not a Hugging Face model directory" in _one_line(e)
    with pytest.raises(ModelError) as e:
        preflight(cfg(f"hf:{tmp_path}"))
    assert "has no config.json" in _one_line(e)


def test_model_class_not_installed_is_one_line(tmp_path: Path) -> None:
    path = llama(tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError) as e:
        preflight(cfg(f"hf:{path}"))
    assert "config.json names the model class 'NoSuchModelForCausalLM', which transformers" in _one_line(e)


def test_missing_and_misshaped_tensors_are_one_line(tmp_path: Path) -> None:
    path = llama(tmp_path)
    files = weights(path)
    del files["model.norm.weight"]
    files["lm_head.weight"] = torch.zeros(65, 32)
    files["extra.weight"] = torch.zeros(2)
    save_file(files, str(path / "model.safetensors"))
    with pytest.raises(ModelError) as e:
        preflight(cfg(f"hf:{path}"))
    assert _one_line(e) == (
        f"--model hf:{path}: the weights do not match the model LlamaForCausalLM: missing model.norm.weight; "
        f"unexpected extra.weight; mis-shaped lm_head.weight (file [65, 32], model [64, 32]); write them from this "
        f"model (save_pretrained, --save) or fix the model's options")


@pytest.mark.parametrize("kind", ["safetensors", "checkpoint"])
def test_init_from_gives_a_zoo_model_its_weights(tmp_path: Path, kind: str) -> None:
    options = TINY_OPTIONS["gpt"]
    source = load_bundle(TrainConfig.of(model="gpt", model_options=options, seed=5), 2).model.state_dict()
    source = {k: v.contiguous() for k, v in source.items()}
    if kind == "safetensors":
        file = tmp_path / "w.safetensors"
        save_file(source, str(file))
    else:
        file = tmp_path / "w.pt"
        torch.save(source, file)
    model = load_bundle(TrainConfig.of(model="gpt", model_options=options, init_from=str(file)), 2).model
    for name, t in model.state_dict().items():
        assert torch.equal(t, source[name]), name
    bad = dict(source)
    bad.pop("wte.weight")
    save_file(bad, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ModelError, match=r"^--init-from \S+bad\.safetensors: the weights do not match the model GPT: "
                                         r"missing wte\.weight; write them"):
        load_bundle(TrainConfig.of(model="gpt", model_options=options, init_from=str(tmp_path / "bad.safetensors")), 2)


def test_directory_copy_is_the_same_model(tmp_path: Path) -> None:
    """The weights come from the files, not from the seed: another seed starts the same."""
    path = llama(tmp_path)
    shutil.copytree(path, tmp_path / "copy")
    a = load_bundle(cfg(f"hf:{path}", seed=1), 4).model.state_dict()
    b = load_bundle(cfg(f"hf:{tmp_path / 'copy'}", seed=2), 4).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def _bad_input(tmp: Path, kind: str) -> list[str]:
    """The ``pipetrain train`` arguments of one kind of bad input."""
    if kind == "not-a-directory":
        return ["--model", f"hf:{tmp / 'nowhere'}"]
    path = llama(tmp)
    if kind == "class-not-installed":
        config = json.loads((path / "config.json").read_text())
        config["architectures"] = ["NoSuchModelForCausalLM"]
        (path / "config.json").write_text(json.dumps(config))
        return ["--model", f"hf:{path}"]
    files = weights(path)
    if kind == "hf-misshaped":
        files["model.norm.weight"] = torch.zeros(3)
        save_file(files, str(path / "model.safetensors"))
        return ["--model", f"hf:{path}"]
    options = TINY_OPTIONS["gpt"]
    source = {k: v.contiguous() for k, v in
              load_bundle(TrainConfig.of(model="gpt", model_options=options), 2).model.state_dict().items()}
    source["wpe.weight"] = torch.zeros(1, 1)
    save_file(source, str(tmp / "w.safetensors"))
    return ["--model", "gpt", *[a for k, v in options.items() for a in ("--option", f"{k}={v}")],
            "--init-from", str(tmp / "w.safetensors")]


@pytest.mark.parametrize(("kind", "text"), [
    ("not-a-directory", "is not a Hugging Face model directory"),
    ("class-not-installed", "names the model class 'NoSuchModelForCausalLM'"),
    ("hf-misshaped", "mis-shaped model.norm.weight (file [3], model [32])"),
    ("init-from-misshaped", "the weights do not match the model GPT: mis-shaped wpe.weight (file [1, 1], model"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str,
                                          text: str) -> None:
    from pipetrain.cli import main

    args = _bad_input(tmp_path, kind)
    capsys.readouterr()
    assert main(["train", *args, "--steps", "1", "--workers", "1"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: ") and text in err[0], err


def neox(tmp: Path) -> Path:
    """A tiny ``GPTNeoXForCausalLM``: transformers 5 saves its head as ``embed_out.weight``
    and names the module's ``lm_head.weight``, renaming the file's name as it loads."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, max_position_embeddings=32)
    torch.manual_seed(11)
    path = tmp / "neox"
    GPTNeoXForCausalLM(config).save_pretrained(path)
    return path


def test_a_tensor_stored_under_an_older_name_is_read_as_from_pretrained_reads_it(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = neox(tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(path).state_dict()
    stored = weights(path)
    if "lm_head.weight" in stored:
        pytest.skip("this transformers stores GPT-NeoX's head under the module's name")
    assert "embed_out.weight" in stored
    state = load_bundle(cfg(f"hf:{path}"), 4).model.state_dict()
    assert set(state) == set(reference)
    for name, t in reference.items():
        assert torch.equal(state[name], t), name
    run = resolve_run(cfg(f"hf:{path}", 2, "1-1"))  # the head on stage 1, read by its stored name
    staged = build_stages(run, [1], shipped=True)
    assert torch.equal(staged.holder.get_parameter("lm_head.weight"), reference["lm_head.weight"])
