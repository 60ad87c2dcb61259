"""The automatic choice rehearses its fastest candidates (pipetrain.auto.choose, step 5).

- a measured unit replaces a stage's compute exactly: the prediction with measured units
  equals the simulator run on costs made of those units (B, or I + W with W's share), the
  calibration's compute slowdown applied to them as to a profile;
- candidates are rehearsed in the order of their profile predictions, while one is within
  the tie tolerance of the fastest rehearsed so far, at most ``REHEARSALS``; the pick is made
  among the rehearsed; a failed rehearsal keeps the profile's prediction and says why;
- rehearsals are kept in the measurement cache: a repeated choice rehearses nothing again;
- a rank is rehearsed only when what its worker would hold (the planner's memory rule for
  its schedule) fits ``REHEARSAL_MAX_BYTES``.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from test_auto import model_at
from test_calibrated import MBIT, make_cal

from pipetrain.auto.choose import REHEARSALS, TIE_TOLERANCE, Candidate, choose
from pipetrain.errors import PlanError
from pipetrain.profile.cache import MeasurementCache
from pipetrain.schedule import get_schedule
from pipetrain.simulate import MeasuredUnit, StageCosts, simulate
from pipetrain.simulate.calibrated import calibrated_costs

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


def test_a_measured_unit_is_the_stages_compute() -> None:
    base = StageCosts.synthetic(2, [1.0, 2.0], [3.0, 4.0], step_time=0.5).stages[0]
    whole = MeasuredUnit(0.010, backward=0.030, step=0.002).applied_to(base)
    assert (whole.forward_time, whole.backward_time, whole.step_time) == (0.010, 0.030, 0.002)
    assert whole.weight_grad_fraction == base.weight_grad_fraction
    halves = MeasuredUnit(0.010, input=0.001, weight=0.003).applied_to(base)
    assert halves.backward_time == pytest.approx(0.004)
    assert halves.weight_grad_fraction == pytest.approx(0.75)
    assert halves.step_time == base.step_time  # no STEP measured: the given one
    with pytest.raises(PlanError, match="needs its backward"):
        MeasuredUnit(0.01, input=0.001)
    with pytest.raises(PlanError, match="finite times"):
        MeasuredUnit(-1.0, backward=0.1)
    assert MeasuredUnit.from_dict(halves_dict := MeasuredUnit(0.01, None, 0.001, 0.003, 0.002).to_dict()).to_dict() \
        == halves_dict


@pytest.mark.parametrize("schedule", ["flush", "zerobubble"])
def test_the_prediction_with_measured_units_is_the_simulator_on_those_costs(schedule: str) -> None:
    """``calibrated_costs(..., measured=)``: each stage's F, backward and STEP are the measured
    ones times the calibration's compute slowdown; the rest (bytes, links) the plan's."""
    from pipetrain.auto.choose import scale_profile
    from pipetrain.plan.api import PlanOptions
    from pipetrain.plan.calibrated import plan_with_calibration
    from pipetrain.profile import profile_captured

    captured, inputs = model_at(4)
    unit = profile_captured(captured, inputs, batch_size=4, warmup=1, repeats=1)
    cal = replace(make_cal(1000 * MBIT), compute_slowdown=1.5)
    prof = scale_profile(unit, 4, 16)
    plan = plan_with_calibration(prof, 2, cal, PlanOptions(schedule="flush", microbatches=4, use_all_workers=True))
    assert plan.num_stages == 2
    units = [MeasuredUnit(0.010, input=0.004, weight=0.006, step=0.001),
             MeasuredUnit(0.020, backward=0.030, step=0.002)]
    costs = calibrated_costs(plan, prof, cal, units=4, step_time=[0.5, 0.5], measured=units)
    assert [c.forward_time for c in costs.stages] == pytest.approx([0.015, 0.030])
    assert [c.backward_time for c in costs.stages] == pytest.approx([0.015, 0.045])
    assert [c.step_time for c in costs.stages] == pytest.approx([0.0015, 0.003])
    plain = calibrated_costs(plan, prof, cal, units=4, step_time=[0.5, 0.5])
    assert [c.activation_send_bytes for c in costs.stages] == [c.activation_send_bytes for c in plain.stages]
    assert [c.step_time for c in plain.stages] == pytest.approx([0.75, 0.75])
    sched = get_schedule(schedule).build(plan.replicas, 4, 4)
    assert simulate(sched, costs).time_per_minibatch != simulate(sched, plain).time_per_minibatch


class FakeRehearse:
    """A rehearsal whose stages take ``slow`` x the candidate's profile figures (a dict by
    schedule), recording what it was asked."""

    settings = {"fake": 1}

    def __init__(self, slow: dict[str, float], fail: Sequence[str] = ()) -> None:
        self.slow, self.fail, self.asked = slow, set(fail), []

    def __call__(self, c: Candidate) -> list[MeasuredUnit]:
        self.asked.append((c.schedule, c.microbatches))
        if c.schedule in self.fail:
            raise RuntimeError("stage 1 could not be built")
        f = self.slow.get(c.schedule, 1.0)
        return [MeasuredUnit(s["forward"] * f, backward=s["backward"] * f, step=s["step"])
                for s in c.stage_unit_seconds]


def kwargs(**more: Any) -> dict[str, Any]:
    return dict(batch_size=16, workers=2, model_name="mlp", calibration=make_cal(1000 * MBIT), repeats=1, **more)


def test_the_fastest_candidates_are_rehearsed_in_order_and_the_pick_is_among_them() -> None:
    fake = FakeRehearse({"pipedream": 3.0, "2bw": 3.0})
    choice = choose(model_at, rehearse=fake, **kwargs())
    runnable = sorted(choice.runnable, key=lambda c: c.profile_predicted_time or 0.0)
    rehearsed = [c for c in runnable if c.rehearsed]
    assert rehearsed and len(fake.asked) == len(rehearsed) <= REHEARSALS
    assert fake.asked == [(c.schedule, c.microbatches) for c in runnable[:len(rehearsed)]]  # in the profile's order
    best = min(c.predicted_time or 0.0 for c in rehearsed)
    following = runnable[len(rehearsed):]
    if following and len(rehearsed) < REHEARSALS:  # stopped: the next is slower than a rehearsed one by the profile
        assert (following[0].profile_predicted_time or 0.0) > best * (1 + TIE_TOLERANCE)
    for c in rehearsed:
        assert c.profile_predicted_time is not None and c.predicted_time is not None
        if c.schedule in fake.slow:
            assert c.predicted_time > c.profile_predicted_time
    assert choice.best.rehearsed
    assert "rehearsed" in choice.note() and "rehearsed" in choice.best.line()
    assert choice.to_json()["candidates"][0].keys() >= {"rehearsed", "profile_predicted_time_per_minibatch"}


def test_a_failed_rehearsal_keeps_the_profiles_prediction_and_says_why() -> None:
    fake = FakeRehearse({}, fail=["pipedream", "2bw", "flush", "dp", "zerobubble"])
    choice = choose(model_at, rehearse=fake, **kwargs())
    assert fake.asked and not any(c.rehearsed for c in choice.candidates)
    failed = [c for c in choice.candidates if c.rehearsal_note]
    assert failed and all("stage 1 could not be built" in (c.rehearsal_note or "") for c in failed)
    assert all(c.predicted_time == c.profile_predicted_time for c in failed)
    assert "profile only" in failed[0].line()


def test_rehearsals_are_kept_in_the_measurement_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPETRAIN_CACHE", str(tmp_path))
    first = FakeRehearse({"pipedream": 2.0})
    a = choose(model_at, rehearse=first, cache=MeasurementCache(), cache_key={"model": "mlp"}, **kwargs())
    again = FakeRehearse({"pipedream": 2.0})
    b = choose(model_at, rehearse=again, cache=MeasurementCache(), cache_key={"model": "mlp"}, **kwargs())
    assert first.asked and not again.asked
    assert [c.predicted_time for c in a.candidates] == [c.predicted_time for c in b.candidates]
    other = FakeRehearse({"pipedream": 2.0})
    other.settings = {"fake": 2}  # another runtime setting: rehearsed again
    choose(model_at, rehearse=other, cache=MeasurementCache(), cache_key={"model": "mlp"}, **kwargs())
    assert other.asked


def test_a_rehearsals_bytes_are_what_the_rank_holds_under_its_schedule() -> None:
    """What a rehearsal holds in the launcher is a worker's bytes by the planner's memory rule:
    more than the weights and their gradients, and PipeDream's first stage, which stashes a
    weight version per minibatch in flight, more than under flush (one version)."""
    from pipetrain.auto.choose import rehearsal_bytes, scale_profile, stage_parameters
    from pipetrain.plan.api import PlanOptions
    from pipetrain.plan.calibrated import plan_with_calibration
    from pipetrain.profile import profile_captured

    captured, inputs = model_at(4)
    prof = scale_profile(profile_captured(captured, inputs, batch_size=4, warmup=1, repeats=1), 4, 16)
    plan = plan_with_calibration(prof, 2, make_cal(1000 * MBIT),
                                 PlanOptions(schedule="flush", microbatches=4, use_all_workers=True))
    assert plan.num_stages == 2
    weights = max(sum(p.numel() * p.element_size() for p in stage_parameters(captured.gm, list(s.nodes)))
                  for s in plan.stages)
    flush = rehearsal_bytes(plan, prof, "flush", 4)
    assert flush > 2 * weights
    assert rehearsal_bytes(plan, prof, "pipedream", 1) > flush  # the same cut: the stashed version


def test_a_rank_too_large_for_the_launcher_is_not_rehearsed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rehearsal holds what the rank's worker would (its weight versions, gradients,
    optimizer state, activations): a candidate whose rank holds more than
    ``REHEARSAL_MAX_BYTES`` keeps its profile's prediction, says why, and can still be chosen."""
    import pipetrain.auto.choose as choose_module

    monkeypatch.setattr(choose_module, "REHEARSAL_MAX_BYTES", 0)
    fake = FakeRehearse({})
    choice = choose(model_at, rehearse=fake, **kwargs())
    assert not fake.asked and not any(c.rehearsed for c in choice.candidates)
    noted = [c for c in choice.candidates if c.rehearsal_note]
    assert noted and all("not rehearsed: a rank would hold" in (c.rehearsal_note or "") for c in noted)
    assert choice.best in noted


def test_a_candidate_whose_rehearsal_failed_is_not_chosen_over_one_that_ran() -> None:
    """The rehearsal runs the workers' own code: a candidate it could not run is not chosen
    over a rehearsed one, however fast its profile says it is."""

    class FailFirst(FakeRehearse):
        def __call__(self, c: Candidate) -> list[MeasuredUnit]:
            if not self.asked:  # the profile's fastest candidate
                self.asked.append((c.schedule, c.microbatches))
                raise RuntimeError("its stage 0 does not build")
            return super().__call__(c)

    fake = FailFirst({})
    choice = choose(model_at, rehearse=fake, **kwargs())
    (failed,) = [c for c in choice.candidates if c.rehearsal_failed]
    assert (failed.schedule, failed.microbatches) == fake.asked[0]
    assert len(fake.asked) >= 2 and choice.best.rehearsed and choice.best is not failed


def deep_at(samples: int) -> tuple[Any, tuple[Any, ...]]:
    from test_auto import OPTIONS

    from pipetrain.graph import capture
    from pipetrain.models import get_model

    torch.manual_seed(0)
    b = get_model("mlp", batch_size=samples, **{**OPTIONS, "depth": 8})
    return capture(b.model, b.example_inputs), tuple(b.make_batch(samples, torch.Generator().manual_seed(0))[0])


class SlowNodes(FakeRehearse):
    """A rehearsal on a machine whose costs are known: every Linear a unit takes 1 ms (a
    third forward), anything else 0.02 ms, and the nodes in ``slow`` ``factor`` x that,
    whatever the profile said."""

    def __init__(self, slow: Sequence[str], factor: float) -> None:
        super().__init__({})
        self.settings = {"fake": "slow nodes"}  # not FakeRehearse's rehearsals in the cache
        captured, _ = deep_at(4)
        linear = {n.name for n in captured.graph.nodes
                  if n.kind == "module" and isinstance(captured.gm.get_submodule(n.target), torch.nn.Linear)}
        self.cost = {n.name: (1e-3 if n.name in linear else 2e-5) * (factor if n.name in slow else 1.0)
                     for n in captured.graph.nodes if not n.is_input}

    def __call__(self, c: Candidate) -> list[MeasuredUnit]:
        self.asked.append((c.schedule, c.microbatches))
        assert c.plan is not None
        secs = [sum(self.cost.get(n, 0.0) for n in stage.nodes) for stage in c.plan.stages]
        return [MeasuredUnit(t / 3, backward=2 * t / 3, step=1e-5) for t in secs]


def test_stages_that_rehearse_unbalanced_are_planned_again_on_their_rehearsed_times(tmp_path: Path) -> None:
    """5b: the profile put a cut, the rehearsal finds stage 0 twice as slow as the profile
    said against stage 1; the stages are planned again on the rehearsed times, the new plan is
    rehearsed once and replaces the candidate, with fewer nodes on stage 0 and faster. A
    rehearsal as the profile said (any uniform factor) plans nothing again."""
    # one profile for both choices (the cache), so both start from the same first plan
    args = dict(kwargs(schedules=["flush"], microbatches=4), cache=MeasurementCache(tmp_path),
                cache_key={"model": "mlp", "depth": 8})
    uniform = FakeRehearse({"flush": 1.3})
    plain = choose(deep_at, rehearse=uniform, **args)
    (first,) = [c for c in plain.candidates if c.rehearsed]
    assert first.plan is not None and first.plan.num_stages == 2 and first.replanned_from is None
    assert first.rehearsed_imbalance == pytest.approx(1.0) and len(uniform.asked) == 1
    fake = SlowNodes(first.plan.stages[0].nodes, 2.0)
    choice = choose(deep_at, rehearse=fake, **args)
    assert fake.asked == [("flush", 4), ("flush", 4)]  # the first plan, then the one planned again
    best = choice.best
    assert best.replanned_from is not None and first.config in best.replanned_from
    assert best.plan is not None and best.rehearsed and best in choice.candidates
    assert len(best.plan.stages[0].nodes) < len(first.plan.stages[0].nodes)

    def slowest(plan: Any) -> float:  # the bottleneck stage on this machine
        return max(sum(fake.cost.get(n, 0.0) for n in stage.nodes) for stage in plan.stages)
    assert slowest(best.plan) < slowest(first.plan)
    assert "planned again on the rehearsal of" in best.line() and "planned again" in choice.note()
    assert len(choice.candidates) == len(plain.candidates)


def test_a_plan_made_again_that_fails_leaves_the_rehearsed_candidate(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    """5b is a refinement: when planning again on the rehearsed times fails, the candidate
    as planned and rehearsed is kept, and the choice is made."""
    import pipetrain.auto.choose as choose_module

    args = dict(kwargs(schedules=["flush"], microbatches=4), cache=MeasurementCache(tmp_path),
                cache_key={"model": "mlp", "depth": 8})
    first = next(c for c in choose(deep_at, rehearse=FakeRehearse({}), **args).candidates if c.rehearsed)
    assert first.plan is not None

    planned = choose_module._planned

    def refuse_again(unit_prof: Any, plan_fn: Any, rehearsed: Any, timed: Any) -> Any:
        if rehearsed is not None:
            raise PlanError("no plan on these times")
        return planned(unit_prof, plan_fn, rehearsed, timed)
    monkeypatch.setattr(choose_module, "_planned", refuse_again)
    fake = SlowNodes(first.plan.stages[0].nodes, 2.0)
    choice = choose(deep_at, rehearse=fake, **args)
    assert fake.asked == [("flush", 4)] and choice.best.replanned_from is None and choice.best.rehearsed
