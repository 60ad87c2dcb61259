"""User-facing errors.

Every error a user can cause is one of these: a message that states the rule, shows the
values and suggests the fix, on one line. The CLI prints ``error: <message>`` and exits 2
instead of a traceback. Library users catch :class:`PipetrainError` (a ``ValueError``).
"""
from __future__ import annotations


class PipetrainError(ValueError):
    """Base class of every error caused by user input (model, profile, plan, options)."""


class ModelError(PipetrainError):
    """Unknown model name, bad model options, or a factory that returns the wrong thing."""


class CaptureError(PipetrainError):
    """A model could not be captured as a graph of layers."""


class ProfileError(PipetrainError):
    """A profile file is unreadable or malformed, or a profile is inconsistent."""


class PlanError(PipetrainError):
    """Impossible planning request: bad topology, too many stages, no plan fits in memory."""


class ScheduleError(PipetrainError):
    """A schedule cannot be built, is invalid, or deadlocks."""


class RuntimeConfigError(PipetrainError):
    """A training run is misconfigured (worker count, plan and model disagree, ...)."""


class DataError(PipetrainError):
    """A data set cannot be loaded or does not fit: unknown name, missing files, bad factory, bad samples."""
