"""The progress line's ``data wait``: the driving rank's own wait for its units, as a share of
its time per step including the waits outside the timed window (a segment's prefetch)."""
from __future__ import annotations

import io
import logging

import pytest

from pipetrain.data import WaitMeter
from pipetrain.job import TrainConfig
from pipetrain.metrics import Progress
from pipetrain.run import resolve_run
from pipetrain.runtime.worker.monitor import DataWaitClock, TrainMonitor


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_clock_splits_waits_inside_and_outside_its_spans() -> None:
    now = [0.0]
    meter = WaitMeter()
    meter.add(5.0)                               # before the clock: another run's
    clock = DataWaitClock(meter, now=lambda: now[0])
    assert clock.data_wait_share() is None       # no time counted yet
    meter.add(2.0)                               # the first segment's prefetch, before its barrier
    clock.start()
    now[0] = 8.0
    assert clock.waits_outside() == 2.0 and clock.data_wait_share() == 2.0 / (8.0 + 2.0)
    meter.add(1.0)                               # a unit not prefetched, inside the timed span
    now[0] = 10.0
    assert clock.data_wait_share() == 3.0 / (10.0 + 2.0)
    clock.pause()
    now[0] = 30.0                                # an evaluation: no time, no wait
    meter.add(4.0)                               # the next segment's prefetch
    assert clock.waits_outside() == 6.0 and clock.data_wait_share() == 7.0 / (10.0 + 6.0)
    with clock.paused():                         # already standing: the same figures after
        pass
    clock.resume()
    now[0] = 34.0
    assert clock.elapsed() == 14.0 and clock.data_wait_share() == 7.0 / (14.0 + 6.0)


def test_progress_shows_the_data_wait_from_a_few_percent() -> None:
    now = [0.0]
    p = Progress(100, batch_size=4, stream=io.StringIO(), log_every=0, clock=lambda: now[0])
    now[0] = 10.0
    p.update(10, loss=0.5, data_wait=0.04)
    assert p.line() == "step 10/100: loss 0.500000, 4.0 samples/s, ETA 1:30"           # under 5%: not shown
    p.update(20, loss=0.5, data_wait=0.123)
    assert p.line() == "step 20/100: loss 0.500000, 8.0 samples/s, data wait 12%, ETA 0:40"
    p.update(30)                                                                        # unchanged
    assert "data wait 12%" in p.line()
    stream = _Tty()
    with Progress(10, batch_size=8, stream=stream) as bar:
        bar.update(5, loss=0.25, samples_per_second=100.0, data_wait=0.5)
        bar.update(10, loss=0.25)
    assert "data wait=50%" in stream.getvalue()


def test_the_driving_rank_logs_its_data_wait(caplog: pytest.LogCaptureFixture) -> None:
    """One process of a user factory: a wait before the timed window shows in the line; a run
    that never waits shows none."""
    cfg = TrainConfig.of(model="mlp", model_options={"depth": 2, "width": 8}, data="test_data_loader:in_memory",
                         batch_size=8, workers=1, steps=4, json=True, log_every=1)
    run = resolve_run(cfg)
    lines = {}
    for waited in (1000.0, 0.0):
        meter = WaitMeter()
        monitor = TrainMonitor(run, None, None, meter=meter)
        meter.add(waited)                        # the driving rank's prefetch, before the clock runs
        monitor.clock.start()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="pipetrain.progress"):
            monitor.on_step(1, 0.5)
        monitor.close(1)
        lines[waited] = [r.getMessage() for r in caplog.records if r.name == "pipetrain.progress"]
    assert len(lines[1000.0]) == 1 and ", data wait 100%, ETA" in lines[1000.0][0]
    assert lines[0.0] and all("data wait" not in ln for ln in lines[0.0])
