"""The benchmark models, taken from pipetrain's zoo, and the cuts every configuration shares.

Two models, built by ``pipetrain.models.get_model`` with the same seed in every process:

- ``mlp``: ``get_model("mlp")``, 16 x (Linear(1024, 1024) + ReLU), batch 64;
- ``lm``: ``get_model("gpt")``, a GPT-style decoder (d 256, 4 heads, 8 pre-LN blocks,
  context 128, vocabulary 8192), batch 16 sequences.

The PyTorch baselines cut an ``nn.Sequential``; pipetrain's ``GPT`` is re-expressed as the
sequence (embedding, block 0..7, final LayerNorm + head) over the *same* modules
(:func:`as_sequential`), so that every configuration trains exactly the model pipetrain
trains, cut in the same place (pipetrain gets the cut as ``--cut`` module names).
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

#: pipetrain model name of each benchmark model, and its batch size.
MODEL_NAMES = {"mlp": "mlp", "lm": "gpt"}
BATCH_SIZES = {"mlp": 64, "lm": 16}


@dataclass
class BenchModel:
    """One benchmark model, built identically (same seed) in every process.

    Attributes:
        name: benchmark name (``mlp`` or ``lm``).
        batch_size: samples per minibatch (the full batch of the pipeline configurations).
        model: pipetrain's model as built (what ``pipetrain train --model`` trains).
        layers: the same modules as an ``nn.Sequential`` whose children are cut for the stages.
        loss_fn: ``loss_fn(output, target) -> scalar``, the mean over the batch.
        make_batch: ``make_batch(batch_size, generator) -> (inputs tuple, target)``.
        pipetrain_spec: what to pass as ``pipetrain train --model`` to train the same model.
        child_modules: for each child of ``layers``, the module paths in ``model`` it holds
            (the first one is where a stage beginning with that child is cut).
    """

    name: str
    batch_size: int
    model: Any
    layers: Any
    loss_fn: Callable[[Any, Any], Any]
    make_batch: Callable[[int, Any], tuple[tuple[Any, ...], Any]]
    pipetrain_spec: str
    child_modules: list[list[str]]

    def cut_names(self, cuts: Sequence[int]) -> list[str]:
        """pipetrain's ``--cut`` names for child-index cuts: the module each stage begins with."""
        return [self.child_modules[c][0] for c in cuts]

    def num_parameters(self) -> int:
        """Number of trainable scalars of the whole model."""
        return sum(p.numel() for p in self.layers.parameters())


def as_sequential(model: Any) -> tuple[Any, list[list[str]]]:
    """``model`` as an ``nn.Sequential`` over the same modules, and each child's module paths.

    An ``nn.Sequential`` is returned as it is. A GPT with pipetrain's attribute names
    (``wte``, ``wpe``, ``positions``, ``blocks``, ``ln_f``, ``lm_head``, optional ``drop``)
    becomes (embedding, block 0, ..., block L-1, head), computing what ``GPT.forward`` does.
    """
    from torch import nn

    if isinstance(model, nn.Sequential):
        return model, [[str(i)] for i in range(len(model))]
    needed = ("wte", "wpe", "blocks", "ln_f", "lm_head")
    if not all(hasattr(model, a) for a in needed) or not isinstance(model.blocks, nn.ModuleList):
        raise SystemExit(f"benchmark model {type(model).__name__} is neither an nn.Sequential nor pipetrain's GPT")

    class GPTEmbedding(nn.Module):
        """``wte(tokens) + wpe(positions)`` (then dropout, if the model has it)."""

        def __init__(self, gpt: nn.Module) -> None:
            super().__init__()
            self.wte, self.wpe, self.drop = gpt.wte, gpt.wpe, getattr(gpt, "drop", None)
            self.register_buffer("positions", gpt.positions.clone())

        def forward(self, tokens: Any) -> Any:
            x = self.wte(tokens) + self.wpe(self.positions)
            return x if self.drop is None else self.drop(x)

    class GPTHead(nn.Module):
        """``lm_head(ln_f(x))``."""

        def __init__(self, gpt: nn.Module) -> None:
            super().__init__()
            self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

        def forward(self, x: Any) -> Any:
            return self.lm_head(self.ln_f(x))

    children = [["wte", "wpe", "drop"]] + [[f"blocks.{i}"] for i in range(len(model.blocks))] + [["ln_f", "lm_head"]]
    return nn.Sequential(GPTEmbedding(model), *model.blocks, GPTHead(model)), children


def build_bench_model(name: str, seed: int = 0) -> BenchModel:
    """The benchmark model ``name`` (``pipetrain.models.get_model``) with weights drawn from ``seed``."""
    import torch

    from pipetrain.models import get_model

    if name not in MODEL_NAMES:
        raise SystemExit(f"unknown benchmark model {name!r}; choose from {sorted(MODEL_NAMES)}")
    torch.manual_seed(seed)
    bundle = get_model(MODEL_NAMES[name], batch_size=BATCH_SIZES[name])
    layers, children = as_sequential(bundle.model)
    return BenchModel(name, BATCH_SIZES[name], bundle.model, layers, bundle.loss_fn, bundle.make_batch,
                      MODEL_NAMES[name], children)


def split_point(layers: Any, stages: int = 2) -> list[int]:
    """Child indices where each stage after the first begins: equal counts of layers.

    "Layers" are the children holding parameters (Linear, Block, ...); each parameter-free
    child (ReLU) stays with the layer before it. For the MLP (32 children) the cut is after
    the 8th Linear+ReLU; for the LM (embedding, 8 blocks, head) after block 3 (embedding +
    4 blocks | 4 blocks + head).
    """
    children = list(layers)
    weighted = [i for i, c in enumerate(children) if any(True for _ in c.parameters())]
    cuts: list[int] = []
    for s in range(1, stages):
        k = math.ceil(len(weighted) * s / stages)  # layers before the cut
        cuts.append(weighted[k] if k < len(weighted) else len(children))
    return cuts


def split_stages(layers: Any, stages: int = 2, cuts: Sequence[int] | None = None) -> list[Any]:
    """The model cut into ``stages`` ``nn.Sequential`` pieces (modules shared, not copied).

    ``cuts`` (child indices where stages 1.. begin) defaults to :func:`split_point`.
    """
    from torch import nn

    children = list(layers)
    cuts = list(cuts) if cuts is not None else split_point(layers, stages)
    if len(cuts) != stages - 1 or sorted(cuts) != cuts or not all(0 < c < len(children) for c in cuts):
        raise SystemExit(f"bad stage cuts {cuts} for {stages} stages of {len(children)} children")
    bounds = [0, *cuts, len(children)]
    return [nn.Sequential(*children[a:b]) for a, b in zip(bounds, bounds[1:])]


def child_times(bm: BenchModel, seed: int = 0) -> list[float]:
    """Forward + backward seconds of each child of ``bm.layers`` on the full batch, one thread.

    Measured by pipetrain's profiler (``pipetrain.profile.profile_captured``) on the captured
    model; a node belongs to the child holding its module, a functional node (``add``,
    ``transpose``...) to the child of the module node before it. The loss is not included.
    """
    import torch

    from pipetrain.graph import capture
    from pipetrain.profile import profile_captured
    from pipetrain.profile.cache import model_fingerprint

    inputs, _ = bm.make_batch(bm.batch_size, torch.Generator().manual_seed(seed + 1))
    captured = capture(bm.model, tuple(inputs))
    prof = profile_captured(captured, tuple(inputs), batch_size=bm.batch_size, warmup=1, repeats=3, threads=1)
    cost = {n.name: n.compute_time for n in prof.nodes}

    def child_of(path: str) -> int | None:
        for i, prefixes in enumerate(bm.child_modules):
            if any(path == p or path.startswith(p + ".") for p in prefixes):
                return i
        return None

    times = [0.0] * len(bm.child_modules)
    current = 0
    for node in captured.graph.nodes:
        if node.is_input:
            continue
        if node.kind == "module" and node.target is not None:
            found = child_of(node.target)
            current = found if found is not None else current
        times[current] += cost.get(node.name, 0.0)
    return same_structure_medians(times, [model_fingerprint(c) for c in bm.layers])


def same_structure_medians(times: Sequence[float], structures: Sequence[str]) -> list[float]:
    """``times`` with each child's replaced by the median over the children of its structure
    (``structures``: one key per child, :func:`pipetrain.profile.cache.model_fingerprint`).

    Invariant: in the benchmark's models, children of the same structure also take inputs of
    the same shape, so they cost the same and the median of their measurements estimates
    each (one timing of a layer on a shared machine can move a cut by a layer).
    """
    groups: dict[str, list[float]] = {}
    for t, key in zip(times, structures):
        groups.setdefault(key, []).append(t)
    return [statistics.median(groups[key]) for key in structures]


def balanced_cuts(times: Sequence[float], stages: int) -> list[int]:
    """Cuts into ``stages`` contiguous parts minimising the largest part's time
    (``pipetrain.plan.baselines.block_partition``)."""
    from itertools import accumulate

    from pipetrain.plan.baselines import block_partition

    sizes = block_partition(list(times), stages)
    return list(accumulate(sizes))[:-1]
