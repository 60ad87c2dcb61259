"""Communication accounting, predicted: hand-made schedules and cuts with literal byte counts.

The conventions (docs/traffic.md): a transfer counts its bytes at both ends, a collective of
``n`` bytes over ``r`` ranks ``floor(2 (r-1) n / r)`` sent and received per member, the
all-reduce's count element is ``control``, global clipping one 8-byte norm per step index.
"""
from __future__ import annotations

import pytest

from pipetrain.errors import PlanError
from pipetrain.plan.traffic import plan_cut_bytes, plan_stage_param_bytes, plan_traffic, predict_traffic, schedule_units
from pipetrain.plan.types import Plan, Stage
from pipetrain.profile.types import NodeProfile, Profile
from pipetrain.schedule.action import Action, Op, Schedule
from pipetrain.schedule.registry import build_schedule
from pipetrain.schedule.traffic import (
    KINDS,
    CutBytes,
    ReduceBuffer,
    Traffic,
    bytes_per_sample,
    ring_allreduce_bytes,
    total_traffic,
)
from pipetrain.simulate import StageCosts, simulate, to_chrome_trace

CUT = CutBytes(activation=100, gradient=60)


def kinds(**values: float) -> dict[str, float]:
    out: dict[str, float] = {k: 0 for k in KINDS}
    out.update(values)
    return out


def test_ring_allreduce_bytes_is_the_floor_of_two_r_minus_one_over_r() -> None:
    assert ring_allreduce_bytes(40, 1) == 0
    assert ring_allreduce_bytes(40, 2) == 40
    assert ring_allreduce_bytes(30, 3) == 40
    assert ring_allreduce_bytes(4, 3) == 5          # 16 / 3 rounded down
    assert ring_allreduce_bytes(10, 4) == 15
    assert ring_allreduce_bytes(1.5, 3) == pytest.approx(2.0)  # fractional sizes stay exact


def test_two_stage_flush_moves_activations_forward_and_gradients_back() -> None:
    s = build_schedule("flush", [1, 1], 2, steps=1)
    t = predict_traffic(s, [CUT], [40, 12])
    assert t[0].sent == kinds(activation=200) and t[0].received == kinds(gradient=120)
    assert t[1].sent == kinds(gradient=120) and t[1].received == kinds(activation=200)
    assert t[0].messages_sent == kinds(activation=2) and t[0].messages_received == kinds(gradient=2)
    assert t[0].reduced == kinds() and t[1].total_sent == 120


def test_replicated_pipedream_stage_all_reduces_its_gradients_and_count() -> None:
    s = build_schedule("pipedream", [2, 1], 1, steps=2)
    t = predict_traffic(s, [CUT], [40, 12])
    for r in (0, 1):  # one unit each, one all-reduce of 40 gradient bytes + the 4-byte count
        assert t[r].sent == kinds(activation=100, allreduce=40, control=4)
        assert t[r].received == kinds(gradient=60, allreduce=40, control=4)
        assert t[r].reduced == kinds(allreduce=40, control=4)
        assert t[r].messages_sent == kinds(activation=1, allreduce=1)  # the count rides in the same call
    assert t[2].sent == kinds(gradient=120) and t[2].received == kinds(activation=200)
    assert schedule_units(s) == 2
    per = bytes_per_sample(t, schedule_units(s) * 8)  # 8 samples per unit
    assert per == {"activation": 12.5, "gradient": 7.5, "allreduce": 5.0, "control": 0.5, "total": 25.5}


def test_three_way_all_reduce_and_several_dtype_buffers() -> None:
    s = build_schedule("dp", [3], 3, steps=1)
    one = predict_traffic(s, [], [30])
    assert all(one[r].sent == kinds(allreduce=40, control=5) for r in range(3))
    two = predict_traffic(s, [], [[ReduceBuffer(30, 4), ReduceBuffer(16, 2)]])  # float32 + a float16 buffer
    assert two[0].sent == kinds(allreduce=40 + 21, control=5 + 2)
    assert two[0].reduced == kinds(allreduce=46, control=6)
    assert two[0].messages_sent == kinds(allreduce=2)
    assert predict_traffic(s, [], [0])[1] == Traffic()  # no trainable parameters: no all-reduce


def test_global_clipping_sums_one_norm_per_step_index() -> None:
    s = build_schedule("flush", [1, 1], 2, steps=2)
    t = predict_traffic(s, [CUT], [40, 12], global_clip=True)
    assert t[0].sent["control"] == 16 and t[0].messages_sent["control"] == 2 and t[0].reduced["control"] == 16
    # interleaved: each rank holds two stages but sums the norm once per step index
    s = build_schedule("interleaved", [1, 1, 1, 1], 2, steps=2, virtual_stages=2)
    t = predict_traffic(s, [CUT] * 3, [8] * 4, global_clip=True)
    assert all(t[r].sent["control"] == 16 and t[r].messages_sent["control"] == 2 for r in (0, 1))
    # cuts 0 and 2 leave rank 0, cut 1 arrives from rank 1: four units (2 x 2 steps) each
    assert t[0].sent["activation"] == 800 and t[0].received["activation"] == 400


def test_local_and_empty_transfers_count_nothing() -> None:
    a = [Action(0, Op.F, 0), Action(0, Op.SEND_F, 0, peer=0), Action(1, Op.RECV_F, 0, peer=0), Action(1, Op.F, 0),
         Action(1, Op.B, 0), Action(1, Op.SEND_B, 0, peer=0), Action(0, Op.RECV_B, 0, peer=0), Action(0, Op.B, 0)]
    local = Schedule("flush", [a], [[0], [0]])
    assert predict_traffic(local, [CUT], [0, 0])[0] == Traffic()
    s = build_schedule("flush", [1, 1], 2, steps=1)
    t = predict_traffic(s, [CutBytes(100, 0)], [0, 0])  # no wire needs a gradient
    assert t[1].sent == kinds() and t[1].messages_sent == kinds() and t[0].received == kinds()


def test_traffic_arithmetic_and_json() -> None:
    s = build_schedule("flush", [2, 1], 2, steps=2)
    t = predict_traffic(s, [CUT], [40, 12], global_clip=True)
    total = total_traffic(t)
    # 4 units over the cut; 2 all-reduces on 2 ranks (40 + 4 count); 2 norms x 3 ranks of 10 bytes
    assert total.sent == kinds(activation=400, gradient=240, allreduce=160, control=16 + 6 * 10)
    assert total.total_sent == total.total_received
    assert Traffic.from_json(t[0].to_json()) == t[0]
    assert t[0].to_json()["total_sent"] == t[0].total_sent
    before = t[0].copy()
    after = t[0] + t[2]
    assert after - before == t[2] and before == t[0]


def test_user_errors() -> None:
    s = build_schedule("flush", [1, 1, 1], 2, steps=1)
    with pytest.raises(PlanError, match="3 stages, so 2 cuts, but 1 cut sizes"):
        predict_traffic(s, [CUT], [0, 0, 0])
    with pytest.raises(PlanError, match="3 stages but 2 parameter sizes"):
        predict_traffic(s, [CUT, CUT], [0, 0])
    with pytest.raises(PlanError, match="cut sizes must be >= 0"):
        predict_traffic(s, [CUT, CutBytes(-1, 0)], [0, 0, 0])
    with pytest.raises(PlanError, match="parameter bytes must be >= 0"):
        predict_traffic(s, [CUT, CUT], [0, -4, 0])
    with pytest.raises(PlanError, match="positive number of samples"):
        bytes_per_sample(predict_traffic(s, [CUT, CUT], [0, 0, 0]), 0)
    with pytest.raises(PlanError, match="needs a Schedule"):
        predict_traffic("flush", [CUT, CUT], [0, 0, 0])  # type: ignore[arg-type]


# -- from a plan and a profile ------------------------------------------------------------
def _profile() -> Profile:
    """x -> a -> b -> c(b, x) -> d, batch 4: a skip connection from the input to c."""
    def node(name: str, inputs: list[str], act: int, params: int, kind: str = "module") -> NodeProfile:
        return NodeProfile(name, "op", 0.0 if kind == "input" else 1.0, 0.0 if kind == "input" else 2.0, act, params,
                           inputs, kind)
    return Profile("toy", 4, [node("x", [], 64, 0, "input"), node("a", ["x"], 32, 40), node("b", ["a"], 48, 0),
                              node("c", ["b", "x"], 16, 12), node("d", ["c"], 8, 8)])


def test_cut_bytes_from_a_profile_relay_inputs_without_gradients() -> None:
    prof = _profile()
    stages = [["a"], ["b"], ["c", "d"]]   # x goes to stage 0
    # cut 0: a (32) and x (64, relayed to c); cut 1: b (48) and x; per unit of 2 of the 4 samples
    assert plan_cut_bytes(stages, prof, 2) == [CutBytes(48, 16), CutBytes(56, 24)]
    assert plan_cut_bytes(stages, prof, 3) == [CutBytes(72, 24), CutBytes(84, 36)]
    assert plan_stage_param_bytes(stages, prof) == [40, 0, 20]
    with pytest.raises(PlanError, match="node 'd' is in no stage"):
        plan_cut_bytes([["a"], ["b", "c"]], prof, 2)
    with pytest.raises(PlanError, match="no batch size"):
        plan_cut_bytes(stages, Profile("toy", None, prof.nodes), 2)


def test_plan_traffic_equals_the_simulators_figures() -> None:
    prof = _profile()
    plan = Plan([Stage(["a"], replicas=2), Stage(["b"]), Stage(["c", "d"])], batch_size=4)
    s = build_schedule("flush", [2, 1, 1], 2, steps=2)
    pred = plan_traffic(plan, prof, s)   # units of 4 / 2 = 2 samples
    assert pred[0].sent == kinds(activation=96, allreduce=80, control=8)  # units 0, 2 of 4; 2 steps
    assert pred[2].received == kinds(activation=4 * 48, gradient=4 * 24)
    sim = simulate(s, StageCosts.from_plan(plan, prof, units=2))
    assert sim.traffic == pred
    summary = sim.summary()
    assert sim.samples == 8 and summary["bytes_per_sample"] == bytes_per_sample(pred, 8)
    assert summary["bytes_per_minibatch"]["activation"] == (4 * 48 + 4 * 56) / 2
    assert summary["traffic"][3] == pred[3].to_json()
    other = to_chrome_trace(sim)["otherData"]   # the predicted trace carries the same figures
    assert other["bytes_per_sample"] == summary["bytes_per_sample"] and other["traffic"] == summary["traffic"]
    # synthetic costs know no batch size: bytes per minibatch only
    assert simulate(s, StageCosts.synthetic(3, 1.0, 2.0)).summary()["bytes_per_sample"] is None
