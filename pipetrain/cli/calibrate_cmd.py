"""``pipetrain calibrate``: measure link bandwidth, latency and all-reduce cost with gloo.

    pipetrain calibrate                                  # 2 ranks on loopback
    pipetrain calibrate --hosts 2 --bandwidth 50Mbit     # across an emulated cluster (root)
    pipetrain calibrate --cluster ID --output cal.json   # a cluster left up by `cluster up`

Prints a summary (or one JSON object with ``--json``: the calibration file's content) and writes
the calibration file with ``--output`` (format: :mod:`pipetrain.cluster.calibration`). This
module only parses arguments and calls :func:`pipetrain.cluster.measure.calibrate`.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..cluster.errors import ClusterUnavailable


def register(subparsers: Any) -> None:
    """Add the ``calibrate`` subcommand."""
    p = subparsers.add_parser(
        "calibrate",
        help="measure point-to-point bandwidth/latency and all-reduce cost (loopback or an emulated cluster)",
        description="Time gloo send/recv ping-pongs and all-reduces of growing sizes between ranks on loopback, "
                    "or one rank per host of an emulated cluster, and fit latency + bytes / bandwidth to each.",
    )
    p.add_argument("--ranks", type=int, default=2, help="ranks on loopback (default 2)")
    p.add_argument("--hosts", type=int, default=None,
                   help="calibrate across a new emulated cluster of this many hosts (needs root)")
    p.add_argument("--bandwidth", default=None, help="with --hosts: per-link rate, e.g. 50Mbit (default: unlimited)")
    p.add_argument("--cluster", metavar="ID", help="calibrate across a cluster left up by `pipetrain cluster up`")
    p.add_argument("--max-message-seconds", type=float, default=0.1,
                   help="stop growing message sizes once one takes longer than this (default 0.1)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds for the whole measurement (default 120)")
    p.add_argument("--output", "-o", help="write the calibration file (JSON) here")
    p.add_argument("--json", action="store_true", help="print the calibration as one JSON object")
    p.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    from ..cluster.errors import ClusterError
    from ..cluster.measure import calibrate
    from ..cluster.netns import EmulatedCluster
    from ..runtime.process.forkserver import server_processes

    if a.cluster and a.hosts:
        raise ClusterError("pass --hosts N (a new cluster) or --cluster ID (one left up), not both")
    if a.bandwidth and not a.hosts:
        raise ClusterError("--bandwidth applies to a new emulated cluster; add --hosts 2")
    try:
        if a.cluster:
            cal = calibrate(EmulatedCluster.attach(a.cluster), max_message_seconds=a.max_message_seconds,
                            timeout=a.timeout)
        elif a.hosts:
            with EmulatedCluster(a.hosts, a.bandwidth) as c:
                cal = calibrate(c, max_message_seconds=a.max_message_seconds, timeout=a.timeout)
        else:
            cal = calibrate(None, ranks=a.ranks, max_message_seconds=a.max_message_seconds, timeout=a.timeout,
                            processes=server_processes())  # torch imported once for every rank
    except ClusterUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    if a.output:
        cal.save(a.output)
    if a.json:
        print(json.dumps(cal.to_dict()))
        return 0
    where = cal.where + (f", {cal.hosts} hosts" if cal.where == "emulated" else f", {cal.ranks} ranks")
    if cal.bandwidth_limit_bits_per_second:
        where += f", links limited to {cal.bandwidth_limit_bits_per_second / 1e6:g} Mbit/s"
    print(f"calibration ({where}; {cal.seconds:.1f} s)")
    print(f"  point to point: latency {cal.p2p.latency_seconds * 1e6:.0f} us, "
          f"bandwidth {cal.p2p.bandwidth_bits_per_second / 1e6:.1f} Mbit/s")
    print(f"  all-reduce over {cal.allreduce_ranks} ranks: latency {cal.allreduce.latency_seconds * 1e6:.0f} us, "
          f"algorithm bandwidth {cal.allreduce.bandwidth_bits_per_second / 1e6:.1f} Mbit/s "
          f"(per link {cal.allreduce_bus_bandwidth * 8 / 1e6:.1f} Mbit/s)")
    if a.output:
        print(f"  written to {a.output}")
    return 0
