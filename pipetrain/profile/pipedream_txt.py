"""Import of PipeDream's per-layer profile text format (``graph.txt``).

Two kinds of lines (see ``shared/profiles/README.md``): a node line (one line in the file,
shown broken here after ``backward_compute_time``) and a tab-indented edge line::

    node12 -- Conv2d(128, 256, ...) -- forward_compute_time=10.814, backward_compute_time=18.335,
        activation_size=411041792.000, parameter_size=1180672.000
    \tnode11 -- node12

Conversion rules:

- times are milliseconds in the file, seconds in the Profile;
- an activation list ``[a; b; c]`` (a node with several outputs) is summed;
- a node whose description starts with ``Input`` gets ``kind="input"`` (the planner gives it
  no cost and keeps it in stage 0);
- sinks whose description starts with ``__getitem__`` (unused outputs) are dropped with
  their edges (one pass over the file's sinks);
- node names are the file ids (``node12``), the description becomes ``op``;
- nodes come out in a topological order: the file's order if it is one, otherwise the
  order of Kahn's algorithm taking ready nodes by their id's number (``node2`` < ``node10``).
"""
from __future__ import annotations

import re
from pathlib import Path

from ..errors import ProfileError
from .checks import check_costs, topological_nodes
from .types import NodeProfile, Profile

#: Bytes of one ImageNet sample (3x224x224 fp32); used to infer the minibatch size.
IMAGENET_SAMPLE_BYTES = 3 * 224 * 224 * 4

_METRICS = ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size")
_NUM = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?(?:inf|nan)"
_METRIC_RE = re.compile(r"^\s*(\w+)\s*=\s*(\[[^\]]*\]|" + _NUM + r")\s*$")
_ID_RE = re.compile(r"^\S+$")


def _natural_key(name: str) -> tuple:
    """``node2`` < ``node10``: split the digits out of a name."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def _number(text: str) -> float:
    text = text.strip()
    if text.startswith("["):
        return sum(float(x) for x in text[1:-1].split(";") if x.strip())
    return float(text)


class _Line:
    """One non-blank line of the file: its text and where it is, for error messages."""

    def __init__(self, source: str, number: int, text: str) -> None:
        self.source = source
        self.number = number
        self.text = text

    @property
    def where(self) -> str:
        return f"{self.source}:{self.number}"

    def unparseable(self, why: str) -> ProfileError:
        return ProfileError(
            f"{self.where}: cannot parse line {self.text.strip()[:120]!r} ({why}); expected "
            f"'ID -- DESCRIPTION -- forward_compute_time=MS, backward_compute_time=MS, activation_size=BYTES, "
            f"parameter_size=BYTES' or a tab-indented edge 'ID -- ID'; fix the file"
        )


def _read_costs(line: _Line, metrics: str) -> dict[str, float]:
    """The ``name=value`` costs of a node line, every one of :data:`_METRICS` present."""
    values: dict[str, float] = {}
    for item in metrics.split(","):
        m = _METRIC_RE.match(item)
        if not m:
            raise line.unparseable(f"cannot read the cost {item.strip()!r}")
        try:
            values[m.group(1)] = _number(m.group(2))
        except ValueError:
            raise line.unparseable(f"cannot read the number in {item.strip()!r}") from None
    missing = [k for k in _METRICS if k not in values]
    if missing:
        raise line.unparseable(f"missing {', '.join(missing)}")
    return values


def _node_of_line(line: _Line, parts: list[str]) -> NodeProfile:
    """The node of a node line split at ``' -- '`` (times converted from ms to s)."""
    if len(parts) < 3:
        raise line.unparseable("a node line has an id, a description and the costs, separated by ' -- '")
    nid, desc, metrics = parts[0], " -- ".join(parts[1:-1]), parts[-1]
    if not _ID_RE.match(nid):
        raise line.unparseable(f"node id {nid!r} contains spaces")
    values = _read_costs(line, metrics)
    for k in _METRICS:
        if not values[k] >= 0 or values[k] == float("inf"):
            raise ProfileError(
                f"{line.where}: node {nid!r} has {k}={values[k]!r}; "
                "times and sizes must be finite numbers >= 0; fix the profile"
            )
    return NodeProfile(
        name=nid, op=desc,
        forward_time=values["forward_compute_time"] / 1000.0,
        backward_time=values["backward_compute_time"] / 1000.0,
        activation_bytes=int(round(values["activation_size"])),
        parameter_bytes=int(round(values["parameter_size"])),
        kind="input" if desc.startswith("Input") else "module",
    )


def _read_lines(text: str, source: str) -> tuple[dict[str, NodeProfile], list[tuple[str, str]]]:
    """The file's nodes (by id, in file order) and its edges ``(src, dst)``."""
    nodes: dict[str, NodeProfile] = {}
    edges: list[tuple[str, str]] = []
    for lineno, text_line in enumerate(text.splitlines(), start=1):
        if not text_line.strip():
            continue
        line = _Line(source, lineno, text_line)
        parts = text_line.strip().split(" -- ")
        if text_line[0] in " \t":  # an edge line
            if len(parts) != 2 or not all(_ID_RE.match(p) for p in parts):
                raise line.unparseable("an indented line must be an edge 'SRC -- DST'")
            edges.append((parts[0], parts[1]))
            continue
        node = _node_of_line(line, parts)
        if node.name in nodes:
            raise ProfileError(f"{line.where}: node id {node.name!r} appears twice; ids must be unique; "
                               "remove or rename one")
        check_costs(node, line.where)
        nodes[node.name] = node
    return nodes, edges


def _connect(nodes: dict[str, NodeProfile], edges: list[tuple[str, str]], source: str) -> set[str]:
    """Add the edges to their destinations' inputs, except into dropped ``__getitem__`` sinks;
    returns the dropped ids."""
    for src, dst in edges:
        for end in (src, dst):
            if end not in nodes:
                raise ProfileError(
                    f"{source}: edge {src} -- {dst} names node {end!r}, which has no node line; "
                    "add the node or remove the edge"
                )
    has_out = {src for src, _ in edges}
    dropped = {n for n in nodes if n not in has_out and nodes[n].op.startswith("__getitem__")}
    for src, dst in edges:
        if dst in dropped:
            continue
        if src not in nodes[dst].inputs:
            nodes[dst].inputs.append(src)
    return dropped


def _imagenet_batch_size(nodes: list[NodeProfile]) -> int | None:
    """The batch size of a model with one input node of whole ImageNet samples, else None."""
    inputs = [n for n in nodes if n.is_input]
    if (len(inputs) == 1 and inputs[0].activation_bytes > 0
            and inputs[0].activation_bytes % IMAGENET_SAMPLE_BYTES == 0):
        return inputs[0].activation_bytes // IMAGENET_SAMPLE_BYTES
    return None


def parse_pipedream_txt(text: str, source: str = "<string>", model: str = "",
                        batch_size: int | None = None) -> Profile:
    """Parse PipeDream profile text into a Profile (see the module docstring for the rules).

    Args:
        text: the file's contents.
        source: the file name, used in error messages.
        model: the model name to record (default: none).
        batch_size: the minibatch size; if None it is inferred when the model has one input
            node whose size is a whole number of ImageNet samples (3x224x224 fp32), else None.
    Raises:
        ProfileError: an unparseable line (with its number and content), a duplicate id, an
            edge to an unknown node, a negative time, or a cycle.
    """
    nodes, edges = _read_lines(text, source)
    dropped = _connect(nodes, edges, source)
    if not nodes:
        raise ProfileError(
            f"{source}: no node lines found; a PipeDream profile lists lines like 'node1 -- Conv2d(...) -- "
            f"forward_compute_time=MS, backward_compute_time=MS, activation_size=BYTES, parameter_size=BYTES'; "
            f"pass a PipeDream graph.txt file"
        )
    kept = [n for nid, n in nodes.items() if nid not in dropped]
    kept = topological_nodes(kept, source, key=lambda nd: _natural_key(nd.name))
    if batch_size is None:
        batch_size = _imagenet_batch_size(kept)
    return Profile(model=model, batch_size=batch_size, nodes=kept, device="unknown")


def load_pipedream_txt(path: str | Path, batch_size: int | None = None) -> Profile:
    """Read a PipeDream ``.txt`` profile; the model name is the file's stem."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ProfileError(f"profile file {str(p)!r} does not exist; "
                           "pass the path of a PipeDream graph .txt file") from None
    except UnicodeDecodeError as e:
        raise ProfileError(f"profile file {str(p)!r} is not text ({e}); pass a PipeDream graph .txt file") from None
    except OSError as e:
        raise ProfileError(f"cannot read profile file {str(p)!r} ({e.strerror or e}); "
                           "pass a readable PipeDream graph .txt file") from None
    return parse_pipedream_txt(text, source=str(p), model=p.stem, batch_size=batch_size)
