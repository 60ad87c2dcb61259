"""An emulated cluster: hosts as Linux network namespaces on a bandwidth-limited bridge.

    with EmulatedCluster(hosts=2, bandwidth="50Mbit") as c:
        c.run(1, ["ping", "-c", "1", c.address(0)])
        p = c.popen(0, [sys.executable, "-m", "pipetrain", "train", ...], env={"OMP_NUM_THREADS": "1"})

Layout and names: :mod:`pipetrain.cluster.names`. Every veth is created directly inside its
namespaces (never in the machine's own), so removing the namespaces removes every link. Each
host also gets ``/etc/netns/NS/hosts`` (naming the hosts ``h0``, ``h1``, ... and mapping this
machine's hostname to the host's own address), which ``ip netns exec`` shows as its
``/etc/hosts``; it is removed with the namespace.

Cleanup invariant: whatever :meth:`EmulatedCluster.up` made is removed by
:meth:`EmulatedCluster.down`, which is idempotent and runs on leaving the ``with`` block (also
on an exception), on SIGINT/SIGTERM (handlers installed while a cluster is up; the previous
handler runs afterwards) and at interpreter exit (atexit). ``down`` first ends every process
still inside the cluster's namespaces (those started with :meth:`popen` by process group, then
any other by ``ip netns pids``), then deletes the namespaces. A process killed with SIGKILL
cannot clean up: ``pipetrain cluster down --all`` (:func:`remove_leftovers`) removes what such
a run left.

Needs root and iproute2 (``ip``, ``tc``) with the ``tbf`` qdisc; :func:`unavailable_reason`
says why not otherwise.
"""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import Any

from .errors import ClusterError, ClusterUnavailable
from .names import MTU, ClusterLayout, TbfParams, new_cluster_id, parse_namespace, parse_rate, tbf_params

__all__ = ["EmulatedCluster", "unavailable_reason", "list_namespaces", "list_clusters", "cluster_info",
           "remove_cluster", "remove_leftovers", "namespace_pids", "kill_pids"]

log = logging.getLogger(__name__)

IP_TIMEOUT = 20.0  # seconds any one `ip`/`tc` command may take
ETC_NETNS = "/etc/netns"  # `ip netns exec NS` bind-mounts ETC_NETNS/NS/FILE over /etc/FILE


# ----------------------------------------------------------------------------- ip / tc


def _ip(args: Sequence[str], check: bool = True, timeout: float = IP_TIMEOUT) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS`` (or ``tc`` when ``args[0] == "tc"``); raise RuntimeError on failure if ``check``."""
    argv = list(args) if args[0] == "tc" else ["ip", *args]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if check and p.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed (exit {p.returncode}): {p.stderr.strip()}")
    return p


_AVAILABLE: str | None | bool = False  # False: not yet checked


def unavailable_reason() -> str | None:
    """Why this machine cannot host an emulated cluster, or None if it can (checked once).

    Checks: root, ``ip`` and ``tc`` on PATH, and a trial namespace with a veth carrying a tbf.
    """
    global _AVAILABLE
    if _AVAILABLE is not False:
        return _AVAILABLE  # type: ignore[return-value]
    reason: str | None = None
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        reason = "emulated clusters need root (network namespaces); run as root or skip"
    elif shutil.which("ip") is None or shutil.which("tc") is None:
        reason = "emulated clusters need iproute2 (`ip` and `tc` on PATH)"
    else:
        probe = f"pipetrain-{new_cluster_id()}-h0"
        try:
            _ip(["netns", "add", probe])
            try:
                _ip(["-n", probe, "link", "add", "ptprobe0", "type", "veth", "peer", "name", "ptprobe1"])
                _ip(["tc", "-n", probe, "qdisc", "add", "dev", "ptprobe0", "root", "tbf", "rate", "1mbit",
                     "burst", "40000", "limit", "160000"])
            finally:
                _ip(["netns", "del", probe], check=False)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            reason = f"cannot make a network namespace with a veth and a tbf qdisc here: {e}"
    _AVAILABLE = reason
    return reason


def list_namespaces() -> list[str]:
    """Names of every network namespace (``ip netns list``)."""
    out = _ip(["netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def list_clusters() -> dict[str, list[str]]:
    """Pipetrain clusters present on this machine: cluster id -> its namespaces."""
    found: dict[str, list[str]] = {}
    for ns in list_namespaces():
        parsed = parse_namespace(ns)
        if parsed:
            found.setdefault(parsed[0], []).append(ns)
    return found


def cluster_info(cluster_id: str) -> dict[str, Any]:
    """What is on this machine of cluster ``cluster_id``: its hosts (namespace, interface,
    address, tbf rate as tc prints it) and the number of processes inside its namespaces."""
    nss = list_clusters().get(cluster_id, [])
    hosts = []
    for ns in sorted((n for n in nss if not n.endswith("-br")), key=lambda n: int(n.rsplit("-h", 1)[1])):
        iface = addr = rate = None
        for line in _ip(["-n", ns, "-o", "-4", "addr", "show"], check=False).stdout.splitlines():
            parts = line.split()
            if len(parts) > 3 and parts[1] != "lo" and parts[2] == "inet":
                iface, addr = parts[1], parts[3].split("/")[0]
        for line in _ip(["tc", "-n", ns, "qdisc", "show"], check=False).stdout.splitlines():
            parts = line.split()
            if "tbf" in parts and "rate" in parts:
                rate = parts[parts.index("rate") + 1]
        hosts.append({"namespace": ns, "interface": iface, "address": addr, "rate": rate})
    return {"cluster_id": cluster_id, "namespaces": sorted(nss), "hosts": hosts,
            "processes": sum(len(namespace_pids(ns)) for ns in nss)}


def namespace_pids(ns: str) -> list[int]:
    """Process ids running inside namespace ``ns`` (``ip netns pids``)."""
    out = _ip(["netns", "pids", ns], check=False).stdout
    return [int(t) for t in out.split() if t.isdigit()]


def kill_pids(pids: Sequence[int], grace: float = 2.0) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds, each of ``pids`` (and its process group
    if it leads one)."""
    def send(sig: int) -> None:
        for pid in pids:
            try:
                if os.getpgid(pid) == pid:
                    os.killpg(pid, sig)
                else:
                    os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    if not pids:
        return
    send(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    send(signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def remove_cluster(namespaces: Sequence[str]) -> None:
    """End every process inside ``namespaces`` and delete them (missing ones are skipped)."""
    for ns in namespaces:  # the per-namespace /etc files (hosts), present or not
        if parse_namespace(ns):
            shutil.rmtree(os.path.join(ETC_NETNS, ns), ignore_errors=True)
    _remove_etc_netns_if_empty()
    present = set(list_namespaces())
    nss = [ns for ns in namespaces if ns in present]
    for _ in range(3):  # a process may start another while we kill: sweep again
        pids = [p for ns in nss for p in namespace_pids(ns)]
        if not pids:
            break
        kill_pids(pids)
    errors = []
    for ns in nss:
        p = _ip(["netns", "del", ns], check=False)
        if p.returncode != 0 and ns in list_namespaces():
            errors.append(f"{ns}: {p.stderr.strip()}")
    if errors:
        raise RuntimeError("could not delete network namespaces: " + "; ".join(errors))


def remove_leftovers(cluster_id: str | None = None) -> list[str]:
    """Remove every pipetrain cluster on this machine (or only ``cluster_id``); returns the
    namespaces removed. Also removes stray ``pt<id>...`` links in the machine's namespace."""
    clusters = list_clusters()
    for name in (os.listdir(ETC_NETNS) if os.path.isdir(ETC_NETNS) else []):  # /etc files of gone namespaces
        parsed = parse_namespace(name)
        if parsed and (cluster_id is None or parsed[0] == cluster_id) and name not in clusters.get(parsed[0], []):
            shutil.rmtree(os.path.join(ETC_NETNS, name), ignore_errors=True)
    removed: list[str] = []
    for cid, nss in sorted(clusters.items()):
        if cluster_id is None or cid == cluster_id:
            # hosts before the bridge, as EmulatedCluster.down does
            nss = sorted(nss, key=lambda n: n.endswith("-br"))
            remove_cluster(nss)
            removed.extend(nss)
    out = _ip(["-o", "link", "show"], check=False).stdout
    for line in out.splitlines():
        parts = line.split(":")
        if len(parts) > 1:
            name = parts[1].strip().split("@")[0]
            if (len(name) > 8 and name.startswith("pt") and all(c in "0123456789abcdef" for c in name[2:8])
                    and (cluster_id is None or name[2:8] == cluster_id)):
                _ip(["link", "del", name], check=False)
                removed.append(name)
    return removed


def _remove_etc_netns_if_empty() -> None:
    try:
        os.rmdir(ETC_NETNS)  # only if empty: another cluster's files keep it
    except OSError:
        pass


# ----------------------------------------------------------------------------- cleanup on exit/signal

_LIVE: dict[str, EmulatedCluster] = {}
_LOCK = threading.RLock()
_PREVIOUS: dict[int, Any] = {}
_ATEXIT = False


def _teardown_all() -> None:
    with _LOCK:
        clusters = list(_LIVE.values())
    for c in clusters:
        try:
            c.down()
        except Exception as e:  # keep going: remove the others
            log.error("removing emulated cluster %s failed: %s", c.cluster_id, e)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    prev = _PREVIOUS.get(signum, signal.SIG_DFL)  # before teardown, which restores and forgets it
    _teardown_all()
    if callable(prev):
        prev(signum, frame)  # e.g. Python's SIGINT handler raises KeyboardInterrupt
    elif prev != signal.SIG_IGN:  # SIG_DFL, or None (a handler not set from Python): the default
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _register(c: EmulatedCluster) -> None:
    global _ATEXIT
    with _LOCK:
        _LIVE[c.cluster_id] = c
        if not _ATEXIT:
            atexit.register(_teardown_all)
            _ATEXIT = True
        if threading.current_thread() is threading.main_thread() and not _PREVIOUS:
            for sig in (signal.SIGINT, signal.SIGTERM):
                _PREVIOUS[sig] = signal.getsignal(sig)
                signal.signal(sig, _on_signal)


def _unregister(c: EmulatedCluster) -> None:
    with _LOCK:
        _LIVE.pop(c.cluster_id, None)
        if not _LIVE and _PREVIOUS and threading.current_thread() is threading.main_thread():
            for sig, prev in list(_PREVIOUS.items()):
                if signal.getsignal(sig) is _on_signal:
                    signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
            _PREVIOUS.clear()


# ----------------------------------------------------------------------------- the cluster


class EmulatedCluster:
    """``hosts`` network namespaces joined by a bridge, each link limited to ``bandwidth``.

    Args:
        hosts: number of emulated hosts (1..253).
        bandwidth: per-link rate in each direction, e.g. ``"50Mbit"`` or bits/s as a number;
            None: no limit (the veth's own speed).
        cluster_id: 6 hex digits (default: random); names derive from it (:class:`ClusterLayout`).
        mtu: MTU of every veth and the bridge (default 9000; see :func:`names.tbf_params`).
        keep: leave the cluster up when this object is left or the process exits (for
            ``pipetrain cluster up``); it is then removed by ``pipetrain cluster down``.
    """

    def __init__(self, hosts: int = 2, bandwidth: str | int | float | None = None, *,
                 cluster_id: str | None = None, mtu: int = MTU, keep: bool = False) -> None:
        self.layout = ClusterLayout(cluster_id or new_cluster_id(), hosts)
        self.bandwidth_bits: int | None = None if bandwidth is None else parse_rate(bandwidth)
        if not 1280 <= mtu <= 65535:
            raise ClusterError(f"MTU must be between 1280 and 65535 bytes, got {mtu}")
        self.mtu = mtu
        self.tbf: TbfParams | None = None if self.bandwidth_bits is None else tbf_params(self.bandwidth_bits, mtu)
        self.keep = keep
        self._procs: list[subprocess.Popen[Any]] = []
        self._made: list[str] = []   # namespaces created so far, in creation order
        self._is_up = False

    # --- names
    @property
    def cluster_id(self) -> str:
        return self.layout.cluster_id

    @property
    def hosts(self) -> int:
        return self.layout.hosts

    def namespace(self, i: int) -> str:
        return self.layout.host_namespace(i)

    def address(self, i: int) -> str:
        return self.layout.address(i)

    def interface(self, i: int) -> str:
        """Host ``i``'s network interface (set ``GLOO_SOCKET_IFNAME`` to it)."""
        return self.layout.host_interface(i)

    @property
    def is_up(self) -> bool:
        return self._is_up

    # --- lifecycle
    def __enter__(self) -> EmulatedCluster:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        if not self.keep:
            self.down()

    def up(self) -> EmulatedCluster:
        """Create the namespaces, bridge, veths and qdiscs. On any failure removes what it made
        and raises (:class:`ClusterUnavailable` if the machine cannot do it at all)."""
        if self._is_up:
            return self
        reason = unavailable_reason()
        if reason:
            raise ClusterUnavailable(reason)
        if not self.keep:
            _register(self)
        try:
            self._create()
        except BaseException:
            self.down()
            raise
        self._is_up = True
        return self

    def _create(self) -> None:
        lay, br_ns = self.layout, self.layout.bridge_namespace
        for ns in lay.namespaces:
            self._made.append(ns)  # before `add`: a half-made namespace is removed too
            _ip(["netns", "add", ns])
            _ip(["-n", ns, "link", "set", "lo", "up"])
        for i in range(lay.hosts):
            self._write_hosts_file(i)
        _ip(["-n", br_ns, "link", "add", lay.bridge, "mtu", str(self.mtu), "type", "bridge"])
        _ip(["-n", br_ns, "link", "set", lay.bridge, "up"])
        for i in range(lay.hosts):
            ns, dev, port = lay.host_namespace(i), lay.host_interface(i), lay.bridge_port(i)
            _ip(["link", "add", dev, "netns", ns, "mtu", str(self.mtu), "type", "veth",
                 "peer", "name", port, "netns", br_ns, "mtu", str(self.mtu)])
            _ip(["-n", br_ns, "link", "set", port, "master", lay.bridge])
            _ip(["-n", br_ns, "link", "set", port, "up"])
            _ip(["-n", ns, "addr", "add", f"{lay.address(i)}/{lay.PREFIX_LEN}", "dev", dev])
            _ip(["-n", ns, "link", "set", dev, "up"])
            if self.tbf is not None:  # egress of both ends: both directions limited
                _ip(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *self.tbf.tc_args()])
                _ip(["tc", "-n", br_ns, "qdisc", "add", "dev", port, "root", *self.tbf.tc_args()])

    def _write_hosts_file(self, i: int) -> None:
        """``/etc/hosts`` as host ``i`` sees it: every host as ``h0``, ``h1``, ... and this machine's
        hostname as host ``i``'s own address, so name lookups (torchrun's, gloo's) answer from
        the file instead of asking a DNS server the namespace cannot reach."""
        lines = ["127.0.0.1 localhost", f"{self.address(i)} {socket.gethostname()}"]
        lines += [f"{self.address(j)} h{j}" for j in range(self.hosts)]
        # the rendezvous store listens on IPv6 and sees its clients as IPv4-mapped addresses;
        # glibc does not look those up as IPv4, so c10d warned "hostname ... cannot be retrieved"
        lines += [f"::ffff:{self.address(j)} h{j}" for j in range(self.hosts)]
        d = os.path.join(ETC_NETNS, self.namespace(i))
        for attempt in range(5):  # another cluster's down() may remove an empty ETC_NETNS meanwhile
            try:
                os.makedirs(d, exist_ok=True)
                with open(os.path.join(d, "hosts"), "w") as f:
                    f.write("\n".join(lines) + "\n")
                return
            except FileNotFoundError:
                if attempt == 4:
                    raise

    def down(self) -> None:
        """End every process in the cluster's namespaces and delete them (idempotent)."""
        try:
            live = [p for p in self._procs if p.poll() is None]
            kill_pids([p.pid for p in live], grace=1.0)
            for p in live:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            names = self.layout.namespaces if (self._is_up or self.keep) else list(self._made)
            remove_cluster(names)
        finally:
            self._made.clear()
            self._is_up = False
            _unregister(self)

    # --- running commands inside a host
    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """The argv that runs ``argv`` inside host ``host``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def popen(self, host: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
              **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside host ``host`` in a new session (its own process group).

        ``env`` is *added* to this process's environment. stdin defaults to /dev/null. The
        process is ended by :meth:`down` if still running.
        """
        self._require_up()
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        kwargs.setdefault("start_new_session", True)
        p = subprocess.Popen(self.command(host, argv), env={**os.environ, **(env or {})}, **kwargs)
        self._procs.append(p)
        return p

    def run(self, host: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
            timeout: float = 60.0, check: bool = False) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside host ``host`` to completion (text output captured); on timeout
        its process group is killed and :class:`subprocess.TimeoutExpired` raised."""
        p = self.popen(host, argv, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_pids([p.pid], grace=0.5)
            p.communicate()
            raise
        done = subprocess.CompletedProcess(p.args, p.returncode, out, err)
        if check:
            done.check_returncode()
        return done

    def pids(self) -> dict[str, list[int]]:
        """Processes now inside each of the cluster's namespaces."""
        return {ns: namespace_pids(ns) for ns in self.layout.namespaces}

    def describe(self) -> dict[str, Any]:
        """The cluster as a JSON-able dict (id, hosts with namespace/interface/address, link)."""
        return {
            "cluster_id": self.cluster_id,
            "bandwidth_bits_per_second": self.bandwidth_bits,
            "mtu": self.mtu,
            "tbf": None if self.tbf is None else {"rate_bits": self.tbf.rate_bits, "burst_bytes": self.tbf.burst_bytes,
                                                  "limit_bytes": self.tbf.limit_bytes},
            "bridge_namespace": self.layout.bridge_namespace,
            "hosts": [{"namespace": self.namespace(i), "interface": self.interface(i), "address": self.address(i)}
                      for i in range(self.hosts)],
        }

    def _require_up(self) -> None:
        if not self._is_up:
            raise ClusterError(f"emulated cluster {self.cluster_id} is not up; use it inside "
                               "`with EmulatedCluster(...)` or call up() first")

    @classmethod
    def attach(cls, cluster_id: str) -> EmulatedCluster:
        """An object for a cluster left up by ``pipetrain cluster up`` (``keep=True``: leaving it
        does not remove the cluster; call :meth:`down` to)."""
        nss = list_clusters().get(cluster_id)
        if not nss:
            raise ClusterError(f"no emulated cluster {cluster_id!r} on this machine; `pipetrain cluster status` "
                               "lists them")
        info = cluster_info(cluster_id)
        rate = info["hosts"][0]["rate"] if info["hosts"] else None
        c = cls(len(info["hosts"]), rate, cluster_id=cluster_id, keep=True)
        c._is_up = True
        return c

