"""Emulated cluster, without root: names and addresses, rates, tbf parameters, the calibration
fit and file, the delay model, launch commands, and the cleanup logic against a fake ``ip``."""
from __future__ import annotations

import argparse
import ipaddress
import json
import math
import signal
from pathlib import Path
from typing import Any

import pytest

import pipetrain.cluster.netns as netns
from pipetrain.cluster.calibration import (
    Calibration,
    LinkFit,
    Sample,
    curve_seconds,
    fit_link,
    fit_samples,
    load_calibration,
    measured_curve,
)
from pipetrain.cluster.delay import MessageDelay, message_delay
from pipetrain.cluster.errors import CalibrationError, ClusterError
from pipetrain.cluster.launch import (
    AgentResult,
    ClusterRunResult,
    agent_command,
    agent_env,
)
from pipetrain.cluster.names import (
    MAX_HOSTS,
    MTU,
    ClusterLayout,
    format_rate,
    new_cluster_id,
    parse_namespace,
    parse_rate,
    tbf_params,
)
from pipetrain.errors import PipetrainError
from pipetrain.plan.calibrated import calibrated_topology

pytestmark = pytest.mark.timeout(60)


# ----------------------------------------------------------------------------- names and addresses


def test_layout_names_fit_linux_limits_and_are_unique() -> None:
    lay = ClusterLayout("a1b2c3", MAX_HOSTS)
    links = [lay.bridge] + [f(i) for i in range(lay.hosts) for f in (lay.host_interface, lay.bridge_port)]
    assert max(len(n) for n in links) <= 15
    assert len(set(links)) == len(links) and all(n.startswith(lay.link_prefix) for n in links)
    assert len(set(lay.namespaces)) == lay.hosts + 1
    net = ipaddress.ip_network("198.18.0.0/15")
    addrs = [lay.address(i) for i in range(lay.hosts)]
    assert len(set(addrs)) == lay.hosts and all(ipaddress.ip_address(a) in net for a in addrs)
    assert addrs[0] == "198.18.0.1" and addrs[-1] == "198.18.0.253"
    assert lay.namespaces[-1] == lay.bridge_namespace  # hosts first, the bridge last


def test_parse_namespace_recognises_only_pipetrain_namespaces() -> None:
    lay = ClusterLayout("0f0f0f", 3)
    assert [parse_namespace(n) for n in lay.namespaces] == [("0f0f0f", "h0"), ("0f0f0f", "h1"), ("0f0f0f", "h2"),
                                                           ("0f0f0f", "br")]
    for other in ("pipetrain-xyz-h0", "pipetrain-0f0f0f", "netns1", "pipetrain-0f0f0f-h", "pipetrain-0F0F0F-h0"):
        assert parse_namespace(other) is None


def test_cluster_ids_are_fresh_and_well_formed() -> None:
    ids = {new_cluster_id() for _ in range(50)}
    assert len(ids) == 50
    for i in ids:
        ClusterLayout(i, 1)  # valid


@pytest.mark.parametrize("cid, hosts, message", [
    ("a1b2c3", 0, r"an emulated cluster has 1 to 253 hosts .* got 0; pass --hosts between 1 and 253"),
    ("a1b2c3", 254, r"got 254"),
    ("A1B2C3", 2, r"cluster id must be 6 lowercase hex digits, got 'A1B2C3'"),
    ("a1b2", 2, r"cluster id must be 6 lowercase hex digits"),
])
def test_layout_errors(cid: str, hosts: int, message: str) -> None:
    with pytest.raises(ClusterError, match=message):
        ClusterLayout(cid, hosts)


def test_host_index_out_of_range() -> None:
    with pytest.raises(ClusterError, match=r"host index must be in 0..1 for a cluster of 2 hosts, got 2"):
        ClusterLayout("a1b2c3", 2).address(2)


@pytest.mark.parametrize("text, bits", [
    ("50Mbit", 50_000_000), ("50mbit", 50_000_000), ("1.5Gbit", 1_500_000_000), ("800kbit", 800_000),
    ("2000000", 2_000_000), (100e6, 100_000_000), ("100 Mbit/s", 100_000_000),
])
def test_parse_rate(text: Any, bits: int) -> None:
    assert parse_rate(text) == bits


@pytest.mark.parametrize("text, message", [
    ("50MB", r"bandwidth must be a number of bits per second .* got '50MB'"),
    ("50Mbps", r"got '50Mbps'"),
    ("fast", r"got 'fast'"),
    ("0", r"bandwidth must be between 8kbit and 1Tbit per second, got '0'"),
    (-5, r"between 8kbit and 1Tbit"),
])
def test_parse_rate_errors(text: Any, message: str) -> None:
    with pytest.raises(ClusterError, match=message):
        parse_rate(text)


def test_format_rate_round_trips() -> None:
    for bits in (50_000_000, 1_000_000_000, 800_000, 12_345):
        assert parse_rate(format_rate(bits)) == bits
    assert format_rate(50_000_000) == "50Mbit"


@pytest.mark.parametrize("rate", [8_000, 1_000_000, 50_000_000, 1_000_000_000, 10_000_000_000])
def test_tbf_bucket_holds_jumbo_packets_and_a_millisecond(rate: int) -> None:
    p = tbf_params(rate)
    assert p.burst_bytes >= 2 * MTU  # tbf drops packets larger than its bucket
    assert p.burst_bytes >= rate / 8 * 0.001
    assert p.limit_bytes >= 4 * p.burst_bytes
    assert p.tc_args() == ["tbf", "rate", f"{rate}bit", "burst", str(p.burst_bytes), "limit", str(p.limit_bytes)]


# ----------------------------------------------------------------------------- calibration fit and file


def test_fit_recovers_latency_and_bandwidth() -> None:
    lat, bw = 5e-5, 6.25e6
    sizes = [4, 4096, 65536, 1 << 20, 4 << 20]
    fit = fit_link(sizes, [lat + s / bw for s in sizes])
    assert fit.latency_seconds == pytest.approx(lat + 4 / bw)
    assert fit.bandwidth_bytes_per_second == pytest.approx(bw, rel=1e-4)
    assert fit.seconds(1 << 20) == pytest.approx(lat + (1 << 20) / bw, rel=1e-4)


def test_fit_ignores_a_token_bucket_burst_and_a_slow_small_size() -> None:
    """Large messages gain a bucket's worth of bytes at line speed (a negative intercept); one
    small size was slowed by the CPU scheduler. Bandwidth within 5%, latency the fastest time."""
    bw, burst = 6.25e6, 36_400
    sizes = [4, 4096, 16384, 65536, 262144, 1 << 20]
    times = [6e-5, 4e-3] + [max(6e-5, (s - burst) / bw) + 6e-5 for s in sizes[2:]]
    fit = fit_link(sizes, times)
    assert fit.latency_seconds == pytest.approx(6e-5)
    assert fit.bandwidth_bytes_per_second == pytest.approx(bw, rel=0.05)


def test_the_calibration_fits_each_sizes_mean_what_a_run_pays_for_its_transfers() -> None:
    """The fastest repetitions say what the link can do; a run's time adds up its transfers,
    so it pays their mean, the scheduler's delays on shared cores included: the fit is of the
    means, of the medians where a sample has no mean, of the fastest where it has neither,
    and of the kind asked for."""
    lat, bw = 1e-4, 2.5e9
    sizes = [4, 4096, 1 << 20, 4 << 20, 16 << 20]
    samples = [Sample("allreduce", n, lat + n / bw, 15, 2 * (lat + n / bw), 3 * (lat + n / bw)) for n in sizes]
    samples += [Sample("p2p", n, lat + n / (2 * bw), 15, None) for n in sizes]
    samples += [Sample("old", n, lat + n / bw, 15, 2 * (lat + n / bw)) for n in sizes]
    ar = fit_samples(samples, "allreduce")
    assert ar.latency_seconds == pytest.approx(3 * (lat + 4 / bw))
    assert ar.bandwidth_bytes_per_second == pytest.approx(bw / 3, rel=1e-4)  # the means: three times as slow
    assert ar.seconds(8 << 20) == pytest.approx(3 * (lat + (8 << 20) / bw), rel=1e-3)
    assert fit_samples(samples, "old").bandwidth_bytes_per_second == pytest.approx(bw / 2, rel=1e-4)  # medians
    p2p = fit_samples(samples, "p2p")  # neither: the fastest
    assert p2p.bandwidth_bytes_per_second == pytest.approx(2 * bw, rel=1e-4)
    with pytest.raises(CalibrationError, match="2 or more message sizes"):
        fit_samples(samples[:1], "allreduce")


def test_the_measured_curve_never_falls_and_is_read_between_and_beyond_its_sizes() -> None:
    """An all-reduce's measured means by size, as the 2-core loopback gives them (a jump at
    64 KiB, a larger size measured faster than a smaller one): the curve pools the violators
    into their mean so it never falls, reads linearly between sizes, holds the smallest size's
    time below them and adds the fitted seconds per byte above them. The two-parameter fit
    through the same points says far less at 256 KiB."""
    ms = 1e-3
    sizes = [4, 4096, 65536, 262144, 1 << 20, 4 << 20]
    means = [0.3 * ms, 0.7 * ms, 2.8 * ms, 3.3 * ms, 2.7 * ms, 6.0 * ms]
    samples = tuple(Sample("allreduce", n, t / 3, 40, t / 2, t) for n, t in zip(sizes, means))
    samples += (Sample("p2p", 4, 1e-5, 40, 1e-5, 1e-5),)
    curve = measured_curve(samples, "allreduce")
    assert [s for s, _ in curve] == sizes
    assert [t for _, t in curve] == pytest.approx([0.3 * ms, 0.7 * ms, 2.8 * ms, 3.0 * ms, 3.0 * ms, 6.0 * ms])
    assert all(a[1] <= b[1] for a, b in zip(curve, curve[1:]))
    per_byte = 1 / 1e9
    assert curve_seconds(curve, 1, per_byte) == pytest.approx(0.3 * ms)
    assert curve_seconds(curve, 4096, per_byte) == pytest.approx(0.7 * ms)
    assert curve_seconds(curve, (65536 + 262144) / 2, per_byte) == pytest.approx(2.9 * ms)
    assert curve_seconds(curve, (4 << 20) + 1e6, per_byte) == pytest.approx(6.0 * ms + 1e-3)
    fit = fit_samples(samples, "allreduce")
    assert fit.seconds(262144) < 0.4 * curve_seconds(curve, 262144, per_byte)
    cal = Calibration(p2p=LinkFit(1e-5, 1e9), allreduce=fit, allreduce_ranks=2, hosts=1, ranks=2,
                      where="loopback", samples=samples)
    assert cal.allreduce_curve == curve
    assert measured_curve((), "allreduce") == ()
    # a file written before the means were kept reads its medians
    older = Calibration.from_dict({**cal.to_dict(), "samples": [
        {k: v for k, v in vars(s).items() if k != "mean_seconds"} for s in samples]})
    assert older.allreduce_curve[0][1] == pytest.approx(0.15 * ms)


def test_fit_errors() -> None:
    with pytest.raises(CalibrationError, match=r"needs times at 2 or more message sizes, got 1; measure more sizes"):
        fit_link([4, 4], [1e-4, 1e-4])
    with pytest.raises(CalibrationError, match=r"measured times do not grow with message size"):
        fit_link([4, 4096], [1e-3, 1e-3])


def _calibration() -> Calibration:
    return Calibration(p2p=LinkFit(6e-5, 6.3e6), allreduce=LinkFit(2e-4, 6.0e6), allreduce_ranks=2, hosts=2,
                       ranks=2, where="emulated", bandwidth_limit_bits_per_second=50_000_000,
                       samples=(Sample("p2p", 4, 6e-5, 15, 8e-5), Sample("allreduce", 4096, 3e-4, 15)),
                       measured_at="2026-12-01T04:00:00Z", seconds=4.2)


def test_calibration_file_round_trips(tmp_path: Path) -> None:
    cal = _calibration()
    cal.save(tmp_path / "cal.json")
    assert load_calibration(tmp_path / "cal.json") == cal
    d = json.loads((tmp_path / "cal.json").read_text())
    assert d["format"] == "pipetrain-calibration" and d["version"] == 1
    assert d["p2p"] == {"latency_seconds": 6e-5, "bandwidth_bytes_per_second": 6.3e6}
    assert cal.allreduce_bus_bandwidth == pytest.approx(6.0e6)  # 2 ranks: 2 (n-1)/n = 1
    four = Calibration.from_dict({**d, "allreduce_ranks": 4})
    assert four.allreduce_bus_bandwidth == pytest.approx(6.0e6 * 1.5)
    topo = calibrated_topology(cal, 4)
    assert topo.total_workers == 4 and topo.levels[0].bandwidth == 6.3e6
    assert cal.compute_slowdown == 1.0 and "compute_slowdown" in d  # written; absent (older files): 1.0
    del d["compute_slowdown"]
    assert Calibration.from_dict(d).compute_slowdown == 1.0
    assert Calibration.from_dict({**d, "compute_slowdown": 1.4}).compute_slowdown == 1.4


@pytest.mark.parametrize("edit, message", [
    ({"format": "pipetrain-plan"}, r"is not a pipetrain calibration \(format must be 'pipetrain-calibration'\)"),
    ({"version": 7}, r"has calibration version 7, this pipetrain reads version 1"),
    ({"p2p": {"latency_seconds": 1e-5, "bandwidth_bytes_per_second": -1}},
     r"p2p needs latency_seconds >= 0 and bandwidth_bytes_per_second > 0, got 1e-05 and -1"),
    ({"hosts": None}, r"is malformed \(TypeError"),
    ({"compute_slowdown": 0}, r"compute_slowdown must be a number > 0, got 0"),
])
def test_calibration_file_errors(tmp_path: Path, edit: dict[str, Any], message: str) -> None:
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({**_calibration().to_dict(), **edit}))
    with pytest.raises(CalibrationError, match=message):
        load_calibration(path)


def test_missing_or_broken_calibration_file(tmp_path: Path) -> None:
    with pytest.raises(CalibrationError, match=r"calibration file '.*nope.json' does not exist"):
        load_calibration(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(CalibrationError, match=r"is not readable JSON"):
        load_calibration(tmp_path / "bad.json")


# ----------------------------------------------------------------------------- delay model


def test_message_delay_is_latency_plus_bytes_over_bandwidth() -> None:
    assert message_delay(1_000_000, 0.001, 1e6) == pytest.approx(1.001)
    assert message_delay(1_000_000, 0.001) == 0.001
    d = MessageDelay(0.002, 6.25e6)
    assert d.seconds(6250) == pytest.approx(0.003)
    assert MessageDelay.from_env(d.to_env()) == d
    assert MessageDelay.from_env({}) is None
    assert MessageDelay.from_env({"PIPETRAIN_LINK_LATENCY": "0.0005"}) == MessageDelay(0.0005)
    assert MessageDelay.from_env({"PIPETRAIN_LINK_BANDWIDTH": "50Mbit"}) == MessageDelay(0.0, 6.25e6)


def test_message_delay_errors() -> None:
    with pytest.raises(ClusterError, match=r"link latency must be a finite number of seconds >= 0, got -1"):
        MessageDelay(-1)
    with pytest.raises(ClusterError, match=r"PIPETRAIN_LINK_LATENCY must be seconds .* got '1ms'"):
        MessageDelay.from_env({"PIPETRAIN_LINK_LATENCY": "1ms"})
    with pytest.raises(ClusterError, match=r"link bandwidth must be > 0 bytes/s, got nan"):
        MessageDelay(0.0, math.nan)


# ----------------------------------------------------------------------------- launch commands


def test_agent_command_and_environment() -> None:
    c = netns.EmulatedCluster(3, "100Mbit", cluster_id="abc123")  # not brought up: names only
    cmd = agent_command(c, 2, ["-m", "pipetrain", "train"], nproc_per_node=2, port=29400, run_id="pt-1",
                        timeout=60)
    i = cmd.index("--rdzv-endpoint")
    assert cmd[i + 1] == "198.18.0.1:29400"
    assert cmd[cmd.index("--nnodes") + 1] == "3" and cmd[cmd.index("--nproc-per-node") + 1] == "2"
    assert cmd[cmd.index("--local-addr") + 1] == "198.18.0.3"
    assert cmd[cmd.index("--rdzv-conf") + 1] == "is_host=0,join_timeout=60"
    assert cmd[cmd.index("--rdzv-backend") + 1] == "c10d" and cmd[-3:] == ["-m", "pipetrain", "train"]
    cmd0 = agent_command(c, 0, [], 1, 29400, "pt-1", 60)
    assert cmd0[cmd0.index("--rdzv-conf") + 1].startswith("is_host=1,")
    env = agent_env(c, 2, "pt-1", {"X": "1"})
    assert env["GLOO_SOCKET_IFNAME"] == "ptabc123h2" == env["TP_SOCKET_IFNAME"]
    assert env["OMP_NUM_THREADS"] == "1" and env["PIPETRAIN_CLUSTER_RUN"] == "pt-1" and env["X"] == "1"


def test_run_result_exit_code_and_json() -> None:
    ok = ClusterRunResult([AgentResult(0, 0, '{"steps": 3}\n', ""), AgentResult(1, 0, "", "")], 1.0)
    assert ok.ok and ok.returncode == 0 and ok.json_output() == {"steps": 3}
    bad = ClusterRunResult([AgentResult(0, 0, "", ""), AgentResult(1, 1, "", "boom\n")], 1.0)
    assert not bad.ok and bad.returncode == 1 and bad.json_output() is None and "host 1: exit 1\nboom" in \
        bad.describe_failure()
    late = ClusterRunResult([AgentResult(0, None, "", "", killed=True)], 9.0, timed_out=True)
    assert late.returncode == 124 and "(killed)" in late.describe_failure()


def test_popen_needs_a_cluster_that_is_up() -> None:
    with pytest.raises(ClusterError, match=r"emulated cluster abc123 is not up; use it inside `with"):
        netns.EmulatedCluster(2, cluster_id="abc123").popen(0, ["true"])


# ----------------------------------------------------------------------------- cleanup logic, fake `ip`


class FakeIp:
    """Records `ip`/`tc` commands and keeps a set of namespaces; fails on a chosen command."""

    def __init__(self, namespaces: list[str] | None = None, fail_on: str | None = None) -> None:
        self.namespaces = list(namespaces or [])
        self.fail_on = fail_on
        self.calls: list[list[str]] = []

    def __call__(self, args: list[str], check: bool = True, timeout: float = 0) -> Any:
        import subprocess

        self.calls.append(list(args))
        out, rc = "", 0
        if self.fail_on and self.fail_on in " ".join(args):
            rc = 2
        elif args[:2] == ["netns", "add"]:
            self.namespaces.append(args[2])
        elif args[:2] == ["netns", "del"]:
            self.namespaces.remove(args[2])
        elif args[:2] == ["netns", "list"]:
            out = "".join(f"{n} (id: {k})\n" for k, n in enumerate(self.namespaces))
        if rc and check:
            raise RuntimeError(f"`ip {' '.join(args)}` failed (exit {rc}): fake failure")
        return subprocess.CompletedProcess(args, rc, out, "")

    def deleted(self) -> list[str]:
        return [c[2] for c in self.calls if c[:2] == ["netns", "del"]]


@pytest.fixture
def fake_ip(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeIp:
    fake = FakeIp(["netns-of-someone-else"])
    monkeypatch.setattr(netns, "_ip", fake)
    monkeypatch.setattr(netns, "unavailable_reason", lambda: None)
    monkeypatch.setattr(netns, "ETC_NETNS", str(tmp_path / "etc-netns"))
    return fake


def test_failed_setup_removes_what_it_made(fake_ip: FakeIp, tmp_path: Path) -> None:
    fake_ip.fail_on = "type veth"
    before = signal.getsignal(signal.SIGTERM)
    c = netns.EmulatedCluster(2, "50Mbit", cluster_id="c0ffee")
    with pytest.raises(RuntimeError, match="fake failure"), c:
        pass
    assert fake_ip.namespaces == ["netns-of-someone-else"]
    assert fake_ip.deleted() == ["pipetrain-c0ffee-h0", "pipetrain-c0ffee-h1", "pipetrain-c0ffee-br"]
    assert not (tmp_path / "etc-netns").exists()  # hosts files and the emptied directory
    assert not c.is_up and "c0ffee" not in netns._LIVE
    assert signal.getsignal(signal.SIGTERM) == before


def test_up_then_down_removes_everything_and_restores_handlers(fake_ip: FakeIp, tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGINT)
    with netns.EmulatedCluster(2, "50Mbit", cluster_id="beef01") as c:
        assert signal.getsignal(signal.SIGINT) is netns._on_signal
        hosts = (tmp_path / "etc-netns" / "pipetrain-beef01-h1" / "hosts").read_text().splitlines()
        assert hosts[1].startswith("198.18.0.2 ")  # this machine's hostname: host 1's own address
        assert hosts[-4:] == ["198.18.0.1 h0", "198.18.0.2 h1", "::ffff:198.18.0.1 h0", "::ffff:198.18.0.2 h1"]
        tc = [x for x in fake_ip.calls if x[0] == "tc"]
        assert len(tc) == 4  # both ends of both veths
        assert sorted(x[x.index("dev") + 1] for x in tc) == ["ptbeef01h0", "ptbeef01h1", "ptbeef01p0", "ptbeef01p1"]
        assert c.is_up
    assert fake_ip.namespaces == ["netns-of-someone-else"]
    assert signal.getsignal(signal.SIGINT) == before
    assert not (tmp_path / "etc-netns").exists()


def test_sigterm_removes_the_cluster_then_runs_the_previous_handler(fake_ip: FakeIp) -> None:
    import os

    seen: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    try:
        with netns.EmulatedCluster(1, cluster_id="5e5e5e"):
            os.kill(os.getpid(), signal.SIGTERM)
            # the handler ran (Python runs it between bytecodes): the cluster is gone already
            assert fake_ip.namespaces == ["netns-of-someone-else"] and seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_remove_leftovers_touches_only_pipetrain_namespaces(fake_ip: FakeIp) -> None:
    fake_ip.namespaces += ["pipetrain-aaaaaa-br", "pipetrain-aaaaaa-h0", "pipetrain-bbbbbb-h0", "pipetrain-bbbbbb-br",
                           "pipetrain-nothex-h0"]
    assert netns.remove_leftovers("aaaaaa") == ["pipetrain-aaaaaa-h0", "pipetrain-aaaaaa-br"]  # hosts first
    assert netns.remove_leftovers() == ["pipetrain-bbbbbb-h0", "pipetrain-bbbbbb-br"]
    assert fake_ip.namespaces == ["netns-of-someone-else", "pipetrain-nothex-h0"]


# ----------------------------------------------------------------------------- command-line errors


def _parse(argv: list[str]) -> argparse.Namespace:
    from pipetrain.cli import calibrate_cmd, cluster_cmd

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    cluster_cmd.register(sub)
    calibrate_cmd.register(sub)
    return parser.parse_args(argv)


@pytest.mark.parametrize("argv, message", [
    (["cluster", "run", "--hosts", "2"], r"pipetrain cluster run needs the command to run after --"),
    (["cluster", "down"], r"pipetrain cluster down needs cluster ids or --all \(not both\)"),
    (["calibrate", "--bandwidth", "50Mbit"], r"--bandwidth applies to a new emulated cluster; add --hosts 2"),
    (["calibrate", "--hosts", "2", "--cluster", "abcdef"], r"pass --hosts N .* or --cluster ID .*, not both"),
    (["calibrate", "--ranks", "1"], r"calibration needs 2 or more ranks, got 1; use --ranks 2"),
])
def test_command_line_errors(argv: list[str], message: str) -> None:
    a = _parse(argv)
    with pytest.raises(PipetrainError, match=message):
        a.func(a)
