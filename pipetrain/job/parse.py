"""The parsers of the run's textual options: ``--config``, ``--cut``, ``--option``, ``--betas``, ``--debug-fail``.

Each turns the command-line text into the value the configuration holds, or raises a
one-line :class:`~pipetrain.errors.RuntimeConfigError` with the rule, the value and an
example of the form it takes.
"""
from __future__ import annotations

import ast
from collections.abc import Mapping
from typing import Any

from ..errors import RuntimeConfigError

__all__ = ["DEBUG_FAIL_MODES", "parse_betas", "parse_config", "parse_cut", "parse_debug_fail", "parse_model_option",
           "parse_model_options"]

#: Modes of the hidden ``--debug-fail`` test hook (:func:`parse_debug_fail`).
DEBUG_FAIL_MODES = ("raise", "hang", "kill", "kill-save")


def parse_config(text: str) -> list[int]:
    """PipeDream's configuration string ``"2-1-1"`` -> replicas per stage ``[2, 1, 1]``."""
    try:
        reps = [int(x) for x in str(text).split("-")]
    except ValueError:
        reps = []
    if not reps or any(r < 1 for r in reps):
        raise RuntimeConfigError(
            f"--config must list replicas per stage joined by '-', each >= 1 (e.g. 2-1-1), got {text!r}")
    return reps


def parse_cut(text: str) -> list[str]:
    """``--cut blocks.4`` / ``--cut _16,_24`` -> the names where stages 1, 2, ... begin."""
    names = [x.strip() for x in str(text).split(",")]
    if not names or any(not n for n in names):
        raise RuntimeConfigError(
            f"--cut takes node or module names joined by ',' (where stages 1, 2, ... begin, e.g. blocks.4), "
            f"got {text!r}")
    return names


def parse_debug_fail(text: str) -> tuple[int, int, str]:
    """Hidden ``--debug-fail RANK:STEP[:MODE]`` -> (rank, step, mode), mode one of ``raise``
    (default), ``hang``, ``kill`` (SIGKILL at the step's first forward) and ``kill-save``
    (SIGKILL inside the checkpoint write at that step); ``kill*`` act on the first attempt only
    (``TORCHELASTIC_RESTART_COUNT`` 0), so that a restarted run goes through."""
    parts = str(text).split(":")
    try:
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in DEBUG_FAIL_MODES):
            raise ValueError
        return int(parts[0]), int(parts[1]), parts[2] if len(parts) == 3 else "raise"
    except ValueError:
        others = ", :".join(m for m in DEBUG_FAIL_MODES if m != "hang")
        raise RuntimeConfigError(f"--debug-fail takes RANK:STEP[:hang] (or :{others}), got {text!r}") from None


def parse_model_option(text: str) -> tuple[str, Any]:
    """``--option key=value``: the value is read as Python literal when possible (int, float,
    bool, None, tuple), else kept as a string."""
    key, eq, raw = text.partition("=")
    if not eq or not key.strip():
        raise RuntimeConfigError(f"--option takes key=value, got {text!r} (e.g. --option depth=4)")
    raw = raw.strip()
    lowered = {"true": True, "false": False, "none": None}
    if raw.lower() in lowered:
        return key.strip(), lowered[raw.lower()]
    try:
        return key.strip(), ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return key.strip(), raw


def parse_model_options(items: Any) -> dict[str, Any]:
    """``["depth=4", "width=16"]`` (repeated ``--option``) -> ``{"depth": 4, "width": 16}``;
    a mapping is taken as it is."""
    if isinstance(items, Mapping):
        return dict(items)
    return dict(parse_model_option(str(o)) for o in items)


def parse_betas(text: Any) -> tuple[float, float]:
    """``--betas 0.9,0.999`` -> ``(0.9, 0.999)``; a pair is taken as it is."""
    if isinstance(text, (tuple, list)):
        return tuple(text)  # type: ignore[return-value]
    try:
        betas = tuple(float(x) for x in str(text).split(","))
    except ValueError:
        betas = ()
    if len(betas) != 2:
        raise RuntimeConfigError(f"--betas takes two numbers like 0.9,0.999, got {text!r}")
    return betas[0], betas[1]
