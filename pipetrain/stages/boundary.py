"""What crosses a stage boundary: values, their wire tensors and their codecs.

A value crossing a cut is usually one tensor, but fx graphs also pass Python ints (``x.size(0)``
feeding a ``view``), ``torch.Size``, tuples of tensors (an LSTM's ``(out, (h, c))``) and
constants. A :class:`ValueCodec`, built from the value one example run produced, turns a value
into *wire tensors* and back:

- every tensor leaf is one wire tensor (shape and dtype known, so receives are pre-allocated);
- every int/float/bool leaf is packed, with the value's other scalars, into one small 1-D
  tensor (int64, or float64 when a float is among them) and converted back on arrival;
- anything else (``None``, dtypes, strings, ...) is a constant of the structure, not sent.

A wire tensor ``needs_grad`` when it is floating point and, in the example run with trainable
parameters, required grad: the receiver makes it a leaf that requires grad and the sender
expects its gradient back. Both ends derive the same codecs from the same example run.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["WireSpec", "ValueCodec", "BoundaryCodec"]


@dataclass(frozen=True)
class WireSpec:
    """Shape, dtype and gradient need of one wire tensor (for one unit)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    needs_grad: bool = False

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


# Template nodes: ("t", i) tensor leaf i; ("s", j, kind) scalar leaf j; ("c", value) constant;
# ("seq", cls, children) tuple/list/torch.Size; ("dict", keys, children).
_Template = tuple


class ValueCodec:
    """Encode one boundary value into wire tensors and decode it back (see module docstring)."""

    def __init__(self, example: Any) -> None:
        self.tensor_specs: list[WireSpec] = []
        self.scalar_kinds: list[type] = []
        self.template: _Template = self._build(example)
        self.scalar_dtype = torch.float64 if float in self.scalar_kinds else torch.int64
        self.specs: list[WireSpec] = list(self.tensor_specs)
        if self.scalar_kinds:
            self.specs.append(WireSpec((len(self.scalar_kinds),), self.scalar_dtype, False))
        self.is_plain_tensor = self.template[0] == "t" and not self.scalar_kinds

    def _build(self, v: Any) -> _Template:
        if isinstance(v, Tensor):
            needs = bool(v.requires_grad and (v.is_floating_point() or v.is_complex()))
            self.tensor_specs.append(WireSpec(tuple(int(d) for d in v.shape), v.dtype, needs))
            return ("t", len(self.tensor_specs) - 1)
        if isinstance(v, (bool, int, float)):
            kind = bool if isinstance(v, bool) else (int if isinstance(v, int) else float)
            self.scalar_kinds.append(kind)
            return ("s", len(self.scalar_kinds) - 1, kind)
        if isinstance(v, (tuple, list)):  # torch.Size is a tuple
            return ("seq", type(v), [self._build(x) for x in v])
        if isinstance(v, dict):
            return ("dict", type(v), list(v.keys()), [self._build(x) for x in v.values()])
        return ("c", v)

    # -- encode --------------------------------------------------------------------------
    def encode(self, value: Any, device: torch.device) -> list[Tensor]:
        """The wire tensors of ``value`` (tensors as they are; scalars packed)."""
        if self.is_plain_tensor:
            return [value]
        tensors: list[Tensor] = []
        scalars: list[Any] = []
        self._flatten(self.template, value, tensors, scalars)
        if self.scalar_kinds:
            tensors.append(torch.tensor([float(s) if self.scalar_dtype == torch.float64 else int(s) for s in scalars],
                                        dtype=self.scalar_dtype, device=device))
        return tensors

    def _flatten(self, t: _Template, v: Any, tensors: list[Tensor], scalars: list[Any]) -> None:
        kind = t[0]
        if kind == "t":
            tensors.append(v)
        elif kind == "s":
            scalars.append(v)
        elif kind == "seq":
            for ct, cv in zip(t[2], v):
                self._flatten(ct, cv, tensors, scalars)
        elif kind == "dict":
            for ct, key in zip(t[3], t[2]):
                self._flatten(ct, v[key], tensors, scalars)

    # -- decode --------------------------------------------------------------------------
    def decode(self, wires: Sequence[Tensor]) -> Any:
        """The value from its wire tensors (in :attr:`specs` order)."""
        if self.is_plain_tensor:
            return wires[0]
        scalars: list[Any] = []
        if self.scalar_kinds:
            raw = wires[len(self.tensor_specs)].tolist()
            scalars = [k(x) for k, x in zip(self.scalar_kinds, raw)]
        return self._unflatten(self.template, wires, scalars)

    def _unflatten(self, t: _Template, wires: Sequence[Tensor], scalars: list[Any]) -> Any:
        kind = t[0]
        if kind == "t":
            return wires[t[1]]
        if kind == "s":
            return scalars[t[1]]
        if kind == "seq":
            items = [self._unflatten(c, wires, scalars) for c in t[2]]
            cls = t[1]
            if cls is torch.Size:
                return torch.Size(items)
            if cls in (tuple, list):
                return cls(items)
            try:
                return cls(*items)  # namedtuple
            except TypeError:
                return tuple(items)
        if kind == "dict":
            d = {k: self._unflatten(c, wires, scalars) for k, c in zip(t[2], t[3])}
            try:
                return t[1](d)
            except TypeError:
                return d
        return t[1]


class BoundaryCodec:
    """All values crossing one cut, in order, and their concatenated wire tensors."""

    def __init__(self, names: Sequence[str], codecs: Sequence[ValueCodec]) -> None:
        self.names = list(names)
        self.codecs = list(codecs)
        self.specs: list[WireSpec] = [s for c in self.codecs for s in c.specs]
        self._slices: list[tuple[int, int]] = []
        start = 0
        for c in self.codecs:
            self._slices.append((start, start + len(c.specs)))
            start += len(c.specs)
        #: indices (into :attr:`specs`) of the wire tensors whose gradient travels back
        self.grad_indices: list[int] = [i for i, s in enumerate(self.specs) if s.needs_grad]
        self.all_plain = all(c.is_plain_tensor for c in self.codecs)

    def encode(self, values: Sequence[Any], device: torch.device) -> list[Tensor]:
        if self.all_plain:
            return list(values)
        out: list[Tensor] = []
        for c, v in zip(self.codecs, values):
            out.extend(c.encode(v, device))
        return out

    def decode(self, wires: Sequence[Tensor]) -> list[Any]:
        if self.all_plain:
            return list(wires)
        return [c.decode(wires[a:b]) for c, (a, b) in zip(self.codecs, self._slices)]

    @property
    def nbytes(self) -> int:
        """Bytes on the wire per unit (forward direction)."""
        return sum(s.nbytes for s in self.specs)
