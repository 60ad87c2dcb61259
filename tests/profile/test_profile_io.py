"""Profile IO: PipeDream text import of the published profiles, JSON round trip, errors."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pipetrain.errors import ProfileError
from pipetrain.profile.io import load_profile, profile_from_dict, profile_to_dict, save_profile
from pipetrain.profile.pipedream_txt import parse_pipedream_txt
from pipetrain.profile.types import NodeProfile, Profile

#: The published PipeDream profiles, carried by the tests (MIT; see data/profiles/NOTICE).
PROFILES = Path(__file__).resolve().parents[1] / "data" / "profiles"
TXT_FILES = sorted(PROFILES.glob("*.txt"))


def raw_counts(path: Path) -> dict:
    """Count nodes, edges and totals straight from the file, independently of the importer."""
    nodes: dict[str, tuple[str, float, float]] = {}
    edges: list[tuple[str, str]] = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        if line.startswith("\t"):
            a, b = line.strip().split(" -- ")
            edges.append((a, b))
        else:
            parts = line.split(" -- ")
            fwd = float(re.search(r"forward_compute_time=([0-9.]+)", parts[-1]).group(1))
            par = float(re.search(r"parameter_size=([0-9.]+)", parts[-1]).group(1))
            nodes[parts[0]] = (parts[1], fwd, par)
    sources = {a for a, _ in edges}
    dropped = {n for n, (d, _, _) in nodes.items() if d.startswith("__getitem__") and n not in sources}
    kept_edges = [(a, b) for a, b in edges if b not in dropped]
    fwd_ms = sum(f for n, (d, f, _) in nodes.items() if n not in dropped and not d.startswith("Input"))
    params = sum(p for n, (_, _, p) in nodes.items() if n not in dropped)
    return {"nodes": len(nodes) - len(dropped), "edges": len(set(kept_edges)), "fwd": fwd_ms / 1000.0,
            "params": params, "dropped": dropped}


@pytest.mark.parametrize("path", TXT_FILES, ids=lambda p: p.stem)
def test_published_profile_imports(path: Path) -> None:
    prof = load_profile(path)
    raw = raw_counts(path)
    assert len(prof) == raw["nodes"]
    assert len(prof.edges()) == raw["edges"]
    assert prof.total_forward_time == pytest.approx(raw["fwd"], rel=1e-12)
    assert prof.total_parameter_bytes == pytest.approx(raw["params"], rel=1e-12)
    assert not raw["dropped"] & set(prof.names)
    # topological order, node names are the file ids, inputs are kind "input"
    seen: set[str] = set()
    for n in prof.nodes:
        assert all(s in seen for s in n.inputs), n.name
        seen.add(n.name)
        assert re.fullmatch(r"node\d+", n.name)
        assert n.is_input == n.op.startswith("Input")
    assert any(n.is_input for n in prof.nodes)


def test_gnmt_details() -> None:
    prof = load_profile(PROFILES / "gnmt.txt")
    assert [n.name for n in prof.nodes if n.is_input] == ["node1", "node2", "node3"]
    # LSTM activation list [6291456.0; 131072.0; 131072.0] is summed; ms -> s
    assert prof["node7"].activation_bytes == 6291456 + 2 * 131072
    assert prof["node7"].forward_time == pytest.approx(3.190e-3)
    assert "node9" not in prof.names and "node8" in prof.names  # unused __getitem__ sink dropped
    assert prof.batch_size is None


def test_alexnet_sorted_and_batch_inferred() -> None:
    prof = load_profile(PROFILES / "alexnet.txt")  # the file lists nodes out of order
    assert prof.names[:3] == ["node1", "node2", "node3"]
    assert prof.batch_size == 256


def _small() -> Profile:
    return Profile(model="toy", batch_size=8, nodes=[
        NodeProfile("x", "Input", 0.0, 0.0, 100, 0, [], "input"),
        NodeProfile("a", "Linear", 0.1, 0.2, 50, 400, ["x"]),
        NodeProfile("b", "ReLU", 0.01, 0.02, 50, 0, ["a"], "function"),
    ], optimizer="adam", optimizer_state_bytes_per_parameter_byte=2.0)


def test_json_round_trip(tmp_path: Path) -> None:
    prof = _small()
    save_profile(prof, tmp_path / "p.json")
    back = load_profile(tmp_path / "p.json")
    assert profile_to_dict(back) == profile_to_dict(prof)
    assert back["b"].kind == "function" and back.optimizer_state_bytes_per_parameter_byte == 2.0


def test_txt_to_json_round_trip(tmp_path: Path) -> None:
    prof = load_profile(PROFILES / "resnet50.txt")
    save_profile(prof, tmp_path / "r.json")
    assert profile_to_dict(load_profile(tmp_path / "r.json")) == profile_to_dict(prof)


def test_json_unsorted_nodes_are_sorted() -> None:
    d = profile_to_dict(_small())
    d["nodes"].reverse()
    assert profile_from_dict(d).names == ["x", "a", "b"]


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="does not exist"):
        load_profile(tmp_path / "nope.json")
    with pytest.raises(ProfileError, match="does not exist"):
        load_profile(tmp_path / "nope.txt")


def test_not_json(tmp_path: Path) -> None:
    (tmp_path / "p.json").write_text("{not json")
    with pytest.raises(ProfileError, match="is not JSON"):
        load_profile(tmp_path / "p.json")


def test_version_errors() -> None:
    d = profile_to_dict(_small())
    del d["version"]
    with pytest.raises(ProfileError, match="missing field 'version'"):
        profile_from_dict(d)
    d["version"] = 2
    with pytest.raises(ProfileError, match="version 2 is not supported"):
        profile_from_dict(d)


def test_missing_node_field() -> None:
    d = profile_to_dict(_small())
    del d["nodes"][1]["backward_time"]
    with pytest.raises(ProfileError, match=r"node 'a' misses field 'backward_time'"):
        profile_from_dict(d)


def test_negative_time() -> None:
    d = profile_to_dict(_small())
    d["nodes"][1]["forward_time"] = -1.0
    with pytest.raises(ProfileError, match=r"node 'a' has forward_time=-1.0"):
        profile_from_dict(d)
    with pytest.raises(ProfileError, match=r"node .node1. has backward_compute_time=-2.0"):
        parse_pipedream_txt("node1 -- Linear -- forward_compute_time=1.0, backward_compute_time=-2.0, "
                            "activation_size=1.0, parameter_size=0.0\n")


def test_edge_to_unknown_node() -> None:
    d = profile_to_dict(_small())
    d["nodes"][2]["inputs"] = ["zz"]
    with pytest.raises(ProfileError, match=r"reads 'zz', which is not a node"):
        profile_from_dict(d)
    text = ("node1 -- Input -- forward_compute_time=0, backward_compute_time=0, activation_size=4, parameter_size=0\n"
            "\tnode1 -- node7\n")
    with pytest.raises(ProfileError, match=r"names node 'node7'"):
        parse_pipedream_txt(text)


def test_cycle_detected() -> None:
    d = profile_to_dict(_small())
    d["nodes"][1]["inputs"] = ["x", "b"]
    with pytest.raises(ProfileError, match=r"cycle through node '(a|b)'"):
        profile_from_dict(d)
    line = "{} -- L -- forward_compute_time=1, backward_compute_time=1, activation_size=4, parameter_size=0\n"
    text = line.format("node1") + line.format("node2") + "\tnode1 -- node2\n\tnode2 -- node1\n"
    with pytest.raises(ProfileError, match=r"cycle through node 'node[12]'"):
        parse_pipedream_txt(text)


def test_unparseable_line() -> None:
    good = "node1 -- Input -- forward_compute_time=0, backward_compute_time=0, activation_size=4, parameter_size=0\n"
    with pytest.raises(ProfileError, match=r"<string>:2: cannot parse line 'node2 garbage'"):
        parse_pipedream_txt(good + "node2 garbage\n")
    with pytest.raises(ProfileError, match=r":2: cannot parse line .*forward_compute_time=abc"):
        parse_pipedream_txt(good + "node2 -- X -- forward_compute_time=abc, backward_compute_time=0, "
                                   "activation_size=4, parameter_size=0\n")


def test_txt_by_extension(tmp_path: Path) -> None:
    text = ("node2 -- Linear -- forward_compute_time=2.0, backward_compute_time=4.0, activation_size=[8.0; 2.0], "
            "parameter_size=16.0\n"
            "node1 -- Input -- forward_compute_time=5.0, backward_compute_time=0.0, activation_size=4.0, "
            "parameter_size=0.0\n"
            "node3 -- __getitem__(1) -- forward_compute_time=0.0, backward_compute_time=0.0, activation_size=2.0, "
            "parameter_size=0.0\n"
            "\tnode1 -- node2\n\tnode2 -- node3\n")
    (tmp_path / "m.txt").write_text(text)
    prof = load_profile(tmp_path / "m.txt")
    assert prof.names == ["node1", "node2"] and prof.model == "m"
    assert prof["node2"].activation_bytes == 10 and prof["node2"].backward_time == pytest.approx(0.004)
    assert prof["node1"].kind == "input" and prof["node2"].inputs == ["node1"]
    json.dumps(profile_to_dict(prof))
