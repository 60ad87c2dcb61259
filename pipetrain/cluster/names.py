"""Names, addresses and link parameters of an emulated cluster (pure: no side effects).

A cluster with id ``ID`` (6 hex digits, random) and ``H`` hosts is laid out as ::

    netns pipetrain-ID-h0          netns pipetrain-ID-br            netns pipetrain-ID-h1
    +-------------------+          +------------------------+       +-------------------+
    | ptIDh0 198.18.0.1 |--veth----| ptIDp0   bridge ptIDbr  |--veth-| ptIDh1 198.18.0.2 |
    |   tbf egress      |          |   tbf egress  ptIDp1   |       |   tbf egress      |
    +-------------------+          +------------------------+       +-------------------+

Host ``i`` has address ``198.18.0.(i+1)/24`` (RFC 2544's benchmarking range 198.18.0.0/15,
never routed on the Internet) on its interface ``ptIDh{i}``; the other end of its veth pair is
port ``ptIDp{i}`` of the bridge ``ptIDbr``. Both ends of every veth carry a ``tbf`` qdisc at
the link rate, so each host has a full-duplex link of that rate to a switch. No namespace has
a route or a link to the machine's own network: nothing can leave the machine.

Invariants: every interface name fits Linux's 15 characters (``IFNAMSIZ - 1``); every name
starts with ``pipetrain-`` (namespaces) or ``pt`` + the id (links), so clusters made in
parallel never collide and leftovers are recognised by :func:`parse_namespace`.
"""
from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

from .errors import ClusterError

__all__ = ["NAMESPACE_PREFIX", "MAX_HOSTS", "MTU", "ClusterLayout", "TbfParams", "new_cluster_id",
           "parse_namespace", "parse_rate", "tbf_params", "format_rate"]

NAMESPACE_PREFIX = "pipetrain-"
MAX_HOSTS = 253          # 198.18.0.1 .. 198.18.0.253 in one /24
MTU = 9000               # jumbo frames on every veth and the bridge (see tbf_params)
IFNAMSIZ = 15            # longest interface name Linux accepts
_ID = re.compile(r"^[0-9a-f]{6}$")
_NS = re.compile(r"^pipetrain-([0-9a-f]{6})-(br|h(\d+))$")


def new_cluster_id() -> str:
    """A fresh random cluster id: 6 lowercase hex digits."""
    return secrets.token_hex(3)


@dataclass(frozen=True)
class ClusterLayout:
    """The names and addresses of cluster ``cluster_id`` with ``hosts`` hosts.

    >>> lay = ClusterLayout("a1b2c3", 2)
    >>> lay.host_namespace(1), lay.host_interface(1), lay.address(1)
    ('pipetrain-a1b2c3-h1', 'pta1b2c3h1', '198.18.0.2')
    """

    cluster_id: str
    hosts: int

    def __post_init__(self) -> None:
        if not _ID.match(self.cluster_id):
            raise ClusterError(f"cluster id must be 6 lowercase hex digits, got {self.cluster_id!r}; "
                               "use new_cluster_id()")
        if not isinstance(self.hosts, int) or not 1 <= self.hosts <= MAX_HOSTS:
            raise ClusterError(f"an emulated cluster has 1 to {MAX_HOSTS} hosts (one /24 of 198.18.0.0/15), "
                               f"got {self.hosts}; pass --hosts between 1 and {MAX_HOSTS}")

    # namespaces
    def host_namespace(self, i: int) -> str:
        return f"{NAMESPACE_PREFIX}{self.cluster_id}-h{self._check(i)}"

    @property
    def bridge_namespace(self) -> str:
        return f"{NAMESPACE_PREFIX}{self.cluster_id}-br"

    @property
    def namespaces(self) -> list[str]:
        """Every namespace of the cluster, hosts first (the order they are removed in)."""
        return [self.host_namespace(i) for i in range(self.hosts)] + [self.bridge_namespace]

    # links
    def host_interface(self, i: int) -> str:
        """The host's end of its veth (inside the host's namespace): what gloo binds to."""
        return f"pt{self.cluster_id}h{self._check(i)}"

    def bridge_port(self, i: int) -> str:
        """The bridge's end of host ``i``'s veth (inside the bridge namespace)."""
        return f"pt{self.cluster_id}p{self._check(i)}"

    @property
    def bridge(self) -> str:
        return f"pt{self.cluster_id}br"

    @property
    def link_prefix(self) -> str:
        """Every interface of this cluster starts with this."""
        return f"pt{self.cluster_id}"

    # addresses
    def address(self, i: int) -> str:
        """Host ``i``'s IPv4 address: ``198.18.0.(i+1)``."""
        return f"198.18.0.{self._check(i) + 1}"

    PREFIX_LEN = 24

    def _check(self, i: int) -> int:
        if not isinstance(i, int) or not 0 <= i < self.hosts:
            raise ClusterError(f"host index must be in 0..{self.hosts - 1} for a cluster of {self.hosts} hosts, "
                               f"got {i}")
        return i


def parse_namespace(name: str) -> tuple[str, str] | None:
    """``(cluster_id, role)`` of a pipetrain namespace name (role ``br`` or ``hN``), else None."""
    m = _NS.match(name)
    return (m.group(1), m.group(2)) if m else None


_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bits|bit/s|b/s)?\s*$", re.IGNORECASE)
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_rate(text: str | int | float) -> int:
    """Bits per second of a rate such as ``50Mbit``, ``1.5gbit``, ``800kbit`` or ``2000000``.

    Units are decimal bits (tc's ``mbit`` = 10^6 bit/s). Byte units (tc's ``bps`` means *bytes*
    per second) are refused to avoid a factor-of-8 mistake.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        bits = float(text)
    else:
        m = _RATE.match(str(text))
        if not m:
            raise ClusterError(f"bandwidth must be a number of bits per second with an optional k/M/G prefix and "
                               f"'bit' (e.g. 50Mbit, 1Gbit), got {text!r}")
        bits = float(m.group(1)) * _SCALE[m.group(2).lower()]
    if not bits >= 8000 or bits > 10**12:
        raise ClusterError(f"bandwidth must be between 8kbit and 1Tbit per second, got {text!r}")
    return int(round(bits))


def format_rate(bits_per_second: float) -> str:
    """``50Mbit`` for 50e6 (the largest unit that divides it, else bits)."""
    for unit, scale in (("Gbit", 10**9), ("Mbit", 10**6), ("kbit", 10**3)):
        if bits_per_second >= scale and bits_per_second % scale == 0:
            return f"{int(bits_per_second // scale)}{unit}"
    return f"{int(bits_per_second)}bit"


@dataclass(frozen=True)
class TbfParams:
    """Arguments of ``tc qdisc add dev D root tbf rate R burst B limit L``.

    ``rate_bits`` bits/s; ``burst_bytes`` the bucket size; ``limit_bytes`` the queue.
    """

    rate_bits: int
    burst_bytes: int
    limit_bytes: int

    def tc_args(self) -> list[str]:
        return ["tbf", "rate", f"{self.rate_bits}bit", "burst", str(self.burst_bytes),
                "limit", str(self.limit_bytes)]


def tbf_params(rate_bits: int, mtu: int = MTU, burst_seconds: float = 0.001,
               queue_seconds: float = 0.05) -> TbfParams:
    """The tbf parameters used for a link of ``rate_bits`` bits/s.

    tbf drops every packet larger than its bucket (TCP then stalls), and TCP over a veth sends
    packets up to the MTU (larger GSO packets tbf splits itself). So the bucket holds 2 packets
    of the MTU plus headers (18.2 KB at MTU 9000), or ``burst_seconds`` of traffic at the rate
    if that is more (a bucket that small needs a timer per packet; 1 ms keeps 1 Gbit/s links
    at 97% of their rate instead of 95%). The bucket is also a burst above the rate after an
    idle period: a message up to about twice its size crosses the two tbf ends of a path
    faster than the rate (measured at 50 Mbit/s: a 64 KiB message at 98 Mbit/s with a 36 KB
    bucket), so it is kept small. Measured with a TCP stream: 49.7 Mbit/s at 50 Mbit/s, 953
    Mbit/s at 1 Gbit/s. The queue holds ``queue_seconds`` at the rate (at least 4 buckets);
    beyond it tbf drops and TCP backs off.
    """
    rate_bytes = rate_bits / 8.0
    burst = max(2 * (mtu + 100), int(rate_bytes * burst_seconds))
    limit = max(4 * burst, int(rate_bytes * queue_seconds))
    return TbfParams(rate_bits=int(rate_bits), burst_bytes=int(burst), limit_bytes=int(limit))
