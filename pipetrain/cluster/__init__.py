"""Emulated multi-host clusters on one Linux machine, multi-host launch, and link calibration.

- :mod:`.names`: names, addresses and tbf parameters of a cluster (pure).
- :mod:`.netns`: :class:`EmulatedCluster` (network namespaces, bridge, veths, tbf), cleanup.
- :mod:`.launch`: one torchrun agent per emulated host (:func:`launch_torchrun`).
- :mod:`.calibration`: the calibration file format and the least-squares fit.
- :mod:`.measure`: measuring point-to-point and all-reduce costs with gloo.
- :mod:`.delay`: the per-message delay model ``latency + bytes / bandwidth``.

See docs/cluster.md.
"""
from __future__ import annotations

from .errors import ClusterError, ClusterUnavailable
from .names import ClusterLayout, parse_rate
from .netns import EmulatedCluster, remove_leftovers, unavailable_reason

__all__ = ["ClusterError", "ClusterUnavailable", "ClusterLayout", "EmulatedCluster", "parse_rate",
           "remove_leftovers", "unavailable_reason"]
