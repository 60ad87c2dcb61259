"""Reading and writing profiles: JSON version 1 and PipeDream's text format.

``load_profile(path)`` picks the reader by extension (``.txt``: PipeDream text, anything
else: JSON). Every reader returns nodes in a topological order (stable: a file already in
topological order keeps its order) and rejects cycles, duplicate names, edges to unknown
nodes and negative costs with a one-line :class:`~pipetrain.errors.ProfileError`.

Example::

    >>> prof = load_profile("tests/data/profiles/vgg16.txt")   # doctest: +SKIP
    >>> save_profile(prof, "vgg16.json"); load_profile("vgg16.json").names == prof.names
    True
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..errors import ProfileError
from .checks import check_costs, topological_nodes
from .types import PROFILE_VERSION, NodeProfile, Profile

#: Node kinds a profile may hold (the LayerGraph's: model inputs, leaf modules, functional ops).
NODE_KINDS = ("input", "module", "function")

#: Fields every JSON node must have (``op``, ``inputs`` and ``kind`` have defaults).
REQUIRED_NODE_FIELDS = ("name", "forward_time", "backward_time", "activation_bytes", "parameter_bytes")


# -- JSON ----------------------------------------------------------------------------------
def profile_to_dict(profile: Profile) -> dict[str, Any]:
    """The JSON (version 1) form of ``profile``."""
    return {
        "version": PROFILE_VERSION,
        "model": profile.model,
        "batch_size": profile.batch_size,
        "device": profile.device,
        "optimizer": profile.optimizer,
        "optimizer_state_bytes_per_parameter_byte": profile.optimizer_state_bytes_per_parameter_byte,
        "nodes": [
            {"name": n.name, "op": n.op, "kind": n.kind, "forward_time": n.forward_time,
             "backward_time": n.backward_time, "activation_bytes": n.activation_bytes,
             "parameter_bytes": n.parameter_bytes, "inputs": list(n.inputs),
             **({"saved_bytes": n.saved_bytes, "saved_inputs": list(n.saved_inputs), "output_saved": n.output_saved}
                if n.saved_bytes is not None else {})}
            for n in profile.nodes
        ],
        **({"loss_saved_bytes": profile.loss_saved_bytes, "loss_saves_output": profile.loss_saves_output}
           if profile.loss_saved_bytes is not None else {}),
        **({"measured_step": {"forward_time": profile.measured_forward_time,
                              "backward_time": profile.measured_backward_time,
                              **({"first_node": profile.measured_from} if profile.measured_from else {})}}
           if profile.measured_step_time is not None else {}),
    }


def profile_from_dict(d: Any, source: str = "<dict>") -> Profile:
    """Build and validate a Profile from its JSON (version 1) form; ``source`` names it in errors."""
    if not isinstance(d, dict):
        raise ProfileError(f"{source}: a profile must be a JSON object, got {type(d).__name__}; "
                           "write it with save_profile or `pipetrain profile`")
    if "nodes" not in d and "stages" in d:
        raise ProfileError(
            f"{source} is a plan, not a profile (it has 'stages' but no 'nodes'); pass the profile the plan was "
            f"made from (a .json written by `pipetrain profile --output` or a PipeDream .txt)"
        )
    if "version" not in d:
        raise ProfileError(f"{source}: missing field 'version'; a profile needs \"version\": {PROFILE_VERSION}; "
                           "add it or regenerate the profile")
    if d["version"] != PROFILE_VERSION:
        raise ProfileError(
            f"{source}: profile version {d['version']!r} is not supported (this pipetrain reads version "
            f"{PROFILE_VERSION}); regenerate it with `pipetrain profile`"
        )
    raw = d.get("nodes")
    if not isinstance(raw, list):
        raise ProfileError(f"{source}: field 'nodes' must be a list of node objects, got {type(raw).__name__}; "
                           "add the nodes")
    nodes: list[NodeProfile] = []
    for i, nd in enumerate(raw):
        if not isinstance(nd, dict):
            raise ProfileError(f"{source}: node {i} must be an object, got {type(nd).__name__}; fix the profile")
        label = nd.get("name", i)
        for f in REQUIRED_NODE_FIELDS:
            if f not in nd:
                raise ProfileError(f"{source}: node {label!r} misses field {f!r}; "
                                   f"every node needs {', '.join(REQUIRED_NODE_FIELDS)}; add it")
        if not isinstance(nd["name"], str) or not nd["name"]:
            raise ProfileError(f"{source}: node {i} has name={nd['name']!r}; node names must be non-empty strings; "
                               f"quote it, e.g. \"name\": \"{nd['name']}\"")
        kind = nd.get("kind", "module")
        if kind not in NODE_KINDS:
            raise ProfileError(f"{source}: node {label!r} has kind={kind!r}; kind must be one of "
                               f"{', '.join(NODE_KINDS)}; fix it (or drop it: the default is 'module')")
        inputs = nd.get("inputs", [])
        if not isinstance(inputs, list) or not all(isinstance(s, str) for s in inputs):
            raise ProfileError(f"{source}: node {label!r} has inputs={inputs!r}; inputs must be a list of node names; "
                               "fix it")
        node = NodeProfile(
            name=str(nd["name"]), op=str(nd.get("op", "")), forward_time=nd["forward_time"],
            backward_time=nd["backward_time"], activation_bytes=nd["activation_bytes"],
            parameter_bytes=nd["parameter_bytes"], inputs=list(inputs), kind=kind,
            saved_bytes=_optional_bytes(nd.get("saved_bytes"), source, label, "saved_bytes"),
            saved_inputs=[str(x) for x in nd.get("saved_inputs", [])], output_saved=bool(nd.get("output_saved", False)),
        )
        check_costs(node, source)
        nodes.append(node)
    batch = d.get("batch_size")
    if batch is not None and (not isinstance(batch, int) or isinstance(batch, bool) or batch <= 0):
        raise ProfileError(f"{source}: batch_size={batch!r} must be a positive integer or null; fix it")
    osb = d.get("optimizer_state_bytes_per_parameter_byte", 1.0)
    if not isinstance(osb, (int, float)) or isinstance(osb, bool) or not 0 <= osb < math.inf:
        raise ProfileError(f"{source}: optimizer_state_bytes_per_parameter_byte={osb!r} must be a finite number >= 0; "
                           "fix it")
    step = _measured_step(d.get("measured_step"), source)
    if not nodes:
        raise ProfileError(f"{source}: the profile has no nodes; "
                           "profile a model with `pipetrain profile --model NAME --output FILE`")
    if step[2] is not None and step[2] not in {n.name for n in nodes}:
        raise ProfileError(f"{source}: measured_step names first_node {step[2]!r}, which is not a node of the "
                           "profile; fix it or drop measured_step")
    return Profile(
        model=str(d.get("model", "")), batch_size=batch, nodes=topological_nodes(nodes, source),
        device=str(d.get("device", "unknown")), optimizer=str(d.get("optimizer", "sgd")),
        optimizer_state_bytes_per_parameter_byte=float(osb),
        loss_saved_bytes=_optional_bytes(d.get("loss_saved_bytes"), source, "loss", "loss_saved_bytes"),
        loss_saves_output=bool(d.get("loss_saves_output", False)),
        measured_forward_time=step[0], measured_backward_time=step[1], measured_from=step[2],
    )


def _measured_step(v: Any, source: str) -> tuple[float | None, float | None, str | None]:
    """(forward, backward) seconds and first node of the optional ``measured_step`` object
    (all None when absent)."""
    if v is None:
        return None, None, None
    times: list[Any] = [v.get(k) for k in ("forward_time", "backward_time")] if isinstance(v, dict) else [None]
    if not all(isinstance(t, (int, float)) and not isinstance(t, bool) and 0 <= t < math.inf for t in times):
        raise ProfileError(f"{source}: measured_step={v!r} must be {{\"forward_time\": S, \"backward_time\": S}} "
                           "with finite seconds >= 0; fix it or drop it")
    first = v.get("first_node")
    if first is not None and not isinstance(first, str):
        raise ProfileError(f"{source}: measured_step first_node={first!r} must be a node name; fix it or drop it")
    return float(times[0]), float(times[1]), first


def _optional_bytes(v: Any, source: str, label: Any, name: str) -> int | None:
    """An optional byte count of a profile (None when absent); ProfileError unless an integer >= 0."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or v != int(v):
        raise ProfileError(f"{source}: {label!r} has {name}={v!r}; it must be an integer >= 0 (bytes); fix it")
    return int(v)


def save_profile(profile: Profile, path: str | Path) -> None:
    """Write ``profile`` as JSON version 1 (whatever the extension); ProfileError if ``path`` cannot be written."""
    try:
        Path(path).write_text(json.dumps(profile_to_dict(profile), indent=1))
    except OSError as e:
        raise ProfileError(
            f"cannot write profile {str(path)!r}: {e.strerror or e}; "
            "choose a writable file path (does the directory exist?)"
        ) from None


def load_profile(path: str | Path) -> Profile:
    """Read a profile: PipeDream text for ``.txt``, JSON version 1 otherwise."""
    if not isinstance(path, (str, Path)) or not str(path):
        raise ProfileError(f"a profile path must be a non-empty str or Path, got {path!r}; "
                           "pass e.g. load_profile('model.json')")
    p = Path(path)
    if p.is_dir():
        raise ProfileError(f"profile file {str(p)!r} is a directory; "
                           "pass a profile file (.json, or PipeDream .txt) inside it")
    if not p.is_file():
        raise ProfileError(
            f"profile file {str(p)!r} does not exist; "
            f"create one with `pipetrain profile MODEL --output {p.name}` or pass a PipeDream .txt profile"
        )
    if p.suffix.lower() == ".txt":
        from .pipedream_txt import load_pipedream_txt

        return load_pipedream_txt(p)
    try:
        d = json.loads(p.read_text())
    except OSError as e:
        raise ProfileError(f"cannot read profile file {str(p)!r} ({e.strerror or e}); check its permissions") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProfileError(
            f"profile file {str(p)!r} is not JSON ({e}); "
            "profiles are JSON version 1 or PipeDream text with a .txt extension; regenerate it"
        ) from None
    return profile_from_dict(d, str(p))


def names_of(nodes: Iterable[NodeProfile]) -> list[str]:
    """Names of ``nodes`` (a small helper for callers and tests)."""
    return [n.name for n in nodes]
