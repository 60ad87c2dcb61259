"""Per-layer profiles: the :class:`Profile` type, the profiler, file I/O and a table view."""
from __future__ import annotations

from .io import load_profile, save_profile
from .profiler import optimizer_state_factor, profile_captured, profile_model
from .table import format_bytes, format_profile_table
from .types import PROFILE_VERSION, NodeProfile, Profile

__all__ = [
    "PROFILE_VERSION", "NodeProfile", "Profile", "format_bytes", "format_profile_table", "load_profile",
    "optimizer_state_factor", "profile_captured", "profile_model", "save_profile",
]
