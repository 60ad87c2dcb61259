"""Activation recomputation (``--recompute``): the same numbers, less activation memory.

Every stage keeps only its input per unit in flight and recomputes its forward in the
backward (runtime/engine/recompute.py), under the version the backward names and the unit's
random stream. So a run with recomputation equals the same run without, weight for weight
(to 1e-6; in practice bit for bit), under flush, pipedream (with and without stashing, also
against the replay), 2bw and zero-bubble's split backward; and the tensor ledger counts at
most half the activations on stage 0.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from pipetrain.errors import PlanError, RuntimeConfigError
from pipetrain.job import OptimizerConfig, TrainConfig
from pipetrain.plan.types import Plan, Stage
from pipetrain.run import resolve_run
from pipetrain.runtime import launch_local, replay_config

pytestmark = pytest.mark.timeout(180)

# dropout > 0: the recompute must draw the forward's masks (graph/random_ops.py)
GPT = {"vocab": 64, "d_model": 32, "layers": 4, "heads": 4, "seq_len": 16, "dropout": 0.1}
TIMEOUT = 60
#: (name, schedule, microbatches, schedule options)
CASES = [("flush", "flush", 4, {}), ("pipedream", "pipedream", 1, {}),
         ("nostash", "pipedream", 1, {"stashing": False}), ("2bw", "2bw", 4, {}),
         ("zerobubble", "zerobubble", 4, {})]


def cfg(schedule: str, microbatches: int, recompute: bool, **kw: Any) -> TrainConfig:
    return TrainConfig.of(model="gpt", model_options=GPT, schedule=schedule, workers=2, config="1-1",
                          microbatches=microbatches, batch_size=8, steps=4, seed=0, return_state=True,
                          measure_memory=True, recompute=recompute, timeout=TIMEOUT, quiet=True, threads=1,
                          optimizer=OptimizerConfig("sgd", lr=0.1, momentum=0.9), **kw)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / (b.float().abs().max() + 1e-12))


@pytest.fixture(scope="module")
def runs() -> dict[tuple[str, bool], Any]:
    keys, resolved = [], []
    for name, sched, m, opts in CASES:
        for rec in (False, True):
            keys.append((name, rec))
            resolved.append(resolve_run(cfg(sched, m, rec, **opts)))
    results = launch_local(resolved, timeout=TIMEOUT * 2)
    return {k: (run, res) for k, run, res in zip(keys, resolved, results)}


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_recompute_equals_no_recompute(runs: dict[tuple[str, bool], Any], name: str) -> None:
    (run_r, with_r), (_, without) = runs[(name, True)], runs[(name, False)]
    assert run_r.recompute_stages == {0, 1}
    for n, t in without.state.items():
        err = rel_err(with_r.state[n], t)
        assert err <= 1e-6, f"{name} {n}: relative error {err:.2e} > 1e-6"
    assert with_r.losses == pytest.approx(without.losses, rel=1e-6)


@pytest.mark.parametrize("name", ["pipedream", "nostash", "2bw"])
def test_recompute_equals_replay(runs: dict[tuple[str, bool], Any], name: str) -> None:
    run, res = runs[(name, True)]
    rep = replay_config(run)
    # Attention's key bias has a zero gradient (softmax ignores a shift shared by every key):
    # it holds rounding noise (about 1e-12), which the runtime and the replay round apart.
    # Errors are relative to each tensor's largest value, at least 1e-6 of the model's.
    floor = 1e-6 * max(float(t.abs().max()) for t in rep.params.values())
    for n, t in rep.params.items():
        err = float((res.state[n].float() - t.float()).abs().max()) / max(float(t.abs().max()), floor)
        assert err <= 1e-5, f"{name} {n}: relative error {err:.2e} > 1e-5"


@pytest.mark.parametrize("name", ["flush", "pipedream", "zerobubble"])
def test_stage0_activations_at_most_half(runs: dict[tuple[str, bool], Any], name: str) -> None:
    (_, with_r), (_, without) = runs[(name, True)], runs[(name, False)]
    a_r = with_r.tensor_max_by_kind[0]["activations"]
    a_0 = without.tensor_max_by_kind[0]["activations"]
    assert 0 < a_r <= 0.5 * a_0, (name, a_r, a_0)


def test_one_worker_refuses_recompute() -> None:
    with pytest.raises(RuntimeConfigError, match=r"--recompute recomputes the stages of a pipeline, but this run "
                                                 r"has 1 worker.*pass --workers 2"):
        resolve_run(TrainConfig.of(model="mlp", workers=1, steps=1, recompute=True, quiet=True))


def test_plan_stage_recompute_round_trip() -> None:
    plan = Plan([Stage(["a"]), Stage(["b"], recompute=True)])
    d = plan.to_dict()
    assert "recompute" not in d["stages"][0] and d["stages"][1]["recompute"] is True
    assert [s.recompute for s in Plan.from_dict(d).stages] == [False, True]
    d["stages"][1]["recompute"] = "yes"
    with pytest.raises(PlanError, match=r"stage 1 has recompute='yes'; it must be true or false"):
        Plan.from_dict(d)
