"""What a worker reports while it trains: progress, logs, evaluations, the target.

:class:`TrainMonitor` is built by every rank; only the *driving* rank (the first rank of the
last stage: it sees the losses) shows the progress bar (:class:`pipetrain.metrics.Progress`:
a tqdm bar on a terminal, log lines otherwise) and writes ``--log-dir``
(:class:`pipetrain.metrics.MetricsLogger`: ``metrics.jsonl`` and TensorBoard events, with
``config.json``, ``plan.json`` and ``schedule.txt`` written before the first step). Every
rank keeps the same :class:`pipetrain.metrics.TargetTracker` (every rank receives every
evaluation), so all ranks decide to stop at the same boundary.

Time: :attr:`TrainMonitor.clock` runs only while a timed segment runs (barrier to barrier),
so every figure of time (samples/s, ETA, ``wall_time`` of an evaluation, time to accuracy)
excludes evaluation, checkpoints, data prefetching and the warm-up.

Data wait: the progress line's ``data wait 12%`` is the driving rank's own wait for its units
(its :class:`~pipetrain.data.UnitLoader` adds every second it blocks, in ``unit`` or in a
segment's ``prefetch``, to the process's :data:`~pipetrain.data.DATA_WAIT`), as a share of
that rank's training time plus the waits outside it: ``wait / (timed seconds + waits while
the clock stood)``, i.e. of the time per step including its loading. :class:`DataWaitClock`
tells the waits inside the timed spans from those outside. No rank sends anything for it: the
last stage reads the targets, and for user datasets (items read whole) its wait is the first
stage's too.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ...data import DATA_WAIT, WaitMeter
from ...metrics import MetricsLogger, Progress, TargetTracker, TrainClock, TrainPoint, write_run_files
from ...schedule.action import Schedule

__all__ = ["DataWaitClock", "TrainMonitor", "run_files"]


def run_files(run: Any) -> tuple[dict[str, Any], dict[str, Any] | None, str]:
    """``config.json``, ``plan.json`` and ``schedule.txt`` contents of a resolved run."""
    info = run.to_json()
    config = {"config": info["config"], "world_size": run.world_size, "batch_size": run.batch_size,
              "microbatches": run.microbatches, "plan_note": run.plan_note, "segments": info["segments"],
              "data": info.get("data")}
    text = f"# {run.config.parallel.schedule}: {len(run.segments)} segment(s), steps " + \
        ", ".join(str(s.steps) for s in run.segments) + "\n"
    scheds = [s.schedule for s in run.segments if s.schedule is not None]
    if scheds:
        first = scheds[0]
        text += f"# the first segment's actions ({first.steps} steps), one row per rank\n" + first.grid() + "\n"
    return config, info.get("plan"), text


class DataWaitClock(TrainClock):
    """The training clock (not running until :meth:`start`) that also splits the data waits of
    ``meter`` counted since it was built into those while it runs and those while it stands
    (a segment's prefetch before its barrier, a warm-up): :meth:`data_wait_share`."""

    def __init__(self, meter: WaitMeter, now: Callable[[], float] = time.perf_counter) -> None:
        super().__init__(now, start=False)
        self.meter = meter
        self._base = meter.seconds          # waits before this clock: not its run's
        self._stood_at: float | None = meter.seconds   # the meter when the clock last stopped (None: running)
        self._outside = 0.0                 # waits while the clock stood, up to _stood_at

    def _run(self) -> None:
        if self._stood_at is not None:
            self._outside += self.meter.seconds - self._stood_at
            self._stood_at = None

    def start(self) -> None:
        self._run()
        super().start()

    def resume(self) -> None:
        self._run()
        super().resume()

    def pause(self) -> None:
        if self._stood_at is None:
            self._stood_at = self.meter.seconds
        super().pause()

    def waits_outside(self) -> float:
        """Seconds of data wait while the clock stood."""
        return self._outside + (0.0 if self._stood_at is None else self.meter.seconds - self._stood_at)

    def data_wait_share(self) -> float | None:
        """``waits / (elapsed + waits outside)``: the share of the time per step, loading included,
        spent waiting for data (``None`` before any time counted)."""
        total = self.elapsed() + self.waits_outside()
        return (self.meter.seconds - self._base) / total if total > 0 else None


class TrainMonitor:
    """Progress, logs and the target of one rank (module docstring).

    Args:
        run: the resolved run.
        rank: this rank (``None``: the one process of a one-process run, which drives).
        schedule: the run's schedule (``None`` for one process).
        start_step: steps done before this run (resumed runs).
        meter: the data waits to show (default: the process's, :data:`~pipetrain.data.DATA_WAIT`).
    """

    def __init__(self, run: Any, rank: int | None, schedule: Schedule | None, start_step: int = 0,
                 meter: WaitMeter = DATA_WAIT) -> None:
        cfg = run.config
        self.run = run
        self.driving = rank is None or (schedule is not None and rank == schedule.stage_ranks[-1][0])
        self.clock = DataWaitClock(meter)
        ev = cfg.evaluation
        self.tracker = TargetTracker(ev.target_accuracy, ev.target_loss)
        self.batch_size = run.batch_size
        self.steps_per_epoch = run.data.steps_per_epoch if run.data is not None else None
        self.log_every = cfg.output.log_every
        self.start_step = start_step
        self.total = start_step + run.total_steps
        self.progress: Progress | None = None
        self.logger: MetricsLogger | None = None
        self._last: tuple[int, float] | None = None     # (step, clock) of the previous log point
        if not self.driving:
            return
        if cfg.output.log_dir is not None:
            config, plan, text = run_files(run)
            write_run_files(cfg.output.log_dir, config, plan, text)
            self.logger = MetricsLogger(cfg.output.log_dir, append=start_step > 0)
        if not cfg.output.quiet and (run.data is not None or self.logger is not None):
            self.progress = Progress(self.total, start_step=start_step, steps_per_epoch=self.steps_per_epoch,
                                     batch_size=run.batch_size, bar=False if cfg.output.json else None,
                                     log_every=self.log_every, clock=self.clock.elapsed)

    @property
    def wants_steps(self) -> bool:
        """Whether the executor should report every step (:meth:`on_step`)."""
        return self.progress is not None or self.logger is not None

    def epoch(self, step: int) -> float | None:
        return step / self.steps_per_epoch if self.steps_per_epoch else None

    def on_step(self, step: int, loss: float) -> None:
        """The last stage finished minibatch ``step`` (1-based, absolute) with mean ``loss``."""
        if self.progress is not None:
            self.progress.update(step, loss=loss, data_wait=self.clock.data_wait_share())
        if self.logger is not None and self.log_every and step % self.log_every == 0:
            now = self.clock.elapsed()
            sps = None
            if self._last is not None and now > self._last[1]:
                sps = (step - self._last[0]) * self.batch_size / (now - self._last[1])
            self._last = (step, now)
            self.logger.log_train(TrainPoint(step, self.epoch(step) or 0.0, step * self.batch_size, loss, sps, now))

    def on_eval(self, result: Any) -> bool:
        """Record an evaluation (every rank); returns whether the run stops here (target reached)."""
        reached = self.tracker.update(result)
        if self.progress is not None:
            self.progress.eval(result)
        if self.logger is not None:
            t = result.wall_time or self.clock.elapsed()  # the clock at the evaluated step (pipeline_eval.py)
            done = result.step - self.start_step
            self.logger.log_eval(result, samples_per_second=done * self.batch_size / t if t > 0 else None)
        return reached and self.tracker.has_target

    def summary(self, steps_done: int) -> dict[str, Any]:
        """The figures of ``train --json``: the tracker's, the epochs trained and the history."""
        out = self.tracker.to_dict() if self.tracker.history else {}
        if self.tracker.history:
            epochs = self.epoch(steps_done)
            out["target_summary"] = self.tracker.summary(epochs, self.run.config.training.max_epochs)
            out["epochs"] = epochs
            out["eval_history"] = [r.to_dict() for r in self.tracker.history]
        return out

    def close(self, steps_done: int) -> None:
        """Close the bar; log the end of the run (the target line) and close the logs."""
        if self.progress is not None:
            self.progress.close()
            self.progress = None
        if self.driving and self.tracker.history:
            line = self.tracker.summary(self.epoch(steps_done), self.run.config.training.max_epochs)
            from ..process.log import progress as plog

            if not self.run.config.output.quiet:
                plog.info(line)
            if self.logger is not None:
                self.logger.log_event("target", **{k: v for k, v in self.tracker.to_dict().items()
                                                   if k != "target_summary"}, summary=line)
        if self.logger is not None:
            self.logger.close()
            self.logger = None
