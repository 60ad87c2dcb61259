"""The random operations of a captured graph and the per-unit stream they draw from.

The rule (docs/runtime.md, "Random operations"): while a training unit runs, every random
node ``n`` of the captured graph (dropout in any form, ``rand``/``randn``/``bernoulli``...,
attention with dropout) starts from the global generator seeded with

    unit_seed(seed, u, n.name) = blake2b(f"{seed}:{u}:{n.name}") (63 bits)

where ``seed`` is the run's ``--seed`` and ``u = t * m + j`` the global index of the unit
(microbatch ``j`` of minibatch ``t``, ``m`` microbatches per minibatch). The masks therefore
depend on the unit and the node only: not on the layout, the stage holding the node, the
order in which a schedule runs units, or how often a unit's forward runs (a recompute draws
the same masks). One worker running the whole graph, every pipeline stage and the reference
replay apply the same rule, so every synchronous schedule equals one worker with the same
microbatches.

How: :func:`insert_seeding` puts a call of :func:`draw_from_stream` (the node's name as its
argument) before every random node of a graph; outside :func:`unit_stream` that call does
nothing, so the graph behaves as plain PyTorch (the global generator, as it is). Inside, the
global generator state is saved on entry and restored on exit: training leaves the user's
random stream as it was.
"""
from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Iterator, Sequence
from numbers import Number
from typing import Any

import torch
import torch.fx
from torch import nn

__all__ = ["draw_from_stream", "insert_seeding", "is_random_node", "random_nodes", "seeded_module", "unit_seed",
           "unit_stream"]

# torch.nn layers that draw random numbers in training mode (their ``p`` is the probability).
_RANDOM_LAYERS: tuple[type[nn.Module], ...] = (
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout, nn.RReLU,
)
# Python-level random functions with no ATen op of the same name (ATen ops are recognised by
# their ``nondeterministic_seeded`` tag).
_RANDOM_FUNCTIONS = {"dropout1d", "dropout2d", "dropout3d", "gumbel_softmax", "feature_alpha_dropout"}
# Where a dropout-like op takes its probability and its training flag: (position, keyword).
_PROBABILITY_ARG = {
    "dropout": (1, "p"), "dropout1d": (1, "p"), "dropout2d": (1, "p"), "dropout3d": (1, "p"),
    "alpha_dropout": (1, "p"), "feature_alpha_dropout": (1, "p"), "feature_dropout": (1, "p"),
    "native_dropout": (1, "p"), "scaled_dot_product_attention": (4, "dropout_p"),
}
_TRAINING_ARG = {
    "dropout": (2, "training"), "alpha_dropout": (2, "training"), "feature_alpha_dropout": (2, "training"),
    "feature_dropout": (2, "train"), "dropout1d": (2, "training"), "dropout2d": (2, "training"),
    "dropout3d": (2, "training"), "native_dropout": (2, "train"),
}


def unit_seed(seed: int, unit: int, key: str) -> int:
    """The generator seed of random node ``key`` in the forward of global unit ``unit``."""
    digest = hashlib.blake2b(f"{seed}:{unit}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class _Active(threading.local):
    def __init__(self) -> None:
        self.streams: list[tuple[int, int, tuple[int, ...]]] = []  # (seed, unit, CUDA device indices)


_ACTIVE = _Active()


@contextlib.contextmanager
def unit_stream(seed: int, unit: int, devices: Sequence[torch.device] = ()) -> Iterator[None]:
    """Run a block (a forward of global unit ``unit``) under the per-unit stream: the random
    nodes of seeded graphs draw from ``unit_seed(seed, unit, node)``; the global generators
    (CPU, and the CUDA ones of ``devices``) are restored afterwards."""
    cuda = sorted({d.index or 0 for d in devices if d.type == "cuda"})
    with torch.random.fork_rng(devices=cuda, enabled=True):
        _ACTIVE.streams.append((seed, unit, tuple(cuda)))
        try:
            yield
        finally:
            _ACTIVE.streams.pop()


@torch.fx.node.has_side_effect
def draw_from_stream(key: str) -> None:
    """Seed the global generator for random node ``key`` of the running unit (no-op outside
    :func:`unit_stream`)."""
    if _ACTIVE.streams:
        seed, unit, cuda = _ACTIVE.streams[-1]
        value = unit_seed(seed, unit, key)
        # the generators the stream forked, as torch.manual_seed would seed them; torch.manual_seed
        # itself also queues a lazy seeding of every CUDA device (a Python stack trace per call
        # on a machine without CUDA: a fifth of a small model's forward)
        torch.default_generator.manual_seed(value)
        for index in cuda:
            torch.cuda.default_generators[index].manual_seed(value)


def _op_name(node: torch.fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t.rsplit(".", 1)[-1]
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name.split("::")[-1]
    if isinstance(t, torch._ops.OpOverloadPacket):
        return str(t).rsplit(".", 1)[-1]
    return getattr(t, "__name__", "")


def _aten_seeded(name: str) -> bool:
    packet = getattr(torch.ops.aten, name, None) if name and not name.startswith("_") else None
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return False
    return any(torch.Tag.nondeterministic_seeded in getattr(packet, o).tags for o in packet.overloads())


def _argument(node: torch.fx.Node, spec: tuple[int, str] | None) -> Any:
    """The argument at ``spec`` (position, keyword); left out, the op schema's default (an
    omitted ``dropout_p`` of attention is 0: it never draws)."""
    if spec is None:
        return None
    pos, kw = spec
    if kw in node.kwargs:
        return node.kwargs[kw]
    if len(node.args) > pos:
        return node.args[pos]
    target: Any = node.target
    if not isinstance(target, torch._ops.OpOverload):  # a torch function: its ATen op's schema
        target = getattr(getattr(torch.ops.aten, _op_name(node), None), "default", None)
    for a in getattr(getattr(target, "_schema", None), "arguments", ()):
        if a.name == kw and a.has_default_value():
            return a.default_value
    return None


def _never_draws(node: torch.fx.Node, name: str) -> bool:
    """A dropout whose probability is the constant 0, or whose training flag is constant False."""
    p = _argument(node, _PROBABILITY_ARG.get(name))
    training = _argument(node, _TRAINING_ARG.get(name))
    return (isinstance(p, Number) and not isinstance(p, bool) and p == 0) or training is False


def _layer_draws(module: nn.Module) -> bool:
    """Whether a torch.nn layer (a leaf of the graph) holds a random layer or a dropout."""
    for m in module.modules():
        if isinstance(m, _RANDOM_LAYERS) and getattr(m, "p", 1.0) != 0:
            return True
        rate = getattr(m, "dropout", None)
        if isinstance(rate, float) and rate > 0:  # nn.MultiheadAttention, nn.LSTM
            return True
    return False


def _subgraphs(node: torch.fx.Node, gm: torch.fx.GraphModule) -> list[torch.fx.GraphModule]:
    out = []
    for a in node.args:
        if isinstance(a, torch.fx.Node) and a.op == "get_attr":
            sub = getattr(gm, str(a.target), None)
            if isinstance(sub, torch.fx.GraphModule):
                out.append(sub)
    return out


def is_random_node(node: torch.fx.Node, gm: torch.fx.GraphModule) -> bool:
    """Whether running ``node`` draws from the global random generator."""
    if node.op == "call_module":
        return _layer_draws(gm.get_submodule(str(node.target)))
    if node.op not in ("call_function", "call_method"):
        return False
    if isinstance(node.target, torch._ops.HigherOrderOperator):
        return any(is_random_node(n, sub) for sub in _subgraphs(node, gm) for n in sub.graph.nodes)
    name = _op_name(node)
    if isinstance(node.target, torch._ops.OpOverload):
        seeded = torch.Tag.nondeterministic_seeded in node.target.tags
    else:
        seeded = name in _RANDOM_FUNCTIONS or _aten_seeded(name)
    return seeded and not _never_draws(node, name)


def random_nodes(gm: torch.fx.GraphModule) -> list[str]:
    """Names of ``gm``'s random nodes, in graph order."""
    return [n.name for n in gm.graph.nodes if is_random_node(n, gm)]


def insert_seeding(graph: torch.fx.Graph, gm: torch.fx.GraphModule, keys: dict[torch.fx.Node, str]) -> int:
    """Put ``draw_from_stream(keys[n])`` right before every node ``n`` of ``graph`` that
    ``keys`` names (the random nodes, keyed by their name in the captured graph; ``gm`` holds
    the modules they call). Returns how many were put."""
    for n, key in keys.items():
        with graph.inserting_before(n):
            graph.call_function(draw_from_stream, (key,))
    return len(keys)


def seeded_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` with its random nodes drawing from the per-unit stream: a new GraphModule over
    a copy of the graph (same call signature and output structure) that shares ``gm``'s
    parameters, buffers and submodules; ``gm`` itself is unchanged."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, env))
    codegen = getattr(gm.graph, "_codegen", None)  # export graphs: the model's input/output structure
    if codegen is not None:
        graph.set_codegen(codegen)
    insert_seeding(graph, gm, {env[n]: n.name for n in gm.graph.nodes if is_random_node(n, gm)})
    graph.lint()
    out = torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    out.train(gm.training)
    return out

