"""Multi-process training on CPU (gloo): every schedule against its single-process reference.

Synchronous schedules (flush, gpipe, dp, interleaved, zerobubble, replicated flush) must give,
after K steps, the parameters of plain single-process training on the same global batches;
asynchronous ones (pipedream with and without vertical sync, replicated pipedream, 2bw) the
parameters of the single-process replay of the same schedule (reference.py). Process start-up
is amortised by running many configurations in one launch per worker count.
"""
from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from pipetrain.graph import capture
from pipetrain.job import OptimizerConfig, TrainConfig
from pipetrain.models import TINY_OPTIONS, get_model
from pipetrain.plan.types import Plan, Stage
from pipetrain.run import resolve_run
from pipetrain.runtime import WorkerFailure, launch_local, replay_config, single_config
from pipetrain.schedule.action import Op

pytestmark = pytest.mark.timeout(240)

MLP = dict(TINY_OPTIONS["mlp"], depth=6)
SGD = OptimizerConfig("sgd", lr=0.1, momentum=0.9)
ADAM = OptimizerConfig("adam", lr=0.01)
FAST = OptimizerConfig("sgd", lr=0.5, momentum=0.9)  # large steps: staleness shows clearly
RESNET = dict(TINY_OPTIONS["resnet50"], norm="none")  # GroupNorm over tiny groups amplifies rounding
TIMEOUT = 30


def cfg(schedule: str, workers: int, config: str | None = None, **kw: Any) -> TrainConfig:
    base: dict[str, Any] = dict(model="mlp", model_options=MLP, batch_size=8, steps=3, optimizer=SGD,
                                return_state=True, timeout=TIMEOUT, quiet=True)
    base.update(kw)
    return TrainConfig.of(schedule=schedule, workers=workers, config=config, **base)


def launch(cfgs: dict[str, TrainConfig]) -> dict[str, Any]:
    """Resolve every config (once, here) and run them all in one launch."""
    runs = {name: resolve_run(c) for name, c in cfgs.items()}
    results = launch_local(list(runs.values()), timeout=TIMEOUT)
    return {"cfgs": cfgs, "runs": runs, "results": dict(zip(runs, results))}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the tensor's largest magnitude, with a floor of 1e-6 for
    tensors that are numerically zero (a GPT's key bias: its gradient is rounding noise)."""
    return float((a.float() - b.float()).abs().max() / (b.float().abs().max() + 1e-6))


def assert_params_close(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], tol: float = 1e-5) -> None:
    for name, t in ref.items():
        assert name in state, f"missing {name}"
        err = rel_err(state[name], t)
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol}"


def resnet_plan(tmp: Path, stages: int) -> str:
    """A plan whose first cut goes through a residual block (its skip crosses, or is relayed)."""
    torch.manual_seed(0)
    b = get_model("resnet50", batch_size=2, **RESNET)
    names = [n.name for n in capture(b.model, b.example_inputs).graph.nodes]
    cut = names.index("layer1_0_relu1") + 1
    if stages == 2:
        parts = [names[:cut], names[cut:]]
    else:
        add = names.index("add")
        parts = [names[:cut], names[cut:add - 1], names[add - 1:]]
    path = tmp / f"resnet{stages}.json"
    Plan(stages=[Stage(nodes=p) for p in parts], model="resnet50").save(path)
    return str(path)


def in_flight_bound(schedule: Any, rank: int, stage: int) -> int:
    """Most versions a stage must hold: those of forwards awaiting their backward, the newest,
    and the one a STEP is creating."""
    pending: dict[int, int] = {}
    newest, bound = 0, 1
    for a in schedule.workers[rank]:
        if a.stage != stage:
            continue
        if a.op is Op.F:
            pending[a.mb] = a.version
        elif a.op in (Op.B, Op.W):
            pending.pop(a.mb, None)
        elif a.op is Op.STEP:
            bound = max(bound, len(set(pending.values()) | {newest}) + 1)
            newest += 1
    return bound


# --------------------------------------------------------------------------- launches


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("two")
    runs: dict[str, TrainConfig] = {
        "flush": cfg("flush", 2, "1-1", microbatches=4),
        "gpipe_adam": cfg("gpipe", 2, "1-1", optimizer=ADAM, microbatches=2),
        "dp": cfg("dp", 2, microbatches=4),
        "interleaved": cfg("interleaved", 2, microbatches=4, optimizer=ADAM),
        "zerobubble": cfg("zerobubble", 2, "1-1", microbatches=4),
        "flush_clip_cosine": cfg("flush", 2, "1-1", microbatches=2, clip_grad_norm=0.05,
                                 lr_schedule="cosine:warmup=1", optimizer=OptimizerConfig("adamw", lr=0.01,
                                                                                           weight_decay=0.1)),
        "pipedream": cfg("pipedream", 2, "1-1", steps=4, optimizer=FAST),
        "pipedream_vsync": cfg("pipedream", 2, "1-1", steps=4, vertical_sync=True, optimizer=ADAM),
        "2bw": cfg("2bw", 2, "1-1", microbatches=2, steps=4),
        "pipedream_clip": cfg("pipedream", 2, "1-1", steps=4, clip_grad_norm=0.5, optimizer=FAST),
        "resnet_flush": cfg("flush", 2, plan=resnet_plan(tmp, 2), model="resnet50", model_options=RESNET,
                            microbatches=2, batch_size=4, steps=2),
        "gpt_pipedream": cfg("pipedream", 2, "1-1", model="gpt", model_options=TINY_OPTIONS["gpt"],
                             batch_size=2, steps=3),  # not Adam: the key bias's gradient is pure rounding noise
        "straight": cfg("flush", 2, "1-1", microbatches=2, steps=4, optimizer=ADAM),
        "first_half": cfg("flush", 2, "1-1", microbatches=2, steps=2, optimizer=ADAM, save=str(tmp / "ckpt.pt"),
                          warmup_steps=0),
    }
    if importlib.util.find_spec("transformers") is not None:
        runs["hf_flush"] = cfg("flush", 2, "1-1", model="hf-gpt2", model_options=TINY_OPTIONS["hf-gpt2"],
                               batch_size=2, microbatches=2, steps=2)
    return dict(launch(runs), tmp=tmp)


@pytest.fixture(scope="module")
def three_workers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("three")
    runs = {
        "pipedream_2_1": cfg("pipedream", 3, "2-1", steps=4),
        "flush_2_1": cfg("flush", 3, "2-1", microbatches=4, optimizer=ADAM),
        "resnet_relay_pipedream": cfg("pipedream", 3, plan=resnet_plan(tmp, 3), model="resnet50",
                                      model_options=RESNET, batch_size=2, steps=3),
        "2bw_3": cfg("2bw", 3, "1-1-1", microbatches=3, batch_size=6, steps=3, optimizer=ADAM),
    }
    return launch(runs)


@pytest.fixture(scope="module")
def four_workers() -> dict[str, Any]:
    runs = {
        "flush_1_2_1": cfg("flush", 4, "1-2-1", microbatches=4),
        "pipedream_vsync_2_1_1": cfg("pipedream", 4, "2-1-1", steps=4, vertical_sync=True),
    }
    return launch(runs)


SYNC_TWO = ["flush", "gpipe_adam", "dp", "interleaved", "zerobubble", "flush_clip_cosine", "resnet_flush", "straight"]
ASYNC_TWO = ["pipedream", "pipedream_vsync", "2bw", "pipedream_clip", "gpt_pipedream"]


@pytest.mark.parametrize("name", SYNC_TWO)
def test_sync_schedules_equal_single_process(two_workers: dict[str, Any], name: str) -> None:
    run, r = two_workers["runs"][name], two_workers["results"][name]
    ref = single_config(run)
    assert_params_close(r.state, ref.state)
    assert r.losses == pytest.approx(ref.losses, rel=1e-5)
    steps = run.config.training.steps
    assert r.steps == steps and r.workers == 2 and len(r.losses) == steps


@pytest.mark.parametrize("name", ASYNC_TWO)
def test_async_schedules_equal_replay(two_workers: dict[str, Any], name: str) -> None:
    run, r = two_workers["runs"][name], two_workers["results"][name]
    rep = replay_config(run)
    assert_params_close(r.state, rep.params)
    # stale weights really differ from synchronous training (the check can fail)
    single = single_config(run)
    assert max(rel_err(r.state[n], single.state[n]) for n in rep.params) > 1e-4


def test_hugging_face_model_trains_through_the_pipeline(two_workers: dict[str, Any]) -> None:
    if "hf_flush" not in two_workers["results"]:
        pytest.skip("transformers is not installed")
    run, r = two_workers["runs"]["hf_flush"], two_workers["results"]["hf_flush"]
    assert_params_close(r.state, single_config(run).state)


def test_weight_versions_are_released(two_workers: dict[str, Any], three_workers: dict[str, Any]) -> None:
    for fixture, name, workers in [(two_workers, "pipedream", 2), (two_workers, "pipedream_vsync", 2),
                                   (two_workers, "2bw", 2), (three_workers, "resnet_relay_pipedream", 3),
                                   (two_workers, "flush", 2)]:
        run, r = fixture["runs"][name], fixture["results"][name]
        sched = run.schedule
        assert run.world_size == workers
        for stage, peak in r.peak_versions.items():
            k = int(stage)
            rank = sched.stage_ranks[k][0]
            assert peak <= in_flight_bound(sched, rank, k), (name, stage, peak)
        # after the run only the newest version is alive
        assert set(r.alive_versions.values()) == {1}, (name, r.alive_versions)
        if run.spec.flushes and not run.spec.splits_backward:
            assert max(r.peak_versions.values()) <= 2


@pytest.mark.parametrize("name", ["pipedream_2_1", "resnet_relay_pipedream", "2bw_3"])
def test_three_worker_async_equal_replay(three_workers: dict[str, Any], name: str) -> None:
    run, r = three_workers["runs"][name], three_workers["results"][name]
    assert_params_close(r.state, replay_config(run).params)


def test_replicated_flush_2_1_equals_single_process(three_workers: dict[str, Any]) -> None:
    run, r = three_workers["runs"]["flush_2_1"], three_workers["results"]["flush_2_1"]
    assert r.config == "2-1"
    assert_params_close(r.state, single_config(run).state)


def test_four_workers(four_workers: dict[str, Any]) -> None:
    run, r = four_workers["runs"]["flush_1_2_1"], four_workers["results"]["flush_1_2_1"]
    assert r.config == "1-2-1"
    assert_params_close(r.state, single_config(run).state)
    run, r = four_workers["runs"]["pipedream_vsync_2_1_1"], four_workers["results"]["pipedream_vsync_2_1_1"]
    assert_params_close(r.state, replay_config(run).params)


def test_saved_checkpoint_loads_in_one_process(two_workers: dict[str, Any]) -> None:
    run, r = two_workers["runs"]["first_half"], two_workers["results"]["first_half"]
    path = Path(str(run.config.checkpoint.save))
    assert path.exists() and Path(str(path) + ".trainer").exists()
    torch.manual_seed(0)
    b = get_model("mlp", batch_size=8, **MLP)
    sd = torch.load(path, weights_only=True)
    b.model.load_state_dict(sd)  # strict: exactly the model's keys
    x = torch.randn(5, MLP["in_features"])
    from torch.func import functional_call

    torch.testing.assert_close(b.model(x), functional_call(b.model, r.state, (x,)))
    assert_params_close(sd, single_config(run).state)


def test_resume_continues_exactly(two_workers: dict[str, Any]) -> None:
    c = two_workers["cfgs"]["first_half"]
    straight = two_workers["results"]["straight"]
    again = c.replace(resume=c.checkpoint.save, save=None, steps=2)
    resumed = launch_local([resolve_run(again)], timeout=TIMEOUT)[0]
    assert resumed.start_step == 2
    assert_params_close(resumed.state, straight.state, tol=1e-6)
    assert resumed.losses == pytest.approx(straight.losses[2:], rel=1e-6)


def test_failing_rank_is_named() -> None:
    with pytest.raises(WorkerFailure, match="rank 1 failed: RuntimeError: debug failure injected on rank 1") as e:
        launch_local([resolve_run(cfg("pipedream", 2, "1-1", steps=4, debug_fail="1:2"))], timeout=TIMEOUT)
    assert e.value.rank == 1 and not e.value.user_error


def test_stuck_rank_times_out_instead_of_hanging() -> None:
    import time

    t = time.monotonic()
    with pytest.raises(WorkerFailure, match="rank 0 failed: .*[Tt]imed out"):
        launch_local([resolve_run(cfg("flush", 2, "1-1", microbatches=2, debug_fail="1:1:hang", timeout=8))], timeout=8)
    assert time.monotonic() - t < 60


def test_user_error_in_worker_is_one_line() -> None:
    """A user error raised inside a worker (here the resolved run's model options are broken
    after resolution) arrives as a structured record: its message alone, marked a user error."""
    run = resolve_run(cfg("flush", 2, "1-1", microbatches=2))
    bad = replace(run, config=run.config.replace(model_options=dict(MLP, depth=0)))
    with pytest.raises(WorkerFailure, match="mlp option 'depth' must be an integer >= 1") as e:
        launch_local([bad], timeout=TIMEOUT)
    assert e.value.user_error and e.value.rank in (0, 1)
