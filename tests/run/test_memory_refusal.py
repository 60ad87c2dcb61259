"""Memory known before launch: every worker's predicted peak in the resolved run (``train
--json``) and in ``plan --json``, and ``--memory`` refusing, before any worker starts, a plan
that would not fit."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pipetrain.cli import main
from pipetrain.errors import RuntimeConfigError
from pipetrain.job import OptimizerConfig, TrainConfig
from pipetrain.job.model import load_bundle
from pipetrain.models import TINY_OPTIONS
from pipetrain.run import resolve_run

PROFILES = Path(__file__).resolve().parents[1] / "data" / "profiles"
MLP = TINY_OPTIONS["mlp"]


def cfg(**kw: Any) -> TrainConfig:
    base: dict[str, Any] = dict(model="mlp", model_options=MLP, workers=2, config="1-1", schedule="flush",
                                batch_size=8, microbatches=2, steps=1, quiet=True)
    base.update(kw)
    return TrainConfig.of(**base)


def predicted(c: TrainConfig) -> list[dict[str, Any]]:
    return list(resolve_run(c).plan.extra["worker_memory"]["workers"])  # type: ignore[union-attr]


def model_bytes() -> int:
    model = load_bundle(cfg(), 4).model
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize(("optimizer", "state"), [(OptimizerConfig("sgd"), 0.0),
                                                  (OptimizerConfig("sgd", momentum=0.9), 1.0),
                                                  (OptimizerConfig("adam"), 2.0)])
def test_prediction_by_kind(optimizer: OptimizerConfig, state: float) -> None:
    """Flush: the workers' weights add up to the model's bytes; gradients equal the weights,
    optimizer state is the optimizer's buffers per weight; the total is the sum of the kinds."""
    workers = predicted(cfg(optimizer=optimizer))
    assert [w["rank"] for w in workers] == [0, 1] and [w["stages"] for w in workers] == [[0], [1]]
    assert sum(w["weights"] for w in workers) == model_bytes()
    for w in workers:
        assert w["weights"] > 0 and w["activations"] > 0
        assert w["gradients"] == w["weights"] and w["optimizer_state"] == state * w["weights"]
        assert w["total"] == w["weights"] + w["gradients"] + w["optimizer_state"] + w["activations"]


def test_pipedream_counts_its_stashed_versions() -> None:
    flush = predicted(cfg())
    dream = predicted(cfg(schedule="pipedream", microbatches=1))
    assert dream[0]["weights"] == 2 * flush[0]["weights"]  # stage 0 of 2 stashes 2 versions
    assert dream[1]["weights"] == flush[1]["weights"]


def test_a_plan_over_memory_is_refused_before_any_worker_starts(monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    workers = predicted(cfg())
    worst = max(workers, key=lambda w: w["total"])
    limit = int(worst["total"]) - 1
    with pytest.raises(RuntimeConfigError) as e:
        resolve_run(cfg(memory=limit))
    text = str(e.value)
    assert "\n" not in text
    assert text.startswith(f"worker {worst['rank']} (stage {worst['stages'][0]} of config 1-1, schedule flush, 2 "
                           f"microbatches) is predicted to peak at {worst['total']:.4g} bytes")
    assert f"over --memory {limit:.4g} bytes" in text and "add workers" in text and "raise --memory" in text
    resolve_run(cfg(memory=worst["total"]))  # fits exactly: accepted

    import pipetrain.runtime.launch as launch

    def no_launch(*_: Any, **__: Any) -> None:
        raise AssertionError("a worker was started")

    monkeypatch.setattr(launch, "launch_local", no_launch)
    args = ["train", "--model", "mlp", *[a for k, v in MLP.items() for a in ("--option", f"{k}={v}")],
            "--workers", "2", "--config", "1-1", "--schedule", "flush", "--batch-size", "8", "--microbatches", "2",
            "--steps", "1", "--memory", str(limit)]
    capsys.readouterr()
    assert main(args) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0] == f"error: {text}"


def test_memory_takes_units() -> None:
    assert cfg(memory="2GiB").parallel.memory == 2 * 2 ** 30
    assert cfg(memory="2e9").parallel.memory == 2e9
    with pytest.raises(RuntimeConfigError, match=r"^--memory takes positive bytes per worker, as a number or with a "
                                                 r"unit \(2e9, 2GB, 2GiB\), got 'lots'; fix the value$"):
        cfg(memory="lots")
    with pytest.raises(RuntimeConfigError, match="got -1"):
        cfg(memory=-1)


def test_plan_json_states_each_workers_peak(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(PROFILES / "vgg16.txt"), "--workers", "4", "--bandwidth", "10Gbit", "--straight",
                 "--schedule", "flush", "--microbatches", "4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    memory = d["extra"]["worker_memory"]
    ranks = [r for k, s in enumerate(d["stages"]) for r in range(sum(x["replicas"] for x in d["stages"][:k]),
                                                                  sum(x["replicas"] for x in d["stages"][:k + 1]))]
    assert [w["rank"] for w in memory["workers"]] == sorted(ranks)
    by_stage = {w["stages"][0]: w["total"] for w in memory["workers"]}
    for k, s in enumerate(d["stages"]):  # the planner's per-stage figure, by kind
        assert by_stage[k] == pytest.approx(s["memory_bytes"], rel=1e-12)
    assert memory["peak"] == max(by_stage.values())


def test_recomputing_stages_hold_only_their_inputs() -> None:
    plain, again = predicted(cfg()), predicted(cfg(recompute=True))
    for p, r in zip(plain, again):
        assert r["weights"] == p["weights"] and 0 <= r["activations"] < p["activations"]
    assert again[0]["activations"] == 0  # stage 0's input is the batch, held by the data


def test_one_process_is_checked_as_one_stage() -> None:
    two = predicted(cfg())
    with pytest.raises(RuntimeConfigError, match=r"^worker 0 \(stage 0 of config 1 \(one process\), schedule flush, "
                                                 r"2 microbatches\) is predicted to peak at"):
        resolve_run(cfg(workers=1, config=None, memory=max(w["total"] for w in two)))
    resolve_run(cfg(workers=1, config=None, memory=10 * sum(w["total"] for w in two)))
