"""The catalogue of user errors (docs/errors.md): each case, its one-line message, in process.

Cases already covered elsewhere are linked from docs/errors.md (tests/cli/test_user_errors.py,
tests/plan/test_planner.py, tests/graph/test_capture.py, tests/data/test_data_loader.py); the cases here are
the ones a training run meets, checked through the same entry points the CLI uses
(:func:`pipetrain.run.resolve_run`, :func:`pipetrain.run.train` before any worker starts,
the checkpoint loader). Each message is one line with the rule, the values and the fix.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pipetrain.checkpoint import CheckpointError, RankState, latest_checkpoint, load_for_rank, save_checkpoint_dir
from pipetrain.data import ArrayDataset, DataSource, check_fits
from pipetrain.errors import CaptureError, DataError, PipetrainError, PlanError, RuntimeConfigError
from pipetrain.graph import capture
from pipetrain.job import TrainConfig
from pipetrain.job.segments import cut_at, segments_done
from pipetrain.models import TINY_OPTIONS, get_model
from pipetrain.run import resolve_run, train
from pipetrain.runtime.checkpoints.periodic import manifest_info

MLP = dict(TINY_OPTIONS["mlp"], depth=6)


def cfg(**kw: Any) -> TrainConfig:
    base: dict[str, Any] = dict(model="mlp", model_options=MLP, batch_size=8, steps=4, quiet=True, timeout=30)
    base.update(kw)
    return TrainConfig.of(**base)


def one_line(e: pytest.ExceptionInfo[BaseException]) -> str:
    msg = str(e.value)
    assert "\n" not in msg and isinstance(e.value, PipetrainError)
    return msg


# --------------------------------------------------------------------------- configuration


def test_plan_and_worker_count_mismatch(tmp_path: Path) -> None:
    with pytest.raises(RuntimeConfigError, match=r"--workers 3 does not match --config 1-1, which needs 2 workers; "
                                                 r"pass --workers 2") as e:
        resolve_run(cfg(workers=3, config="1-1", schedule="flush"))
    one_line(e)
    plan = resolve_run(cfg(workers=2, config="1-1", schedule="flush")).plan
    assert plan is not None
    plan.save(tmp_path / "plan.json")
    with pytest.raises(RuntimeConfigError, match=r"--workers 4 does not match the plan .*plan\.json, which needs 2 "
                                                 r"workers; pass --workers 2"):
        resolve_run(cfg(workers=4, plan=str(tmp_path / "plan.json"), schedule="flush"))


def test_unknown_schedule_and_options() -> None:
    with pytest.raises(RuntimeConfigError, match=r"unknown schedule 'zigzag'; valid schedules: .*flush.*pipedream"):
        cfg(schedule="zigzag")
    with pytest.raises(RuntimeConfigError, match=r"unknown training setting 'colour'; settings are: "):
        cfg(colour="red")
    with pytest.raises(RuntimeConfigError, match=r"--vertical-sync applies to the pipedream schedule only .*"
                                                 r"drop --vertical-sync or pass --schedule pipedream"):
        cfg(schedule="flush", vertical_sync=True)


def test_unknown_flag_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    from pipetrain.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train", "--colour", "red"])
    assert e.value.code == 2
    assert "unrecognized arguments: --colour red" in capsys.readouterr().err


def test_microbatches_that_do_not_divide_the_batch() -> None:
    with pytest.raises(RuntimeConfigError, match=r"batch size 8 is not divisible by microbatches 3: .*use "
                                                 r"--microbatches 2 or --batch-size 9") as e:
        resolve_run(cfg(workers=2, config="1-1", schedule="flush", microbatches=3))
    one_line(e)


def test_restarts_need_a_checkpoint_dir() -> None:
    with pytest.raises(RuntimeConfigError, match=r"--max-restarts 2 restarts from the latest checkpoint, so it needs "
                                                 r"--checkpoint-dir DIR"):
        cfg(max_restarts=2)
    with pytest.raises(RuntimeConfigError, match=r"--checkpoint-every needs --checkpoint-dir DIR"):
        cfg(checkpoint_every=2)


# --------------------------------------------------------------------------- model, plan, profile


class BranchOnValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if y.sum() > 0:
            return y
        return -y


def test_a_model_that_cannot_be_captured() -> None:
    with pytest.raises(CaptureError, match=r"cannot capture model BranchOnValue.*control flow") as e:
        capture(BranchOnValue(), torch.randn(3, 4))
    one_line(e)


def test_a_plan_from_another_model(tmp_path: Path) -> None:
    plan = resolve_run(cfg(workers=2, config="1-1", schedule="flush")).plan
    assert plan is not None
    plan.save(tmp_path / "plan.json")
    other = dict(MLP, depth=3)
    with pytest.raises(PipetrainError, match=r"the plan was made for another model or other (model )?options") as e:
        resolve_run(cfg(model_options=other, workers=2, plan=str(tmp_path / "plan.json"), schedule="flush"))
    one_line(e)


def test_a_plan_that_will_not_fit_in_memory() -> None:
    from pipetrain.plan import PlanOptions, Topology, plan
    from pipetrain.profile import profile_model

    bundle = get_model("mlp", batch_size=8, **MLP)
    prof = profile_model(bundle, warmup=0, repeats=1)
    with pytest.raises(PlanError, match=r"no plan fits in 1000 bytes per worker on 2 workers .* the smallest memory "
                                        r"per worker that fits is about .*; raise --memory, add workers") as e:
        plan(prof, Topology.flat(2, 1e9, 1000.0), PlanOptions(schedule="pipedream"))
    one_line(e)


# --------------------------------------------------------------------------- data


def test_a_data_set_that_does_not_fit_the_model() -> None:
    ds = ArrayDataset((torch.rand(6, 64),), torch.arange(6) % 10)
    src = DataSource("features", ds, ds, "classification", (64,), torch.float32, num_classes=10)
    bundle = get_model("mlp", batch_size=2, **dict(MLP, in_features=32))
    with pytest.raises(DataError, match=r"samples of data 'features' do not fit model 'mlp': the model reads inputs "
                                        r"\[32\] float32 per sample, the data gives \[64\] float32; pick a model") as e:
        check_fits(bundle, src)
    one_line(e)


# --------------------------------------------------------------------------- checkpoints


def _save(root: Path, model: nn.Module, step: int, options: dict[str, Any]) -> Path:
    run = resolve_run(cfg(model_options=options, workers=2, config="1-1", schedule="flush"))
    return save_checkpoint_dir(root, step, rank_state=RankState(model=dict(model.state_dict())),
                               manifest_info=manifest_info(run, step), sync_files=False)


def test_a_checkpoint_from_another_model(tmp_path: Path) -> None:
    small = dict(MLP, width=8)
    model = get_model("mlp", batch_size=8, **small).model
    path = _save(tmp_path / "ck", model, 2, small)
    # a run of another model with that --checkpoint-dir: refused before any worker starts
    with pytest.raises(CheckpointError, match=r"checkpoint '.*step_00000002' is for model mlp .*'width': 8.*, not "
                                              r"model mlp .*; resume with the same --model and --option values") as e:
        train(cfg(workers=2, config="1-1", schedule="flush", checkpoint_dir=str(tmp_path / "ck")))
    one_line(e)
    # a rank loading its parameters by name and shape
    big = get_model("mlp", batch_size=8, **MLP).model
    with pytest.raises(CheckpointError, match=r"is from another model: parameter '.*' has shape"):
        load_for_rank(path, {n: tuple(t.shape) for n, t in big.state_dict().items()})


def test_a_truncated_checkpoint_is_named_and_skipped(tmp_path: Path) -> None:
    model = get_model("mlp", batch_size=8, **MLP).model
    good = _save(tmp_path / "ck", model, 2, MLP)
    bad = _save(tmp_path / "ck", model, 4, MLP)
    f = next(p for p in bad.iterdir() if p.suffix == ".distcp")
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"is truncated: file '__0_0\.distcp' has 100 bytes but its manifest "
                                              r"records \d+; resume from an older checkpoint") as e:
        load_for_rank(bad, list(model.state_dict()))
    one_line(e)
    assert latest_checkpoint(tmp_path / "ck") == good  # the damaged newer one is skipped


def test_a_checkpoint_step_that_the_run_cannot_continue() -> None:
    with pytest.raises(CheckpointError, match=r"the checkpoint to resume is at step 3, which is not a segment boundary "
                                              r"of this run \(boundaries: 2, 4\)"):
        segments_done([2, 2], 3)
    with pytest.raises(CheckpointError, match=r"at step 6, past this run's last step 4: .*pass more --steps"):
        segments_done([2, 2], 6)
    assert segments_done([2, 2], 0) == 0 and segments_done([2, 2], 2) == 1 and segments_done([2, 2], 4) == 2
    run = resolve_run(cfg(workers=2, config="1-1", schedule="flush"))
    cut = cut_at(run, 3)  # the launcher adds the boundary a checkpoint of another layout needs
    assert [s.steps for s in cut.segments] == [3, 1]
    assert all(s.schedule is not None and s.schedule.steps == s.steps for s in cut.segments)
