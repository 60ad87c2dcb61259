"""A captured model as plain data: what a process needs to run the graph, without the model's code.

:func:`capture` runs the model's own code (a Hugging Face model's classes, ``torch.export``):
importing and tracing them costs a process about 200 MiB whatever the model's size. A
:class:`PortableCapture` is the capture as picklable data, made once by the process that
captured it and rebuilt by the others (:meth:`PortableCapture.rebuild`) with nothing but
torch's ATen operators and ``torch.fx``:

* the graph as a node table (name, op, target, arguments), every node keeping its name (the
  plan names stages by node names) and the metadata the library reads (``nn_module_stack``
  with its module paths, ``stack_trace``); an ATen operator is written as its qualified name
  (``aten.linear.default``) and looked up again in ``torch.ops``;
* the module tree: plain containers holding the model's parameters and buffers under their
  qualified names (weightless, on ``meta``: no storage), a tensor held under several names
  (a tie) still one tensor; the leaf modules a ``torch.fx`` capture calls are kept as they are;
* the output structure: a Hugging Face ``ModelOutput`` (a class of the model's library) is
  written as a dict with its keys, which :func:`pipetrain.models.output.output_logits` reads
  the same way.

Only what rebuilds exactly is portable: a graph that calls a target which is neither an
operator nor importable by reference, or holds a module subclass other than ``torch.fx``'s
own, raises :class:`NotPortable`, and the caller captures the model itself instead.
"""
from __future__ import annotations

import copy
import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.utils import _pytree as pytree

from . import ops as _ops  # noqa: F401 - registers pipetrain's operators, which a rebuilt graph may call
from .capture import CapturedModel

__all__ = ["NotPortable", "PortableCapture", "portable"]

# node.meta entries kept: what the library reads from a captured graph (plan/cuts.node_modules,
# profile/segments, the stack traces of runtime/process/user_code).
_KEPT_META = ("nn_module_stack", "stack_trace")


class NotPortable(Exception):
    """A capture that cannot be rebuilt from plain data (the message says what)."""


@dataclass(frozen=True)
class _Ref:
    """An argument that is the value of the node named ``name``."""

    name: str


@dataclass(frozen=True)
class _Op:
    """A ``torch.ops`` operator by its qualified name (``aten.linear.default``)."""

    qualname: str

    def resolve(self) -> Any:
        namespace, op, overload = self.qualname.split(".")
        return getattr(getattr(getattr(torch.ops, namespace), op), overload)


def _target(target: Any) -> Any:
    if isinstance(target, torch._ops.OpOverload):
        return _Op(str(target))
    if isinstance(target, str):
        return target
    try:
        pickle.loads(pickle.dumps(target))
    except Exception as exc:  # noqa: BLE001 - whatever pickling raises
        raise NotPortable(f"node target {target!r} cannot be written by reference ({type(exc).__name__})") from None
    return target


def _meta(node: torch.fx.Node) -> dict[str, Any]:
    out: dict[str, Any] = {}
    stack = node.meta.get("nn_module_stack")
    if stack:
        out["nn_module_stack"] = {str(k): (str(v[0]), str(v[1])) if isinstance(v, tuple) else str(v)
                                  for k, v in stack.items()}
    if node.meta.get("stack_trace"):
        out["stack_trace"] = str(node.meta["stack_trace"])
    return out


def _plain_spec(spec: Any) -> Any:
    """``spec`` with every node type that is not a builtin container made a dict of its keys
    (a ``ModelOutput``): rebuildable without the model's library."""
    if spec is None or spec.is_leaf():
        return spec
    children = [_plain_spec(c) for c in spec.children()]
    if spec.type in (tuple, list, dict):
        return pytree.TreeSpec(spec.type, spec.context, children)
    keys = list(spec.context) if isinstance(spec.context, (list, tuple)) else None
    if keys is None or len(keys) != len(children):
        raise NotPortable(f"the model's output type {spec.type.__name__} is not a mapping of its fields")
    return pytree.TreeSpec(dict, keys, children)


def _dumps(spec: Any) -> str | None:
    return None if spec is None else pytree.treespec_dumps(_plain_spec(spec))


def _loads(text: str | None) -> Any:
    return None if text is None else pytree.treespec_loads(text)


def _check_modules(gm: torch.fx.GraphModule) -> None:
    for name, m in gm.named_modules():
        if isinstance(m, torch.fx.GraphModule) and m is not gm:
            raise NotPortable(f"submodule {name!r} is a graph of its own (a higher-order operator)")
        if type(m).__module__.split(".")[0] not in ("torch", "pipetrain"):
            raise NotPortable(f"submodule {name or '<root>'!r} is a {type(m).__module__}.{type(m).__name__}, "
                              f"which the workers would import")


@dataclass
class PortableCapture:
    """A :class:`~pipetrain.graph.capture.CapturedModel` as picklable data (module docstring).

    Attributes:
        captured: the capture's plain fields (its layer graph and name tables); ``gm`` is
            rebuilt by :meth:`rebuild`.
        nodes: ``(name, op, target, args, kwargs, meta)`` in graph order; arguments that
            are node values are :class:`_Ref`.
        root: the module tree holding the model's parameters and buffers (and a ``torch.fx``
            capture's leaf modules).
        in_spec, out_spec: the graph's input and output pytree structure
            (``treespec_dumps``; ``None`` for a ``torch.fx`` capture).
    """

    captured: dict[str, Any]
    nodes: list[tuple[str, str, Any, Any, Any, dict[str, Any]]]
    root: nn.Module
    in_spec: str | None = None
    out_spec: str | None = None
    training: bool = True

    def rebuild(self) -> tuple[CapturedModel, nn.Module]:
        """The capture again, and a fresh copy of :attr:`root` (every tensor under the model's
        names; the graph module holds those its graph reads): a plain ``GraphModule`` over it
        whose nodes have the names, targets, arguments and kept metadata of the original."""
        graph = torch.fx.Graph()
        env: dict[str, torch.fx.Node] = {}

        def arg(a: Any) -> Any:
            return env[a.name] if isinstance(a, _Ref) else a

        for name, op, target, args, kwargs, meta in self.nodes:
            t = target.resolve() if isinstance(target, _Op) else target
            a = pytree.tree_map(arg, args, is_leaf=lambda x: isinstance(x, _Ref))
            k = pytree.tree_map(arg, kwargs, is_leaf=lambda x: isinstance(x, _Ref))
            n = graph.create_node(op, t, tuple(a), dict(k), name=name)
            if n.name != name:
                raise NotPortable(f"node {name!r} came back as {n.name!r}")
            n.meta.update(meta)
            env[name] = n
        if self.in_spec is not None or self.out_spec is not None:
            placeholders = [n.name for n in graph.nodes if n.op == "placeholder"]
            graph.set_codegen(torch.fx.graph._PyTreeCodeGen(  # the model's call structure, as export writes it
                torch.fx.graph._PyTreeInfo(placeholders, _loads(self.in_spec), _loads(self.out_spec))))
        root = copy.deepcopy(self.root)  # a tie stays one tensor (deepcopy's memo)
        gm = torch.fx.GraphModule(root, graph)
        # every tensor under every name, in the capture's order (a tie's first name is its name)
        children = dict(root.named_children())
        extra = {k: m for k, m in gm.named_children() if k not in children}
        for name, child in [*children.items(), *extra.items()]:
            if hasattr(gm, name):
                delattr(gm, name)
            gm.add_module(name, child)
        gm.train(self.training)
        return CapturedModel(gm=gm, **self.captured), root


def _tensor_names(module: nn.Module) -> dict[str, bool]:
    """Every buffer's qualified name and whether ``state_dict`` holds it."""
    saved = set(module.state_dict(keep_vars=True))
    return {name: name in saved for name, _ in module.named_buffers(remove_duplicate=False)}


def portable(captured: CapturedModel) -> PortableCapture:
    """``captured`` as plain data (module docstring); raises :class:`NotPortable` when it
    cannot be rebuilt exactly. The capture must be weightless (its tensors on ``meta``) or
    small: every tensor it holds is part of the data."""
    gm = captured.gm
    _check_modules(gm)
    nodes = []

    def ref(a: Any) -> Any:
        return _Ref(a.name) if isinstance(a, torch.fx.Node) else a

    for n in gm.graph.nodes:
        args = torch.fx.node.map_aggregate(n.args, ref)
        kwargs = torch.fx.node.map_aggregate(n.kwargs, ref)
        nodes.append((n.name, n.op, _target(n.target), args, kwargs, _meta(n)))
    root = nn.Module()
    for name, m in gm.named_children():
        root.add_module(name, m)
    for name, p in gm.named_parameters(recurse=False):
        root.register_parameter(name, p)
    persistent = _tensor_names(gm)
    for name, b in gm.named_buffers(recurse=False):
        root.register_buffer(name, b, persistent=persistent.get(name, True))
    for n in gm.graph.nodes:  # attributes a get_attr reads that are neither (constants)
        if n.op == "get_attr" and "." not in str(n.target) and not hasattr(root, str(n.target)):
            setattr(root, str(n.target), getattr(gm, str(n.target)))
    info = getattr(getattr(gm.graph, "_codegen", None), "pytree_info", None)
    fields = {k: getattr(captured, k) for k in ("graph", "method", "input_names", "output_names",
                                                "shared_parameters", "node_parameters", "folded_attributes",
                                                "unused_parameters")}
    out = PortableCapture(fields, nodes, root,
                          in_spec=_dumps(info.in_spec) if info is not None else None,
                          out_spec=_dumps(info.out_spec) if info is not None else None,
                          training=gm.training)
    try:
        pickle.dumps(out)
    except Exception as exc:  # noqa: BLE001 - whatever pickling raises
        raise NotPortable(f"the capture does not pickle ({type(exc).__name__}: {str(exc)[:160]})") from None
    return out
