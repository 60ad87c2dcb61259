"""Emulated cluster with root: hosts reach each other only over their tbf links, a 2-stage
pipeline trains across two torchrun agents, calibration measures the link, and nothing
(namespace, link, /etc/netns file, process) is left behind."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from pipetrain.cluster import EmulatedCluster, unavailable_reason
from pipetrain.cluster.netns import ETC_NETNS, list_clusters

REASON = unavailable_reason()
pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(REASON is not None, reason=f"emulated cluster unavailable: {REASON}")]

CONNECT = ("import socket, sys\n"
           "s = socket.create_connection((sys.argv[1], 5001), timeout=5); s.sendall(b'hello'); s.close()\n")
ACCEPT = ("import socket\n"
          "s = socket.socket(); s.bind(('0.0.0.0', 5001)); s.listen(1); print('ready', flush=True)\n"
          "c, a = s.accept(); print(a[0], c.recv(5).decode(), flush=True)\n")


def _links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=10).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line}


def _ours(names: set[str], cluster_id: str) -> set[str]:
    return {n for n in names if cluster_id in n}


def _state(cluster_id: str) -> tuple[set[str], set[str], bool]:
    from pipetrain.cluster.netns import list_namespaces

    etc = os.path.isdir(ETC_NETNS) and any(cluster_id in n for n in os.listdir(ETC_NETNS))
    return _ours(set(list_namespaces()), cluster_id), _ours(_links(), cluster_id), etc


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _marked_anywhere(mark: str) -> list[int]:
    """Processes on the whole machine whose environment carries ``mark`` (e.g. a run id)."""
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/environ", "rb") as f:
                    if mark.encode() in f.read().split(b"\0"):
                        found.append(int(d))
            except OSError:
                pass
    return found


@pytest.fixture
def nothing_left() -> Iterator[list[str]]:
    """Collects cluster ids; afterwards no namespace, link or /etc/netns entry of them exists."""
    ids: list[str] = []
    yield ids
    for cid in ids:
        assert _state(cid) == (set(), set(), False), f"cluster {cid} left {_state(cid)}"


def test_hosts_talk_over_limited_links_and_everything_is_removed(nothing_left: list[str]) -> None:
    with EmulatedCluster(hosts=2, bandwidth="200Mbit") as c:
        nothing_left.append(c.cluster_id)
        nss, links, etc = _state(c.cluster_id)
        assert nss == {f"pipetrain-{c.cluster_id}-{r}" for r in ("h0", "h1", "br")} and etc
        assert links == set()  # every link lives inside the cluster's namespaces
        # both ends of each veth carry the tbf at 200 Mbit/s
        for ns, dev in ((c.namespace(1), c.interface(1)), (c.layout.bridge_namespace, c.layout.bridge_port(1))):
            q = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True, text=True).stdout
            assert "tbf" in q and "rate 200Mbit" in q, q
        server = c.popen(0, [sys.executable, "-c", ACCEPT], stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        client = c.run(1, [sys.executable, "-c", CONNECT, c.address(0)], timeout=30)
        assert client.returncode == 0, client.stderr
        assert server.communicate(timeout=10)[0].split() == [c.address(1), "hello"]
        # a host's only route is its /24 on the bridge: nothing can leave the machine
        for h in range(2):
            assert c.run(h, ["ip", "-4", "route", "show"]).stdout.split() == \
                ["198.18.0.0/24", "dev", c.interface(h), "proto", "kernel", "scope", "link", "src", c.address(h)]
        stray = c.popen(1, ["sleep", "300"])  # still running at exit: down() must end it
    assert not _alive(stray.pid) and not _alive(server.pid)


def test_exception_sigterm_and_sigkill_leave_nothing_behind(nothing_left: list[str]) -> None:
    c = EmulatedCluster(hosts=2, bandwidth="50Mbit")
    with pytest.raises(KeyError), c:
        nothing_left.append(c.cluster_id)
        raise KeyError("boom")
    hold = ("import sys, time\nfrom pipetrain.cluster import EmulatedCluster\n"
            "with EmulatedCluster(hosts=2, bandwidth='50Mbit') as c:\n"
            "    p = c.popen(0, ['sleep', '300'])\n"
            "    print(c.cluster_id, p.pid, flush=True)\n"
            "    time.sleep(60)\n")
    from pipetrain.cluster import remove_leftovers

    for sig in (signal.SIGTERM, signal.SIGKILL):
        p = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
        try:
            assert p.stdout is not None
            cid, sleeper = p.stdout.readline().split()
            nothing_left.append(cid)
            assert cid in list_clusters()
            p.send_signal(sig)
            p.wait(timeout=30)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        if sig == signal.SIGTERM:  # the handler removed it
            assert p.returncode == -signal.SIGTERM and cid not in list_clusters()
            assert not _alive(int(sleeper))
        else:  # nothing can run on SIGKILL: `pipetrain cluster down ID` removes the leftovers
            assert cid in list_clusters() and _alive(int(sleeper))
            removed = remove_leftovers(cid)
            assert set(removed) == {f"pipetrain-{cid}-{r}" for r in ("h0", "h1", "br")}
            time.sleep(0.1)
            assert not _alive(int(sleeper))


COMMON = ["train", "--model", "mlp", "--option", "depth=4", "--option", "width=64", "--schedule", "flush",
          "--batch-size", "8", "--steps", "3", "--json", "--timeout", "60", "--log-every", "0"]
TRAIN = [*COMMON, "--config", "1-1", "--microbatches", "2"]


def _tx_bytes(c: EmulatedCluster, host: int) -> int:
    out = c.run(host, ["cat", f"/sys/class/net/{c.interface(host)}/statistics/tx_bytes"]).stdout
    return int(out)


def _cli(capsys: pytest.CaptureFixture[str], argv: list[str], parse: bool = True) -> dict:
    """``pipetrain ARGV`` in this process; its JSON output (``cluster``/``calibrate`` through
    ``python -m pipetrain.cluster``'s entry point)."""
    from pipetrain.cli import main as pipetrain_main
    from pipetrain.cluster.__main__ import main as cluster_main

    capsys.readouterr()
    rc = (cluster_main if argv[0] in ("cluster", "calibrate") else pipetrain_main)(argv)
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out) if parse else {"stdout": out}


def test_two_emulated_hosts_train_a_two_stage_pipeline(capsys: pytest.CaptureFixture[str],
                                                       nothing_left: list[str]) -> None:
    """The issue's test: two torchrun agents, one per emulated host, train a 2-stage pipeline;
    the activations and gradients cross the veths; the losses equal one process's; nothing is
    left behind."""
    with EmulatedCluster(hosts=2, bandwidth="100Mbit") as c:
        nothing_left.append(c.cluster_id)
        tx0 = [_tx_bytes(c, h) for h in range(2)]
        # `pipetrain cluster run --cluster ID`: the command runs launch_torchrun on this cluster
        res = _cli(capsys, ["cluster", "run", "--cluster", c.cluster_id, "--timeout", "100", "--json-result", "--",
                            *TRAIN])
        assert res["returncode"] == 0 and [a["returncode"] for a in res["agents"]] == [0, 0], res
        tx = [_tx_bytes(c, h) - tx0[h] for h in range(2)]
        assert c.pids()[c.namespace(0)] == [] and c.pids()[c.namespace(1)] == []  # no process of the run left
    out = res["result"]
    assert out is not None and out["workers"] == 2 and out["stages"] == 2 and out["steps"] == 3
    assert all(math.isfinite(x) for x in out["losses"]) and len(out["losses"]) == 3
    # what each worker sent went over its host's veth (plus rendezvous and TCP overhead)
    for h in range(2):
        assert tx[h] >= min(out["bytes_sent"]), (tx, out["bytes_sent"])
    # a synchronous schedule equals plain training in one process
    assert _cli(capsys, [*COMMON, "--workers", "1"])["losses"] == pytest.approx(out["losses"], rel=1e-5)


@pytest.mark.parametrize("forked", [False, True], ids=["interpreters", "fork-server"])
def test_calibration_on_loopback_is_positive_and_finite(forked: bool) -> None:
    """Ranks as fresh interpreters, or forked from the server that has imported torch (the
    launcher's way, ``processes``): the same measurements."""
    from pipetrain.cluster.measure import calibrate
    from pipetrain.runtime.process.forkserver import server_processes

    processes = server_processes() if forked else None
    assert processes is not None or not forked
    cal = calibrate(None, ranks=2, timeout=60, processes=processes)
    for fit in (cal.p2p, cal.allreduce):
        assert 0 < fit.latency_seconds < 1 and math.isfinite(fit.latency_seconds)
        assert 0 < fit.bandwidth_bytes_per_second < math.inf
    assert cal.where == "loopback" and {s.kind for s in cal.samples} == {"p2p", "allreduce"}
    assert 1.0 <= cal.compute_slowdown < 10


def test_forked_calibration_ranks_past_their_timeout_are_ended() -> None:
    """Ranks that cannot finish within the timeout: one error, and none of them is left."""
    import multiprocessing

    from pipetrain.cluster.errors import CalibrationError
    from pipetrain.cluster.measure import calibrate
    from pipetrain.runtime.process.forkserver import server_processes

    with pytest.raises((CalibrationError, RuntimeError), match="calibration"):
        calibrate(None, ranks=2, timeout=0.3, processes=server_processes())
    assert multiprocessing.active_children() == []


@pytest.mark.skipif((os.cpu_count() or 1) > 2, reason="needs more ranks than cores: 4 ranks on at most 2 cores")
def test_more_ranks_than_cores_compute_slower_by_about_their_ratio() -> None:
    """4 one-thread ranks on 2 cores: each computes at about half its speed alone."""
    from pipetrain.cluster.measure import calibrate

    cal = calibrate(None, ranks=4, timeout=60)
    assert 1.4 <= cal.compute_slowdown <= 4.0, cal.compute_slowdown  # about 2; the machine may be shared


def test_calibration_measures_a_50mbit_link_from_the_command_line(capsys: pytest.CaptureFixture[str],
                                                                  nothing_left: list[str], tmp_path: str) -> None:
    from pipetrain.cluster.calibration import load_calibration

    before = set(list_clusters())
    out = os.path.join(str(tmp_path), "cal.json")
    d = _cli(capsys, ["calibrate", "--hosts", "2", "--bandwidth", "50Mbit", "--json", "--output", out])
    assert set(list_clusters()) == before
    cal = load_calibration(out)
    assert cal.to_dict() == d and cal.where == "emulated" and cal.bandwidth_limit_bits_per_second == 50_000_000
    limit = 50e6 / 8
    assert abs(cal.p2p.bandwidth_bytes_per_second / limit - 1) < 0.3, cal.p2p
    assert abs(cal.allreduce_bus_bandwidth / limit - 1) < 0.3, cal.allreduce
    assert 0 < cal.p2p.latency_seconds < 0.01


def test_cluster_command_up_status_exec_down(capsys: pytest.CaptureFixture[str], nothing_left: list[str]) -> None:
    cid = _cli(capsys, ["cluster", "up", "--hosts", "2", "--bandwidth", "20Mbit", "--json"])["cluster_id"]
    nothing_left.append(cid)
    try:
        mine = [c for c in _cli(capsys, ["cluster", "status", "--json"])["clusters"] if c["cluster_id"] == cid]
        assert len(mine) == 1 and [h["address"] for h in mine[0]["hosts"]] == ["198.18.0.1", "198.18.0.2"]
        assert {h["rate"] for h in mine[0]["hosts"]} == {"20Mbit"}
        ex = subprocess.run(["ip", "netns", "exec", f"pipetrain-{cid}-h1", "cat", "/etc/hosts"], capture_output=True,
                            text=True, timeout=10)
        assert "198.18.0.1 h0" in ex.stdout, ex.stderr
    finally:
        down = _cli(capsys, ["cluster", "down", cid], parse=False)["stdout"]
    assert cid not in list_clusters() and down.startswith("removed 3 namespace(s)/link(s): pipetrain-")


def test_a_run_past_its_timeout_is_killed_with_every_worker(tmp_path: str, nothing_left: list[str]) -> None:
    from pipetrain.cluster.launch import launch_torchrun

    script = os.path.join(str(tmp_path), "hang.py")
    with open(script, "w") as f:
        f.write("import time\ntime.sleep(300)\n")
    with EmulatedCluster(hosts=2) as c:
        nothing_left.append(c.cluster_id)
        res = launch_torchrun(c, [script], module=None, timeout=8)
        assert c.pids()[c.namespace(0)] == [] and c.pids()[c.namespace(1)] == []
    assert res.timed_out and res.returncode == 124 and all(a.killed for a in res.agents)
    assert _marked_anywhere(f"PIPETRAIN_CLUSTER_RUN={res.run_id}") == []
