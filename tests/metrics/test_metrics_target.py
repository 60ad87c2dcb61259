"""TargetTracker: first crossing, never-reached summary, target validation; TrainClock."""
from __future__ import annotations

import math

import pytest

from pipetrain.errors import RuntimeConfigError
from pipetrain.metrics import EvalResult, TargetTracker, TrainClock, validate_target_accuracy, validate_target_loss


def _r(step: int, epoch: float, acc: float | None, loss: float = 1.0, t: float | None = None,
       ppl: float | None = None) -> EvalResult:
    return EvalResult(step=step, epoch=epoch, samples=step * 32, loss=loss, accuracy=acc, perplexity=ppl,
                      wall_time=float(step) / 10 if t is None else t,
                      task="regression" if acc is None else "classification")


def test_first_crossing_counts_and_later_evaluations_do_not_move_it() -> None:
    tr = TargetTracker(target_accuracy=0.9)
    seq = [_r(100, 1, 0.5), _r(200, 2, 0.8), _r(300, 3, 0.92, t=41.5), _r(400, 4, 0.89), _r(500, 5, 0.97)]
    reached = [tr.update(r) for r in seq]
    assert reached == [False, False, True, True, True]
    assert tr.reached and tr.reached_at is seq[2]
    assert (tr.time_to_target, tr.epochs_to_target, tr.steps_to_target) == (41.5, 3, 300)
    assert tr.best is seq[4] and tr.last is seq[4]
    assert tr.summary() == "target accuracy 0.9 reached at epoch 3 (step 300, 41.5 s): accuracy 0.92, loss 1"


def test_exactly_the_target_counts_as_reached_and_fractional_epochs() -> None:
    tr = TargetTracker(target_accuracy=0.75)
    tr.update(_r(30, 0.25, 0.5))
    tr.update(_r(60, 0.5, 0.75))
    assert tr.epochs_to_target == 0.5 and tr.steps_to_target == 60
    assert "reached at epoch 0.50 (step 60" in tr.summary()


def test_never_reached_summary_names_the_best() -> None:
    tr = TargetTracker(target_accuracy=0.95)
    for e, a in enumerate([0.6, 0.8, 0.88, 0.91, 0.9], start=1):
        assert not tr.update(_r(e * 100, e, a))
    assert not tr.reached
    assert tr.time_to_target is None and tr.epochs_to_target is None and tr.steps_to_target is None
    assert tr.summary() == "target accuracy 0.95 not reached in 5 epochs (best 0.91 at epoch 4)"
    d = tr.to_dict()
    assert d["reached"] is False and d["time_to_accuracy"] is None and d["eval_accuracy"] == 0.9
    assert d["target_summary"] == tr.summary()


def test_loss_target_and_both_targets() -> None:
    tr = TargetTracker(target_loss=0.5)
    tr.update(_r(1, 1, None, loss=0.7))
    tr.update(_r(2, 2, None, loss=0.5))
    assert tr.steps_to_target == 2
    both = TargetTracker(target_accuracy=0.9, target_loss=0.3)
    both.update(_r(1, 1, 0.95, loss=0.4))  # accuracy met, loss not
    both.update(_r(2, 2, 0.85, loss=0.2))  # loss met, accuracy not
    assert not both.reached
    both.update(_r(3, 3, 0.91, loss=0.29))
    assert both.steps_to_target == 3
    assert both.describe_target() == "target accuracy 0.9 and loss 0.3"
    never = TargetTracker(target_loss=0.1)
    for e, loss in enumerate([2.0, 1.2, 1.5], start=1):
        never.update(_r(e, e, None, loss=loss))
    assert never.summary() == "target loss 0.1 not reached in 3 epochs (best loss 1.2 at epoch 2)"


def test_nan_loss_never_meets_a_loss_target() -> None:
    tr = TargetTracker(target_loss=10.0)
    tr.update(_r(1, 1, None, loss=math.nan))
    assert not tr.reached
    assert tr.to_dict()["eval_loss"] is None


def test_no_target_keeps_history_only() -> None:
    tr = TargetTracker()
    assert not tr.update(_r(1, 1, 0.99))
    assert not tr.reached and tr.describe_target() == "no target"
    assert tr.summary().startswith("no target set; accuracy 0.99")
    assert TargetTracker(0.9).summary() == "target accuracy 0.9: no evaluation ran"


@pytest.mark.parametrize("value,hint", [(90, "pass 0.9 for 90%"), (95.5, "pass 0.955 for 95.5%"),
                                        (250, "pass e.g. 0.9 for 90%"), (0, "pass e.g. 0.9"),
                                        (-0.5, "pass e.g. 0.9"), (math.nan, "pass e.g. 0.9")])
def test_bad_accuracy_targets(value: float, hint: str) -> None:
    with pytest.raises(RuntimeConfigError, match=r"--target-accuracy is a fraction in \(0, 1\], got .*; " + hint):
        TargetTracker(target_accuracy=value)


def test_good_targets_pass_through() -> None:
    assert validate_target_accuracy(1.0) == 1.0 and validate_target_accuracy(0.9) == 0.9
    assert validate_target_accuracy(None) is None and validate_target_loss(None) is None
    assert validate_target_loss(-1.5) == -1.5
    with pytest.raises(RuntimeConfigError, match="--target-loss must be a finite number, got inf"):
        validate_target_loss(math.inf)


def test_accuracy_target_on_a_regression_task_is_refused() -> None:
    tr = TargetTracker(target_accuracy=0.9)
    with pytest.raises(RuntimeConfigError, match="needs a classification task.*use --target-loss instead"):
        tr.update(_r(1, 1, None))
    assert tr.history == []


def test_train_clock_excludes_paused_spans() -> None:
    now = [100.0]
    clock = TrainClock(now=lambda: now[0])
    now[0] = 103.0
    with clock.paused():
        now[0] = 110.0  # evaluation: not counted
        assert clock.elapsed() == 3.0
    now[0] = 112.0
    assert clock.elapsed() == 5.0
    clock.pause()
    clock.pause()  # idempotent
    now[0] = 120.0
    clock.resume()
    now[0] = 121.0
    assert clock.elapsed() == 6.0
    assert TrainClock(start=False).elapsed() == 0.0


def test_language_best_is_the_lowest_loss_with_perplexity() -> None:
    tr = TargetTracker(target_loss=1.1)
    for e, loss in enumerate([2.0, 1.24, 1.3], start=1):
        tr.update(EvalResult(step=e, epoch=float(e), samples=e, loss=loss, accuracy=0.4 + e / 100,
                             perplexity=math.exp(loss), wall_time=float(e), task="language"))
    assert not tr.ranks_by_accuracy and tr.best is tr.history[1]
    assert tr.summary() == "target loss 1.1 not reached in 3 epochs (best loss 1.24 (perplexity 3.456) at epoch 2)"
    assert tr.summary(epochs=3.5) == ("target loss 1.1 not reached in 3.50 epochs "
                                      "(best loss 1.24 (perplexity 3.456) at epoch 2)")
