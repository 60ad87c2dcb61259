"""The calibration file: measured communication costs, and the fit that produces them.

Cost model (Hockney's alpha-beta model; PipeDream's planner uses its bandwidth term):

    t(S) = latency + S / bandwidth           seconds for a message of S bytes

fitted (:func:`fit_link`) separately for a point-to-point message between two ranks (gloo
send/recv) and for an all-reduce (sum) of an S-byte buffer over ``allreduce_ranks`` ranks.
For a ring all-reduce over n ranks on links of bandwidth B each rank sends ``2 (n-1)/n * S``
bytes, so the fitted all-reduce bandwidth is the *algorithm* bandwidth ``B * n / (2 (n-1))`` and
:attr:`Calibration.allreduce_bus_bandwidth` converts it back to a per-link figure (B).

File format (JSON, ``format: "pipetrain-calibration"``, ``version: 1``); every figure is in
SI units (seconds, bytes, bits/s where the name says bits)::

    {"format": "pipetrain-calibration", "version": 1,
     "where": "emulated" | "loopback",       # what was measured
     "hosts": 2, "ranks": 2,                 # hosts, ranks (one per host when emulated)
     "bandwidth_limit_bits_per_second": 50000000 | null,   # tbf rate of the emulated links
     "p2p": {"latency_seconds": 9.1e-05, "bandwidth_bytes_per_second": 6.0e+06},
     "allreduce": {"latency_seconds": ..., "bandwidth_bytes_per_second": ...},
     "allreduce_ranks": 2,
     "samples": [{"kind": "p2p" | "allreduce", "bytes": 4096, "seconds": 1.2e-4, "reps": 5,
                  "median_seconds": 1.3e-4, "mean_seconds": 2.1e-4}, ...],
     "compute_slowdown": 1.31,               # optional (1.0): see below
     "measured_at": "2026-12-01T04:10:00Z", "seconds": 3.2}

``samples[].seconds`` is the fastest of ``reps`` timings of one message (half a ping-pong
round trip for p2p; one all-reduce for allreduce), ``median_seconds`` their median and
``mean_seconds`` their mean. The fits use the mean (:func:`fit_samples`): a run's time per
minibatch adds up its transfers, so it is their mean that it pays, and on a machine whose
cores the ranks share the times are heavy-tailed with the CPU scheduler's delays (the 2-core
loopback here: an 8 MiB all-reduce's median 1.7-2.6x its fastest; a 256 KiB all-reduce
between computing ranks 0.5-0.7 ms by the median, 1.1-1.8 ms by the mean, one in ten over
3 ms). Samples without a mean use the median, and without either the fastest.

``compute_slowdown`` is how much longer a worker's computation takes while every rank of a
host computes at once than alone (the probe's training step, :mod:`pipetrain.cluster.gloo_probe`):
ranks share a host's cores, caches and memory bandwidth, so a stage computes slower inside a
run than profiled alone. The planner and the simulator's calibrated costs multiply every
compute time by it. Files without it read as 1.0.
"""
from __future__ import annotations

import bisect
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import CalibrationError

__all__ = ["CALIBRATION_FORMAT", "CALIBRATION_VERSION", "Curve", "LinkFit", "Sample", "Calibration", "curve_seconds",
           "fit_link", "fit_samples", "measured_curve", "FIT_STATISTIC", "ALLREDUCE_TIMED", "load_calibration"]

CALIBRATION_FORMAT = "pipetrain-calibration"
CALIBRATION_VERSION = 1


@dataclass(frozen=True)
class LinkFit:
    """``t(S) = latency_seconds + S / bandwidth_bytes_per_second``."""

    latency_seconds: float
    bandwidth_bytes_per_second: float

    def seconds(self, nbytes: float) -> float:
        """Predicted seconds for ``nbytes`` bytes."""
        return self.latency_seconds + nbytes / self.bandwidth_bytes_per_second

    @property
    def bandwidth_bits_per_second(self) -> float:
        return 8.0 * self.bandwidth_bytes_per_second


@dataclass(frozen=True)
class Sample:
    """One measured size: the fastest (``seconds``), the median and the mean of ``reps``
    messages of ``bytes`` bytes; ``kind`` is ``p2p`` or ``allreduce``."""

    kind: str
    bytes: int
    seconds: float
    reps: int
    median_seconds: float | None = None
    mean_seconds: float | None = None


def fit_link(sizes: Sequence[float], seconds: Sequence[float]) -> LinkFit:
    """Fit ``t = latency + S / bandwidth`` to measured (size, seconds) points.

    ``latency`` is the shortest time measured (a message of a few bytes: no transfer time to
    speak of; the shortest, not the smallest size's, so one size slowed by a busy CPU does not
    set it); ``1 / bandwidth`` is the least-squares slope of ``t - latency`` against ``S`` (absolute
    errors, so the largest messages, whose time is nearly all transfer, decide it).

    Why not a free two-parameter fit: a tbf link lets a bucket's worth of bytes (its burst)
    through at line speed, so the large messages lie on a line with a *negative* intercept
    (about -burst/rate: -6 ms at 50 Mbit/s with a 36 KB bucket) that says nothing about
    latency, and a relative-error fit then trades the slope against the small messages.
    """
    pts = sorted((float(s), float(t)) for s, t in zip(sizes, seconds) if t > 0 and math.isfinite(t))
    distinct = len({s for s, _ in pts})
    if distinct < 2:
        raise CalibrationError(f"fitting latency + bytes/bandwidth needs times at 2 or more message sizes, got "
                               f"{distinct}; measure more sizes")
    latency = min(t for _, t in pts)
    sxx = sum(s * s for s, _ in pts)
    sxy = sum(s * (t - latency) for s, t in pts)
    if not sxy > 0:
        raise CalibrationError(f"measured times do not grow with message size (largest: {pts[-1][0]:.0f} bytes in "
                               f"{pts[-1][1]:.3g} s, shortest time: {latency:.3g} s); measure larger messages")
    return LinkFit(latency_seconds=latency, bandwidth_bytes_per_second=sxx / sxy)


#: Which of a size's repetitions the fits use (a measurement cache keys calibrations by it, so
#: one fitted otherwise is measured again).
FIT_STATISTIC = "mean"
#: How the probe times an all-reduce (:mod:`pipetrain.cluster.gloo_probe`): part of the
#: measurement cache's key, so a calibration timed otherwise is measured again.
ALLREDUCE_TIMED = "after a compute burst on every rank, from rank 0's arrival"


def _typical(s: Sample) -> float:
    """A size's mean (its median where a sample has no mean, else its fastest)."""
    for t in (s.mean_seconds, s.median_seconds):
        if t is not None:
            return t
    return s.seconds


def _optional_seconds(sample: Mapping[str, Any], key: str) -> float | None:
    return None if sample.get(key) is None else float(sample[key])


def fit_samples(samples: Sequence[Sample], kind: str) -> LinkFit:
    """:func:`fit_link` of the ``kind`` samples' typical times: each size's mean (module
    docstring), what a run's transfers cost it on average."""
    mine = [s for s in samples if s.kind == kind]
    return fit_link([s.bytes for s in mine], [_typical(s) for s in mine])


#: (bytes, seconds) points of a measured cost curve, ascending in bytes and in seconds.
Curve = tuple[tuple[float, float], ...]


def measured_curve(samples: Sequence[Sample], kind: str) -> Curve:
    """The ``kind`` samples' typical times (:func:`fit_samples`') by size, made non-decreasing
    in size: where a larger size's time is below a smaller one's, the sizes between take their
    pooled mean (pool-adjacent-violators), so a message never costs less for growing. Empty
    without samples.

    What it is for: the two-parameter fit cannot follow a machine whose small collectives wait
    on the CPU scheduler. On the 2-core loopback an all-reduce's median was 0.33 ms at 4 bytes,
    0.7-0.8 ms at 4-16 KiB and 2.8-3.3 ms from 64 KiB to 1 MiB in one calibration, where the
    fit through them said 0.6 ms at 256 KiB; a BERT's tied embedding (256 KiB) is exchanged
    at every STEP of both its stages, on the pipeline's critical path, and took 2.5 ms there
    (the median after both ranks arrived, traced in a zero-bubble run).
    """
    pts = sorted((float(s.bytes), _typical(s)) for s in samples if s.kind == kind)
    blocks: list[tuple[float, int]] = []  # (mean seconds, points pooled)
    for _, t in pts:
        mean, n = t, 1
        while blocks and blocks[-1][0] > mean:
            m0, n0 = blocks.pop()
            mean, n = (m0 * n0 + mean * n) / (n0 + n), n0 + n
        blocks.append((mean, n))
    times = [mean for mean, n in blocks for _ in range(n)]
    return tuple((s, t) for (s, _), t in zip(pts, times))


def curve_seconds(curve: Curve, nbytes: float, seconds_per_byte: float) -> float:
    """Seconds of an ``nbytes`` message on ``curve``: linear between measured sizes, the
    smallest size's time below them, the largest's plus ``seconds_per_byte`` for every byte
    beyond them (the fitted bandwidth)."""
    if nbytes <= curve[0][0]:
        return curve[0][1]
    i = bisect.bisect_left([s for s, _ in curve], nbytes)
    if i == len(curve):
        s, t = curve[-1]
        return t + (nbytes - s) * seconds_per_byte
    (s0, t0), (s1, t1) = curve[i - 1], curve[i]
    return t0 + (t1 - t0) * (nbytes - s0) / (s1 - s0)


@dataclass(frozen=True)
class Calibration:
    """Measured communication costs of the current hosts (see the module docstring for units)."""

    p2p: LinkFit
    allreduce: LinkFit
    allreduce_ranks: int
    hosts: int
    ranks: int
    where: str
    bandwidth_limit_bits_per_second: int | None = None
    samples: tuple[Sample, ...] = field(default_factory=tuple)
    measured_at: str = ""
    seconds: float = 0.0
    compute_slowdown: float = 1.0

    @property
    def allreduce_curve(self) -> Curve:
        """The all-reduces' measured times over ``allreduce_ranks`` ranks by size
        (:func:`measured_curve`); empty for a file without samples."""
        return measured_curve(self.samples, "allreduce")

    @property
    def allreduce_bus_bandwidth(self) -> float:
        """Per-link bandwidth (bytes/s) implied by the all-reduce fit for a ring:
        algorithm bandwidth * 2 (n-1) / n."""
        n = self.allreduce_ranks
        return self.allreduce.bandwidth_bytes_per_second * (2 * (n - 1) / n if n > 1 else 1.0)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["samples"] = [asdict(s) for s in self.samples]
        return {"format": CALIBRATION_FORMAT, "version": CALIBRATION_VERSION, **d}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "calibration") -> Calibration:
        if not isinstance(d, dict) or d.get("format") != CALIBRATION_FORMAT:
            raise CalibrationError(f"{source} is not a pipetrain calibration (format must be "
                                   f"{CALIBRATION_FORMAT!r}); write one with `pipetrain calibrate --output FILE`")
        if d.get("version") != CALIBRATION_VERSION:
            raise CalibrationError(f"{source} has calibration version {d.get('version')!r}, this pipetrain reads "
                                   f"version {CALIBRATION_VERSION}; measure again with `pipetrain calibrate`")
        try:
            fits = {k: LinkFit(float(d[k]["latency_seconds"]), float(d[k]["bandwidth_bytes_per_second"]))
                    for k in ("p2p", "allreduce")}
            for k, f in fits.items():
                if not (f.latency_seconds >= 0 and f.bandwidth_bytes_per_second > 0
                        and math.isfinite(f.latency_seconds) and math.isfinite(f.bandwidth_bytes_per_second)):
                    raise CalibrationError(f"{source}: {k} needs latency_seconds >= 0 and bandwidth_bytes_per_second "
                                           f"> 0, got {f.latency_seconds} and {f.bandwidth_bytes_per_second}")
            samples = tuple(Sample(str(s["kind"]), int(s["bytes"]), float(s["seconds"]), int(s["reps"]),
                                   _optional_seconds(s, "median_seconds"), _optional_seconds(s, "mean_seconds"))
                            for s in d.get("samples", []))
            limit = d.get("bandwidth_limit_bits_per_second")
            slowdown = float(d.get("compute_slowdown", 1.0))
            if not (math.isfinite(slowdown) and slowdown > 0):
                raise CalibrationError(f"{source}: compute_slowdown must be a number > 0, got {slowdown}")
            return cls(p2p=fits["p2p"], allreduce=fits["allreduce"], allreduce_ranks=int(d["allreduce_ranks"]),
                       hosts=int(d["hosts"]), ranks=int(d["ranks"]), where=str(d["where"]),
                       bandwidth_limit_bits_per_second=None if limit is None else int(limit), samples=samples,
                       measured_at=str(d.get("measured_at", "")), seconds=float(d.get("seconds", 0.0)),
                       compute_slowdown=slowdown)
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, CalibrationError):
                raise
            raise CalibrationError(f"{source} is malformed ({type(e).__name__}: {e}); measure again with "
                                   "`pipetrain calibrate --output FILE`") from None


def load_calibration(path: str | Path) -> Calibration:
    """Read a calibration file written by :meth:`Calibration.save` (``pipetrain calibrate --output``)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise CalibrationError(f"calibration file '{p}' does not exist; write one with `pipetrain calibrate "
                               "--output FILE`") from None
    except (OSError, json.JSONDecodeError) as e:
        raise CalibrationError(f"calibration file '{p}' is not readable JSON ({e})") from None
    return Calibration.from_dict(data, source=f"calibration file '{p}'")
