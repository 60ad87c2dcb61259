"""Progress: a tqdm bar on terminals, periodic log lines otherwise."""
from __future__ import annotations

import io
import logging

import pytest

from pipetrain.metrics import EvalResult, Progress
from pipetrain.metrics.progress import format_seconds


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _eval(step: int, acc: float | None, ppl: float | None = None) -> EvalResult:
    return EvalResult(step=step, epoch=step / 10, samples=step * 4, loss=0.25, accuracy=acc, perplexity=ppl,
                      wall_time=1.0)


def test_without_a_terminal_log_lines_every_n_steps(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    stream = io.StringIO()
    with (caplog.at_level(logging.INFO, logger="pipetrain"),
          Progress(25, steps_per_epoch=10, batch_size=4, log_every=10, stream=stream, clock=lambda: now[0]) as p):
        assert not p.bar
        for step in range(1, 26):
            now[0] = step * 0.5
            p.update(step, loss=1.0 / step)
            if step == 10:
                p.eval(_eval(10, 0.8125))
    assert stream.getvalue() == ""  # nothing but the logger
    lines = [r.getMessage() for r in caplog.records if r.name == "pipetrain.progress"]
    assert lines == [
        "step 10/25 (epoch 1.00): loss 0.100000, 8.0 samples/s, ETA 0:08",
        "eval at epoch 1 (step 10): accuracy 0.8125, loss 0.250000",
        "step 20/25 (epoch 2.00): loss 0.050000, accuracy 0.8125 (last eval), 8.0 samples/s, ETA 0:02",
        "step 25/25 (epoch 2.50): loss 0.040000, accuracy 0.8125 (last eval), 8.0 samples/s, ETA 0:00",
    ]


def test_jumps_over_a_multiple_still_log(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="pipetrain"):
        p = Progress(100, log_every=10, stream=io.StringIO())
        for step in (7, 14, 21, 28):
            p.update(step, loss=0.5, samples_per_second=3.0)
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["step 14/100", "step 21/100"]


def test_bar_on_a_terminal_shows_loss_accuracy_and_rate(caplog: pytest.LogCaptureFixture) -> None:
    stream = _Tty()
    with caplog.at_level(logging.INFO, logger="pipetrain"), Progress(10, batch_size=8, stream=stream) as p:
        assert p.bar
        p.update(5, loss=0.123456, samples_per_second=250.0)
        p.eval(_eval(5, 0.75))
        p.update(10, loss=0.1)
    out = stream.getvalue()
    assert "10/10" in out and "loss=0.1000" in out and "acc=0.7500" in out and "samples/s=" in out
    assert "eval at epoch 0.50 (step 5): accuracy 0.7500" in out  # printed above the bar
    assert not [r for r in caplog.records if r.name == "pipetrain.progress"]  # no log lines with the bar


def test_languages_show_perplexity() -> None:
    stream = _Tty()
    with Progress(4, stream=stream) as p:
        p.eval(_eval(2, 0.3, ppl=4.5))
        p.update(4, loss=1.5)
    assert "ppl=4.500" in stream.getvalue()


def test_quiet_or_forced_off_means_no_bar_even_on_a_terminal() -> None:
    assert not Progress(5, quiet=True, stream=_Tty()).bar
    assert not Progress(5, bar=False, stream=_Tty()).bar
    p = Progress(5, bar=True, quiet=True, stream=_Tty())
    assert not p.bar


def test_eta_and_resumed_runs() -> None:
    now = [0.0]
    p = Progress(100, start_step=40, stream=io.StringIO(), log_every=0, clock=lambda: now[0])
    assert p.eta() is None
    now[0] = 20.0
    p.update(50)
    assert p.eta() == pytest.approx(100.0)  # 10 steps in 20 s, 50 left
    assert format_seconds(75) == "1:15" and format_seconds(3725) == "1:02:05"
