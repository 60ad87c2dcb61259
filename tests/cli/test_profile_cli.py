"""``pipetrain profile``: table output, JSON round trip, printing saved profiles, errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pipetrain.cli import main
from pipetrain.cli.profile_cmd import parse_option
from pipetrain.errors import PipetrainError
from pipetrain.models import MODEL_NAMES
from pipetrain.profile import load_profile

torch.set_num_threads(1)
MLP = ["--model", "mlp", "--batch-size", "4", "--option", "depth=2", "--option", "width=8",
       "--option", "in_features=6", "--repeats", "1", "--warmup", "0", "--threads", "1"]


def test_profile_prints_table_and_writes_json_that_round_trips(tmp_path: Path, capsys) -> None:
    out = tmp_path / "mlp.json"
    assert main(["profile", *MLP, "--output", str(out), "--optimizer", "adam"]) == 0
    text = capsys.readouterr().out
    assert "profile of mlp: batch size 4" in text and "adam" in text
    assert "Linear(in_features=6, out_features=8" in text
    assert f"wrote {out}" in text
    prof = load_profile(out)
    total = next(line for line in text.splitlines() if line.startswith("total: "))
    assert total.startswith(f"total: {len(prof.nodes)} nodes")
    assert prof.model == "mlp" and prof.batch_size == 4 and prof.optimizer == "adam"
    assert prof.optimizer_state_bytes_per_parameter_byte == 2.0
    assert prof.total_parameter_bytes == (6 * 8 + 8 + 8 * 8 + 8) * 4
    raw = json.loads(out.read_text())
    assert raw["version"] == 1 and [n["name"] for n in raw["nodes"]] == prof.names
    # printing the saved file gives the same table
    assert main(["profile", str(out)]) == 0
    again = capsys.readouterr().out
    assert again.splitlines()[:4] == text.splitlines()[:4]
    assert again.splitlines()[-1] == total


def test_profile_prints_a_pipedream_txt_profile(tmp_path: Path, capsys) -> None:
    path = tmp_path / "two.txt"
    path.write_text(
        "node1 -- Input0 -- forward_compute_time=0.000, backward_compute_time=0.000, "
        "activation_size=4096.000, parameter_size=0.000\n"
        "node2 -- Linear(in_features=32, out_features=10) -- forward_compute_time=1.500, "
        "backward_compute_time=3.000, activation_size=2048.000, parameter_size=1320.000\n"
        "\tnode1 -- node2\n"
    )
    assert main(["profile", str(path)]) == 0
    text = capsys.readouterr().out
    assert "node2" in text and "Linear(in_features=32, out_features=10)" in text
    assert text.splitlines()[-1] == (
        "total: 2 nodes, forward 1.500 ms, backward 3.000 ms, activations 2.0 KiB, parameters 1.3 KiB")


def test_unknown_model_lists_valid_names(capsys) -> None:
    assert main(["profile", "--model", "resnet51", "--batch-size", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: unknown model 'resnet51'")
    assert all(name in err for name in MODEL_NAMES)


def test_malformed_profile_file_is_a_one_line_error(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["profile", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "bad.json" in err
    missing = tmp_path / "missing.json"
    assert main(["profile", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err


def test_argument_errors(tmp_path: Path, capsys) -> None:
    assert main(["profile"]) == 2
    assert "pass --model NAME" in capsys.readouterr().err
    assert main(["profile", str(tmp_path / "x.json"), "--model", "mlp"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["profile", *MLP, "--option", "depth"]) == 2
    assert "must be KEY=VALUE" in capsys.readouterr().err
    assert main(["profile", *MLP, "--option", "colour=red"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "colour" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests the error raised without CUDA")
def test_cuda_without_cuda(capsys) -> None:
    assert main(["profile", *MLP, "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "CUDA is not available" in err


def test_factory_spec(tmp_path: Path, capsys, monkeypatch) -> None:
    (tmp_path / "my_factory_mod.py").write_text(
        "import torch\nfrom torch import nn\n"
        "def make(batch_size=3, hidden=5):\n"
        "    return nn.Sequential(nn.Linear(4, hidden), nn.Tanh()), torch.randn(batch_size, 4)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["profile", "--model", "my_factory_mod:make", "--batch-size", "3", "--option", "hidden=7",
                 "--repeats", "1", "--warmup", "0"]) == 0
    text = capsys.readouterr().out
    assert "Linear(in_features=4, out_features=7" in text and "Tanh()" in text
    assert "parameters 140 B" in text  # (4 * 7 + 7) * 4


@pytest.mark.parametrize("item,expected", [
    ("depth=4", ("depth", 4)), ("dropout=0.5", ("dropout", 0.5)), ("bias=false", ("bias", False)),
    ("norm=group", ("norm", "group")), ("layers=1,1,2,1", ("layers", (1, 1, 2, 1))),
    ("width-mult=0.25", ("width_mult", 0.25)), ("name=a,b", ("name", "a,b")),
])
def test_parse_option(item: str, expected: tuple) -> None:
    assert parse_option(item) == expected


def test_parse_option_rejects_missing_value() -> None:
    with pytest.raises(PipetrainError, match="--option 'depth' must be KEY=VALUE"):
        parse_option("depth")


def test_the_check_flags_default_to_the_profilers_bounds() -> None:
    """The parser spells the defaults out (it does not import the profiler); they must stay
    the profiler's own."""
    from pipetrain.cli import build_parser
    from pipetrain.profile.measure import CHECK_MEMORY, CHECK_SECONDS

    args = build_parser().parse_args(["profile", "--model", "mlp"])
    assert args.check_memory * 2**30 == CHECK_MEMORY and args.check_seconds == CHECK_SECONDS
