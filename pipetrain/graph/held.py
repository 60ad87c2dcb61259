"""Real tensors for a weightless captured graph, a few at a time, for timing it.

A graph captured on ``meta`` (:mod:`pipetrain.job.model`) holds no parameter storage. To time
it (the planner's quick profile, a stage timed as a whole) :class:`HeldTensors` gives the
tensors a node reads real storage just before the node runs and puts the graph's own meta
tensors back once no node still to run reads them, so a pass over the graph holds one
segment's parameters (and what a caller pins), never the whole model's. Operations the
capture wrote a ``meta`` device into create their tensors on the timing device meanwhile.
Whatever happens inside, :meth:`HeldTensors.restore` (or leaving the ``with`` block) leaves
the graph exactly as it was: the same meta tensor objects under the same names, the same
node arguments, so the capture stays the one the launcher plans, ships and checks.

Values: ``value(name)`` (the files' value of that tensor, a buffer kept at the build) where it
has one, else a stand-in: normal(0, 0.02) floating point from a generator seeded by the
name, zeros otherwise. Timing a layer does not depend on its values (the graph's shapes
and operations are fixed by the capture); a stand-in is never trained or saved.
"""
from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, cast

import torch
import torch.fx
from torch import nn

__all__ = ["HeldTensors", "ValueOf", "STAND_IN_STD", "TRIM_EVERY", "let_go", "on_meta", "trim_heap", "retarget",
           "undo_retarget"]

_T = TypeVar("_T", bound=torch.Tensor)

#: The standard deviation of a floating-point stand-in value.
STAND_IN_STD = 0.02

ValueOf = Callable[[str], "torch.Tensor | None"]


def _owner(gm: nn.Module, target: str) -> tuple[nn.Module, str]:
    prefix, _, leaf = target.rpartition(".")
    return (gm.get_submodule(prefix) if prefix else gm), leaf


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _stand_in(t: torch.Tensor, name: str, device: torch.device) -> torch.Tensor:
    if t.is_floating_point():
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        return torch.empty(t.shape, dtype=t.dtype).normal_(0.0, STAND_IN_STD, generator=g).to(device)
    return torch.zeros(t.shape, dtype=t.dtype, device=device)


#: Bytes put back after which :meth:`HeldTensors.release` hands freed heap memory back to
#: the kernel (:func:`trim_heap`).
TRIM_EVERY = 64 << 20


def on_meta(t: _T) -> _T:
    """An empty tensor on ``meta`` of ``t``'s shape and dtype; of a parameter, a parameter
    that keeps its ``requires_grad``."""
    meta = torch.empty_like(t, device="meta")
    return cast(_T, nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta)


def trim_heap() -> None:
    """Give the kernel back the heap pages freed tensors left (glibc's ``malloc_trim``; nothing
    elsewhere). Tensors below glibc's mmap threshold come from the heap, and a pass that frees
    and allocates layer after layer leaves it fragmented: without this the process's resident
    set grows with every layer it times, though it holds only one at a time."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


Moved = list[tuple[torch.fx.GraphModule, torch.fx.Node, Any, Any]]


def retarget(gm: torch.fx.GraphModule, device: torch.device) -> Moved:
    """Make the operations of ``gm`` (and its GraphModule children) that create tensors on
    ``meta`` (``torch.export`` writes the example's device into ``arange``, ``full``...)
    create them on ``device``; what changed, for :func:`undo_retarget`."""
    meta = torch.device("meta")

    def swap(a: Any) -> Any:
        return device if isinstance(a, torch.device) and a == meta else a

    moved: Moved = []
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        changed = False
        for n in module.graph.nodes:
            args = torch.fx.node.map_aggregate(n.args, swap)
            kwargs = torch.fx.node.map_aggregate(n.kwargs, swap)
            if args != n.args or kwargs != n.kwargs:
                moved.append((module, n, n.args, n.kwargs))
                n.args, n.kwargs = args, kwargs  # type: ignore[assignment]
                changed = True
        if changed:
            module.recompile()
    return moved


def undo_retarget(moved: Moved) -> None:
    """The nodes :func:`retarget` changed, as they were."""
    modules = {id(m): m for m, _, _, _ in moved}
    for _, n, args, kwargs in moved:
        n.args, n.kwargs = args, kwargs
    for m in modules.values():
        m.recompile()


def let_go(module: nn.Module, root: nn.Module) -> None:
    """Drop the tensors ``module``'s own submodules hold (those not also ``root``'s: a
    ``call_module`` target it shares stays as it is). A GraphModule built on ``root`` to time
    part of its graph (its module and its graph refer to each other) is freed only by the
    cyclic collector's full pass; the held tensors it refers to, and their gradients, must go
    when the timing is done."""
    shared = {id(m) for m in root.modules()}
    for m in module.modules():
        if id(m) not in shared:
            for name in [n for n, _ in (*m.named_parameters(recurse=False), *m.named_buffers(recurse=False))]:
                delattr(m, name)


class HeldTensors:
    """The meta tensors a graph's nodes read, given storage on demand (module docstring).

    A node's tensors are its ``get_attr`` inputs' targets and, for a ``call_module`` node,
    the module's own parameters and buffers. Two names of one tensor (a tie) share one real
    tensor. :meth:`hold` gives a node's tensors storage; :meth:`done` says a node has run;
    :meth:`release` puts back every tensor whose nodes have all run and that is not pinned.
    """

    def __init__(self, gm: torch.fx.GraphModule, value: ValueOf | None = None,
                 device: torch.device | str = "cpu") -> None:
        self.gm, self.value, self.device = gm, value, torch.device(device)
        self.targets: dict[torch.fx.Node, list[str]] = {}
        self.original: dict[str, torch.Tensor] = {}
        for n in gm.graph.nodes:
            names = self._names_of(n)
            if names:
                self.targets[n] = names
        self.left: dict[int, int] = {}  # id of a meta tensor -> nodes still to run that read it
        for names in self.targets.values():
            for key in {id(self.original[t]) for t in names}:
                self.left[key] = self.left.get(key, 0) + 1
        self.names: dict[int, list[str]] = {}
        for name, t in self.original.items():
            self.names.setdefault(id(t), []).append(name)
        self.real: dict[int, torch.Tensor] = {}
        #: the storages of the held tensors (kept up to date)
        self.storages: set[int] = set()
        self.pinned: set[int] = set()
        self.held_bytes = 0  # bytes of the tensors held now
        self.peak_bytes = 0
        self._freed = 0  # bytes put back since the heap was last trimmed
        # operations the capture wrote the meta device into create their tensors on the
        # timing device meanwhile (until restore)
        self.moved = retarget(gm, self.device) if self.original else []

    def _names_of(self, n: torch.fx.Node) -> list[str]:
        found: list[str] = []

        def add(name: str, t: Any) -> None:
            if isinstance(t, torch.Tensor) and t.is_meta:
                self.original.setdefault(name, t)
                found.append(name)

        if n.op in ("get_attr", "placeholder", "output"):
            return []  # a tensor is held for the nodes that compute with it
        def add_module(prefix: str, module: nn.Module) -> None:
            for name, t in [*module.named_parameters(), *module.named_buffers()]:
                add(f"{prefix}.{name}", t)

        for a in n.all_input_nodes:
            if a.op == "get_attr":
                owner, leaf = _owner(self.gm, str(a.target))
                value = getattr(owner, leaf, None)
                if isinstance(value, nn.Module):  # a higher-order op's subgraph: the tensors it reads
                    add_module(str(a.target), value)
                else:
                    add(str(a.target), value)
        if n.op == "call_module":
            add_module(str(n.target), self.gm.get_submodule(str(n.target)))
        return found

    @property
    def weightless(self) -> bool:
        """Whether any node reads a meta tensor (else there is nothing to hold)."""
        return bool(self.original)

    def sizes(self, node: torch.fx.Node) -> dict[int, int]:
        """``node``'s tensors: id of the meta tensor -> its bytes (a tie once)."""
        return {id(t): _nbytes(t) for t in (self.original[name] for name in self.targets.get(node, []))}

    def nbytes(self, node: torch.fx.Node, seen: set[int]) -> int:
        """Bytes of ``node``'s tensors not in ``seen`` (ids; updated with them)."""
        new = {k: b for k, b in self.sizes(node).items() if k not in seen}
        seen.update(new)
        return sum(new.values())

    @property
    def total_bytes(self) -> int:
        return sum(_nbytes(t) for t in {id(t): t for t in self.original.values()}.values())

    def pin(self, nodes: Iterable[torch.fx.Node]) -> None:
        """Keep exactly ``nodes``' tensors held once held, until :meth:`restore` or the next
        ``pin``: a tensor pinned before and not now goes at the next :meth:`release` once
        its nodes have all run."""
        self.pinned = {id(self.original[t]) for n in nodes for t in self.targets.get(n, [])}

    def hold(self, node: torch.fx.Node) -> None:
        """Real storage for every tensor ``node`` reads (the graph's attributes point at it)."""
        for name in self.targets.get(node, []):
            key = id(self.original[name])
            if key not in self.real:
                self._give(key)

    def _give(self, key: int) -> None:
        names = self.names[key]
        meta = self.original[names[0]]
        found = next((v for v in (self.value(n) for n in names) if v is not None), None) if self.value else None
        real = (found.to(self.device, meta.dtype) if found is not None
                else _stand_in(meta, names[0], self.device)).reshape(meta.shape)
        new: torch.Tensor = (nn.Parameter(real, requires_grad=meta.requires_grad) if isinstance(meta, nn.Parameter)
                             else real)
        self.real[key] = new
        self.storages.add(new.untyped_storage().data_ptr())
        for name in names:
            owner, leaf = _owner(self.gm, name)
            setattr(owner, leaf, new)
        self.held_bytes += _nbytes(new)
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def done(self, node: torch.fx.Node) -> None:
        """``node`` has run (its tensors may go at the next :meth:`release`)."""
        for key in {id(self.original[t]) for t in self.targets.get(node, [])}:
            self.left[key] -= 1

    def release(self) -> None:
        """Put back every held tensor no node still to run reads, unless pinned."""
        for key in [k for k in self.real if self.left.get(k, 0) <= 0 and k not in self.pinned]:
            self._freed += self._put_back(key)
        if self._freed >= TRIM_EVERY:
            self._freed = 0
            trim_heap()

    def _put_back(self, key: int) -> int:
        """Put back one held tensor; its bytes."""
        real = self.real.pop(key)
        self.storages.discard(real.untyped_storage().data_ptr())
        real.grad = None
        for name in self.names[key]:
            owner, leaf = _owner(self.gm, name)
            setattr(owner, leaf, self.original[name])
        self.held_bytes -= _nbytes(real)
        return _nbytes(real)

    def zero_grad(self) -> None:
        for t in self.real.values():
            t.grad = None

    def restore(self) -> None:
        """The graph as it was: every name on its own meta tensor again."""
        for key in list(self.real):
            self._put_back(key)
        trim_heap()
        undo_retarget(self.moved)
        self.moved = []

    def __enter__(self) -> HeldTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()
