"""Multi-host launch on an emulated cluster: one torchrun agent per host, c10d rendezvous.

Host ``i`` of the cluster runs, inside its namespace ::

    python -m torch.distributed.run --nnodes H --nproc-per-node P \\
        --rdzv-backend c10d --rdzv-endpoint 198.18.0.1:PORT --rdzv-id RUN \\
        --rdzv-conf is_host=1|0,join_timeout=T --local-addr 198.18.0.(i+1) --max-restarts 0 \\
        -m pipetrain train ...

with ``GLOO_SOCKET_IFNAME`` (and ``TP_SOCKET_IFNAME``) set to the host's interface, so every
gloo pair binds to it and all traffic between hosts crosses the bandwidth-limited veths;
``OMP_NUM_THREADS=1``; stdin from /dev/null. Host 0 hosts the rendezvous store (``is_host=1``);
the others connect to it. Ranks come from the rendezvous in join order, so which host holds
which global ranks is torchrun's choice; the runtime's own rank layout (stage by stage) then
puts consecutive ranks' traffic on the same host where ``--nproc-per-node`` > 1.

Every agent and every worker it starts carries ``PIPETRAIN_CLUSTER_RUN=<run id>`` in its
environment. When the agents are done, have failed, or the timeout expired, every process
inside the hosts' namespaces with that mark is ended (torchrun starts workers in new
sessions, so killing an agent's process group alone would leave them running).
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import ClusterError
from .netns import EmulatedCluster, kill_pids, namespace_pids

__all__ = ["AgentResult", "ClusterRunResult", "launch_torchrun", "agent_command", "RUN_MARK"]

RUN_MARK = "PIPETRAIN_CLUSTER_RUN"
DEFAULT_PORT = 29400
FAILURE_GRACE = 20.0  # seconds the other agents get after one fails before they are killed


@dataclass
class AgentResult:
    """One torchrun agent: its host, exit code (None if it had to be killed), output."""

    host: int
    returncode: int | None
    stdout: str
    stderr: str
    killed: bool = False


@dataclass
class ClusterRunResult:
    """The agents' results, host order; ``timed_out`` if the deadline ended the run."""

    agents: list[AgentResult]
    seconds: float
    timed_out: bool = False
    run_id: str = ""
    command: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(a.returncode == 0 for a in self.agents)

    @property
    def returncode(self) -> int:
        """0 if every agent succeeded, 124 on timeout, else the first non-zero exit code."""
        if self.timed_out:
            return 124
        for a in self.agents:
            if a.returncode:
                return a.returncode
        return 0 if self.ok else 1

    def json_output(self) -> dict[str, Any] | None:
        """The JSON object printed by global rank 0 (``pipetrain train --json``), if any agent's
        stdout ends with one."""
        for a in self.agents:
            text = a.stdout.strip()
            if text.startswith("{") and text.endswith("}"):
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError:
                    continue
                if isinstance(obj, dict):
                    return obj
        return None

    def describe_failure(self) -> str:
        """The last lines of each failed agent's stderr (for error messages and test output)."""
        parts = []
        for a in self.agents:
            if a.returncode != 0:
                tail = "\n".join(a.stderr.strip().splitlines()[-15:])
                parts.append(f"host {a.host}: exit {a.returncode}{' (killed)' if a.killed else ''}\n{tail}")
        return ("timed out\n" if self.timed_out else "") + "\n----\n".join(parts)


def agent_command(cluster: EmulatedCluster, host: int, argv: Sequence[str], nproc_per_node: int, port: int,
                  run_id: str, timeout: float, python: str = sys.executable) -> list[str]:
    """The torchrun command host ``host`` runs (without the ``ip netns exec`` prefix).

    ``argv`` follows torchrun's options: ``["-m", "pipetrain", "train", ...]`` or a script path
    and its arguments.
    """
    return [python, "-m", "torch.distributed.run", "--nnodes", str(cluster.hosts),
            "--nproc-per-node", str(nproc_per_node), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{cluster.address(0)}:{port}", "--rdzv-id", run_id,
            "--rdzv-conf", f"is_host={1 if host == 0 else 0},join_timeout={int(max(timeout, 10))}",
            "--local-addr", cluster.address(host), "--max-restarts", "0", "--monitor-interval", "0.1",
            *argv]


def agent_env(cluster: EmulatedCluster, host: int, run_id: str,
              extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment added for host ``host``'s agent: gloo bound to the host's interface, one
    thread per rank, the run mark."""
    iface = cluster.interface(host)
    env = {"GLOO_SOCKET_IFNAME": iface, "TP_SOCKET_IFNAME": iface, "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1", RUN_MARK: run_id}
    env.update(extra or {})
    return env


def marked_pids(cluster: EmulatedCluster, run_id: str) -> list[int]:
    """Processes inside the cluster's host namespaces whose environment has ``RUN_MARK=run_id``."""
    needle = f"{RUN_MARK}={run_id}".encode()
    found = []
    for i in range(cluster.hosts):
        for pid in namespace_pids(cluster.namespace(i)):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        found.append(pid)
            except OSError:
                pass
    return found


def launch_torchrun(cluster: EmulatedCluster, args: Sequence[str], *, nproc_per_node: int = 1,
                    timeout: float = 120.0, port: int | None = None, module: str | None = "pipetrain",
                    env: Mapping[str, str] | None = None, python: str = sys.executable) -> ClusterRunResult:
    """Run ``python -m MODULE ARGS`` (``module=None``: ``python ARGS``) as one torchrun agent per
    host of ``cluster``, ``nproc_per_node`` workers each; wait for all, at most ``timeout`` s.

    Returns every agent's exit code and output. If an agent fails, the others get
    :data:`FAILURE_GRACE` seconds to stop on their own; then (and on timeout) every process of
    the run is killed. Never leaves a process of the run behind.

    >>> with EmulatedCluster(2, "100Mbit") as c:                       # doctest: +SKIP
    ...     r = launch_torchrun(c, ["train", "--model", "mlp", "--config", "1-1", "--json"])
    ...     r.ok, r.json_output()["samples_per_second"]
    """
    if nproc_per_node < 1:
        raise ClusterError(f"--nproc-per-node must be >= 1, got {nproc_per_node}")
    if not timeout > 0:
        raise ClusterError(f"timeout must be > 0 seconds, got {timeout}")
    run_id = f"pt-{secrets.token_hex(4)}"
    port = port or DEFAULT_PORT  # each host has its own port space: no clash with the machine's
    argv = (["-m", module] if module else []) + list(args)
    procs: list[subprocess.Popen[Any]] = []
    files: list[tuple[Any, Any]] = []
    killed: set[int] = set()
    timed_out = False
    t0 = time.monotonic()
    try:
        for host in range(cluster.hosts):
            # Outlive the loop (read after the agents exit); closed after reading below.
            out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()  # noqa: SIM115
            files.append((out, err))
            cmd = agent_command(cluster, host, argv, nproc_per_node, port, run_id, timeout, python)
            procs.append(cluster.popen(host, cmd, env=agent_env(cluster, host, run_id, env), stdout=out, stderr=err))
        deadline, failed_at = t0 + timeout, None
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = now
            if now > deadline or (failed_at is not None and now > failed_at + FAILURE_GRACE):
                timed_out = now > deadline
                for i, p in enumerate(procs):
                    if p.poll() is None:
                        killed.add(i)
                break
            time.sleep(0.05)
    finally:
        _end_run(cluster, run_id, procs)
    agents = []
    for i, (p, (out, err)) in enumerate(zip(procs, files)):
        out.seek(0)
        err.seek(0)
        agents.append(AgentResult(host=i, returncode=None if i in killed else p.returncode,
                                  stdout=out.read().decode(errors="replace"),
                                  stderr=err.read().decode(errors="replace"),
                                  killed=i in killed))
        out.close()
        err.close()
    return ClusterRunResult(agents=agents, seconds=time.monotonic() - t0, timed_out=timed_out, run_id=run_id,
                            command=agent_command(cluster, 0, argv, nproc_per_node, port, run_id, timeout, python))


def _end_run(cluster: EmulatedCluster, run_id: str, procs: Sequence[subprocess.Popen[Any]]) -> None:
    """Kill what is left of the run: the agents' process groups, then every marked process."""
    live = [p.pid for p in procs if p.poll() is None]
    for pid in live:
        try:
            os.killpg(pid, signal.SIGTERM)  # torchrun forwards SIGTERM to its workers
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    for _ in range(3):
        left = marked_pids(cluster, run_id) + [p.pid for p in procs if p.poll() is None]
        if not left:
            break
        kill_pids(sorted(set(left)), grace=1.0)
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
