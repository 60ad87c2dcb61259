"""The planner chooses activation recomputation per stage, only where a stage would not fit.

On a profile of a small GPT, ``pipetrain plan --workers 2 --schedule flush --no-recompute``
with too little memory states the smallest memory that fits without recomputation; at 0.8
of it, the plan (recomputation allowed, the default) marks its stages ``"recompute": true``,
predicts their memory without the activations and their time with one more forward; and
``train --plan`` runs those stages recomputing, within the predicted memory. The simulator
adds the recompute to those stages' backwards. With bf16 the planner's wire bytes halve.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from pipetrain.cli import main
from pipetrain.job import OptimizerConfig, TrainConfig
from pipetrain.models import get_model
from pipetrain.plan import PlanOptions, plan
from pipetrain.plan.recompute import precision_profile, recompute_profile
from pipetrain.plan.traffic import plan_cut_bytes
from pipetrain.plan.types import Plan, Topology
from pipetrain.profile.io import save_profile
from pipetrain.profile.profiler import profile_model
from pipetrain.run import resolve_run
from pipetrain.runtime import launch_local
from pipetrain.simulate.tensor_memory import predict_tensor_memory

pytestmark = pytest.mark.timeout(180)

GPT = {"vocab": 64, "d_model": 32, "layers": 4, "heads": 4, "seq_len": 16}
BATCH = 8


@pytest.fixture(scope="module")
def profile_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    prof = profile_model(get_model("gpt", batch_size=BATCH, **GPT), batch_size=BATCH, warmup=0, repeats=1)
    path = tmp_path_factory.mktemp("prof") / "gpt.json"
    save_profile(prof, path)
    return path, prof


def _plan_json(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = main(["plan", *args])
    cap = capsys.readouterr()
    return rc, cap.out + cap.err


def test_plan_recomputes_where_a_stage_would_not_fit(profile_file: tuple[Path, Any], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    path, prof = profile_file
    base = [str(path), "--workers", "2", "--schedule", "flush", "--microbatches", "4"]
    rc, text = _plan_json([*base, "--memory", "1000", "--no-recompute", "--json"], capsys)
    assert rc == 2
    need = float(re.search(r"smallest memory per worker that fits is about ([0-9.e+]+) bytes", text).group(1))
    # at the smallest memory that fits without, no stage recomputes
    rc, text = _plan_json([*base, "--memory", f"{need:.6g}", "--json"], capsys)
    assert rc == 0 and not any(s.get("recompute") for s in json.loads(text)["stages"])
    out = tmp_path / "plan.json"
    rc, text = _plan_json([*base, "--memory", f"{0.8 * need:.6g}", "--json", "--output", str(out)], capsys)
    assert rc == 0, text
    d = json.loads(text)
    marked = [k for k, s in enumerate(d["stages"]) if s.get("recompute") is True]
    assert marked, d["stages"]
    saved = Plan.load(out)
    assert [s.recompute for s in saved.stages] == [s.get("recompute", False) for s in d["stages"]]
    # every stage's predicted memory fits; a recomputing stage's time has one more forward
    for k, s in enumerate(saved.stages):
        assert s.memory_bytes is not None and s.memory_bytes <= 0.8 * need
        fwd = sum(prof[n].forward_time for n in s.nodes if not prof[n].is_input)
        bwd = sum(prof[n].backward_time for n in s.nodes if not prof[n].is_input)
        assert s.compute_time == pytest.approx(2 * fwd + bwd if s.recompute else fwd + bwd, rel=1e-9), k
    # train --plan honours the marks
    run = resolve_run(TrainConfig.of(model="gpt", model_options=GPT, plan=str(out), workers=2, schedule="flush",
                                     microbatches=4, batch_size=BATCH, steps=2, quiet=True, threads=1,
                                     measure_memory=True, timeout=60, optimizer=OptimizerConfig("sgd", lr=0.1)))
    assert run.recompute_stages == frozenset(marked)
    res = launch_local([run], timeout=120)[0]
    assert res.final_loss is not None and all(b and b > 0 for b in res.tensor_peak_bytes)
    # each worker's tensor peak is within 20% of the simulator's prediction for the plan with its
    # recompute marks (the ledger's accounting; the planner's stage memory leaves out the data
    # and the receive pool)
    _, target = get_model("gpt", batch_size=BATCH, **GPT).make_batch(BATCH, torch.Generator().manual_seed(0))
    seg = run.segments[-1]
    sim = predict_tensor_memory(seg.schedule, run.plan, prof, optimizer_state=0.0, data_steps=seg.steps,
                                target_bytes=target.numel() * target.element_size())
    for meas, p in zip(res.tensor_peak_bytes, sim):
        assert meas is not None and abs(meas - p) <= 0.2 * meas, (meas, p)
    # and training fits the plan: each worker's measured tensor peak is at most 1.2x its stage's
    # predicted memory in the plan (which counts optimizer state for the profile's momentum; the
    # run trains plain SGD) and so within 1.2x the --memory asked for
    for meas, s in zip(res.tensor_peak_bytes, saved.stages):
        assert meas is not None and s.memory_bytes is not None and meas <= 1.2 * s.memory_bytes, (meas, s.memory_bytes)
        assert meas <= 1.2 * 0.8 * need


def test_no_plan_message_states_both_needs(profile_file: tuple[Path, Any], capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = profile_file
    rc, text = _plan_json([str(path), "--workers", "2", "--schedule", "flush", "--microbatches", "4",
                           "--memory", "1000"], capsys)
    assert rc == 2
    assert re.search(r"no plan fits in 1000 bytes .* about [0-9.e+]+ bytes \([0-9.]+ GiB\) without "
                     r"recomputation, about [0-9.e+]+ bytes \([0-9.]+ GiB\) with it; raise --memory", text), text


def test_recompute_profile_costs_and_bf16_bytes(profile_file: tuple[Path, Any]) -> None:
    _, prof = profile_file
    rp = recompute_profile(prof)
    for a, b in zip(prof.nodes, rp.nodes):
        if not a.is_input:
            assert b.backward_time == a.backward_time + a.forward_time and b.saved_bytes == 0
    half = precision_profile(prof, "bf16")
    stages = plan(prof, Topology.flat(2, 1e9), PlanOptions(schedule="flush", microbatches=4, num_stages=2,
                                                           straight=True)).stages
    full = plan_cut_bytes(stages, prof, 2)
    assert plan_cut_bytes(stages, half, 2) == plan_cut_bytes(stages, prof, 2, wire_scale=0.5)
    assert [c.activation for c in plan_cut_bytes(stages, half, 2)] == [c.activation // 2 for c in full]


def test_simulator_counts_the_recompute(profile_file: tuple[Path, Any]) -> None:
    from pipetrain.schedule import build_schedule
    from pipetrain.simulate.costs import StageCosts
    from pipetrain.simulate.engine import simulate

    _, prof = profile_file
    base = plan(prof, Topology.flat(2, 1e9), PlanOptions(schedule="flush", microbatches=4, num_stages=2,
                                                         straight=True))
    marked = Plan.from_dict({**base.to_dict(), "stages": [{**s, "recompute": k == 0}
                                                          for k, s in enumerate(base.to_dict()["stages"])]})
    sched = build_schedule("flush", [1, 1], 4, 2)
    plain, rec = (simulate(sched, StageCosts.from_plan(p, prof, units=4)) for p in (base, marked))
    fwd0 = StageCosts.from_plan(base, prof, units=4)[0].forward_time
    assert plain.recompute_time == [0.0, 0.0]
    assert rec.recompute_time[0] == pytest.approx(8 * fwd0) and rec.recompute_time[1] == 0.0  # 2 steps x 4 units
    assert rec.busy_time[0] == pytest.approx(plain.busy_time[0] + 8 * fwd0)
    assert rec.summary()["recompute_time"] == rec.recompute_time
