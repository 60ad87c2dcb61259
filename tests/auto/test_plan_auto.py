"""``pipetrain plan PROFILE --calibration FILE`` chooses the schedule and microbatches too
(``pipetrain.auto.choose.choose_on_profile``), on the profile given.

- every candidate's printed prediction is the simulator's time for its plan, schedule and
  microbatches on the calibrated costs (recomputed here), and the choice is the smallest;
- the regimes flip with the link: a weight-heavy profile on a slow link is pipelined (data
  parallelism all-reduces every weight), a compute-heavy one with few weights on a fast link
  is data parallel;
- a memory limit is checked with each schedule's own rule (too small: one line naming it);
- ``--schedule NAME`` keeps PipeDream's plan for that schedule; ``--schedule auto`` without
  a calibration, or with ``--straight``, is refused in one line.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_calibrated import MBIT, compute_heavy, make_cal, vgg_like

from pipetrain.auto.choose import choose_on_profile, memory_rule_of
from pipetrain.errors import PlanError
from pipetrain.plan.stage_memory import stage_memory
from pipetrain.profile.io import save_profile
from pipetrain.profile.types import Profile
from pipetrain.schedule import SCHEDULES, get_schedule
from pipetrain.simulate.calibrated import predict_run

pytestmark = pytest.mark.timeout(120)


def cli(tmp_path: Path, prof: Profile, cal_bw: float | None, *extra: str) -> subprocess.CompletedProcess[str]:
    prof_path = tmp_path / "p.json"
    save_profile(prof, prof_path)
    cmd = [sys.executable, "-m", "pipetrain", "plan", str(prof_path), *extra]
    if cal_bw is not None:
        make_cal(cal_bw).save(tmp_path / "cal.json")
        cmd += ["--calibration", str(tmp_path / "cal.json")]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("workers", [2, 4])
def test_each_prediction_is_the_simulators_and_the_choice_the_fastest(workers: int) -> None:
    prof, cal = vgg_like(), make_cal(200 * MBIT)
    choice = choose_on_profile(prof, workers, cal)
    assert {c.schedule for c in choice.candidates} == {n for n, s in SCHEDULES.items() if s.auto}
    runnable = choice.runnable
    assert len(runnable) >= 3
    for c in runnable:
        assert c.plan is not None and c.predicted_time is not None
        assert get_schedule(c.schedule).ranks_needed(c.plan.replicas, {}) <= workers
        again = predict_run(c.plan, prof, cal, c.schedule, microbatches=c.microbatches)
        assert again["time_per_minibatch"] == pytest.approx(c.predicted_time, rel=1e-12)
        # the candidate carries the simulated per-stage costs into --json's "auto"
        assert [dict(x) for x in c.stage_unit_seconds] == again["stage_unit_seconds"]
        assert c.to_json()["stage_unit_seconds"] == again["stage_unit_seconds"]
        assert len(c.stage_unit_seconds) == c.plan.num_stages
    assert choice.best.predicted_time == min(c.predicted_time for c in runnable if c.predicted_time is not None)


def test_the_link_flips_the_choice_between_pipelines_and_data_parallelism() -> None:
    slow = choose_on_profile(vgg_like(), 2, make_cal(20 * MBIT))
    assert not get_schedule(slow.best.schedule).one_stage
    dp = next(c for c in slow.candidates if get_schedule(c.schedule).one_stage)
    assert dp.predicted_time is not None and slow.best.predicted_time is not None
    assert dp.predicted_time > 3 * slow.best.predicted_time   # 7.5 MB of weights over 20 Mbit/s
    fast = choose_on_profile(compute_heavy(), 2, make_cal(10_000 * MBIT))
    assert get_schedule(fast.best.schedule).one_stage and fast.best.plan is not None
    assert fast.best.plan.replicas == [2]


def test_a_memory_limit_is_checked_with_each_schedules_rule() -> None:
    prof, cal = vgg_like(), make_cal(200 * MBIT)
    free = choose_on_profile(prof, 2, cal)
    need = sorted(max(stage_memory(prof, c.plan, schedule=memory_rule_of(c.schedule), microbatches=c.microbatches))
                  for c in free.runnable if c.plan is not None)
    limit = need[len(need) // 2]     # about half the candidates fit as planned
    limited = choose_on_profile(prof, 2, cal, memory_limit=limit)
    assert limited.runnable
    for c in limited.runnable:
        assert c.plan is not None
        held = stage_memory(prof, c.plan, schedule=memory_rule_of(c.schedule), microbatches=c.microbatches)
        assert max(held) <= limit * (1 + 1e-9)
    with pytest.raises(PlanError, match="no configuration could be planned for --schedule auto.*--memory"):
        choose_on_profile(prof, 2, cal, memory_limit=1000.0)


def test_plan_cli_prints_and_records_the_choice(tmp_path: Path) -> None:
    out = cli(tmp_path, vgg_like(), 20 * MBIT, "--workers", "2", "--json", "--output", str(tmp_path / "plan.json"))
    assert out.returncode == 0, out.stderr
    d: dict[str, Any] = json.loads(out.stdout)
    want = choose_on_profile(vgg_like(), 2, make_cal(20 * MBIT))
    assert (d["schedule"], d["microbatches"], d["config"]) == (want.best.schedule, want.best.microbatches,
                                                               want.best.config)
    assert d["predicted_time_per_minibatch"] == pytest.approx(want.best.predicted_time, rel=1e-12)
    assert len(d["extra"]["auto"]["candidates"]) == len(want.candidates)
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["extra"]["auto"]["schedule"] == want.best.schedule
    table = cli(tmp_path, vgg_like(), 20 * MBIT, "--workers", "2")
    assert table.returncode == 0, table.stderr
    assert f"auto: {want.best.schedule} m={want.best.microbatches} on {want.best.config}" in table.stdout
    assert "predicted time per minibatch" in table.stdout


def test_a_named_schedule_keeps_pipedreams_plan_and_bad_combinations_are_one_line(tmp_path: Path) -> None:
    named = cli(tmp_path, vgg_like(), 20 * MBIT, "--workers", "2", "--schedule", "pipedream", "--json")
    assert named.returncode == 0, named.stderr
    assert "auto" not in json.loads(named.stdout)["extra"]
    for extra, why in ((["--schedule", "auto"], "pass --calibration"),):
        bad = cli(tmp_path, vgg_like(), None, "--workers", "2", *extra)
        assert bad.returncode == 2 and why in bad.stderr and "Traceback" not in bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1
    bad = cli(tmp_path, vgg_like(), 20 * MBIT, "--workers", "2", "--schedule", "auto", "--straight")
    assert bad.returncode == 2 and "drop --straight" in bad.stderr and "Traceback" not in bad.stderr
    bad = cli(tmp_path, vgg_like(), 20 * MBIT, "--workers", "2", "--schedule", "auto", "--microbatches", "0")
    assert bad.returncode == 2 and "--microbatches) must be an integer >= 1, got 0" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_a_stage_step_covers_the_parameters_an_exported_capture_reads_through_get_attr() -> None:
    """A ``torch.export`` capture's weights are ``get_attr`` nodes folded into the nodes that read
    them, so a plan's stages never name them: each stage's STEP is still timed over the
    parameters its nodes read (before, the choice predicted a STEP of 0 s for every Hugging Face
    model), a tied weight once per stage that reads it."""
    import torch

    from pipetrain.auto.choose import stage_parameters
    from pipetrain.graph import capture
    from tests.graph.test_capture import tiny_hf_gpt2

    model = tiny_hf_gpt2()
    cm = capture(model, torch.randint(0, 100, (2, 8)))
    assert cm.method == "export"
    nodes = [n.name for n in cm.graph]
    assert not set(nodes) & {n.name for n in cm.gm.graph.nodes if n.op == "get_attr"}  # folded
    whole = stage_parameters(cm.gm, nodes)
    assert sum(p.numel() for p in whole) == sum(p.numel() for p in model.parameters())  # the tie counted once
    half = len(nodes) // 2
    first, second = stage_parameters(cm.gm, nodes[:half]), stage_parameters(cm.gm, nodes[half:])
    assert first and second
    ids = {id(p) for p in first} | {id(p) for p in second}
    assert ids == {id(p) for p in whole}


def test_the_prediction_holds_a_weight_tied_across_stages_as_the_runtime_exchanges_it() -> None:
    """GPT-2 ties its token embedding and its LM head: cut between them, the two stages each
    hold a copy whose gradients the runtime all-reduces at every STEP (stages/tied.py);
    ``plan_ties`` gives the prediction that tensor and its holders, and nothing for a plan
    that keeps every reader in one stage."""
    import torch

    from pipetrain.auto.choose import plan_ties
    from pipetrain.graph import capture
    from pipetrain.plan.types import Plan, Stage
    from tests.graph.test_capture import tiny_hf_gpt2

    model = tiny_hf_gpt2()
    cm = capture(model, torch.randint(0, 100, (2, 8)))
    nodes = [n.name for n in cm.graph]
    half = len(nodes) // 2
    ties = plan_ties(cm.gm, Plan([Stage(nodes[:half]), Stage(nodes[half:])]))
    wte = model.get_input_embeddings().weight
    assert [(t.nbytes, t.stages) for t in ties] == [(wte.numel() * wte.element_size(), (0, 1))]
    assert plan_ties(cm.gm, Plan([Stage(nodes)])) == ()
