"""Progress of a run on the console: :class:`Progress`.

The driving process shows one tqdm bar over the run's total steps, with the last training
loss, the accuracy (or perplexity) of the last evaluation, samples per second and the ETA:

    train:  42%|████▏     | 126/300 [00:10<00:14, 12.1step/s, loss=0.3121, acc=0.9120, samples/s=387]

Where the stream is not a terminal, or the run is quiet (``--json``), there is no bar:
every ``log_every`` steps (and at the last) one line goes to the ``pipetrain.progress``
logger at INFO level instead,

    step 126/300 (epoch 1.26): loss 0.312100, accuracy 0.9120 (last eval), 387.2 samples/s, ETA 0:14

and every evaluation logs one line too (in bar mode it is printed above the bar). The CLI
routes the ``pipetrain`` loggers (:func:`pipetrain.runtime.process.log.setup_logging`: stderr under
``--json``).

When the caller reports how much of the time went to waiting for data (:meth:`Progress.update`'s
``data_wait``, a share of the time per step) and it is at least :data:`DATA_WAIT_SHOWN`, the
line and the bar show it too: ``..., 387.2 samples/s, data wait 12%, ETA 0:14``
(``data wait=12%`` in the bar).
"""
from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, TextIO

from .records import EvalResult

log = logging.getLogger("pipetrain.progress")

DATA_WAIT_SHOWN = 0.05  # the smallest share of a step spent waiting for data that is shown


class Progress:
    """Progress bar (or periodic log lines) over ``total_steps`` optimizer steps.

    Args:
        total_steps: steps the run will take at most (``epochs * steps_per_epoch``); a run
            that stops early at its target just calls :meth:`close`.
        start_step: steps already done (a resumed run).
        steps_per_epoch: to show the epoch in log lines (optional).
        batch_size: samples per step, to compute samples/s where :meth:`update` is not given it.
        bar: True/False to force the bar on/off; None (default) shows it when ``stream`` is a
            terminal and ``quiet`` is False.
        quiet: no bar (``--json``, or a worker that is not the driving process).
        log_every: without the bar, log a line every this many steps (0: never, except the
            evaluations).
        stream: where the bar goes (stderr by default).
        clock: the time source (tests pass a fake).
    """

    def __init__(self, total_steps: int, *, start_step: int = 0, steps_per_epoch: int | None = None,
                 batch_size: int | None = None, bar: bool | None = None, quiet: bool = False, log_every: int = 10,
                 stream: TextIO | None = None, desc: str = "train",
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.total_steps = int(total_steps)
        self.start_step = self.step = int(start_step)
        self.steps_per_epoch = steps_per_epoch
        self.batch_size = batch_size
        self.log_every = int(log_every)
        self.stream: TextIO = stream if stream is not None else sys.stderr
        self._clock = clock
        self._t0 = clock()
        self.loss: float | None = None
        self.samples_per_second: float | None = None
        self.data_wait: float | None = None          # share of the time per step spent waiting for data
        self.last_eval: EvalResult | None = None
        if bar is None:
            bar = not quiet and _isatty(self.stream)
        self._bar: Any = None
        if bar and not quiet:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total_steps, initial=self.start_step, desc=desc, unit="step",
                             file=self.stream, dynamic_ncols=True, mininterval=0.25, leave=True)

    @property
    def bar(self) -> bool:
        """Whether the tqdm bar is shown (else log lines)."""
        return self._bar is not None

    def update(self, step: int, loss: float | None = None, samples_per_second: float | None = None,
               data_wait: float | None = None) -> None:
        """Steps completed so far (absolute, counting ``start_step``), with the loss of the last
        one, the recent throughput (None: the average since the start, from ``batch_size``) and
        the share of the time spent waiting for data (None: unchanged)."""
        prev, self.step = self.step, step
        if loss is not None:
            self.loss = loss
        if data_wait is not None:
            self.data_wait = data_wait
        if samples_per_second is None and self.batch_size:
            elapsed = self._clock() - self._t0
            samples_per_second = (step - self.start_step) * self.batch_size / elapsed if elapsed > 0 else None
        if samples_per_second is not None:
            self.samples_per_second = samples_per_second
        if self._bar is not None:
            self._bar.set_postfix(self._postfix(), refresh=False)
            self._bar.update(step - prev)
        elif self.log_every and (step // self.log_every > prev // self.log_every or step == self.total_steps):
            log.info(self.line())

    def eval(self, result: EvalResult) -> None:
        """Record an evaluation: shown in the bar's postfix and as a line of its own."""
        self.last_eval = result
        line = eval_line(result)
        if self._bar is not None:
            self._bar.set_postfix(self._postfix(), refresh=False)
            self._bar.write(line, file=self.stream)
        else:
            log.info(line)

    def write(self, line: str) -> None:
        """Print a line without breaking the bar (through the logger without one)."""
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            log.info(line)

    def line(self) -> str:
        """The log line of the current state (see the module docstring)."""
        parts = [f"step {self.step}/{self.total_steps}"]
        if self.steps_per_epoch:
            parts[0] += f" (epoch {self.step / self.steps_per_epoch:.2f})"
        figures = []
        if self.loss is not None:
            figures.append(f"loss {self.loss:.6f}")
        if self.last_eval is not None:
            figures.append(_eval_figure(self.last_eval) + " (last eval)")
        if self.samples_per_second is not None:
            figures.append(f"{self.samples_per_second:.1f} samples/s")
        wait = self._data_wait_figure()
        if wait is not None:
            figures.append(f"data wait {wait}")
        eta = self.eta()
        if eta is not None:
            figures.append(f"ETA {format_seconds(eta)}")
        return parts[0] + (": " + ", ".join(figures) if figures else "")

    def eta(self) -> float | None:
        """Seconds left at the average pace since the start (None before the first step)."""
        done = self.step - self.start_step
        if done <= 0:
            return None
        return max(0, self.total_steps - self.step) * (self._clock() - self._t0) / done

    def _postfix(self) -> dict[str, str]:
        post: dict[str, str] = {}
        if self.loss is not None:
            post["loss"] = f"{self.loss:.4f}"
        if self.last_eval is not None:
            r = self.last_eval
            if r.perplexity is not None:
                post["ppl"] = f"{r.perplexity:.3f}"
            elif r.accuracy is not None:
                post["acc"] = f"{r.accuracy:.4f}"
            else:
                post["eval_loss"] = f"{r.loss:.4f}"
        if self.samples_per_second is not None:
            post["samples/s"] = f"{self.samples_per_second:.0f}"
        wait = self._data_wait_figure()
        if wait is not None:
            post["data wait"] = wait
        return post

    def _data_wait_figure(self) -> str | None:
        """``"12%"`` when the data wait is worth showing (at least :data:`DATA_WAIT_SHOWN`)."""
        if self.data_wait is None or self.data_wait < DATA_WAIT_SHOWN:
            return None
        return f"{100 * self.data_wait:.0f}%"

    def close(self) -> None:
        """Close the bar (idempotent)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def eval_line(r: EvalResult) -> str:
    """``eval at epoch 1 (step 100): accuracy 0.9120, loss 0.310000``."""
    epoch = str(int(round(r.epoch))) if abs(r.epoch - round(r.epoch)) < 1e-9 else f"{r.epoch:.2f}"
    parts = []
    if r.accuracy is not None:
        parts.append(f"accuracy {r.accuracy:.4f}")
    parts.append(f"loss {r.loss:.6f}")
    if r.perplexity is not None:
        parts.append(f"perplexity {r.perplexity:.4f}")
    return f"eval at epoch {epoch} (step {r.step}): " + ", ".join(parts)


def format_seconds(s: float) -> str:
    """``75.0`` -> ``"1:15"``, ``3725`` -> ``"1:02:05"``."""
    s = int(round(s))
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def _eval_figure(r: EvalResult) -> str:
    if r.perplexity is not None:
        return f"perplexity {r.perplexity:.4f}"
    if r.accuracy is not None:
        return f"accuracy {r.accuracy:.4f}"
    return f"eval loss {r.loss:.6f}"


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
