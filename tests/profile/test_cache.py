"""The measurement cache (pipetrain.profile.cache): its place, keys that include the machine,
misses on any difference, ``--no-cache``, damaged entries, an unwritable directory, and
``pipetrain profile`` reusing a profile it measured before."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import pipetrain.profile as profile_pkg
from pipetrain.cli import main
from pipetrain.profile import NodeProfile, Profile
from pipetrain.profile.cache import (
    CACHE_ENV,
    MeasurementCache,
    cache_dir,
    cached_profile,
    graph_fingerprint,
    machine_identity,
    model_fingerprint,
    source_digest,
)

torch.set_num_threads(1)
MLP = ["--model", "mlp", "--batch-size", "4", "--option", "depth=2", "--option", "width=8",
       "--option", "in_features=6", "--repeats", "1", "--warmup", "0", "--threads", "1"]


def test_the_cache_lives_in_the_environment_variable_else_the_home(private_cache: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    assert cache_dir() == private_cache
    assert MeasurementCache().directory == private_cache
    monkeypatch.delenv(CACHE_ENV)
    assert cache_dir() == Path.home() / ".cache" / "pipetrain"


def test_the_key_holds_the_machine() -> None:
    ident = machine_identity()
    assert ident["torch"] == torch.__version__ and ident["cpu"] and ident["cores"]
    full = MeasurementCache().key("profile", {"model": "mlp", "batch_size": (4,)})
    assert full["machine"] == ident and full["kind"] == "profile" and full["batch_size"] == [4]


def test_a_measurement_is_reused_only_by_the_code_that_made_it(tmp_path: Path, private_cache: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # the key names pipetrain's own source, not only its version (unchanged between commits)
    assert machine_identity()["source"] == source_digest(Path(profile_pkg.__file__).resolve().parent.parent)
    tree = tmp_path / "src"
    (tree / "runtime").mkdir(parents=True)
    (tree / "runtime" / "a.py").write_text("x = 1\n")
    (tree / "notes.txt").write_text("not code")
    first = source_digest(tree)
    assert source_digest(tree) == first
    (tree / "notes.txt").write_text("still not code")
    assert source_digest(tree) == first
    (tree / "runtime" / "a.py").write_text("x = 2\n")
    edited = source_digest(tree)
    assert edited != first
    (tree / "runtime" / "a.py").rename(tree / "runtime" / "b.py")
    assert source_digest(tree) not in (first, edited)

    cache = MeasurementCache()
    monkeypatch.setattr("pipetrain.profile.cache._own_source_digest", lambda: "before-a-fix")
    cache.put("rehearsal", {"schedule": "pipedream"}, {"step": 0.046})
    assert cache.get("rehearsal", {"schedule": "pipedream"}) == {"step": 0.046}
    monkeypatch.setattr("pipetrain.profile.cache._own_source_digest", lambda: "after-a-fix")
    assert cache.get("rehearsal", {"schedule": "pipedream"}) is None


def test_a_value_is_read_back_only_under_the_same_key(private_cache: Path) -> None:
    cache = MeasurementCache()
    path = cache.put("profile", {"model": "mlp", "batch_size": 4}, {"x": 1})
    assert path is not None and path.parent == private_cache / "profile"
    assert json.loads(path.read_text())["key"]["model"] == "mlp"
    assert cache.get("profile", {"model": "mlp", "batch_size": 4}) == {"x": 1}
    assert cache.get("profile", {"model": "mlp", "batch_size": 8}) is None
    assert cache.get("calibration", {"model": "mlp", "batch_size": 4}) is None
    # a stored key that differs (a hash collision, an edited file) is a miss too
    entry = json.loads(path.read_text())
    entry["key"]["model"] = "gpt"
    path.write_text(json.dumps(entry))
    assert cache.get("profile", {"model": "mlp", "batch_size": 4}) is None


def test_fetch_measures_once_and_a_disabled_cache_never(private_cache: Path) -> None:
    calls: list[int] = []

    def make() -> dict[str, int]:
        calls.append(1)
        return {"v": len(calls)}

    cache = MeasurementCache()
    assert cache.fetch("k", {"a": 1}, make, dict, dict) == ({"v": 1}, False)
    assert cache.fetch("k", {"a": 1}, make, dict, dict) == ({"v": 1}, True)
    assert (cache.hits, cache.misses, len(calls)) == (1, 1, 1)
    off = MeasurementCache(enabled=False)
    assert off.fetch("k", {"a": 1}, make, dict, dict) == ({"v": 2}, False)
    assert off.fetch("k", {"a": 2}, make, dict, dict) == ({"v": 3}, False)
    assert len(list((private_cache / "k").iterdir())) == 1  # the disabled cache wrote nothing


def test_a_damaged_entry_is_measured_again_and_replaced() -> None:
    cache = MeasurementCache()
    path = cache.put("k", {"a": 1}, {"v": 0})
    assert path is not None
    path.write_text("{not json")
    assert cache.fetch("k", {"a": 1}, lambda: {"v": 5}, dict, dict) == ({"v": 5}, False)
    rejected = cache.fetch("k", {"a": 1}, lambda: {"v": 6}, dict, lambda d: (_ for _ in ()).throw(ValueError()))
    assert rejected == ({"v": 6}, False)
    assert cache.get("k", {"a": 1}) == {"v": 6}


def test_an_unwritable_cache_warns_once_and_measures(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    cache = MeasurementCache(blocker / "cache")  # a directory under a file cannot be made
    caplog.set_level(logging.WARNING, logger="pipetrain.profile")
    assert cache.fetch("k", {"a": 1}, lambda: 7, int, int) == (7, False)
    assert cache.fetch("k", {"a": 2}, lambda: 8, int, int) == (8, False)
    [record] = caplog.records
    assert record.getMessage().startswith(f"warning: cannot write the measurement cache {blocker / 'cache'} (")
    assert record.getMessage().endswith(f"set {CACHE_ENV} to a writable directory, or pass --no-cache)")


def test_profiles_round_trip_through_the_cache() -> None:
    nodes = [NodeProfile("x", "Input", 0.0, 0.0, 16, 0, kind="input"), NodeProfile("fc", "Linear", 0.25, 0.5, 8, 4,
                                                                                   ["x"])]
    made = Profile("m", 4, nodes, measured_forward_time=0.3, measured_backward_time=0.6)
    cache = MeasurementCache()
    first, hit = cached_profile(cache, {"model": "m"}, lambda: made)
    again, hit2 = cached_profile(cache, {"model": "m"}, lambda: pytest.fail("measured again"))
    assert (hit, hit2) == (False, True)
    assert again.names == made.names and again.measured_step_time == made.measured_step_time
    assert [n.compute_time for n in again.nodes] == [n.compute_time for n in made.nodes]
    assert cached_profile(None, {"model": "m"}, lambda: made) == (made, False)


def test_fingerprints_change_with_the_model() -> None:
    from pipetrain.graph import capture

    a, b = torch.nn.Linear(4, 8), torch.nn.Linear(4, 9)
    x = torch.randn(2, 4)
    assert model_fingerprint(a, x) == model_fingerprint(torch.nn.Linear(4, 8), x)
    assert model_fingerprint(a, x) != model_fingerprint(b, x)
    assert model_fingerprint(a, x) != model_fingerprint(a, torch.randn(3, 4))
    assert graph_fingerprint(capture(a, x).graph) == graph_fingerprint(capture(torch.nn.Linear(4, 8), x).graph)
    assert graph_fingerprint(capture(a, x).graph) != graph_fingerprint(capture(b, x).graph)


def test_the_profile_command_reuses_its_profile_unless_told(private_cache: Path, capsys: Any,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = profile_pkg.profile_model

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(str(kwargs.get("model_name")))
        return real(*args, **kwargs)

    monkeypatch.setattr(profile_pkg, "profile_model", counting)
    assert main(["profile", *MLP]) == 0
    first = capsys.readouterr().out
    assert len(calls) == 1 and "from the measurement cache" not in first
    assert main(["profile", *MLP]) == 0
    second = capsys.readouterr().out
    assert len(calls) == 1
    [entry] = (private_cache / "profile").iterdir()
    written = json.loads(entry.read_text())["written"]
    assert (f"profile from the measurement cache ({private_cache}), written {written}; pass --no-cache to "
            f"measure again") in second
    # the same table and step check as measured
    assert [ln for ln in second.splitlines() if ln.startswith(("total:", "step check:"))] == \
        [ln for ln in first.splitlines() if ln.startswith(("total:", "step check:"))]
    assert main(["profile", *MLP, "--no-cache"]) == 0
    assert len(calls) == 2 and "from the measurement cache" not in capsys.readouterr().out
    assert main(["profile", *MLP, "--option", "width=16"]) == 0          # another option: another profile
    assert main(["profile", *MLP, "--repeats", "2"]) == 0               # other repeats: another profile
    assert len(calls) == 4
    assert len(list((private_cache / "profile").iterdir())) == 3


def test_the_profile_command_prints_the_step_check(capsys: Any) -> None:
    assert main(["profile", *MLP, "--no-cache"]) == 0
    out = capsys.readouterr().out.splitlines()
    total = next(i for i, line in enumerate(out) if line.startswith("total: "))
    assert out[total + 1].startswith("step check: profile total ")
    assert " ms / measured whole-model step " in out[total + 1]
