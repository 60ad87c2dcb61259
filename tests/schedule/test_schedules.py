"""Schedule builders, the comm pass and validation: golden lists, rules, versions, errors."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipetrain.errors import ScheduleError
from pipetrain.schedule import (
    SCHEDULE_NAMES,
    SCHEDULES,
    Action,
    Op,
    Schedule,
    build_schedule,
    check_structure,
    get_schedule,
    insert_comm,
    lcm,
    strip_comm,
    validate,
)

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "schedules"

# name, file stem, replicas, microbatches, steps, options
GOLDEN_CASES = [
    ("pipedream", "pipedream_p2_n4", [1, 1], 1, 4, {}),
    ("pipedream", "pipedream_p3_n6", [1, 1, 1], 1, 6, {}),
    ("pipedream", "pipedream_2-1_n4", [2, 1], 1, 4, {}),
    ("pipedream", "pipedream_vsync_p3_n6", [1, 1, 1], 1, 6, {"vertical_sync": True}),
    ("flush", "flush_p2_m3_s2", [1, 1], 3, 2, {}),
    ("flush", "flush_2-1_m2", [2, 1], 2, 1, {}),
    ("gpipe", "gpipe_p2_m3", [1, 1], 3, 1, {}),
    ("2bw", "2bw_p2_m2_s2", [1, 1], 2, 2, {}),
    ("dp", "dp_n2_m2_s2", [2], 2, 2, {}),
    ("interleaved", "interleaved_p2_v2_m4", [1, 1, 1, 1], 4, 1, {"virtual_stages": 2}),
    ("zerobubble", "zerobubble_p2_m3", [1, 1], 3, 1, {}),
]


@pytest.mark.parametrize("name,stem,replicas,m,steps,options", GOLDEN_CASES, ids=[c[1] for c in GOLDEN_CASES])
def test_golden(name: str, stem: str, replicas: list[int], m: int, steps: int, options: dict) -> None:
    """Generated lists equal the reviewed golden files (PIPETRAIN_REGEN_GOLDEN=1 rewrites them)."""
    s = build_schedule(name, replicas, m, steps, **options)
    validate(s)
    path = GOLDEN / f"{stem}.csv"
    lines = s.to_csv().splitlines()
    if os.environ.get("PIPETRAIN_REGEN_GOLDEN"):
        path.write_text("\n".join(lines) + "\n")
    assert lines == path.read_text().splitlines()


# -- every schedule validates over a range of shapes ------------------------------------
REPLICATIONS = [[1], [1, 1], [1, 1, 1], [1, 1, 1, 1], [2, 1, 1], [3, 1], [1, 2, 1], [2], [2, 2]]


@pytest.mark.parametrize("replicas", REPLICATIONS, ids=lambda r: "-".join(map(str, r)))
def test_every_schedule_validates(replicas: list[int]) -> None:
    P = len(replicas)
    for name in ("flush", "gpipe", "zerobubble"):
        for m in sorted({max(replicas), P, 2 * P + 1, 6}):
            if m < max(replicas):
                continue
            for steps in (1, 3):
                validate(build_schedule(name, replicas, m, steps))
    period = 1
    for r in replicas:
        period = period * r // __import__("math").gcd(period, r)
    for steps in (period, 4 * period, 6 * period):
        validate(build_schedule("pipedream", replicas, 1, steps))
        validate(build_schedule("pipedream", replicas, 1, steps, vertical_sync=True))
    for m in (P, P + 1, 2 * P + 2, 6):
        if all(m % r == 0 for r in replicas) and m >= len(replicas):
            try:
                s = build_schedule("2bw", replicas, m, 3)
            except ScheduleError as e:  # replicated stages may need more microbatches; the error says so
                assert "needs microbatches >=" in str(e)
                continue
            validate(s)
    if len(replicas) == 1:
        for m in (replicas[0], replicas[0] + 1, 5):
            validate(build_schedule("dp", replicas, m, 2))


@pytest.mark.parametrize("P,v", [(2, 1), (2, 2), (2, 3), (3, 2), (4, 2), (4, 3)])
def test_interleaved_validates(P: int, v: int) -> None:
    for m in (P, 2 * P, 3 * P):
        s = build_schedule("interleaved", [1] * (P * v), m, 2, virtual_stages=v)
        validate(s)
        assert s.num_workers == P
        assert all(ranks == [k % P] for k, ranks in enumerate(s.stage_ranks))


def test_interleaved_with_one_chunk_is_flush() -> None:
    for P in (2, 3, 4):
        a = build_schedule("interleaved", [1] * P, 2 * P, 2, virtual_stages=1)
        b = build_schedule("flush", [1] * P, 2 * P, 2)
        assert a.workers == b.workers


# -- rules: routing, relay, step placement ----------------------------------------------
def _compute(s: Schedule, rank: int, ops: tuple[Op, ...] = (Op.F, Op.B)) -> list[Action]:
    return [a for a in s.workers[rank] if a.op in ops]


def test_round_robin_routing_and_peers() -> None:
    s = build_schedule("pipedream", [2, 1, 2], 1, 4)
    assert s.stage_ranks == [[0, 1], [2], [3, 4]]
    for rank in range(s.num_workers):
        for a in s.workers[rank]:
            if a.op is Op.F:
                reps = s.stage_ranks[a.stage]
                assert rank == reps[a.mb % len(reps)]
            if a.op is Op.SEND_F:  # goes to the replica of the next stage that runs the unit
                nxt = s.stage_ranks[a.stage + 1]
                assert a.peer == nxt[a.mb % len(nxt)]
            if a.op is Op.RECV_B:
                nxt = s.stage_ranks[a.stage + 1]
                assert a.peer == nxt[a.mb % len(nxt)]


def test_sync_routing_uses_index_within_minibatch() -> None:
    s = build_schedule("flush", [2, 1], 3, 2)
    units0 = sorted(a.mb for a in _compute(s, 0, (Op.F,)))
    units1 = sorted(a.mb for a in _compute(s, 1, (Op.F,)))
    assert units0 == [0, 2, 3, 5] and units1 == [1, 4]  # microbatch index 0, 2 -> replica 0; 1 -> replica 1


def test_send_right_after_compute_and_recv_right_before() -> None:
    s = build_schedule("flush", [1, 1, 1], 4, 1)
    for acts in s.workers:
        for i, a in enumerate(acts):
            if a.op is Op.SEND_F:
                assert acts[i - 1] == Action(a.stage, Op.F, a.mb, version=acts[i - 1].version)
            if a.op is Op.SEND_B:
                assert acts[i - 1].op is Op.B and acts[i - 1].mb == a.mb
            if a.op is Op.RECV_F:
                assert acts[i + 1].op is Op.F and acts[i + 1].mb == a.mb
            if a.op is Op.RECV_B:
                assert acts[i + 1].op is Op.B and acts[i + 1].mb == a.mb


def test_allreduce_only_for_replicated_stages_right_before_step() -> None:
    s = build_schedule("pipedream", [2, 1], 1, 6)
    for acts in s.workers:
        for i, a in enumerate(acts):
            if a.op is Op.ALLREDUCE:
                assert len(s.stage_ranks[a.stage]) == 2
                assert acts[i + 1] == Action(a.stage, Op.STEP, a.mb)
            if a.op is Op.STEP and a.stage == 1:
                assert acts[i - 1].op is not Op.ALLREDUCE
    # Stage 0 steps once per group of 2 minibatches: 3 steps; stage 1 after every minibatch.
    assert [a.mb for a in s.workers[0] if a.op is Op.STEP] == [0, 1, 2]
    assert [a.mb for a in s.workers[2] if a.op is Op.STEP] == [0, 1, 2, 3, 4, 5]


def test_comm_pass_is_separate_and_invertible() -> None:
    s = build_schedule("2bw", [1, 1, 1], 3, 2)
    bare = strip_comm(s)
    assert all(a.op in (Op.F, Op.B, Op.STEP) for acts in bare.workers for a in acts)
    assert insert_comm(bare).workers == s.workers


def test_pipedream_warmup_is_noam() -> None:
    # NOAM = ceil(workers / replicas of the input stage): 4 workers, 2 input replicas -> 2.
    s = build_schedule("pipedream", [2, 1, 1], 1, 8)
    ops = [a.op for a in _compute(s, 0)]
    assert ops[:3] == [Op.F, Op.F, Op.B]
    s = build_schedule("pipedream", [1, 1, 1, 1], 1, 8)
    for stage in range(4):
        ops = [a.op for a in _compute(s, stage)]
        assert ops.index(Op.B) == 4 - stage


# -- weight versions ---------------------------------------------------------------------
def _versions(s: Schedule) -> dict[tuple[int, Op, int], int]:
    return {(a.stage, a.op, a.mb): a.version for acts in s.workers for a in acts if a.version is not None}


@pytest.mark.parametrize("replicas", [[1, 1, 1, 1], [2, 1, 1], [1, 2], [3, 1]], ids=str)
def test_pipedream_versions_stash_and_are_newest(replicas: list[int]) -> None:
    s = build_schedule("pipedream", replicas, 1, 12)
    ver = _versions(s)
    for acts in s.workers:
        steps: dict[int, int] = {}
        for a in acts:
            if a.op is Op.F:
                assert a.version == steps.get(a.stage, 0)  # the newest version when it runs
            if a.op is Op.B:
                assert a.version == ver[(a.stage, Op.F, a.mb)]  # weight stashing
            if a.op is Op.STEP:
                steps[a.stage] = steps.get(a.stage, 0) + 1


def test_pipedream_staleness_formula() -> None:
    # Stage s of P (no replication) sees minibatch u with version max(0, u - (P - s) + 1).
    P = 4
    s = build_schedule("pipedream", [1] * P, 1, 12)
    ver = _versions(s)
    for stage in range(P):
        for u in range(12):
            assert ver[(stage, Op.F, u)] == max(0, u - (P - stage) + 1)


def test_vertical_sync_uses_stage0_version() -> None:
    s = build_schedule("pipedream", [1, 1, 1, 1], 1, 12, vertical_sync=True)
    ver = _versions(s)
    for u in range(12):
        for stage in range(4):
            assert ver[(stage, Op.F, u)] == ver[(0, Op.F, u)]
            assert ver[(stage, Op.B, u)] == ver[(0, Op.F, u)]
    # Replicated: version k of a stage with r_s replicas holds minibatches 0..k*r_s-1.
    s = build_schedule("pipedream", [2, 1], 1, 12, vertical_sync=True)
    ver = _versions(s)
    for u in range(12):
        assert ver[(1, Op.F, u)] == 2 * ver[(0, Op.F, u)]
    validate(s)


def test_twobw_versions() -> None:
    m = 3
    s = build_schedule("2bw", [1, 1, 1], m, 4)
    for (_stage, _op, u), v in _versions(s).items():
        assert v == max(u // m - 1, 0)
    validate(s)


@pytest.mark.parametrize("name", ["flush", "gpipe", "zerobubble"])
def test_sync_versions_are_step_index(name: str) -> None:
    m = 4
    s = build_schedule(name, [1, 2], m, 3)
    for (_stage, _op, u), v in _versions(s).items():
        assert v == u // m
    s = build_schedule("interleaved", [1] * 4, 2, 3, virtual_stages=2)
    for (_stage, _op, u), v in _versions(s).items():
        assert v == u // 2


# -- user errors --------------------------------------------------------------------------
@pytest.mark.parametrize("call,match", [
    (lambda: build_schedule("nope", [1]), r"unknown schedule 'nope'; valid names: pipedream, 2bw"),
    (lambda: build_schedule("flush", [1, 1], 0), r"microbatches must be an integer >= 1"),
    (lambda: build_schedule("flush", [1, 1], 2, 0), r"steps must be an integer >= 1"),
    (lambda: build_schedule("flush", [1, 1], 2, vertical_sync=True), r"takes no option vertical_sync"),
    (lambda: build_schedule("pipedream", [2, 1], 1, 5), r"steps must be a multiple .* use steps=6"),
    (lambda: build_schedule("pipedream", [1, 1], 4, 5), r"microbatches must be 1"),
    (lambda: build_schedule("2bw", [1, 1, 1], 2, 2), r"microbatches >= stages.*microbatches=2 < 3"),
    (lambda: build_schedule("2bw", [2, 1], 3, 2), r"multiple of every stage's replica count"),
    (lambda: build_schedule("interleaved", [1] * 4, 3, virtual_stages=2), r"not a multiple of 2; use microbatches=4"),
    (lambda: build_schedule("interleaved", [1] * 5, 2, virtual_stages=2), r"multiple of 2: got 5 stages"),
    (lambda: build_schedule("interleaved", [1, 1], 2, virtual_stages=2), r"at least 2 ranks"),
    (lambda: build_schedule("interleaved", [2, 1, 1, 1], 2, virtual_stages=2), r"replicas must be all 1"),
    (lambda: build_schedule("dp", [1, 1], 2), r"replicas must have one entry.*replicas=\[2\]"),
    (lambda: build_schedule("flush", [3, 1], 2), r"microbatches=2 < 3 replicas"),
    (lambda: build_schedule("flush", [1, 0], 2), r"at least one replica"),
    (lambda: build_schedule("flush", [], 2), r"replicas is empty"),
])
def test_user_errors(call, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ScheduleError, match=match):
        call()


def test_schedule_names() -> None:
    assert set(SCHEDULE_NAMES) >= {"pipedream", "2bw", "flush", "gpipe", "dp", "interleaved", "zerobubble"}


# -- broken schedules ----------------------------------------------------------------------
def test_deadlock_is_reported_with_marked_grid() -> None:
    s = build_schedule("flush", [1, 1], 2, 1)
    acts = s.workers[0]
    i = acts.index(Action(0, Op.RECV_B, 0, peer=1))
    acts.insert(0, acts.pop(i))  # rank 0 now waits for 0's gradient before sending its forward
    check_structure(s)  # still well formed: only the order across ranks is wrong
    with pytest.raises(ScheduleError, match=r"schedule deadlocks at rank 0: 0RECV_B0<1 \(waits for rank 1\); "
                                            r"rank 1: 1RECV_F0<0") as exc:
        validate(s)
    msg = str(exc.value)
    grid = msg.split("\n", 1)[1]
    assert "rank  0 | *0RECV_B0" in grid
    assert "*1RECV_F0" in grid.splitlines()[1]


def test_allreduce_order_mismatch_deadlocks() -> None:
    s = build_schedule("dp", [2], 2, 2)
    # Replica 1 skips step 0's all-reduce: the replicas no longer agree on the steps.
    s.workers[1] = [a for a in s.workers[1] if not (a.op is Op.ALLREDUCE and a.mb == 0)]
    with pytest.raises(ScheduleError, match="all-reduce"):
        validate(s)


@pytest.mark.parametrize("mutate,match", [
    (lambda w: w[1].remove(Action(1, Op.RECV_F, 1, peer=0)), r"forward before its input arrives"),
    (lambda w: w[0].remove(Action(0, Op.SEND_F, 1, peer=1)), r"posts 1 matching|sends it 0 time"),
    (lambda w: w[1].__setitem__(2, Action(1, Op.B, 0, version=1)), r"uses version 1 but only 0 steps"),
    (lambda w: w[0].append(Action(0, Op.F, 0, version=1)), r"1 forwards|2 forwards|version"),
    (lambda w: w[1].__setitem__(4, Action(1, Op.RECV_F, 1, peer=1)), r"rank 1 posts 0 matching 1RECV_F1<0"),
])
def test_structural_errors(mutate, match: str) -> None:  # type: ignore[no-untyped-def]
    s = build_schedule("flush", [1, 1], 2, 1)
    mutate(s.workers)
    with pytest.raises(ScheduleError, match=match):
        validate(s)


def test_backward_version_must_match_forward() -> None:
    s = build_schedule("pipedream", [1, 1], 1, 4)
    acts = s.workers[0]
    i = next(i for i, a in enumerate(acts) if a.op is Op.B and a.mb == 2)
    acts[i] = Action(0, Op.B, 2, version=2)
    with pytest.raises(ScheduleError, match=r"uses version 2 but its forward used 1"):
        validate(s)


# -- save / load --------------------------------------------------------------------------
@pytest.mark.parametrize("name,replicas,m,steps,opts", [c[0:1] + c[2:] for c in GOLDEN_CASES][:6] + [
    ("interleaved", [1] * 6, 3, 2, {"virtual_stages": 2}), ("zerobubble", [1, 1, 1], 3, 1, {})])
def test_csv_round_trip(tmp_path: Path, name: str, replicas: list[int], m: int, steps: int, opts: dict) -> None:
    s = build_schedule(name, replicas, m, steps, **opts)
    path = tmp_path / "s.csv"
    s.save(path)
    t = Schedule.load(path)
    assert (t.name, t.workers, t.stage_ranks, t.microbatches, t.steps) == \
        (s.name, s.workers, s.stage_ranks, s.microbatches, s.steps)
    validate(t)


# -- the schedule descriptions (ScheduleSpec) ---------------------------------------------
def test_every_name_has_one_spec() -> None:
    assert tuple(SCHEDULES) == SCHEDULE_NAMES
    for name in SCHEDULE_NAMES:
        spec = get_schedule(name)
        assert spec is SCHEDULES[name] and spec.name == name
        assert spec.unit in ("minibatch", "microbatch")
        assert set(spec.option_defaults) == set(spec.options)
        assert spec.version_rule and spec.summary
    assert {n for n in SCHEDULE_NAMES if get_schedule(n).synchronous} == {"flush", "gpipe", "dp", "interleaved",
                                                                         "zerobubble"}
    assert {n for n in SCHEDULE_NAMES if not get_schedule(n).flushes} == {"pipedream", "2bw"}
    assert [n for n in SCHEDULE_NAMES if get_schedule(n).unit == "minibatch"] == ["pipedream"]


def test_spec_build_equals_build_schedule() -> None:
    for name, _stem, replicas, m, steps, options in GOLDEN_CASES:
        a = get_schedule(name).build(replicas, m, steps, **options)
        assert a.to_csv() == build_schedule(name, replicas, m, steps, **options).to_csv()


@pytest.mark.parametrize("name,stages,replicas,expected", [
    ("pipedream", 4, [1, 1, 1, 1], 1),
    ("pipedream", 3, [2, 1, 1], 1),
    ("flush", 4, [1, 1, 1, 1], 4),
    ("flush", 2, [3, 1], 3),
    ("gpipe", 3, [1, 1, 1], 3),
    ("zerobubble", 2, [1, 1], 2),
    ("dp", 1, [4], 4),
    ("2bw", 3, [1, 1, 1], 3),
    ("2bw", 3, [2, 1, 1], 4),        # max(3, 2) = 3 is not a multiple of 2
    ("2bw", 2, [3, 1], 3),
    ("interleaved", 2, [1, 1], 2),   # stages are ranks
    ("interleaved", 3, [1, 1, 1], 3),
])
def test_default_microbatches(name: str, stages: int, replicas: list[int], expected: int) -> None:
    spec = get_schedule(name)
    m = spec.default_microbatches(stages, replicas)
    assert m == expected
    spec.check_microbatches(m, stages, replicas)  # the default is always accepted
    if spec.unit == "microbatch":
        assert m >= max(stages, max(replicas))


def test_default_microbatches_builds_for_every_schedule() -> None:
    for name in SCHEDULE_NAMES:
        spec = get_schedule(name)
        for model_reps in ([1, 1], [1, 1, 1, 1], [2, 1, 1], [3], [2, 2]):
            try:
                reps = spec.rank_replicas(model_reps, {})
            except ScheduleError:
                continue  # e.g. dp needs one stage, interleaved no replicas
            m = spec.default_microbatches(len(reps), reps)
            steps = spec.steps_period(reps)
            validate(spec.build(model_reps, m, steps))


@pytest.mark.parametrize("name,m,stages,replicas,match", [
    ("pipedream", 4, 2, None, r"pipedream moves whole minibatches .* microbatches must be 1 \(got 4\)"),
    ("flush", 0, 2, None, r"microbatches must be an integer >= 1 \(got 0\)"),
    ("flush", 2.0, 2, None, r"microbatches must be an integer >= 1"),
    ("flush", 1, 2, [2, 1], r"microbatches=1 < 2 replicas of a stage"),
    ("2bw", 2, 3, None, r"2bw needs microbatches >= stages.*microbatches=2 < 3 stages; use microbatches=3"),
    ("2bw", 3, 3, [2, 1, 1], r"multiple of every stage's replica count.*use microbatches=4"),
    ("interleaved", 3, 2, None, r"groups of P=2 ranks: microbatches=3 is not a multiple of 2; use microbatches=4"),
])
def test_check_microbatches_rules(name: str, m: int, stages: int, replicas: list[int] | None, match: str) -> None:
    with pytest.raises(ScheduleError, match=match):
        get_schedule(name).check_microbatches(m, stages, replicas)


def test_check_microbatches_accepts() -> None:
    get_schedule("pipedream").check_microbatches(1, 4)
    get_schedule("2bw").check_microbatches(4, 3, [2, 1, 1])
    get_schedule("interleaved").check_microbatches(6, 3)
    get_schedule("gpipe").check_microbatches(1, 4)  # m < stages is allowed (a bubble, not an error)


def test_options_defaults_and_checks() -> None:
    assert get_schedule("pipedream").check_options({}) == {"vertical_sync": False, "stashing": True}
    assert get_schedule("pipedream").check_options({"vertical_sync": True}) == {"vertical_sync": True,
                                                                                "stashing": True}
    assert get_schedule("interleaved").check_options({}) == {"virtual_stages": 2}
    assert get_schedule("interleaved").check_options({"virtual_stages": 3}) == {"virtual_stages": 3}
    assert get_schedule("flush").check_options({"virtual_stages": None, "vertical_sync": None}) == {}


@pytest.mark.parametrize("name,options,match", [
    ("flush", {"virtual_stages": 2}, r"schedule 'flush' takes no option virtual_stages; its options: none"),
    ("pipedream", {"virtual_stages": 2}, r"takes no option virtual_stages; its options: vertical_sync"),
    ("interleaved", {"virtual_stages": 0}, r"virtual_stages .* must be an integer >= 1 \(got 0\)"),
    ("interleaved", {"virtual_stages": True}, r"virtual_stages .* must be an integer >= 1 \(got True\)"),
    ("pipedream", {"vertical_sync": "yes"}, r"vertical_sync must be True or False \(got 'yes'\)"),
])
def test_option_errors(name: str, options: dict, match: str) -> None:
    with pytest.raises(ScheduleError, match=match):
        get_schedule(name).check_options(options)


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(ScheduleError, match=r"unknown schedule 'pipe'; valid names: pipedream, 2bw, flush, gpipe"):
        get_schedule("pipe")


def test_stages_and_ranks() -> None:
    inter = get_schedule("interleaved")
    assert inter.model_stages(2, {}) == 4
    assert inter.model_stages(2, {"virtual_stages": 3}) == 6
    assert inter.ranks_needed([1] * 6, {"virtual_stages": 3}) == 2
    assert inter.ranks_needed([1] * 6, {}) == 3
    assert inter.rank_replicas([1] * 4, {}) == [1, 1]
    assert inter.chunks_per_rank({"virtual_stages": 3}) == 3
    for name in ("pipedream", "2bw", "flush", "gpipe", "zerobubble"):
        spec = get_schedule(name)
        assert spec.model_stages(3, {}) == 3
        assert spec.ranks_needed([2, 1, 1], {}) == 4
        assert spec.rank_replicas([2, 1, 1], {}) == [2, 1, 1]
    assert get_schedule("dp").ranks_needed([4], {}) == 4
    # ranks_needed agrees with the schedules the specs build
    for name, _stem, replicas, m, steps, options in GOLDEN_CASES:
        s = get_schedule(name).build(replicas, m, steps, **options)
        assert get_schedule(name).ranks_needed(replicas, options) == s.num_workers
        assert get_schedule(name).model_stages(len(get_schedule(name).rank_replicas(replicas, options)),
                                               options) == s.num_stages


@pytest.mark.parametrize("name,replicas,options,match", [
    ("interleaved", [1] * 5, {}, r"multiple of 2: got 5 stages"),
    ("interleaved", [2, 1, 1, 1], {}, r"replicas must be all 1"),
    ("interleaved", [1, 1], {}, r"at least 2 ranks"),
    ("dp", [1, 1], {}, r"dp runs one stage on N replicas.*use replicas=\[2\]"),
    ("flush", [0, 1], {}, r"at least one replica"),
])
def test_ranks_needed_errors(name: str, replicas: list[int], options: dict, match: str) -> None:
    with pytest.raises(ScheduleError, match=match):
        get_schedule(name).ranks_needed(replicas, options)


def test_steps_period_and_lcm() -> None:
    assert lcm([2, 3, 1]) == 6 and lcm([]) == 1 and lcm([4, 6]) == 12
    assert get_schedule("pipedream").steps_period([2, 3, 1]) == 6
    assert get_schedule("flush").steps_period([2, 3, 1]) == 1
