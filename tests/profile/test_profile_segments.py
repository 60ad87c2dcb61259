"""How the profiler times: robust statistics, the timer's cost, repeat budgets, cut-candidate
groups and segments, the split of a segment over its nodes, freed outputs, progress, and the
step check's ratio and warning."""
from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn

from pipetrain.graph import capture
from pipetrain.profile import NodeProfile, Profile, load_profile, save_profile
from pipetrain.profile.measure import CHECK_STARTS, MIN_SHARE, check_candidates, check_start, split_time
from pipetrain.profile.profiler import profile_captured
from pipetrain.profile.progress import LOG_EVERY, ProfileProgress
from pipetrain.profile.saved import SavedBytes
from pipetrain.profile.segments import SegmentBuilder, module_path, starts_group
from pipetrain.profile.step_check import STEP_TOLERANCE, StepCheck, step_check
from pipetrain.profile.timing import RepeatBudget, TimerCost, robust_seconds

torch.set_num_threads(1)


def test_robust_seconds_is_the_median_or_the_trimmed_mean() -> None:
    assert robust_seconds([]) == 0.0
    assert robust_seconds([3.0]) == 3.0
    assert robust_seconds([1.0, 9.0, 2.0]) == 2.0
    assert robust_seconds([1.0, 2.0, 3.0, 100.0]) == 2.5
    # five or more: a fifth dropped at each end, the rest averaged
    assert robust_seconds([100.0, 1.0, 2.0, 3.0, 0.0]) == pytest.approx(2.0)
    assert robust_seconds([1.0] * 8 + [50.0, 0.0]) == pytest.approx(1.0)


def test_the_timer_cost_is_subtracted_and_never_below_zero() -> None:
    cost = TimerCost(forward=1e-6, backward=20e-6)
    assert cost.net(5e-6, 30e-6) == pytest.approx((4e-6, 10e-6))
    assert cost.net(0.5e-6, 10e-6) == (0.0, 0.0)
    assert cost.net(5e-6, None) == pytest.approx((4e-6, 0.0))


def test_repeat_budget_bounds_long_regions() -> None:
    budget = RepeatBudget(warmup=2, repeats=5, seconds=1.0, long=0.25)
    assert budget.warmups(0.01) == 2 and budget.warmups(0.3) == 0
    assert budget.more([])                          # always one timed run
    assert budget.more([0.001] * 4) and not budget.more([0.001] * 5)
    assert not budget.more([1.2])                   # one long run is enough
    assert budget.more([0.4, 0.4]) and not budget.more([0.4, 0.4, 0.4])


def test_a_segments_time_is_split_in_proportion_and_adds_up() -> None:
    est: dict[str, tuple[float, float | None]] = {"a": (1.0, 3.0), "b": (3.0, 1.0), "c": (0.0, None)}
    got = split_time(["a", "b", "c"], 8.0, 40.0, est)
    assert sum(f for f, _ in got.values()) == pytest.approx(8.0)
    assert sum(b for _, b in got.values()) == pytest.approx(40.0)
    assert got["a"][0] == pytest.approx(8.0 * 1.0 / (4.0 + MIN_SHARE))
    assert got["a"][1] == pytest.approx(30.0) and got["b"][1] == pytest.approx(10.0)
    assert got["c"][1] == 0.0                        # no differentiable output: no backward


class TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x).relu() * 2
        return self.b(y).tanh()


def test_cut_candidates_follow_module_calls() -> None:
    cm = capture(TwoBlocks(), torch.randn(2, 8))
    nodes = [n for n in cm.gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    names = [n.name for n in nodes]
    assert names == ["a", "relu", "mul", "b", "tanh"]
    assert module_path(nodes[0]) == "a" and module_path(nodes[3]) == "b"
    starts = [starts_group(n, p) for n, p in zip(nodes, [None, *nodes[:-1]])]
    # a module call starts a group; functions of the top-level forward join each other
    assert starts == [True, True, False, True, True]


def test_a_segment_closes_at_a_group_boundary_once_long_enough() -> None:
    cm = capture(TwoBlocks(), torch.randn(2, 8))
    a, relu, mul, b, tanh = [n for n in cm.gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    seg = SegmentBuilder(seconds=1.0, factor=4.0)
    seg.add(a, 2.0)
    assert seg.complete(relu)                        # long enough, relu begins a group
    seg.take()
    seg.add(relu, 0.9)
    assert not seg.complete(mul)                     # short
    seg.add(mul, 0.5)
    assert seg.complete(b) and [n.name for n in seg.take()] == ["relu", "mul"]
    seg.add(relu, 1.5)
    assert not seg.complete(mul)                     # long enough, but mul is in relu's group
    seg.add(mul, 3.0)
    assert seg.complete(b)                           # 4.5 >= 4 x 1.0: closes inside a group too
    seg.take()
    seg.add(tanh, 0.0)
    assert seg.complete(None)                        # the graph ends


def test_the_profile_records_the_measured_step_and_adds_up_to_its_segments() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    x = torch.randn(32, 64)
    cm = capture(model, x)
    prof = profile_captured(cm, x, warmup=1, repeats=3, threads=1)
    assert prof.measured_forward_time is not None and prof.measured_forward_time > 0
    assert prof.measured_backward_time is not None and prof.measured_backward_time > 0
    check = step_check(prof)
    assert check is not None
    assert check.total == pytest.approx(prof.total_forward_time + prof.total_backward_time)
    assert check.ratio == pytest.approx(check.total / (prof.measured_forward_time + prof.measured_backward_time))
    assert all(n.forward_time > 0 and n.backward_time > 0 for n in prof.nodes if not n.is_input)


def test_the_check_runs_its_region_once_untimed_each_run_without_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """However long the region, its first run (the heap grown to a region the node pass never
    held) is not timed, and no run accumulates into the last one's gradients."""
    from pipetrain.profile import measure, segments

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    x = torch.randn(32, 64)
    cm = capture(model, x)
    runs: list[tuple[object, bool]] = []  # per run of a segment: it, and whether no parameter had a gradient
    run = segments.Segment.run

    def recording(self: segments.Segment, value_of: Any) -> Any:
        runs.append((self, all(p.grad is None for p in cm.gm.parameters())))
        return run(self, value_of)

    def check_runs() -> list[bool]:  # the check's region is the last segment run
        last = runs[-1][0]
        return [fresh for segment, fresh in runs if segment is last]

    monkeypatch.setattr(segments.Segment, "run", recording)
    monkeypatch.setattr(measure, "LONG_RUN", 0.0)  # every region counts as long
    profile_captured(cm, x, warmup=1, repeats=3, threads=1)
    assert len(check_runs()) >= 2 and all(check_runs()), check_runs()
    runs.clear()
    profile_captured(cm, x, warmup=0, repeats=1, threads=1)  # no warm-up asked for: none
    assert check_runs() == [True]


def test_node_outputs_are_freed_once_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chain of 40 layers: the profiler holds a few outputs at a time, not all 40."""
    live: list[int] = []
    register = SavedBytes.register

    def counting(self: SavedBytes, name: str, value: Any) -> None:
        register(self, name, value)
        live.append(len(self.owner))

    monkeypatch.setattr(SavedBytes, "register", counting)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.ReLU()) for _ in range(20)])
    x = torch.randn(128, 512)
    cm = capture(model, x)
    profile_captured(cm, x, warmup=0, repeats=1, threads=1, check_seconds=None)
    assert len(cm.graph) == 41 and len(live) == 41 and max(live) <= 8
    live.clear()  # and the values kept where a check may start, while it still may (a short model)
    profile_captured(cm, x, warmup=0, repeats=1, threads=1)
    assert len(live) == 41 and max(live) <= 8 + CHECK_STARTS - 1
    live.clear()  # a start is let go of once the nodes after it took longer than check_seconds
    profile_captured(cm, x, warmup=0, repeats=1, threads=1, check_seconds=0.0)
    assert len(live) == 41 and max(live) <= 9


def test_progress_logs_lines_without_a_terminal(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    caplog.set_level(logging.INFO, logger="pipetrain.profile")
    progress = ProfileProgress(10, clock=lambda: now[0])
    progress.advance(2)
    assert not caplog.records                       # nothing before LOG_EVERY seconds
    now[0] = LOG_EVERY
    progress.advance(3)
    assert [r.getMessage() for r in caplog.records] == ["profile: 5/10 nodes (50%), 10 s, about 10 s left"]
    quiet = ProfileProgress(10, enabled=False, clock=lambda: now[0])
    now[0] = 100.0
    quiet.advance(5)
    assert len(caplog.records) == 1


def test_the_step_check_says_the_ratio_and_warns_in_one_line_beyond_the_tolerance() -> None:
    assert STEP_TOLERANCE == 0.15
    ok = StepCheck(total=0.088, measured=0.080)
    assert ok.agrees and ok.warning() is None
    assert ok.line() == ("step check: profile total 88.000 ms / measured whole-model step 80.000 ms = 1.10 "
                         "(within 15%)")
    bad = StepCheck(total=0.103, measured=0.080)
    assert not bad.agrees and bad.ratio == pytest.approx(1.2875)
    assert bad.warning() == (
        "warning: the profile's forward + backward (103.000 ms) is 1.29x the whole-model step measured in the same "
        "run (80.000 ms), beyond the 15% tolerance; the machine was probably busy: profile again when it is quiet, "
        "or with more --repeats")
    assert StepCheck(total=0.068, measured=0.080).agrees and not StepCheck(total=0.067, measured=0.080).agrees


def test_the_measured_step_round_trips_through_json_and_old_files_read(tmp_path) -> None:
    nodes = [NodeProfile("x", "Input", 0.0, 0.0, 16, 0, kind="input"), NodeProfile("fc", "Linear", 0.25, 0.5, 8, 4,
                                                                                   ["x"])]
    prof = Profile("m", 4, nodes, measured_forward_time=0.3, measured_backward_time=0.6)
    save_profile(prof, tmp_path / "p.json")
    back = load_profile(tmp_path / "p.json")
    assert (back.measured_forward_time, back.measured_backward_time) == (0.3, 0.6)
    check = step_check(back)
    assert check is not None and check.ratio == pytest.approx(0.75 / 0.9)
    save_profile(Profile("m", 4, nodes), tmp_path / "old.json")
    old = load_profile(tmp_path / "old.json")
    assert old.measured_step_time is None and step_check(old) is None


def test_the_check_runs_on_the_longest_tail_that_fits_its_memory() -> None:
    cm = capture(TwoBlocks(), torch.randn(2, 8))
    nodes = [n for n in cm.gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    acts = {"a": 100, "relu": 100, "mul": 100, "b": 40, "tanh": 40}
    assert check_start(nodes, acts, None) == 0
    assert check_start(nodes, acts, 380) == 0                 # everything fits: the whole model
    assert check_start(nodes, acts, 379) == 1
    assert check_start(nodes, acts, 180) == 2                 # mul, b, tanh
    assert check_start(nodes, acts, 10) == 4                  # at least the last node


def test_a_large_model_is_checked_on_its_tail_and_the_ratio_counts_those_nodes(tmp_path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    x = torch.randn(32, 64)
    cm = capture(model, x)
    one = 32 * 64 * 4                                         # each layer's output
    prof = profile_captured(cm, x, warmup=1, repeats=3, threads=1, check_memory=2.5 * one)
    assert prof.measured_from == "_4" and prof.measured_step_time is not None
    check = step_check(prof)
    assert check is not None and check.first_node == "_4"
    assert check.total == pytest.approx(prof["_4"].compute_time + prof["_5"].compute_time)
    assert check.share == pytest.approx(check.total / (prof.total_forward_time + prof.total_backward_time))
    assert check.line().startswith(f"step check: profile total {check.total * 1e3:.3f} ms / measured step of the "
                                   f"nodes from _4 on ({check.share:.0%} of the profile) ")
    save_profile(prof, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json").measured_from == "_4"


class Skip(nn.Module):
    """x -> a -> relu -> (+ x) -> b: the add reads the input from before the block."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).relu() + x)


def test_the_check_may_start_where_few_values_enter_and_knows_what_enters() -> None:
    cm = capture(Skip(), torch.randn(2, 8))
    nodes = [n for n in cm.gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    assert [n.name for n in nodes] == ["a", "relu", "add", "b"]
    every = check_candidates(nodes, 0)                        # 4 nodes: each one a start
    assert [(nodes[c].name, set(names)) for c, names in every] == [
        ("a", {"x"}), ("relu", {"a", "x"}), ("add", {"relu", "x"}), ("b", {"add"})]
    # two stretches after the first start: [relu], [add, b]; add has two values entering, b one
    assert [nodes[c].name for c, _ in check_candidates(nodes, 0, count=3)] == ["a", "relu", "b"]
    assert [nodes[c].name for c, _ in check_candidates(nodes, 2)] == ["add", "b"]
    assert check_candidates([], 0) == []


def test_a_long_check_runs_on_the_longest_tail_within_check_seconds() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    x = torch.randn(32, 64)
    cm = capture(model, x)

    def tail(prof: Profile, first: str) -> float:
        nodes = [n for n in prof.nodes if not n.is_input]
        return sum(n.compute_time for n in nodes[[n.name for n in nodes].index(first):])

    whole = profile_captured(cm, x, warmup=1, repeats=3, threads=1, check_seconds=None)
    assert whole.measured_from is None
    shortest = profile_captured(cm, x, warmup=1, repeats=3, threads=1, check_seconds=0.0)
    assert shortest.measured_from == "_5"                      # nothing fits: the shortest tail
    check = step_check(shortest)
    assert check is not None and check.total == pytest.approx(shortest["_5"].compute_time)
    prof = profile_captured(cm, x, warmup=1, repeats=3, threads=1, check_seconds=1.0)
    assert prof.measured_from is None                         # a few ms: the whole model
    total = prof.total_forward_time + prof.total_backward_time
    names = [f"_{i}" for i in range(6)]
    for share in (0.3, 0.6):
        limit = share * total
        part = profile_captured(cm, x, warmup=1, repeats=3, threads=1, check_seconds=limit)
        first = part.measured_from
        assert first is not None and part.measured_step_time is not None
        # the longest tail within the limit, by this profile's own times
        assert tail(part, first) <= limit, (first, limit)
        assert tail(part, names[names.index(first) - 1]) > limit, (first, limit)
        check = step_check(part)
        assert check is not None and check.total == pytest.approx(tail(part, first))
