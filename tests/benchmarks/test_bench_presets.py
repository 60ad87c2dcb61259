"""The benchmark's headline figures (benchmarks/): configurations, commands, which ceiling
bounds which configuration, and the per-model JSON fields, on made-up measurements (no
process is launched; speed is never asserted)."""
from __future__ import annotations

import itertools
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import headline  # noqa: E402
import run as bench_run  # noqa: E402
from baselines import pipetrain_cli  # noqa: E402
from timing import Measurement  # noqa: E402


def test_configurations_include_dp_auto_zerobubble_and_unit_ceilings() -> None:
    names = [c.name for c in bench_run.build_configs([4, 8], four_workers=False)]
    for want in ("ceiling", "ceiling_m4", "ceiling_m8", "ceiling_dp", "ddp", "pipetrain_dp", "pipetrain_auto",
                 "pipetrain_flush_m4", "pipetrain_zerobubble_m4", "pipetrain_zerobubble_m8"):
        assert want in names, want
    quick = [c.name for c in bench_run.build_configs([4], four_workers=False, quick=True)]
    assert "pipetrain_zerobubble_m4" in quick and not any("2bw" in n for n in quick)


def test_auto_command_leaves_every_choice_open() -> None:
    cmd = pipetrain_cli.command("pipetrain", "gpt", None, 2, None, 16, 0, 5, 3, 0, 60.0, None)
    assert cmd[cmd.index("--schedule") + 1] == "auto"  # named: a short run that names none is not chosen
    for flag in ("--microbatches", "--config", "--cut", "--plan"):
        assert flag not in cmd
    assert cmd[cmd.index("--workers") + 1] == "2"
    fixed = pipetrain_cli.command("pipetrain", "gpt", "flush", 2, "1-1", 16, 4, 5, 3, 0, 60.0, ["blocks.4"])
    assert fixed[fixed.index("--schedule") + 1] == "flush" and "--cut" in fixed


def test_preset_headline_and_skip(tmp_path: Path) -> None:
    cli = tmp_path / "pipetrain"
    cli.write_text("")
    a = bench_run.parse_args(["--preset", "headline", "--pipetrain", str(cli)])
    assert a.rounds == 3 and a.microbatches == [2, 4, 8] and a.warmup == 2 and a.steps_for == {"mlp": 20, "lm": 12}
    names = [c.name for c in bench_run.select_configs(a)]
    for want in ("single", "ceiling", "ceiling_m4", "ceiling_m8", "ceiling_dp", "ddp", "pipetrain_dp",
                 "pipetrain_auto", "pipetrain_flush_m4", "pipetrain_zerobubble_m4", "torch_gpipe_m8"):
        assert want in names, want
    assert "pipetrain_2bw_m8" not in names and len(names) == 19
    b = bench_run.parse_args(["--preset", "headline", "--rounds", "5", "--pipetrain", str(cli)])
    assert b.rounds == 5  # explicit options win
    assert a.split == "balanced" and bench_run.parse_args(["--pipetrain", str(cli)]).split == "balanced"
    assert bench_run.parse_args(["--split", "layers", "--pipetrain", str(cli)]).split == "layers"


def _slowest_stage(times: list[float], cuts: Sequence[int]) -> float:
    bounds = [0, *cuts, len(times)]
    return max(sum(times[a:b]) for a, b in zip(bounds, bounds[1:]))


def test_the_default_cut_minimises_the_slowest_stage_as_brute_force_does() -> None:
    import bench_models

    rng = random.Random(0)
    for _ in range(200):
        times = [rng.choice([0.0, rng.uniform(0.001, 1.0)]) for _ in range(rng.randint(2, 9))]
        for stages in range(2, min(4, len(times)) + 1):
            cuts = bench_models.balanced_cuts(times, stages)
            assert sorted(set(cuts)) == cuts and len(cuts) == stages - 1 and cuts[0] > 0 and cuts[-1] < len(times)
            best = min(_slowest_stage(times, c) for c in itertools.combinations(range(1, len(times)), stages - 1))
            assert _slowest_stage(times, cuts) == pytest.approx(best)
    # the lm's per-layer times as measured (embedding, 8 blocks, head): 5 blocks / 3 + head
    lm = [0.006, 0.104, 0.098, 0.101, 0.100, 0.101, 0.100, 0.099, 0.103, 0.200]
    assert bench_models.balanced_cuts(lm, 2) == [6]


def test_children_of_one_structure_are_timed_as_their_median_so_identical_layers_cut_evenly() -> None:
    import bench_models
    import torch.nn as nn

    from pipetrain.profile.cache import model_fingerprint

    layers = [m for _ in range(16) for m in (nn.Linear(8, 8), nn.ReLU())]
    keys = [model_fingerprint(m) for m in layers]
    assert len(set(keys)) == 2 and model_fingerprint(nn.Linear(8, 4)) != keys[0]
    rng = random.Random(1)
    noisy = [rng.uniform(4.0, 5.7) if isinstance(m, nn.Linear) else rng.uniform(0.07, 0.3) for m in layers]
    smooth = bench_models.same_structure_medians(noisy, keys)
    assert len(set(smooth)) == 2 and sorted(noisy)[7] <= smooth[0] <= sorted(noisy)[24]
    assert bench_models.balanced_cuts(smooth, 2) == [16]  # 8 Linear + ReLU pairs each


def _cfg(name: str) -> Any:
    return next(c for c in bench_run.build_configs([4, 8], four_workers=False) if c.name == name)


def test_each_configuration_is_bounded_by_the_ceiling_at_its_unit_size() -> None:
    ran = {"ceiling", "ceiling_m4", "ceiling_m8", "ceiling_dp"}
    assert headline.bound_of(_cfg("pipetrain_pipedream"), {}, ran, "ceiling_m8") == "ceiling"
    assert headline.bound_of(_cfg("pipetrain_zerobubble_m4"), {}, ran, "ceiling_m8") == "ceiling_m4"
    assert headline.bound_of(_cfg("torch_gpipe_m8"), {}, ran, "ceiling_m4") == "ceiling_m8"
    assert headline.bound_of(_cfg("ddp"), {}, ran, "ceiling_m4") == "ceiling_dp"
    assert headline.bound_of(_cfg("pipetrain_dp"), {}, ran, "ceiling_m4") == "ceiling_dp"
    auto = _cfg("pipetrain_auto")
    assert headline.bound_of(auto, {"schedule": "flush", "microbatches": 8, "stages": 2}, ran, "x") == "ceiling_m8"
    assert headline.bound_of(auto, {"schedule": "dp", "microbatches": 2, "stages": 1}, ran, "x") == "ceiling_dp"
    # a unit size no ceiling ran at: the best pipeline ceiling
    assert headline.bound_of(auto, {"schedule": "flush", "microbatches": 16, "stages": 2}, ran, "best") == "best"
    assert headline.bound_of(_cfg("single"), {}, ran, "best") is None


def _m(sps: float, **extra: Any) -> Measurement:
    return Measurement(sps, "ok", "", [100.0, 100.0], dict(extra))


def test_headline_fields_from_made_up_rounds() -> None:
    cfgs = bench_run.build_configs([4], four_workers=False, quick=True)
    rates = {"single": 10, "ceiling": 20, "ceiling_m4": 25, "ceiling_dp": 22, "torch_gpipe_m4": 12,
             "torch_1f1b_m4": 15, "ddp": 18, "pipetrain_dp": 19, "pipetrain_auto": 19.5, "pipetrain_pipedream": 17,
             "pipetrain_flush_m4": 20, "pipetrain_gpipe_m4": 19, "pipetrain_zerobubble_m4": 22}
    runs = {n: [_m(v), _m(v * 1.1)] for n, v in rates.items()}
    runs["pipetrain_auto"] = [_m(19.5, chosen={"schedule": "dp", "microbatches": 2, "stages": 1})] * 2
    medians = {n: v * 1.05 for n, v in rates.items()}
    configs: dict[str, dict[str, Any]] = {c.name: {} for c in cfgs}
    configs["pipetrain_flush_m4"].update(predicted_time_per_minibatch_s=1.0, memory_prediction_error=0.3)
    configs["pipetrain_zerobubble_m4"].update(predicted_time_per_minibatch_s=0.8, memory_prediction_error=0.1)
    configs["pipetrain_auto"].update(prediction_error=0.07, prediction_source="pipetrain train --json")
    steady = dict(runs, pipetrain_zerobubble_m4=[_m(23.1), _m(23.1 * 1.1)])
    out = headline.headline_fields(runs, cfgs, medians, configs, [4], 4, "torch_1f1b_m4", steady)
    assert out["auto_best_other"] == "pipetrain_zerobubble_m4"
    assert out["auto_vs_best"] == pytest.approx(19.5 / 22 * (1 + 1 / 1.1) / 2)  # median of the two rounds
    assert out["dp_vs_ddp"] == pytest.approx(19 / 18)
    assert out["zerobubble_vs_flush"] == pytest.approx(22 / 20)
    assert out["zerobubble_vs_flush_predicted_by_m"]["4"] == pytest.approx(1.25)
    assert out["pipetrain_best_pipeline"] == "pipetrain_zerobubble_m4"
    assert out["pipetrain_best_pipeline_vs_torch_best"] == pytest.approx(22 / 15)
    assert out["pipetrain_best_pipeline_steady_vs_torch_best"] == pytest.approx(23.1 / 15)
    assert out["max_vs_ceiling_config"] == "pipetrain_zerobubble_m4"  # 22 / 25 is below 1, but the largest
    assert out["max_vs_ceiling"] == pytest.approx(22 / 25)
    assert configs["pipetrain_auto"]["ceiling"] == "ceiling_dp"
    assert configs["pipetrain_pipedream"]["vs_ceiling"] == pytest.approx(17 / 20)
    assert out["memory_prediction_error"] == pytest.approx(0.3)
    assert out["auto_prediction_error"] == pytest.approx(0.07)


def test_errors_of_predictions() -> None:
    assert headline.relative_error(1.1, 1.0) == pytest.approx(0.1)
    assert headline.relative_error(None, 1.0) is None
    assert headline.memory_error([120.0, 80.0], [100.0, 100.0]) == pytest.approx(0.2)
    assert headline.memory_error(None, [1.0]) is None


def test_lean_ceiling_stage_trains_like_plain_pytorch() -> None:
    """The ceiling's pipetrain-style stage (fused Linear buffers, persistent grads) computes
    the same updates as plain PyTorch over several accumulated units and steps."""
    import copy

    import torch
    from baselines.local import lean_stage

    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    lean = copy.deepcopy(plain)
    o1, o2 = torch.optim.SGD(plain.parameters(), lr=0.1), torch.optim.SGD(lean.parameters(), lr=0.1)
    begin = lean_stage(lean)
    assert type(lean[0]).__name__ == "AccumulatingLinear"
    xs = [torch.randn(4, 8) for _ in range(3)]
    for _ in range(3):
        o1.zero_grad(set_to_none=True)
        begin()
        for x in xs:
            plain(x).pow(2).mean().backward()
            lean(x).pow(2).mean().backward()
        o1.step()
        o2.step()
    for p, q in zip(plain.parameters(), lean.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
