"""Validation of model options: unknown names and bad values become one-line ModelErrors.

Every zoo model declares its options as a ``DEFAULTS`` dict. :class:`Options` fills in the
defaults, rejects unknown names, and its checkers reject bad values with a message that states
the rule, the value and the model's valid options with their defaults::

    mlp option 'depth' must be an integer >= 1, got -3; valid mlp options (defaults):
    depth=16, width=1024, in_features=None, num_classes=None
"""
from __future__ import annotations

import builtins
import difflib
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import ModelError


def describe_options(defaults: Mapping[str, Any]) -> str:
    """``name=default, ...`` for error messages."""
    return ", ".join(f"{k}={v!r}" for k, v in defaults.items())


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Options:
    """The resolved options of one model, with checkers that raise one-line ModelErrors.

    Example:
        >>> opts = Options("mlp", {"depth": 2}, {"depth": 16, "width": 1024})
        >>> opts.int("depth"), opts.values
        (2, {'depth': 2, 'width': 1024})
    """

    def __init__(self, model: str, given: Mapping[str, Any], defaults: Mapping[str, Any]) -> None:
        self.model = model
        self.defaults = dict(defaults)
        unknown = [k for k in given if k not in defaults]
        if unknown:
            hint = difflib.get_close_matches(unknown[0], list(defaults), n=1)
            did_you_mean = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ModelError(
                f"unknown {model} option {unknown[0]!r}{did_you_mean}; "
                f"valid {model} options (defaults): {describe_options(defaults)}"
            )
        self.values: dict[str, Any] = dict(defaults)
        self.values.update(given)

    def fail(self, name: str, rule: str) -> ModelError:
        """The error for option ``name`` breaking ``rule`` (to ``raise``)."""
        return ModelError(
            f"{self.model} option {name!r} must be {rule}, got {self.values[name]!r}; "
            f"valid {self.model} options (defaults): {describe_options(self.defaults)}"
        )

    def int(self, name: str, minimum: int = 1, allow_none: bool = False) -> Any:
        """An integer >= ``minimum`` (or ``None`` when ``allow_none``)."""
        value = self.values[name]
        if allow_none and value is None:
            return None
        if not _is_int(value) or value < minimum:
            raise self.fail(name, f"an integer >= {minimum}" + (" or None" if allow_none else ""))
        return value

    def float(self, name: str, low: float, high: float | None = None,
              low_inclusive: bool = True, high_inclusive: bool = False) -> float:
        """A real number in the interval from ``low`` to ``high`` (``None``: unbounded)."""
        value = self.values[name]
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok:
            ok = value >= low if low_inclusive else value > low
            if ok and high is not None:
                ok = value <= high if high_inclusive else value < high
        if not ok:
            lo = f"{'[' if low_inclusive else '('}{low}"
            hi = f"{high}{']' if high_inclusive else ')'}" if high is not None else "inf)"
            raise self.fail(name, f"a number in {lo}, {hi}")
        return float(value)

    def choice(self, name: str, choices: Sequence[Any]) -> Any:
        """One of ``choices``."""
        value = self.values[name]
        if isinstance(value, bool) or value not in choices:
            raise self.fail(name, f"one of {list(choices)}")
        return value

    def bool(self, name: str) -> bool:
        """True or False."""
        value = self.values[name]
        if not isinstance(value, bool):
            raise self.fail(name, "True or False")
        return value

    # ``builtins.int``: inside this class body, ``int`` names the method above.
    def int_tuple(self, name: str, length: builtins.int, minimum: builtins.int = 1) -> tuple[builtins.int, ...]:
        """A sequence of ``length`` integers >= ``minimum``, stored back as a tuple."""
        value = self.values[name]
        ok = isinstance(value, (tuple, list)) and len(value) == length and all(
            _is_int(v) and v >= minimum for v in value)
        if not ok:
            raise self.fail(name, f"a sequence of {length} integers >= {minimum}")
        self.values[name] = tuple(value)
        return tuple(value)


def scaled(channels: int, mult: float) -> int:
    """Channel count scaled by a width multiplier, at least 1 (``width_mult`` options)."""
    return max(1, int(round(channels * mult)))
