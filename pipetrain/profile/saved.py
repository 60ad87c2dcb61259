"""What each node's forward saves for its backward, storage by storage (the memory model's input).

:class:`SavedBytes` maps every live storage to the node whose output first held it (a view's
storage stays its root's), so a tensor a node's forward saves is either a weight (left out:
counted once per version by the memory model), an earlier node's output (``saved_inputs``:
that node's), or new (``saved_bytes``). The profiler frees a node's output once no later node
reads it; :meth:`SavedBytes.release` forgets its storages then, so an address the allocator
hands out again is never taken for the freed node's.
"""
from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.fx
from torch.utils import _pytree as pytree

__all__ = ["SavedBytes"]


def _storages(value: Any) -> list[int]:
    return [t.untyped_storage().data_ptr() for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


class SavedBytes:
    """Owners of the live storages, and what a forward saves (class docstring)."""

    def __init__(self, gm: torch.fx.GraphModule, held: Collection[int] = ()) -> None:
        """``held``: the storages of weights given storage while the graph runs (a live
        collection: :attr:`pipetrain.graph.held.HeldTensors.storages`), weights too."""
        self.weights = {t.untyped_storage().data_ptr() for t in [*gm.parameters(), *gm.buffers()]}
        self.held = held
        self.owner: dict[int, str] = {}
        self._holders: dict[int, int] = {}  # storage -> live registered values holding it

    def register(self, name: str, value: Any) -> None:
        """``value`` (node ``name``'s output) is live: its new storages are ``name``'s."""
        for ptr in _storages(value):
            self.owner.setdefault(ptr, name)
            self._holders[ptr] = self._holders.get(ptr, 0) + 1

    def release(self, value: Any) -> None:
        """``value`` is freed: storages no live value holds any more are forgotten."""
        for ptr in _storages(value):
            left = self._holders.get(ptr, 0) - 1
            if left > 0:
                self._holders[ptr] = left
            else:
                self._holders.pop(ptr, None)
                self.owner.pop(ptr, None)

    def measure(self, run: Callable[[], Any]) -> tuple[Any, int, list[str], bool]:
        """``run()`` under saved-tensor hooks: (output, new bytes, saved earlier nodes, output saved)."""
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            st = t.untyped_storage()
            saved[st.data_ptr()] = st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = run()
        outs = set(_storages(out))
        new, inputs, output_saved = 0, [], False
        for ptr, nbytes in saved.items():
            if ptr == 0 or ptr in self.weights or ptr in self.held:
                continue
            if ptr in self.owner:
                if self.owner[ptr] not in inputs:
                    inputs.append(self.owner[ptr])
                continue
            new += nbytes
            output_saved = output_saved or ptr in outs
        return out, new, inputs, output_saved
