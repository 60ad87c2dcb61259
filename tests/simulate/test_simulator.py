"""The discrete-event simulator: analytic bubble and memory checks, costs, traces, pictures, CLI."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipetrain.cli import main
from pipetrain.errors import PipetrainError, ScheduleError
from pipetrain.plan.types import Level, Plan, Stage, Topology
from pipetrain.profile.types import NodeProfile, Profile
from pipetrain.schedule import (
    Action,
    Event,
    Op,
    build_schedule,
    steady_state_rates,
    steady_state_throughput,
    steady_state_time_per_minibatch,
    write_chrome_trace,
)
from pipetrain.simulate import (
    StageCost,
    StageCosts,
    save_gantt,
    simulate,
    to_chrome_trace,
    trace_event,
    trace_process_name,
)


def run(name: str, replicas: list[int], m: int, steps: int = 1, F: float = 1.0, B: float = 2.0, **opts):  # type: ignore[no-untyped-def]
    s = build_schedule(name, replicas, m, steps, **opts)
    return simulate(s, StageCosts.synthetic(len(replicas), F, B))


# -- analytic checks (synthetic costs, no communication) --------------------------------
@pytest.mark.parametrize("name", ["gpipe", "flush"])
@pytest.mark.parametrize("P", [1, 2, 3, 4])
@pytest.mark.parametrize("M", [1, 2, 3, 8])
@pytest.mark.parametrize("F,B", [(1.0, 2.0), (1.0, 1.0)])
def test_gpipe_and_flush_bubble(name: str, P: int, M: int, F: float, B: float) -> None:
    r = run(name, [1] * P, M, 1, F, B)
    assert r.bubble_fraction == pytest.approx((P - 1) / (M + P - 1))
    assert r.makespan == pytest.approx((M + P - 1) * (F + B))
    assert r.time_per_minibatch == pytest.approx(r.makespan)


@pytest.mark.parametrize("P,M", [(2, 2), (3, 8), (4, 8), (4, 3), (4, 16)])
def test_flush_holds_at_most_P_gpipe_holds_M(P: int, M: int) -> None:
    flush = run("flush", [1] * P, M)
    gpipe = run("gpipe", [1] * P, M)
    assert flush.peak_in_flight[0] == min(P, M)
    assert flush.peak_in_flight == [min(P - s, M) for s in range(P)]
    assert gpipe.peak_in_flight == [M] * P


@pytest.mark.parametrize("P", [2, 3, 4])
def test_pipedream_steady_state(P: int) -> None:
    F, B = 1.0, 2.0
    r = run("pipedream", [1] * P, 1, 6 * P, F, B)
    assert r.steady_window is not None
    assert r.bubble_fraction == pytest.approx(0.0, abs=1e-12)
    assert r.time_per_minibatch == pytest.approx(F + B)
    assert r.throughput == pytest.approx(1 / (F + B))
    assert r.peak_in_flight == [P - s for s in range(P)]  # stage s holds P-s minibatches
    assert r.peak_versions == [P - s for s in range(P)]  # and stashes P-s weight versions
    # Successive minibatches leave every F+B seconds in the steady state.
    gaps = [b - a for a, b in zip(r.exit_times, r.exit_times[1:])]
    assert all(g == pytest.approx(F + B) for g in gaps[: 6 * P - P])


def test_pipedream_replicated_steady_state() -> None:
    # 2-1: stage 0 takes twice as long per minibatch but has two replicas: no bottleneck.
    s = build_schedule("pipedream", [2, 1], 1, 24)
    costs = StageCosts([StageCost(2.0, 4.0), StageCost(1.0, 2.0)])
    r = simulate(s, costs)
    assert r.time_per_minibatch == pytest.approx(3.0)
    assert r.bubble_fraction == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("P,v,M", [(2, 2, 2), (2, 2, 4), (2, 3, 4), (3, 2, 6), (4, 2, 4), (4, 2, 8), (4, 3, 8)])
def test_interleaved_bubble(P: int, v: int, M: int) -> None:
    # Per-chunk times F, B: bubble (P-1)/(v*M + P-1), i.e. bubble time (P-1)(F+B) = 1/v of
    # 1F1B's with stage times v*F, v*B.
    r = run("interleaved", [1] * (P * v), M, 1, virtual_stages=v)
    assert r.bubble_fraction == pytest.approx((P - 1) / (v * M + P - 1))
    flush = simulate(build_schedule("flush", [1] * P, M), StageCosts.synthetic(P, v * 1.0, v * 2.0))
    assert (flush.makespan - M * v * 3.0) / (r.makespan - M * v * 3.0) == pytest.approx(v)


@pytest.mark.parametrize("P,M", [(2, 2), (3, 4), (4, 4), (4, 8)])
def test_zerobubble_h1(P: int, M: int) -> None:
    F, B = 1.0, 2.0  # I = W = 1
    r = run("zerobubble", [1] * P, M, 1, F, B)
    assert r.makespan == pytest.approx(M * (F + B) + (P - 1) * (F + B / 2 - B / 2))
    assert r.makespan < run("flush", [1] * P, M, 1, F, B).makespan
    assert max(r.peak_in_flight) <= P


def test_twobw_steady_state_two_versions() -> None:
    P, m = 3, 3
    r = run("2bw", [1] * P, m, 8)
    assert r.time_per_minibatch == pytest.approx(m * 3.0)
    assert r.bubble_fraction == pytest.approx(0.0, abs=1e-12)
    assert r.peak_versions == [2] * P


def test_flushed_schedules_have_one_version() -> None:
    for name in ("flush", "gpipe", "zerobubble"):
        assert run(name, [1, 1, 1], 4, 3).peak_versions == [1, 1, 1]


# -- communication, all-reduce, memory ---------------------------------------------------
def test_transfer_times_and_latency() -> None:
    s = build_schedule("flush", [1, 1], 1)
    costs = StageCosts([StageCost(1.0, 2.0, activation_send_bytes=100), StageCost(1.0, 2.0, grad_send_bytes=50)],
                       bandwidth=100.0, latency=0.5)
    r = simulate(s, costs)
    # 0F0 [0,1], transfer 1.5 s, 1F0 [2.5,3.5], 1B0 [3.5,5.5], transfer 1 s, 0B0 [6.5,8.5].
    assert r.makespan == pytest.approx(8.5)
    send = next(e for e in r.timelines[0] if e.action.op is Op.SEND_F)
    assert (send.start, send.end, send.kind) == (1.0, 2.5, "comm")


def test_sends_overlap_compute_and_serialize_on_a_link() -> None:
    s = build_schedule("gpipe", [1, 1], 3)
    costs = StageCosts([StageCost(1.0, 1.0, activation_send_bytes=300), StageCost(1.0, 1.0)], bandwidth=100.0)
    r = simulate(s, costs)
    fwd = [(e.start, e.end) for e in r.timelines[0] if e.action.op is Op.F]
    assert fwd == [(0, 1), (1, 2), (2, 3)]  # the sender never waits for its transfers
    sends = [(e.start, e.end) for e in r.timelines[0] if e.action.op is Op.SEND_F]
    assert sends == [(1, 4), (4, 7), (7, 10)]  # one link: FIFO


def test_dp_allreduce_ring_time() -> None:
    s = build_schedule("dp", [2], 2, 2)
    costs = StageCosts([StageCost(1.0, 2.0, parameter_bytes=100, step_time=0.25)], bandwidth=50.0)
    r = simulate(s, costs)
    # Per step: F+B = 3, ring all-reduce 2*(2-1)/2 * 100/50 = 2, step 0.25.
    assert r.makespan == pytest.approx(2 * (3 + 2 + 0.25))
    ar = [e for e in r.timelines[0] if e.action.op is Op.ALLREDUCE]
    assert [e.duration for e in ar] == pytest.approx([2.0, 2.0])
    assert r.time_per_minibatch == pytest.approx(5.25)


def test_peak_memory_counts_versions_activations_and_state() -> None:
    s = build_schedule("pipedream", [1, 1], 1, 8)
    stage = StageCost(1.0, 2.0, parameter_bytes=1000, activation_bytes=10, optimizer_bytes=500)
    r = simulate(s, StageCosts([stage, stage]))
    # Stage 0 holds 2 minibatches with 2 stashed versions: grad 1000 + optimizer 500 + 2 x 1000 + 2 x 10.
    assert r.peak_memory[0] == pytest.approx(1000 + 500 + 2 * 1000 + 2 * 10)
    assert r.peak_memory[1] == pytest.approx(1000 + 500 + 1000 + 10)


def test_simulator_reports_deadlock() -> None:
    s = build_schedule("flush", [1, 1], 2)
    acts = s.workers[0]
    acts.insert(0, acts.pop(acts.index(Action(0, Op.RECV_B, 0, peer=1))))
    with pytest.raises(ScheduleError, match=r"schedule deadlocks at rank 0: 0RECV_B0<1") as exc:
        simulate(s, StageCosts.synthetic(2, 1, 2))
    assert "*0RECV_B0" in str(exc.value)


def test_costs_stage_count_must_match() -> None:
    with pytest.raises(ScheduleError, match="costs cover 3 stages"):
        simulate(build_schedule("flush", [1, 1], 2), StageCosts.synthetic(3, 1, 1))


# -- costs from a plan and a profile -----------------------------------------------------
def _profile() -> Profile:
    def node(name: str, inputs: list[str], act: int, params: int, f: float = 0.4, b: float = 0.8,
             kind: str = "module") -> NodeProfile:
        return NodeProfile(name, name, f, b, act, params, inputs, kind)

    return Profile("toy", 32, [
        node("x", [], 40, 0, 0.0, 0.0, "input"),
        node("a", ["x"], 100, 10),
        node("b", ["a"], 200, 20),
        node("c", ["b", "a"], 300, 30),  # skip connection a -> c crosses both cuts
    ], optimizer_state_bytes_per_parameter_byte=2.0)


def test_costs_from_plan() -> None:
    plan = Plan([Stage(["a"]), Stage(["b"]), Stage(["c"])])
    topo = Topology((Level(2, 100.0), Level(2, 10.0)))
    c = StageCosts.from_plan(plan, _profile(), topology=topo, units=4)
    assert [s.forward_time for s in c.stages] == pytest.approx([0.1, 0.1, 0.1])
    assert [s.backward_time for s in c.stages] == pytest.approx([0.2, 0.2, 0.2])
    # Relay: cut 0 carries a (100); cut 1 carries a and b (300); per unit / 4.
    assert [s.activation_send_bytes for s in c.stages] == pytest.approx([25, 75, 0])
    assert [s.grad_send_bytes for s in c.stages] == pytest.approx([0, 25, 75])
    assert [s.parameter_bytes for s in c.stages] == [10, 20, 30]
    assert [s.optimizer_bytes for s in c.stages] == [20, 40, 60]
    assert [s.activation_bytes for s in c.stages] == pytest.approx([25, 75, 150])
    assert c.link_bandwidth(0, 1) == 100.0 and c.link_bandwidth(1, 2) == 10.0 and c.link_bandwidth(2, 3) == 100.0
    assert c.allreduce_time(0, [0, 1, 2]) == pytest.approx(2 * 2 / 3 * 10 / 10.0)


def test_costs_from_plan_disagreeing_profile() -> None:
    with pytest.raises(PipetrainError, match="plan and profile disagree"):
        StageCosts.from_plan(Plan([Stage(["a", "zzz"]), Stage(["b", "c"])]), _profile())
    with pytest.raises(PipetrainError, match="'c' is in no stage"):
        StageCosts.from_plan(Plan([Stage(["a"]), Stage(["b"])]), _profile())


# -- traces and pictures ------------------------------------------------------------------
def test_chrome_trace() -> None:
    r = run("pipedream", [2, 1], 1, 4)
    trace = to_chrome_trace(r)
    json.dumps(trace)
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {"rank 0 (stage 0)", "rank 1 (stage 0)", "rank 2 (stage 1)"}
    assert {e["pid"] for e in xs} == {0, 1, 2}
    f3 = next(e for e in xs if e["name"] == "0F3")
    assert f3["pid"] == 1 and f3["cat"] == "compute" and f3["args"]["unit"] == 3 and f3["args"]["stage"] == 0
    assert "version" in f3["args"]
    compute = [e for e in xs if e["cat"] == "compute"]
    assert sum(e["dur"] for e in compute) == pytest.approx(sum(r.busy_time) * 1e6)
    assert trace_event(3, "1B2", 0.5, 0.75, "compute", {"unit": 2}) == {
        "name": "1B2", "cat": "compute", "ph": "X", "pid": 3, "tid": 0, "ts": 500000.0, "dur": 250000.0,
        "args": {"unit": 2}}
    assert trace_event(0, "0SEND_F1", 1.0, 2.0, "comm")["tid"] == 1
    assert trace_process_name(2, "rank 2")["ph"] == "M"


def test_trace_comm_rows_do_not_overlap() -> None:
    s = build_schedule("flush", [1, 2], 4)
    costs = StageCosts([StageCost(1.0, 2.0, activation_send_bytes=500), StageCost(1.0, 2.0, grad_send_bytes=100)],
                       bandwidth=100.0)
    trace = to_chrome_trace(simulate(s, costs))
    rows: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            rows.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in rows.values():
        spans.sort()
        assert all(a[1] <= b[0] + 1e-6 for a, b in zip(spans, spans[1:]))


@pytest.mark.parametrize("ext", ["png", "svg"])
def test_gantt(tmp_path: Path, ext: str) -> None:
    r = run("interleaved", [1] * 4, 4, 1, virtual_stages=2)
    out = save_gantt(r, tmp_path / f"t.{ext}")
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG") if ext == "png" else b"<svg" in data[:2000]
    if ext == "svg":
        assert b"bubble" in data  # the title names the bubble fraction


def test_gantt_rejects_unknown_extension(tmp_path: Path) -> None:
    with pytest.raises(PipetrainError, match=r"must be \.png or \.svg"):
        save_gantt(run("gpipe", [1, 1], 2), tmp_path / "t.jpg")


# -- CLI -----------------------------------------------------------------------------------
KEYS = {"time_per_minibatch", "throughput", "bubble_fraction", "makespan", "peak_memory", "peak_in_flight"}


def test_cli_synthetic_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--stages", "4", "--microbatches", "8", "--forward-time", "1", "--backward-time", "2"]
    assert main(argv + ["--schedule", "gpipe", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= KEYS
    assert out["bubble_fraction"] == pytest.approx(3 / 11)
    assert out["peak_in_flight"] == [8, 8, 8, 8] and len(out["peak_memory"]) == 4
    assert main(argv + ["--schedule", "pipedream", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["steps"] == 8 and out["time_per_minibatch"] == pytest.approx(3.0)
    assert out["peak_in_flight"] == [4, 3, 2, 1]
    assert main(argv + ["--schedule", "interleaved", "--virtual-stages", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["workers"] == 4 and out["stages"] == 8
    assert out["bubble_fraction"] == pytest.approx(3 / (2 * 8 + 3))
    assert main(["simulate", "--stages", "3", "--replicas", "2,1,1", "--microbatches", "4", "--forward-time", "1",
                 "--backward-time", "2", "--schedule", "pipedream", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["workers"] == 4


def test_cli_outputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png, tr = tmp_path / "g.png", tmp_path / "t.json"
    assert main(["simulate", "--stages", "2", "--microbatches", "4", "--forward-time", "1", "--backward-time", "1",
                 "--schedule", "flush", "--print-schedule", "--timeline", str(png), "--trace", str(tr)]) == 0
    out = capsys.readouterr().out
    assert "rank  0 | 0F0 0F1 0B0 0F2" in out and "bubble fraction" in out
    assert png.read_bytes().startswith(b"\x89PNG")
    assert any(e["name"] == "1B3" for e in json.loads(tr.read_text())["traceEvents"])


@pytest.mark.parametrize("extra,match", [
    (["--schedule", "bogus"], r"unknown schedule 'bogus'; valid names: pipedream, 2bw, flush"),
    (["--schedule", "flush", "--microbatches", "0"], r"--microbatches must be >= 1"),
    (["--schedule", "interleaved", "--microbatches", "4"], r"not a multiple of 3"),
    (["--schedule", "flush", "--replicas", "2,1"], r"--replicas lists 2 stages but --stages is 3"),
    (["--schedule", "2bw", "--microbatches", "2"], r"microbatches >= stages"),
])
def test_cli_errors(capsys: pytest.CaptureFixture[str], extra: list[str], match: str) -> None:
    base = ["simulate", "--stages", "3", "--microbatches", "6", "--forward-time", "1", "--backward-time", "2"]
    assert main(base + extra) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    assert __import__("re").search(match, err)


def test_cli_needs_plan_or_synthetic(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--schedule", "flush"]) == 2
    assert "--stages" in capsys.readouterr().err


def test_cli_plan_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = _profile()
    (tmp_path / "p.json").write_text(json.dumps({
        "version": 1, "model": prof.model, "batch_size": prof.batch_size,
        "optimizer_state_bytes_per_parameter_byte": 2.0,
        "nodes": [{"name": n.name, "op": n.op, "kind": n.kind, "forward_time": n.forward_time,
                   "backward_time": n.backward_time, "activation_bytes": n.activation_bytes,
                   "parameter_bytes": n.parameter_bytes, "inputs": n.inputs} for n in prof.nodes]}))
    plan = Plan([Stage(["a"], replicas=2), Stage(["b", "c"])], topology=Topology.flat(3, 1000.0),
                extra={"profile_path": "p.json"})
    plan.save(tmp_path / "plan.json")
    assert main(["simulate", str(tmp_path / "plan.json"), "--schedule", "pipedream", "--minibatches", "8",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["workers"] == 3 and out["replicas"] == [2, 1] and set(out) >= KEYS
    assert main(["simulate", str(tmp_path / "plan.json"), "--schedule", "flush", "--minibatches", "2",
                 "--microbatches", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["microbatches"] == 4 and out["steps"] == 2
    assert main(["simulate", str(tmp_path / "plan.json"), "--schedule", "flush"]) == 2
    assert "--minibatches" in capsys.readouterr().err


# -- the shared event type, trace writer and steady-state definition ----------------------
def _step(rank: int, stage: int, k: int, end: float) -> Event:
    return Event(rank, Action(stage, Op.STEP, k), end - 0.1, end)


def test_steady_state_definition_on_hand_made_events() -> None:
    # Stage 0 steps at 1, 3, 5, 7 (4 steps, 3 intervals over 6 s); stage 1 at 2, 3, 4, 5.
    events = [_step(0, 0, k, 1.0 + 2 * k) for k in range(4)] + [_step(1, 1, k, 2.0 + k) for k in range(4)]
    rates = steady_state_rates(events, 4)
    assert rates == {(0, 0): pytest.approx(3 / 6), (1, 1): pytest.approx(3 / 3)}
    assert steady_state_time_per_minibatch(events, 4) == pytest.approx(2.0)  # the slowest stage
    assert steady_state_throughput(events, 4) == pytest.approx(0.5)
    # A 2-replica PipeDream stage steps once per 2 minibatches.
    rep = [_step(0, 0, k, 4.0 * (k + 1)) for k in range(4)]  # 4 steps of 2 minibatches each, 8 minibatches
    assert steady_state_time_per_minibatch(rep, 8) == pytest.approx(12.0 / (3 * 2))
    assert steady_state_time_per_minibatch([_step(0, 0, 0, 1.0)], 1) is None  # one step: no steady state
    assert steady_state_time_per_minibatch([Event(0, Action(0, Op.F, 0), 0.0, 1.0)], 1) is None


@pytest.mark.parametrize("name,replicas,m,steps", [
    ("pipedream", [1, 1, 1], 1, 12), ("pipedream", [2, 1], 1, 12), ("2bw", [1, 1], 2, 6),
    ("flush", [1, 1, 1], 3, 4), ("dp", [2], 2, 3), ("interleaved", [1] * 4, 2, 3),
])
def test_simulator_uses_the_shared_definition(name: str, replicas: list[int], m: int, steps: int) -> None:
    opts = {"virtual_stages": 2} if name == "interleaved" else {}
    r = simulate(build_schedule(name, replicas, m, steps, **opts), StageCosts.synthetic(len(replicas), 1.0, 2.0))
    assert all(isinstance(e, Event) and e.rank == rank for rank, tl in enumerate(r.timelines) for e in tl)
    assert r.time_per_minibatch == steady_state_time_per_minibatch(r.events, steps)
    assert r.throughput == pytest.approx(1 / r.time_per_minibatch)


def test_flushed_period_equals_makespan_share() -> None:
    # A flushed schedule repeats identically: the flush-to-flush period is makespan / steps.
    r = run("flush", [1, 1, 1], 4, 5)
    assert r.time_per_minibatch == pytest.approx(r.makespan / 5)


def test_write_chrome_trace_measured_and_predicted(tmp_path: Path) -> None:
    s = build_schedule("flush", [1, 1], 2, 3)
    r = simulate(s, StageCosts.synthetic(2, 1.0, 2.0))
    write_chrome_trace(r.events, tmp_path / "sim.json", schedule=s, measured=False, meta={"source": "test"})
    sim = json.loads((tmp_path / "sim.json").read_text())
    assert sim["otherData"]["measured"] is False and sim["otherData"]["source"] == "test"
    assert sim["otherData"]["time_per_minibatch_s"] == pytest.approx(r.time_per_minibatch)
    assert sim["otherData"]["schedule"] == "flush" and sim["otherData"]["steps"] == 3
    # One rank's events only (what a worker writes as rankR.json): only that rank's rows.
    write_chrome_trace(r.timelines[1], tmp_path / "rank1.json", schedule=s, measured=True)
    one = json.loads((tmp_path / "rank1.json").read_text())
    assert one["otherData"]["measured"] is True
    assert {e["pid"] for e in one["traceEvents"]} == {1}
    xs = [e for e in one["traceEvents"] if e["ph"] == "X" and e["cat"] == "compute"]
    assert [e["name"] for e in xs] == [str(a) for a in s.workers[1] if a.op in (Op.F, Op.B, Op.STEP)]
    assert to_chrome_trace(r)["otherData"]["makespan_s"] == pytest.approx(r.makespan)
