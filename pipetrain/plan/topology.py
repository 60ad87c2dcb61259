"""Building a :class:`~pipetrain.plan.types.Topology` from command-line style strings.

A topology is a list of levels, innermost first: ``workers="4,4", bandwidth="300e9,1.25e9"``
means 4 workers a server joined at 300 GB/s, and 4 servers joined at 1.25 GB/s (10 Gbit/s).

Bandwidths are bytes per second. A number may carry a unit suffix: ``10Gbit``, ``10Gb``,
``25gbps`` (bits per second, divided by 8), ``300GB``, ``1.25GB/s``, ``300GBps`` (bytes per
second); ``K``, ``M``, ``G``, ``T`` are powers of 1000 and ``Ki``, ``Mi``, ``Gi``, ``Ti``
powers of 1024. Memory sizes take the same byte suffixes (``16GB``, ``32GiB``).

Example::

    >>> parse_topology("4,4", "300e9,10Gbit").levels
    (Level(workers=4, bandwidth=300000000000.0), Level(workers=4, bandwidth=1250000000.0))
"""
from __future__ import annotations

import math
import re
from collections.abc import Sequence

from ..errors import PlanError
from .types import Level, Topology

_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}
_QTY = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*([kKmMgGtT]i?)?\s*([A-Za-z/]*)\s*$")


def parse_quantity(text: str | float | int, what: str = "bandwidth") -> float:
    """Parse ``1.25e9``, ``10Gbit`` (bits/s), ``300GB/s`` or ``16GiB`` into bytes (per second).

    Upper-case ``B`` and ``byte`` mean bytes; lower-case ``b``, ``bit`` and ``bps`` mean bits.
    Raises PlanError if the text is not a number with an optional unit.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    if not isinstance(text, str):
        raise PlanError(f"{what} must be a number or a string such as '10Gbit', got {type(text).__name__} {text!r}; "
                        "fix the value")
    m = _QTY.match(str(text))
    unit = m.group(3) if m else ""
    low = unit.lower().removesuffix("/s").removesuffix("ps")
    if not m or low not in ("", "b", "bit", "bits", "byte", "bytes"):
        raise PlanError(
            f"cannot read {what} {str(text)!r}; give bytes as a number (1.25e9) or with a unit "
            f"(10Gbit, 25Gbps for bits per second; 300GB, 300GB/s for bytes); fix the value"
        )
    value = float(m.group(1)) * _PREFIX[(m.group(2) or "").lower()]
    if low.startswith("bit") or unit[:1] == "b" and not low.startswith("byte"):
        value /= 8.0
    return value


def _split(values: str | int | float | Sequence[int | float | str], what: str) -> list[str | int | float]:
    if isinstance(values, str):
        return [v for v in (p.strip() for p in values.replace("x", ",").split(",")) if v]
    if isinstance(values, bool) or values is None:
        raise PlanError(f"{what} must be a number, a string like '4,4' or a list of numbers, got {values!r}; "
                        f"fix --{what}")
    if isinstance(values, (int, float)):
        return [values]
    try:
        return list(values)
    except TypeError:
        raise PlanError(f"{what} must be a number, a string like '4,4' or a list of numbers, "
                        f"got {type(values).__name__}; fix --{what}") from None


def parse_topology(workers: str | int | Sequence[int] = "4", bandwidth: str | float | Sequence[float | str] = "1.25e9",
                   memory: str | float | None = None) -> Topology:
    """Build a Topology from per-level worker counts and bandwidths (innermost level first).

    Args:
        workers: ``"4,4"`` (or ``"4x4"``, or ``[4, 4]``): units of the level below in each
            unit of this level; the product is the number of workers.
        bandwidth: one bandwidth per level, bytes/s, with optional unit suffix.
        memory: bytes of memory per worker (optional, with optional suffix).
    Raises:
        PlanError: a count or bandwidth that is not positive, or lists of different lengths.
    """
    ws = _split(workers, "workers")
    bs = _split(bandwidth, "bandwidth")
    if not ws:
        raise PlanError("no worker counts given; pass --workers like 16 or 4,4; fix the option")
    if len(ws) != len(bs):
        raise PlanError(
            f"--workers has {len(ws)} levels ({','.join(map(str, ws))}) but --bandwidth has {len(bs)} "
            f"({','.join(map(str, bs))}); give one bandwidth per level, innermost first"
        )
    levels = []
    for w, b in zip(ws, bs):
        try:
            wi = None if isinstance(w, bool) else int(w) if not isinstance(w, float) or float(w).is_integer() else None
        except (TypeError, ValueError):
            wi = None
        if wi is None or wi <= 0:
            raise PlanError(f"worker count {w!r} must be a positive integer; fix --workers")
        bf = parse_quantity(b, "bandwidth")
        if not bf > 0 or math.isinf(bf):
            raise PlanError(f"bandwidth {b!r} must be a positive number of bytes/s; fix --bandwidth")
        levels.append(Level(wi, bf))
    mem = None
    if memory is not None:
        mem = parse_quantity(memory, "memory")
        if not 0 < mem < math.inf:
            raise PlanError(f"memory per worker {memory!r} must be positive finite bytes; fix --memory (e.g. 16GB)")
    return Topology(tuple(levels), mem)


def check_topology(topology: Topology) -> None:
    """Raise PlanError unless every level has a positive worker count and bandwidth."""
    if not isinstance(topology, Topology):
        raise PlanError(f"the topology must be a Topology, got {type(topology).__name__}; "
                        f"build it with parse_topology('16', '1.25e9') or Topology.flat(16, 1.25e9)")
    if not topology.levels:
        raise PlanError("the topology has no levels; build it with parse_topology('16', '1.25e9')")
    for i, lv in enumerate(topology.levels):
        if not isinstance(lv.workers, int) or lv.workers <= 0:
            raise PlanError(f"level {i} has {lv.workers!r} workers; every level needs a positive integer count; "
                            "fix the topology")
        if not (isinstance(lv.bandwidth, (int, float)) and lv.bandwidth > 0) or math.isinf(lv.bandwidth):
            raise PlanError(f"level {i} has bandwidth {lv.bandwidth!r}; bandwidth must be positive bytes/s; "
                            "fix the topology")
    if topology.memory_per_worker is not None and not topology.memory_per_worker > 0:
        raise PlanError(f"memory_per_worker={topology.memory_per_worker!r} must be positive bytes or None; "
                        "fix the topology")


def unit_workers(topology: Topology) -> list[int]:
    """Workers in one unit of each level: ``[1, w0, w0*w1, ...]`` (level 0 units are workers)."""
    out = [1]
    for lv in topology.levels[:-1]:
        out.append(out[-1] * lv.workers)
    return out
