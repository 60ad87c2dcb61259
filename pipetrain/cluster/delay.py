"""An optional per-message delay: ``latency + bytes / bandwidth`` (latency emulation without netem).

This kernel has ``tbf`` and ``htb`` but no ``netem``, so an emulated cluster limits bandwidth
in the kernel but cannot add propagation delay there. A sender that wants a link with latency
calls :meth:`MessageDelay.seconds` (or :meth:`MessageDelay.wait`) before posting each message:

    delay = MessageDelay.from_env()          # None unless PIPETRAIN_LINK_LATENCY is set
    if delay is not None:
        delay.wait(nbytes)                   # sleeps latency (+ bytes / bandwidth if set)

Two uses:

- latency only (``bandwidth_bytes_per_second=None``) on top of a tbf-limited link: the kernel
  already charges ``bytes / rate``; the sender adds the propagation delay;
- both, on an unlimited link (loopback): the whole alpha-beta cost in the sender.

Semantics and limits (not a network model): the delay is paid by the *sender's* thread before
the message is posted, so messages from one sender are serialised by it (a real link would
overlap the latency of consecutive messages); it is wall-clock sleep, so it shows up as idle
time, not CPU. The runtime's send path (``runtime/engine/comm.py``) does not call it yet.

Environment (read by :meth:`MessageDelay.from_env`): ``PIPETRAIN_LINK_LATENCY`` seconds,
``PIPETRAIN_LINK_BANDWIDTH`` bits per second (optional; same syntax as ``--bandwidth``).
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import ClusterError
from .names import parse_rate

__all__ = ["MessageDelay", "message_delay", "LATENCY_ENV", "BANDWIDTH_ENV"]

LATENCY_ENV = "PIPETRAIN_LINK_LATENCY"
BANDWIDTH_ENV = "PIPETRAIN_LINK_BANDWIDTH"


def message_delay(nbytes: int, latency_seconds: float, bandwidth_bytes_per_second: float | None = None) -> float:
    """Seconds one message of ``nbytes`` bytes takes: ``latency + nbytes / bandwidth``
    (no bandwidth term if ``bandwidth_bytes_per_second`` is None)."""
    t = latency_seconds
    if bandwidth_bytes_per_second is not None:
        t += nbytes / bandwidth_bytes_per_second
    return t


@dataclass(frozen=True)
class MessageDelay:
    """``latency_seconds`` (>= 0) per message plus ``nbytes / bandwidth_bytes_per_second`` if set."""

    latency_seconds: float
    bandwidth_bytes_per_second: float | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.latency_seconds) and self.latency_seconds >= 0):
            raise ClusterError(f"link latency must be a finite number of seconds >= 0, got {self.latency_seconds}")
        b = self.bandwidth_bytes_per_second
        if b is not None and not (math.isfinite(b) and b > 0):
            raise ClusterError(f"link bandwidth must be > 0 bytes/s, got {b}")

    def seconds(self, nbytes: int) -> float:
        return message_delay(nbytes, self.latency_seconds, self.bandwidth_bytes_per_second)

    def wait(self, nbytes: int) -> float:
        """Sleep :meth:`seconds` of ``nbytes``; returns the seconds slept."""
        t = self.seconds(nbytes)
        if t > 0:
            time.sleep(t)
        return t

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> MessageDelay | None:
        """The delay configured by ``PIPETRAIN_LINK_LATENCY`` / ``PIPETRAIN_LINK_BANDWIDTH``, or
        None if neither is set."""
        env = os.environ if env is None else env
        lat, bw = env.get(LATENCY_ENV), env.get(BANDWIDTH_ENV)
        if lat is None and bw is None:
            return None
        try:
            latency = float(lat) if lat is not None else 0.0
        except ValueError:
            raise ClusterError(f"{LATENCY_ENV} must be seconds (e.g. 0.001), got {lat!r}") from None
        return cls(latency, None if bw is None else parse_rate(bw) / 8.0)

    def to_env(self) -> dict[str, str]:
        """The environment that makes :meth:`from_env` return this delay."""
        env = {LATENCY_ENV: repr(self.latency_seconds)}
        if self.bandwidth_bytes_per_second is not None:
            env[BANDWIDTH_ENV] = f"{round(self.bandwidth_bytes_per_second * 8)}bit"
        return env
