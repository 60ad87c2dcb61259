"""``--schedule auto`` through the measurement cache (pipetrain.auto.measured): a second resolve
of the same run profiles nothing, ``--no-cache`` measures again, another model option is
another profile, and the loopback calibration is measured once per rank count."""
from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from test_calibrated import MBIT, make_cal

import pipetrain.auto.stage_timing as stage_timing
import pipetrain.cluster.measure as cluster_measure
import pipetrain.profile.profiler as profiler
from pipetrain.auto.choose import choose
from pipetrain.auto.measured import AutoMeasurements
from pipetrain.graph import capture
from pipetrain.job import TrainConfig
from pipetrain.models import TINY_OPTIONS, get_model
from pipetrain.profile.cache import MeasurementCache
from pipetrain.run.resolve import resolve_run

pytestmark = pytest.mark.timeout(300)

OPTIONS = dict(TINY_OPTIONS["mlp"], depth=4, width=64)


@pytest.fixture(autouse=True)
def one_thread() -> None:
    torch.set_num_threads(1)


class Counts:
    """Calls of the profiler, the stage timer and the loopback calibration."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.profiles = self.stages = self.calibrations = 0
        self.calibrate_kwargs: list[dict[str, Any]] = []
        real_profile, real_stages = profiler.profile_captured, stage_timing.stage_seconds

        def profile(*args: Any, **kwargs: Any) -> Any:
            self.profiles += 1
            return real_profile(*args, **kwargs)

        def stages(*args: Any, **kwargs: Any) -> Any:
            self.stages += 1
            return real_stages(*args, **kwargs)

        def calibrate(*args: Any, **kwargs: Any) -> Any:
            self.calibrations += 1
            self.calibrate_kwargs.append(kwargs)
            return make_cal(1000 * MBIT, ranks=int(kwargs.get("ranks", 2)))

        monkeypatch.setattr(profiler, "profile_captured", profile)
        monkeypatch.setattr(stage_timing, "stage_seconds", stages)
        monkeypatch.setattr(cluster_measure, "calibrate", calibrate)

    def take(self) -> tuple[int, int, int]:
        out = (self.profiles, self.stages, self.calibrations)
        self.profiles = self.stages = self.calibrations = 0
        return out


def auto_config(tmp_path: Path, **changes: Any) -> TrainConfig:
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(make_cal(1000 * MBIT).to_dict()))
    fields: dict[str, Any] = dict(model="mlp", model_options=OPTIONS, workers=2, schedule="auto", batch_size=16,
                                  steps=4, calibration=str(cal), microbatches=2)
    fields.update(changes)
    return TrainConfig.of(**fields)


def test_a_second_resolve_profiles_nothing(tmp_path: Path, private_cache: Path, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    counts = Counts(monkeypatch)
    first = resolve_run(auto_config(tmp_path))
    profiles, stages, _ = counts.take()
    assert profiles >= 1 and stages >= 1
    assert {p.parent.name for p in private_cache.glob("*/*.json")} >= {"profile", "stage-times", "optimizer-step"}
    again = resolve_run(auto_config(tmp_path))
    assert counts.take() == (0, 0, 0)
    assert again.plan is not None and first.plan is not None and again.plan.config == first.plan.config
    assert (again.config.parallel.schedule, again.microbatches) == (first.config.parallel.schedule, first.microbatches)
    assert again.plan.extra["auto"]["candidates"] == first.plan.extra["auto"]["candidates"]
    # the plan's source says its measurements were reused, and from when
    assert "from the cache" not in first.plan_note
    written = min(json.loads(p.read_text())["written"] for p in private_cache.glob("*/*.json"))
    assert f"from the cache ({private_cache}), the oldest written {written}; --no-cache" in again.plan_note


def test_no_cache_measures_again_and_writes_nothing(tmp_path: Path, private_cache: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    counts = Counts(monkeypatch)
    resolve_run(auto_config(tmp_path))
    counts.take()
    before = sorted(private_cache.glob("*/*.json"))
    resolve_run(auto_config(tmp_path, cache=False))
    profiles, stages, _ = counts.take()
    assert profiles >= 1 and stages >= 1
    assert sorted(private_cache.glob("*/*.json")) == before


def test_another_model_option_is_another_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    counts = Counts(monkeypatch)
    resolve_run(auto_config(tmp_path))
    counts.take()
    resolve_run(auto_config(tmp_path, model_options=dict(OPTIONS, width=96)))
    assert counts.take()[0] >= 1
    resolve_run(auto_config(tmp_path, model_options=dict(OPTIONS, width=96)))
    assert counts.take()[0] == 0


def model_at(samples: int) -> tuple[Any, tuple[Any, ...]]:
    torch.manual_seed(0)
    b = get_model("mlp", batch_size=samples, **OPTIONS)
    return capture(b.model, b.example_inputs), tuple(b.make_batch(samples, torch.Generator().manual_seed(0))[0])


def test_the_loopback_calibration_is_measured_once_per_rank_count(monkeypatch: pytest.MonkeyPatch) -> None:
    counts = Counts(monkeypatch)
    kwargs: dict[str, Any] = dict(batch_size=16, workers=2, model_name="mlp", repeats=1, schedules=["flush"],
                                  microbatches=2, cache_key={"model": "mlp", "options": OPTIONS})
    first = choose(model_at, cache=MeasurementCache(), **kwargs)
    assert counts.take()[2] == 1
    again = choose(model_at, cache=MeasurementCache(), **kwargs)
    assert counts.take() == (0, 0, 0)
    assert again.costs == first.costs and again.best.predicted_time == first.best.predicted_time
    choose(model_at, cache=MeasurementCache(enabled=False), **kwargs)
    assert counts.take()[2] == 1
    measured = AutoMeasurements(MeasurementCache(), None, {})
    measured.calibration(3, lambda: make_cal(1000 * MBIT, ranks=3))   # another rank count: its own entry
    assert measured.cache is not None and measured.cache.misses == 1
    # a calibration fitted on another statistic (the fastest, before this rule): measured again
    import pipetrain.cluster.calibration as calibration

    monkeypatch.setattr(calibration, "FIT_STATISTIC", "fastest")
    other = MeasurementCache()
    AutoMeasurements(other, None, {}).calibration(3, lambda: make_cal(1000 * MBIT, ranks=3))
    assert other.misses == 1


def test_a_launcher_forks_its_calibration_ranks_from_the_fork_server(tmp_path: Path, private_cache: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A calibration measured for ``auto`` in the launcher starts its ranks from the workers'
    fork server (torch imported once), not as fresh interpreters."""
    from pipetrain.runtime.process.forkserver import start_method

    counts = Counts(monkeypatch)
    resolve_run(auto_config(tmp_path, calibration=None))
    assert counts.calibrations == 1
    processes = counts.calibrate_kwargs[0]["processes"]
    assert processes is not None and processes.get_start_method() == start_method() == "forkserver"


def counted_solves(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one with every solve of the dynamic program (``plan.api.plan``)."""
    plan_api = importlib.import_module("pipetrain.plan.api")
    solves: list[int] = []
    real_plan = plan_api.plan

    def counted(*args: Any, **kwargs: Any) -> Any:
        solves.append(1)
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(plan_api, "plan", counted)
    return solves


def test_a_repeated_choice_solves_no_plan_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plans made on cached measurements are kept too (kind ``plan``): a repeated choice
    gives the same candidates without solving; other costs are solved again."""
    Counts(monkeypatch)
    solves = counted_solves(monkeypatch)
    kwargs: dict[str, Any] = dict(batch_size=16, workers=2, model_name="mlp", repeats=1,
                                  schedules=["flush", "pipedream"], microbatches=2,
                                  cache_key={"model": "mlp", "options": OPTIONS})
    first = choose(model_at, cache=MeasurementCache(), calibration=make_cal(1000 * MBIT), **kwargs)
    assert len(solves) >= 2
    solves.clear()
    again = choose(model_at, cache=MeasurementCache(), calibration=make_cal(1000 * MBIT), **kwargs)
    assert solves == []
    assert [c.to_json() for c in again.candidates] == [c.to_json() for c in first.candidates]
    assert [c.plan.to_dict() for c in again.candidates] == [c.plan.to_dict() for c in first.candidates]
    choose(model_at, cache=MeasurementCache(), calibration=make_cal(500 * MBIT), **kwargs)
    assert len(solves) >= 2


def test_the_microbatched_schedules_share_their_plans(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a memory limit the dynamic program's answer is every schedule's: 2bw, flush
    and zero-bubble at one microbatch count solve what flush alone solves (the old code solved
    2bw's again), and each candidate's plan carries its own schedule's memory rule."""
    Counts(monkeypatch)
    solves = counted_solves(monkeypatch)
    kwargs: dict[str, Any] = dict(batch_size=16, workers=2, model_name="mlp", repeats=1, microbatches=2,
                                  calibration=make_cal(1000 * MBIT), cache_key={"model": "mlp", "options": OPTIONS})
    choose(model_at, schedules=["flush"], cache=MeasurementCache(tmp_path / "a"), **kwargs)
    alone = len(solves)
    solves.clear()
    three = choose(model_at, schedules=["flush", "2bw", "zerobubble"], cache=MeasurementCache(tmp_path / "b"),
                   **kwargs)
    assert alone >= 1 and len(solves) == alone, (alone, solves)
    rules = {c.schedule: c.plan.extra["options"]["schedule"] for c in three.candidates if c.plan is not None}
    assert rules == {"flush": "flush", "2bw": "2bw", "zerobubble": "flush"}, rules


def test_without_a_model_key_only_the_calibration_is_kept(private_cache: Path, monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    counts = Counts(monkeypatch)
    kwargs: dict[str, Any] = dict(batch_size=16, workers=2, model_name="mlp", repeats=1, schedules=["flush"],
                                  microbatches=2, cache=MeasurementCache())
    choose(model_at, **kwargs)
    choose(model_at, **kwargs)
    profiles, _, calibrations = counts.take()
    assert profiles == 2 and calibrations == 1
    assert {p.parent.name for p in private_cache.glob("*/*.json")} == {"calibration", "optimizer-step"}


def test_the_choice_traces_the_model_once_for_every_unit_size(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The resolve captures the model at the whole minibatch (its layer check; as the workers
    take it) before the choice, which measures every unit size: the model is built at each
    size, its graph traced once and taken at the others (pipetrain.graph.capture.rebatched).
    A capture the workers take at another unit size is traced for its own bundle, once; a
    rehearsal's is not counted."""
    import importlib
    import traceback

    import pipetrain.run.resolve as resolve

    graph_capture = importlib.import_module("pipetrain.graph.capture")  # the module, not the function it exports

    real_load, real_shipped, real_capture = resolve.load_captured, resolve.load_shipped, graph_capture.capture
    samples: list[int] = []
    shipped: list[int] = []
    traced: list[int] = []

    def load_captured(cfg: Any, unit_batch: int, **kwargs: Any) -> Any:
        samples.append(unit_batch)
        return real_load(cfg, unit_batch, **kwargs)

    def load_shipped(cfg: Any, unit_batch: int, **kwargs: Any) -> Any:
        shipped.append(unit_batch)
        return real_shipped(cfg, unit_batch, **kwargs)

    def capture(model: Any, example_inputs: Any, **kwargs: Any) -> Any:
        first = example_inputs[0] if isinstance(example_inputs, tuple) else example_inputs
        if any(f.name in ("_load_captured", "_load_shipped") and f.filename.endswith("resolve.py")
               for f in traceback.extract_stack()):  # the resolve's and the choice's, not a rehearsal's
            traced.append(int(first.shape[0]))
        return real_capture(model, example_inputs, **kwargs)

    monkeypatch.setattr(resolve, "load_captured", load_captured)
    monkeypatch.setattr(resolve, "load_shipped", load_shipped)
    monkeypatch.setattr(graph_capture, "capture", capture)
    run = resolve_run(auto_config(tmp_path, microbatches=None, cache=False))
    assert run.plan is not None
    # the choice measured every unit size, each built once: the whole minibatch's first
    assert shipped[0] == 16 and sorted(samples) == [2, 4, 8], (shipped, samples)
    # and traced the model once; the workers' capture again only at another unit size
    unit = run.batch_size // run.microbatches
    assert shipped[1:] == ([] if unit == 16 else [unit]), (shipped, unit)
    assert traced == [16] + shipped[1:], traced


def test_a_repeated_choice_at_the_whole_minibatch_traces_the_model_once(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Every measurement and plan cached, a choice whose unit is the whole minibatch ships the
    trace it chose on to the workers instead of tracing the model again for them."""
    graph_capture = importlib.import_module("pipetrain.graph.capture")  # the module, not the function it exports
    real_capture = graph_capture.capture
    traced: list[int] = []

    def capture(model: Any, example_inputs: Any, **kwargs: Any) -> Any:
        traced.append(1)
        return real_capture(model, example_inputs, **kwargs)

    Counts(monkeypatch)
    first = resolve_run(auto_config(tmp_path, microbatches=1))
    monkeypatch.setattr(graph_capture, "capture", capture)
    again = resolve_run(auto_config(tmp_path, microbatches=1))
    assert again.microbatches == 1 and len(traced) == 1, traced
    assert again.plan is not None and first.plan is not None and again.plan.config == first.plan.config
    assert (again.model is None) == (first.model is None)
    if again.model is not None and first.model is not None:
        assert again.model.unit_batch == first.model.unit_batch == again.batch_size
