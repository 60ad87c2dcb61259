"""The planner on measured link costs (``pipetrain.plan.calibrated``), and its byte counts.

- a slow calibrated link makes the planner pipeline a communication-heavy profile (large
  fully connected weights, small activations) and keep data parallelism for a compute-heavy
  one (small weights);
- the calibrated all-reduce is the measured fit at the measured rank count; a calibration
  file goes through ``load_calibration`` into ``plan`` and ``pipetrain plan --calibration``;
- model inputs read after stage 0 are counted in the planner's cut bytes (the runtime relays
  them) and the planner's cut bytes equal the traffic prediction's;
- the bytes per sample predicted for a known 2-stage plan (replicated first stage) equal what
  the runtime sends (``launch_local`` on loopback), exactly.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipetrain.cluster.calibration import Calibration, LinkFit, load_calibration
from pipetrain.errors import PipetrainError, PlanError
from pipetrain.plan import PlanOptions, evaluate, plan
from pipetrain.plan.calibrated import calibrated_params, calibrated_topology, plan_with_calibration, ring_step_latency
from pipetrain.plan.cost import LevelCtx, PipetrainCost, stage_arrays
from pipetrain.plan.traffic import plan_cut_bytes
from pipetrain.plan.types import Plan, Stage
from pipetrain.profile.types import NodeProfile, Profile
from pipetrain.simulate.calibrated import calibrated_costs, predict_run

pytestmark = pytest.mark.timeout(120)

MBIT = 1e6 / 8  # bytes/s of 1 Mbit/s


def make_cal(bandwidth: float, latency: float = 60e-6, ranks: int = 2) -> Calibration:
    """A calibration as `pipetrain calibrate` writes it (all-reduce slightly slower than p2p)."""
    algo = bandwidth * 0.98 * ranks / (2 * (ranks - 1))
    return Calibration(p2p=LinkFit(latency, bandwidth), allreduce=LinkFit(3 * latency, algo), allreduce_ranks=ranks,
                       hosts=ranks, ranks=ranks, where="emulated",
                       bandwidth_limit_bits_per_second=int(bandwidth * 8))


def node(name: str, f: float, act: float, params: float, inputs: list[str]) -> NodeProfile:
    return NodeProfile(name, "Layer", f, 2 * f, int(act), int(params), inputs)


def vgg_like() -> Profile:
    """Convolutions (compute, few weights, large maps), then 3 large FC layers (weights)."""
    nodes = [NodeProfile("x", "Input", 0.0, 0.0, 400_000, 0, [], "input")]
    prev = "x"
    for i in range(4):
        nodes.append(node(f"conv{i}", 8e-3, 800_000 // (i + 1), 40_000, [prev]))
        prev = f"conv{i}"
    nodes.append(node("pool", 1e-4, 8_000, 0, [prev]))
    nodes.append(node("fc0", 3e-3, 64_000, 6_400_000, ["pool"]))
    nodes.append(node("fc1", 1e-3, 64_000, 1_000_000, ["fc0"]))
    nodes.append(node("fc2", 2e-4, 1_280, 20_000, ["fc1"]))
    return Profile("vgg-like", 32, nodes)


def compute_heavy() -> Profile:
    """A chain with many seconds of compute and few weights (ResNet-like for the planner)."""
    nodes = [NodeProfile("x", "Input", 0.0, 0.0, 400_000, 0, [], "input")]
    prev = "x"
    for i in range(6):
        nodes.append(node(f"block{i}", 20e-3, 2_000_000, 20_000, [prev]))  # large maps, small weights
        prev = f"block{i}"
    return Profile("compute-heavy", 32, nodes)


# -- choices ---------------------------------------------------------------------------------
@pytest.mark.parametrize("workers", [2, 4])
def test_slow_link_pipelines_a_communication_heavy_model(workers: int) -> None:
    prof = vgg_like()
    cal = make_cal(50 * MBIT)
    p = plan_with_calibration(prof, workers, cal)
    assert p.num_stages >= 2, p.config
    # the cut falls where few bytes cross: the fully connected weights are never all-reduced
    fc_stage = next(k for k, s in enumerate(p.stages) if "fc0" in s.nodes)
    assert p.stages[fc_stage].replicas == 1
    assert p.predicted_time < p.data_parallel_time / 5, (p.predicted_time, p.data_parallel_time)
    assert p.extra["calibration"]["p2p_bandwidth_bytes_per_second"] == cal.p2p.bandwidth_bytes_per_second


@pytest.mark.parametrize("workers", [2, 4])
def test_slow_link_keeps_data_parallelism_for_a_compute_heavy_model(workers: int) -> None:
    p = plan_with_calibration(compute_heavy(), workers, make_cal(50 * MBIT))
    assert p.config == str(workers), p.config
    assert p.predicted_time == pytest.approx(p.data_parallel_time, rel=1e-12)


def test_fast_link_makes_data_parallelism_competitive() -> None:
    """At 100 Gbit/s the all-reduce of 30 MB costs little: data parallelism (4 workers) wins."""
    p = plan_with_calibration(vgg_like(), 4, make_cal(100e9 / 8, latency=5e-6))
    assert p.config == "4", p.config


# -- the calibrated terms ----------------------------------------------------------------------
@pytest.mark.parametrize("ranks", [2, 3])
def test_calibrated_allreduce_is_the_measured_fit(ranks: int) -> None:
    cal = make_cal(50 * MBIT, ranks=ranks)
    params = calibrated_params(cal)
    assert params.overlap == 0.0 and params.latency == cal.p2p.latency_seconds
    assert params.allreduce_bandwidth == pytest.approx(cal.allreduce_bus_bandwidth)
    assert ring_step_latency(cal) * 2 * (ranks - 1) == pytest.approx(cal.allreduce.latency_seconds)
    model = PipetrainCost(params)
    lv = LevelCtx(cal.p2p.bandwidth_bytes_per_second, 1)
    for nbytes in (4.0, 1e5, 8e6):
        assert model.sync(lv, nbytes, ranks) == pytest.approx(cal.allreduce.seconds(nbytes), rel=1e-12)


def test_data_parallel_time_is_compute_plus_measured_allreduce() -> None:
    """pipetrain model, overlap 0: steady T_dp = (C + allreduce(P, N)) / N exactly; the total
    adds the fill amortised over M minibatches, T = T_ss (1 - 1/M) + C / M."""
    prof = vgg_like()
    cal = make_cal(50 * MBIT)
    p = plan_with_calibration(prof, 2, cal)
    C = sum(n.compute_time for n in prof.nodes)
    P = sum(n.parameter_bytes for n in prof.nodes)
    steady = (C + cal.allreduce.seconds(P)) / 2
    M = calibrated_params(cal).minibatches
    assert p.data_parallel_time == pytest.approx(steady * (1 - 1 / M) + C / M, rel=1e-12)


def test_simulated_dp_minibatch_pays_one_measured_allreduce() -> None:
    """The dp schedule (batch split over replicas, one all-reduce a minibatch) simulated on
    calibrated costs: steady time per minibatch = C / 2 + allreduce(P), no overlap."""
    prof = vgg_like()
    cal = make_cal(50 * MBIT)
    dp = Plan(stages=[Stage(nodes=list(prof.names), replicas=2)], model=prof.model, batch_size=prof.batch_size)
    got = predict_run(dp, prof, cal, "dp", steps=6)
    C = sum(n.compute_time for n in prof.nodes)
    P = sum(n.parameter_bytes for n in prof.nodes)
    assert got["microbatches"] == 2
    assert got["time_per_minibatch"] == pytest.approx(C / 2 + cal.allreduce.seconds(P), rel=1e-9)
    # ring convention: 2 (r-1)/r P per rank, r ranks, + the count element
    assert got["bytes_per_sample"]["allreduce"] == pytest.approx(2 * P / prof.batch_size)
    costs = calibrated_costs(dp, prof, cal, units=2)
    assert costs.allreduce_time(0, [0, 1]) == pytest.approx(cal.allreduce.seconds(P), rel=1e-12)
    # each stage's simulated compute per unit, what a trace's F, B and STEP are set against
    (stage,) = got["stage_unit_seconds"]
    assert stage["forward"] + stage["backward"] == pytest.approx(C / 2, rel=1e-9)
    assert stage["forward"] == pytest.approx(sum(n.forward_time for n in prof.nodes) / 2, rel=1e-9)


def test_an_allreduce_over_the_calibrated_ranks_costs_the_measured_curve() -> None:
    """A calibration with samples: an all-reduce over as many ranks as it measured costs the
    measured curve at its bytes (in the simulated dp minibatch and in a tie's exchange), one
    over another rank count the ring formula of the fit."""
    from dataclasses import replace

    from pipetrain.cluster.calibration import Sample, curve_seconds, fit_samples

    prof = vgg_like()
    P = sum(n.parameter_bytes for n in prof.nodes)
    sizes = [4, 4096, 65536, 1 << 20, 16 << 20, 64 << 20]
    samples = tuple(Sample("allreduce", n, 1e-4, 40, 2e-4, 1e-3 + n / 1e8 + (3e-3 if n >= 65536 else 0.0))
                    for n in sizes)
    base = make_cal(50 * MBIT)
    cal = replace(base, samples=samples, allreduce=fit_samples(samples, "allreduce"))
    assert 65536 < P < sizes[-1]
    dp = Plan(stages=[Stage(nodes=list(prof.names), replicas=2)], model=prof.model, batch_size=prof.batch_size)
    per_byte = 1 / cal.allreduce.bandwidth_bytes_per_second
    want = curve_seconds(cal.allreduce_curve, P, per_byte)
    assert want != pytest.approx(cal.allreduce.seconds(P), rel=0.01)  # the case the curve is for
    costs = calibrated_costs(dp, prof, cal, units=2)
    assert costs.allreduce_time(0, [0, 1]) == pytest.approx(want, rel=1e-12)
    assert costs.collective_time(262144, [0, 1]) == pytest.approx(
        curve_seconds(cal.allreduce_curve, 262144, per_byte), rel=1e-12)
    four = costs.collective_time(P, [0, 1, 2, 3])  # not measured at 4 ranks: the ring formula
    assert four == pytest.approx(1.5 * P / cal.allreduce_bus_bandwidth + 6 * ring_step_latency(cal), rel=1e-12)
    C = sum(n.compute_time for n in prof.nodes)
    got = predict_run(dp, prof, cal, "dp", steps=6)
    assert got["time_per_minibatch"] == pytest.approx(C / 2 + want, rel=1e-9)


def test_compute_slowdown_scales_every_compute_time_of_the_prediction() -> None:
    """A calibration measured with the ranks computing slower together than alone: the
    simulated F, B and STEP times are the profile's times that many times, the transfers as
    measured (the DP plan's time is compute / 2 x slowdown + the all-reduce)."""
    from dataclasses import replace

    prof = vgg_like()
    cal = make_cal(50 * MBIT)
    dp = Plan(stages=[Stage(nodes=list(prof.names), replicas=2)], model=prof.model, batch_size=prof.batch_size)
    slow = replace(cal, compute_slowdown=1.5)
    C = sum(n.compute_time for n in prof.nodes)
    P = sum(n.parameter_bytes for n in prof.nodes)
    got = predict_run(dp, prof, slow, "dp", steps=6, step_time=0.01)
    assert got["time_per_minibatch"] == pytest.approx(1.5 * (C / 2 + 0.01) + cal.allreduce.seconds(P), rel=1e-9)
    (stage,) = got["stage_unit_seconds"]  # the per-stage figures are the slowed ones the simulator ran
    assert stage["forward"] + stage["backward"] == pytest.approx(1.5 * C / 2, rel=1e-9)
    assert stage["step"] == pytest.approx(1.5 * 0.01, rel=1e-9)
    pipeline = plan_with_calibration(prof, 2, slow, PlanOptions(use_all_workers=True))
    same = plan_with_calibration(prof, 2, cal, PlanOptions(use_all_workers=True))
    assert pipeline.extra["calibration"]["compute_slowdown"] == 1.5
    assert pipeline.predicted_time > same.predicted_time  # the planner sees the slower compute too


# -- calibration file round trip --------------------------------------------------------------
def test_calibration_file_round_trip_into_the_planner(tmp_path: Path) -> None:
    prof = vgg_like()
    cal = make_cal(20 * MBIT)
    path = tmp_path / "cal.json"
    cal.save(path)
    loaded = load_calibration(path)
    assert loaded == cal
    a = plan_with_calibration(prof, 2, cal)
    b = plan_with_calibration(prof, 2, loaded)
    assert (a.config, a.predicted_time, [s.nodes for s in a.stages]) == \
        (b.config, b.predicted_time, [s.nodes for s in b.stages])
    # and the same as plan() with the calibrated topology and constants, spelled out
    c = plan(prof, calibrated_topology(cal, 2), PlanOptions(cost_params=calibrated_params(cal)))
    assert c.predicted_time == a.predicted_time
    assert evaluate(prof, a.stages, calibrated_topology(cal, 2), PipetrainCost(calibrated_params(cal))) == \
        pytest.approx(a.predicted_time, rel=1e-12)


def test_plan_cli_with_calibration(tmp_path: Path) -> None:
    from pipetrain.profile.io import save_profile

    prof_path, cal_path = tmp_path / "p.json", tmp_path / "cal.json"
    save_profile(vgg_like(), prof_path)
    cal = make_cal(50 * MBIT)
    cal.save(cal_path)
    cmd = [sys.executable, "-m", "pipetrain", "plan", str(prof_path), "--workers", "2", "--calibration", str(cal_path),
           "--schedule", "pipedream", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    want = plan_with_calibration(vgg_like(), 2, cal)
    assert d["config"] == want.config
    assert d["predicted_time"] == pytest.approx(want.predicted_time, rel=1e-12)
    assert d["extra"]["calibration"]["allreduce_bus_bandwidth_bytes_per_second"] == \
        pytest.approx(cal.allreduce_bus_bandwidth)
    bad = subprocess.run(cmd + ["--bandwidth", "1e9"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--calibration sets the bandwidth" in bad.stderr
    # a calibration whose ranks compute slower together: the CLI plans as plan_with_calibration
    from dataclasses import replace

    slow = replace(cal, compute_slowdown=1.7)
    slow.save(cal_path)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    want = plan_with_calibration(vgg_like(), 2, slow)
    assert json.loads(out.stdout)["predicted_time"] == pytest.approx(want.predicted_time, rel=1e-12)
    assert want.predicted_time > d["predicted_time"]


def test_bad_calibration_file_is_a_user_error(tmp_path: Path) -> None:
    from pipetrain.plan.calibrated import resolve_calibration

    with pytest.raises(PipetrainError, match="does not exist"):
        resolve_calibration(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text('{"format": "something"}')
    with pytest.raises(PipetrainError, match="not a pipetrain calibration"):
        resolve_calibration(tmp_path / "x.json")
    with pytest.raises(PlanError, match="pipedream"):
        plan_with_calibration(vgg_like(), 2, make_cal(50 * MBIT), PlanOptions(cost_model="pipedream"))


# -- model inputs crossing a cut --------------------------------------------------------------
def skip_input_profile() -> Profile:
    """``x -> a -> b -> c`` and ``c`` also reads ``x`` (a model input used late)."""
    return Profile("skip", 8, [
        NodeProfile("x", "Input", 0.0, 0.0, 1000, 0, [], "input"),
        node("a", 1e-3, 200, 100, ["x"]),
        node("b", 1e-3, 300, 100, ["a"]),
        node("c", 1e-3, 50, 100, ["b", "x"]),
    ])


def test_model_inputs_read_after_stage_0_cross_the_cut() -> None:
    prof = skip_input_profile()
    stages = [["x", "a"], ["b"], ["c"]]
    arr = stage_arrays(prof, stages)
    assert arr.cuts == [0.0, 1200.0, 1300.0, 0.0]  # x relayed over both cuts
    cuts = plan_cut_bytes(stages, prof, unit_samples=8)
    assert [c.activation for c in cuts] == arr.cuts[1:-1]
    assert [c.gradient for c in cuts] == [200, 300]  # no gradient for the model input
    # the planner's DP states count the same bytes: its value equals evaluate() of its plan
    p = plan(prof, calibrated_topology(make_cal(1e4), 3), PlanOptions(cost_params=calibrated_params(make_cal(1e4))))
    assert p.extra["cut_bytes"] == stage_arrays(prof, [s.nodes for s in p.stages]).cuts[1:-1]


# -- measured bytes equal predicted bytes (the real runtime on loopback) -----------------------
def test_predicted_bytes_per_sample_equal_the_runtime_s() -> None:
    import torch

    from pipetrain.graph import capture
    from pipetrain.job import OptimizerConfig, TrainConfig
    from pipetrain.job.model import load_bundle
    from pipetrain.models import TINY_OPTIONS
    from pipetrain.profile.profiler import profile_captured
    from pipetrain.run import resolve_run
    from pipetrain.runtime import launch_local

    torch.set_num_threads(1)
    cfg = TrainConfig.of(schedule="pipedream", workers=3, config="2-1", model="mlp",
                         model_options=dict(TINY_OPTIONS["mlp"], depth=4), batch_size=8, steps=4, timeout=60,
                         quiet=True, optimizer=OptimizerConfig("sgd", lr=0.1))
    run = resolve_run(cfg)
    bundle = load_bundle(cfg, run.unit_batch)
    prof = profile_captured(capture(bundle.model, bundle.example_inputs), bundle.example_inputs, warmup=0, repeats=1)
    assert run.plan is not None and run.plan.num_stages == 2
    pred = predict_run(run.plan, prof, make_cal(50 * MBIT, ranks=2), "pipedream", steps=run.total_steps)
    (result,) = launch_local([run], timeout=90)
    samples = run.batch_size * run.total_steps
    per = pred["bytes_per_sample"]
    assert per["activation"] > 0 and per["gradient"] > 0 and per["allreduce"] > 0
    assert per["total"] * samples == sum(result.bytes_sent)


# -- stage times measured as a whole ----------------------------------------------------------
def test_refined_profile_adds_up_to_the_measured_stage_times() -> None:
    from pipetrain.auto.stage_timing import refine_profile

    prof = vgg_like()
    stages = [["x", "conv0", "conv1"], ["conv2", "conv3", "pool"], ["fc0", "fc1", "fc2"]]
    secs = [0.05, 0.02, 0.03]
    new = refine_profile(prof, stages, secs)
    for nodes, s in zip(stages, secs):
        assert sum(new[n].compute_time for n in nodes) == pytest.approx(s, rel=1e-12)
        for n in nodes:  # the forward/backward split within a node is kept
            if prof[n].compute_time:
                assert new[n].forward_time / new[n].compute_time == pytest.approx(
                    prof[n].forward_time / prof[n].compute_time)
    assert [n.activation_bytes for n in new.nodes] == [n.activation_bytes for n in prof.nodes]


def test_rescaled_profiles_keep_what_the_loss_saves() -> None:
    """A profile refined by stage times keeps every field but the node times; one scaled from
    a unit to a minibatch scales its saved tensors (the loss's too) with its activations."""
    from dataclasses import replace

    from pipetrain.auto.choose import scale_profile
    from pipetrain.auto.stage_timing import refine_profile

    prof = replace(vgg_like(), loss_saved_bytes=1000, loss_saves_output=True,
                   nodes=[replace(n, saved_bytes=10 * i) for i, n in enumerate(vgg_like().nodes)])
    refined = refine_profile(prof, [list(prof.names)], [0.5])
    assert (refined.loss_saved_bytes, refined.loss_saves_output) == (1000, True)
    scaled = scale_profile(prof, 4, 4 * prof.batch_size)
    assert (scaled.loss_saved_bytes, scaled.loss_saves_output, scaled.batch_size) == (4000, True, 4 * prof.batch_size)
    assert [n.saved_bytes for n in scaled.nodes] == [4 * (n.saved_bytes or 0) for n in prof.nodes]
    assert [n.activation_bytes for n in scaled.nodes] == [4 * n.activation_bytes for n in prof.nodes]


def test_stage_functions_run_each_stage_of_a_captured_model() -> None:
    import torch

    from pipetrain.auto.stage_timing import refined_plan, stage_seconds
    from pipetrain.graph import capture
    from pipetrain.models import get_model
    from pipetrain.profile.profiler import profile_captured

    torch.set_num_threads(1)
    bundle = get_model("mlp", batch_size=8, depth=4, width=32)
    cap = capture(bundle.model, bundle.example_inputs)
    names = [n.name for n in cap.gm.graph.nodes if n.op not in ("placeholder", "output")]
    secs = stage_seconds(cap.gm, bundle.example_inputs, [names[:3], names[3:]], repeats=1)
    assert len(secs) == 2 and all(s > 0 for s in secs)
    prof = profile_captured(cap, bundle.example_inputs, warmup=0, repeats=1)
    cal = make_cal(1 * MBIT)
    p, refined = refined_plan(prof, cap.gm, bundle.example_inputs, lambda pr: plan_with_calibration(pr, 2, cal))
    assert p.num_workers <= 2 and sorted(n for s in p.stages for n in s.nodes) == sorted(prof.names)
    assert [n.activation_bytes for n in refined.nodes] == [n.activation_bytes for n in prof.nodes]


# -- runs on the emulated cluster ---------------------------------------------------------------
def test_run_result_round_trips_through_json() -> None:
    from pipetrain.job.result import RunResult
    from pipetrain.run.on_cluster import result_from_json

    r = RunResult(steps=2, samples_per_second=10.0, final_loss=1.0, losses=[2.0, 1.0], config="1-1",
                  schedule="pipedream", workers=2, batch_size=8, microbatches=1, seconds=0.5, warmup_steps=0,
                  warmup_losses=[], start_step=0, plan_source="x", stages=2, device="cpu", peak_rss_mib=[None],
                  peak_rss_scope="training", rss_setup_mib=[None], rss_end_mib=[None], peak_rss_life_mib=[None],
                  bytes_sent=[10, 20])
    back = result_from_json(json.loads(json.dumps({**r.to_json(), "unknown_key": 1})))
    assert back.to_json() == r.to_json()


def test_cluster_train_runs_a_config_across_two_emulated_hosts() -> None:
    from pipetrain.cluster.netns import EmulatedCluster, unavailable_reason

    why = unavailable_reason()
    if why:
        pytest.skip(f"emulated cluster unavailable: {why}")
    from pipetrain.job import OptimizerConfig, TrainConfig
    from pipetrain.models import TINY_OPTIONS
    from pipetrain.run.on_cluster import cluster_train

    cfg = TrainConfig.of(schedule="flush", workers=2, config="1-1", model="mlp", microbatches=2,
                         model_options=dict(TINY_OPTIONS["mlp"], depth=4), batch_size=8, steps=2, timeout=60,
                         quiet=True, optimizer=OptimizerConfig("sgd", lr=0.1))
    with EmulatedCluster(2, "200Mbit") as c:
        train = cluster_train(c, timeout=120)
        result = train(cfg)
        with pytest.raises(PipetrainError, match="emulated cluster has 2"):
            train(cfg.replace(workers=3))
    assert result.config == "1-1" and result.workers == 2 and len(result.losses) == 2
    assert all(b > 0 for b in result.bytes_sent)
