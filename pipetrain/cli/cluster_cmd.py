"""``pipetrain cluster``: emulated multi-host clusters (network namespaces, tbf-limited links).

    pipetrain cluster run --hosts 2 --bandwidth 100Mbit -- train --model mlp --config 1-1 --json
    pipetrain cluster up --hosts 2 --bandwidth 50Mbit       # prints the cluster id; stays up
    pipetrain cluster exec ID 1 -- ip addr                  # a command inside host 1
    pipetrain cluster status [--json]
    pipetrain cluster down ID | --all

``run`` brings a cluster up (or uses ``--cluster ID``), starts one torchrun agent per host
running ``python -m pipetrain ARGS`` (see :mod:`pipetrain.cluster.launch`), prints the agents'
standard output (rank 0's JSON with ``train --json``) and their standard error prefixed with
``[hN]``, removes the cluster it made, and exits with the run's code (124: timed out). Needs
root. This module only parses arguments and calls :mod:`pipetrain.cluster`.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..cluster.errors import ClusterError, ClusterUnavailable

DEFAULT_TIMEOUT = 600.0


def register(subparsers: Any) -> None:
    """Add the ``cluster`` subcommand and its actions."""
    p = subparsers.add_parser(
        "cluster",
        help="emulated multi-host cluster: network namespaces joined by bandwidth-limited links (needs root)",
        description="Emulate N hosts on this machine as network namespaces on a bridge, each link limited with "
                    "tc tbf (addresses 198.18.0.1..N; nothing leaves the machine), and run torchrun across them.",
    )
    sub = p.add_subparsers(dest="cluster_action", metavar="ACTION")

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--hosts", type=int, default=2, help="emulated hosts (default 2)")
        q.add_argument("--bandwidth", default=None,
                       help="per-link rate in each direction, e.g. 50Mbit, 1Gbit (default: unlimited)")

    r = sub.add_parser("run", help="run `pipetrain ARGS` under one torchrun agent per emulated host",
                       description="Bring up a cluster (unless --cluster), run `python -m pipetrain ARGS` as one "
                                   "torchrun agent per host (c10d rendezvous on host 0, gloo bound to each host's "
                                   "interface), print the output, remove the cluster.")
    common(r)
    r.add_argument("--cluster", metavar="ID", help="use a cluster left up by `pipetrain cluster up` instead")
    r.add_argument("--nproc-per-node", type=int, default=1, help="workers per host (default 1)")
    r.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                   help=f"seconds for the whole run; every process is killed after it (default {DEFAULT_TIMEOUT:g})")
    r.add_argument("--json-result", action="store_true",
                   help="print one JSON object: the cluster, each agent's exit code, and rank 0's JSON output")
    r.add_argument("args", nargs=argparse.REMAINDER, help="-- then the pipetrain command, e.g. -- train --model mlp")
    r.set_defaults(func=run_cmd)

    u = sub.add_parser("up", help="bring a cluster up and leave it (remove it with `pipetrain cluster down ID`)")
    common(u)
    u.add_argument("--json", action="store_true", help="print the cluster as one JSON object")
    u.set_defaults(func=up_cmd)

    d = sub.add_parser("down", help="remove clusters (their namespaces, links and processes)")
    d.add_argument("ids", nargs="*", metavar="ID", help="cluster ids (see `pipetrain cluster status`)")
    d.add_argument("--all", action="store_true", help="remove every pipetrain cluster on this machine")
    d.set_defaults(func=down_cmd)

    s = sub.add_parser("status", help="list the pipetrain clusters on this machine")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.set_defaults(func=status_cmd)

    e = sub.add_parser("exec", help="run a command inside one host of a cluster left up")
    e.add_argument("id", metavar="ID", help="cluster id")
    e.add_argument("host", type=int, help="host index (0-based)")
    e.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds (default 600)")
    e.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the command")
    e.set_defaults(func=exec_cmd)
    p.set_defaults(func=lambda a: (p.print_help(), 2)[1])


def _strip_dashes(args: list[str]) -> list[str]:
    return args[1:] if args and args[0] == "--" else args


def _unavailable(e: ClusterUnavailable) -> int:
    print(f"error: {e}", file=sys.stderr)
    return 3


def run_cmd(a: argparse.Namespace) -> int:
    from ..cluster.launch import launch_torchrun
    from ..cluster.netns import EmulatedCluster

    args = _strip_dashes(list(a.args))
    if not args:
        raise ClusterError("pipetrain cluster run needs the command to run after --, e.g. "
                           "`pipetrain cluster run --hosts 2 -- train --model mlp --config 1-1`")
    if args[0] == "compare" and not a.cluster:
        return _compare_on_cluster(args, a)
    try:
        cluster = (EmulatedCluster.attach(a.cluster) if a.cluster
                   else EmulatedCluster(a.hosts, a.bandwidth)).up()
    except ClusterUnavailable as e:
        return _unavailable(e)
    try:
        res = launch_torchrun(cluster, args, nproc_per_node=a.nproc_per_node, timeout=a.timeout)
        info = cluster.describe()
    finally:
        if not a.cluster:
            cluster.down()
    for ag in res.agents:
        for line in ag.stderr.splitlines():
            print(f"[h{ag.host}] {line}", file=sys.stderr)
    if a.json_result:
        print(json.dumps({"cluster": info, "returncode": res.returncode, "timed_out": res.timed_out,
                          "seconds": res.seconds, "agents": [{"host": g.host, "returncode": g.returncode,
                                                              "killed": g.killed} for g in res.agents],
                          "result": res.json_output()}))
    else:
        for ag in res.agents:
            if ag.stdout:
                sys.stdout.write(ag.stdout)
    if res.timed_out:
        print(f"error: the run did not finish within --timeout {a.timeout:g} s; every process was killed",
              file=sys.stderr)
    return res.returncode


def _compare_on_cluster(argv: list[str], a: argparse.Namespace) -> int:
    """``cluster run -- compare ...``: the comparison runs here and trains each configuration
    across the hosts of a new cluster (one torchrun per configuration); the cluster is removed."""
    from ..cluster.netns import EmulatedCluster
    from ..run.on_cluster import cluster_train
    from . import compare_cmd

    parser = argparse.ArgumentParser(prog="pipetrain")
    compare_cmd.register(parser.add_subparsers(dest="command", metavar="COMMAND"))
    args = parser.parse_args(argv)
    with EmulatedCluster(a.hosts, a.bandwidth) as c:
        return compare_cmd.run(args, train=cluster_train(c, nproc_per_node=a.nproc_per_node, timeout=a.timeout))


def up_cmd(a: argparse.Namespace) -> int:
    from ..cluster.netns import EmulatedCluster

    try:
        c = EmulatedCluster(a.hosts, a.bandwidth, keep=True).up()
    except ClusterUnavailable as e:
        return _unavailable(e)
    info = c.describe()
    if a.json:
        print(json.dumps(info))
    else:
        print(f"cluster {c.cluster_id}: {c.hosts} hosts, "
              f"{a.bandwidth or 'unlimited'} per link; remove with `pipetrain cluster down {c.cluster_id}`")
        for h in info["hosts"]:
            print(f"  {h['namespace']}  {h['interface']}  {h['address']}")
    return 0


def down_cmd(a: argparse.Namespace) -> int:
    from ..cluster.netns import list_clusters, remove_leftovers

    if a.all == bool(a.ids):
        raise ClusterError("pipetrain cluster down needs cluster ids or --all (not both); "
                           "`pipetrain cluster status` lists them")
    if a.all:
        removed = remove_leftovers()
    else:
        present = list_clusters()
        missing = [i for i in a.ids if i not in present]
        if missing:
            raise ClusterError(f"no emulated cluster {', '.join(missing)} on this machine; present: "
                               f"{', '.join(sorted(present)) or 'none'}")
        removed = [n for i in a.ids for n in remove_leftovers(i)]
    print(f"removed {len(removed)} namespace(s)/link(s)" + (f": {' '.join(removed)}" if removed else ""))
    return 0


def status_cmd(a: argparse.Namespace) -> int:
    from ..cluster.netns import cluster_info, list_clusters

    infos = [cluster_info(cid) for cid in sorted(list_clusters())]
    if a.json:
        print(json.dumps({"clusters": infos}))
        return 0
    if not infos:
        print("no pipetrain clusters")
    for info in infos:
        rates = {h["rate"] for h in info["hosts"]}
        print(f"cluster {info['cluster_id']}: {len(info['hosts'])} hosts, rate {', '.join(sorted(map(str, rates)))}, "
              f"{info['processes']} process(es)")
        for h in info["hosts"]:
            print(f"  {h['namespace']}  {h['interface']}  {h['address']}")
    return 0


def exec_cmd(a: argparse.Namespace) -> int:
    import os
    import signal
    import subprocess

    from ..cluster.netns import EmulatedCluster

    argv = _strip_dashes(list(a.argv))
    if not argv:
        raise ClusterError("pipetrain cluster exec needs a command after --, e.g. "
                           "`pipetrain cluster exec ID 0 -- ip addr`")
    c = EmulatedCluster.attach(a.id)
    p = c.popen(a.host, argv, stdin=None)
    try:
        return p.wait(timeout=a.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # popen started it in its own process group
        p.wait()
        print(f"error: the command did not finish within --timeout {a.timeout:g} s", file=sys.stderr)
        return 124
