"""Errors of the emulated cluster (user errors are :class:`pipetrain.errors.PipetrainError`)."""
from __future__ import annotations

from ..errors import PipetrainError

__all__ = ["ClusterError", "ClusterUnavailable", "CalibrationError"]


class ClusterError(PipetrainError):
    """A misconfigured emulated cluster or launch (host count, bandwidth, host index, timeout)."""


class ClusterUnavailable(RuntimeError):
    """This machine cannot make network namespaces (not root, no ``ip netns``, no ``tbf``).

    Not a user error of an option: the message says what is missing; tests skip on it.
    """


class CalibrationError(PipetrainError):
    """A calibration file is unreadable or malformed, or a calibration cannot be fitted."""
