"""``--save-hf DIR``: the trained weights as a Hugging Face directory, every rank writing its
own shard; ``from_pretrained(DIR)`` loads exactly ``--save``'s weights."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from test_hf_dir import llama, weights  # noqa: E402

from pipetrain.cli import main  # noqa: E402
from pipetrain.errors import RuntimeConfigError  # noqa: E402
from pipetrain.job import OptimizerConfig, TrainConfig  # noqa: E402
from pipetrain.run import resolve_run  # noqa: E402
from pipetrain.runtime import launch_local, train_one_process  # noqa: E402

pytestmark = pytest.mark.timeout(240)
TIMEOUT = 60


def cfg(model: str, workers: int = 1, config: str | None = None, **kw: Any) -> TrainConfig:
    return TrainConfig.of(model=model, model_options={"seq_len": 16}, workers=workers, config=config,
                          schedule="flush", batch_size=4, microbatches=2, steps=2, timeout=TIMEOUT, quiet=True,
                          optimizer=OptimizerConfig("sgd", lr=0.1, momentum=0.9), **kw)


def loaded(out: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    return {k: v.detach() for k, v in model.state_dict().items()}


def assert_same(out: Path, checkpoint: Path) -> None:
    saved = torch.load(checkpoint, weights_only=True)
    got = loaded(out)
    assert set(got) == set(saved)
    for name, t in saved.items():
        assert torch.equal(got[name], t), name


def test_two_stages_write_one_shard_each_that_from_pretrained_loads(tmp_path: Path) -> None:
    """Tied embedding and head on different stages: written once, by stage 0's rank, under the
    name the directory holds it by; the index names every tensor's shard."""
    path = llama(tmp_path, tie=True)
    out, ck = tmp_path / "out", tmp_path / "ck.pt"
    launch_local([resolve_run(cfg(f"hf:{path}", 2, "1-1", save=str(ck), save_hf=str(out)))], timeout=TIMEOUT)
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model-00001-of-00002.safetensors",
                                                                 "model-00002-of-00002.safetensors"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    written = weights(out)
    assert set(index["weight_map"]) == set(written) == set(weights(path))  # lm_head.weight not among them
    assert index["weight_map"]["model.embed_tokens.weight"] == "model-00001-of-00002.safetensors"
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in written.values())
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    assert_same(out, ck)
    before = weights(path)
    assert not torch.equal(written["model.embed_tokens.weight"], before["model.embed_tokens.weight"])  # trained


def test_one_worker_writes_the_same_directory(tmp_path: Path) -> None:
    path = llama(tmp_path)
    out, ck = tmp_path / "out", tmp_path / "ck.pt"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"stale")  # an earlier save's file: removed
    train_one_process(resolve_run(cfg(f"hf:{path}", save=str(ck), save_hf=str(out))))
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model-00001-of-00001.safetensors"]
    assert (out / "generation_config.json").is_file() == (path / "generation_config.json").is_file()
    assert_same(out, ck)


def test_save_hf_needs_an_hf_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(RuntimeConfigError, match=r"^--save-hf \S+ writes a Hugging Face directory, so it needs an "
                                                 r"hf:DIR model, got --model mlp; pass --model hf:DIR or use --save"):
        TrainConfig.of(model="mlp", save_hf=str(tmp_path / "out"))
    assert main(["train", "--model", "mlp", "--save-hf", str(tmp_path / "out"), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--save-hf" in err[0] and "Traceback" not in err[0]


def test_save_hf_into_a_file_or_the_source_is_refused_before_training(tmp_path: Path) -> None:
    from pipetrain.run.checks import preflight

    path = llama(tmp_path)
    (tmp_path / "file").write_text("")
    with pytest.raises(RuntimeConfigError, match=r"^--save-hf \S+file: '\S+file' is an existing file, but --save-hf "
                                                 r"writes a Hugging Face directory"):
        preflight(cfg(f"hf:{path}", save_hf=str(tmp_path / "file")))
    with pytest.raises(RuntimeConfigError, match=r"^--save-hf \S+ is the directory --model hf:\S+ reads its weights "
                                                 r"from; pass another directory"):
        preflight(cfg(f"hf:{path}", save_hf=str(path)))


def test_a_tensor_stored_under_an_older_name_is_written_under_it(tmp_path: Path) -> None:
    """GPT-NeoX's head: ``embed_out.weight`` in the directory, ``lm_head.weight`` in the model;
    written back under the directory's name, on the rank that holds it."""
    from test_hf_dir import neox

    path = neox(tmp_path)
    if "embed_out.weight" not in weights(path):
        pytest.skip("this transformers stores GPT-NeoX's head under the module's name")
    out, ck = tmp_path / "out", tmp_path / "ck.pt"
    launch_local([resolve_run(cfg(f"hf:{path}", 2, "1-1", save=str(ck), save_hf=str(out)))], timeout=TIMEOUT)
    written = weights(out)
    assert set(written) == set(weights(path))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["embed_out.weight"] == "model-00002-of-00002.safetensors"
    assert_same(out, ck)
