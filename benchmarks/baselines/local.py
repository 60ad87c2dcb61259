"""``single`` (the whole model in one process) and ``ceiling`` (stages side by side, alone).

``ceiling`` is the most a configuration can deliver on this machine at this moment: its
processes start together (one barrier) and each runs only its own part of the work, with
activations and gradients that are fixed tensors of the right shapes instead of messages:

- a pipeline ceiling (``schedule`` empty): rank ``k`` trains stage ``k`` alone, ``m`` units of
  ``batch / m`` samples per step (forward, backward to its input too, gradients accumulated),
  then the SGD step: the same unit size as the ``m``-microbatch pipelines it bounds (smaller
  units fit the caches better, so the full-batch figure alone is no upper bound for them);
- a data-parallel ceiling (``schedule == "dp"``): every rank trains the whole model on its
  ``batch / world`` samples, no all-reduce: the bound of DDP and pipetrain's ``dp``.

To be an upper bound for pipetrain too, a ceiling worker runs its share the way pipetrain's
stages do (:func:`lean_stage`): glibc's malloc tuned to keep freed memory
(``pipetrain.runtime.process.rss.tune_malloc``), the ``nn.Linear`` weight gradients written by the
GEMM straight into persistent buffers (``pipetrain.runtime.engine.fused``), the other gradients
accumulated into persistent ``.grad`` tensors. Its throughput is batch / (step time of the
slowest worker), computed by the orchestrator from every rank's timed window.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench_models import BenchModel, split_stages
from timing import timed_loop

from baselines.common import LR, barrier, begin_training_phase, fixed_batch


def run_single(spec: dict[str, Any], bm: BenchModel) -> dict[str, Any]:
    """Forward, backward and an SGD step of the whole model on the full batch."""
    import torch

    model = bm.layers
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    inputs, target = fixed_batch(bm, spec["seed"])
    mem = begin_training_phase(bm)
    last: list[float] = [float("nan")]

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = bm.loss_fn(model(*inputs), target)
        loss.backward()
        opt.step()
        last[0] = float(loss.detach())

    elapsed, times = timed_loop(step, spec["warmup"], spec["steps"])
    return {"elapsed_s": elapsed, "step_times": times, "loss": last[0], **mem}


def stage_activations(stages: list[Any], inputs: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    """The inputs of every stage and the last output (``len(stages) + 1`` tuples), no grad."""
    import torch

    acts = [tuple(inputs)]
    with torch.no_grad():
        for s in stages:
            out = s(*acts[-1])
            acts.append(out if isinstance(out, tuple) else (out,))
    return acts


def run_ceiling(spec: dict[str, Any], bm: BenchModel) -> dict[str, Any]:
    """Rank ``rank``'s share alone (see the module docstring): ``m`` units of forward and
    backward (to its input too, as a pipeline must), then the SGD step."""
    import torch

    rank, world = spec["rank"], spec["world"]
    m = max(1, int(spec.get("microbatches") or 1))
    data_parallel = spec.get("schedule") == "dp"
    inputs, target = fixed_batch(bm, spec["seed"])
    if data_parallel:  # the whole model on this rank's share of the batch
        share = bm.batch_size // world
        mod = bm.layers
        inputs = tuple(a[rank * share:(rank + 1) * share] for a in inputs)
        target = target[rank * share:(rank + 1) * share]
        is_first = is_last = True
        size = share // m
        x_units = [tuple(a[u * size:(u + 1) * size] for a in inputs) for u in range(m)]
        grad_out = None
    else:
        stages = split_stages(bm.layers, world, spec.get("cuts"))
        size = bm.batch_size // m
        unit_inputs = tuple(a[:size] for a in inputs)
        acts = stage_activations(stages, unit_inputs)
        mod = stages[rank]
        is_first, is_last = rank == 0, rank == world - 1
        # A later stage receives activations and must return their gradient to its predecessor.
        x_units = [acts[rank] if is_first else tuple(
            a.clone().requires_grad_(a.is_floating_point()) for a in acts[rank]) for _ in range(m)]
        grad_out = None if is_last else tuple(torch.randn_like(a) for a in acts[rank + 1])
        del stages, acts
    targets = [target[u * size:(u + 1) * size] for u in range(m)]
    opt = torch.optim.SGD(mod.parameters(), lr=LR)
    begin_group = lean_stage(mod)
    keep = mod
    mem = begin_training_phase(bm)
    mod = keep
    last: list[float] = [float("nan")]

    def step() -> None:
        begin_group()
        for x, y in zip(x_units, targets):
            for a in x:
                a.grad = None
            out = mod(*x)
            if is_last:
                loss = bm.loss_fn(out, y) / m
                loss.backward()
                last[0] = float(loss.detach()) * m
            else:
                outs = out if isinstance(out, tuple) else (out,)
                torch.autograd.backward(outs, grad_out)
        opt.step()

    elapsed, times = timed_loop(step, spec["warmup"], spec["steps"], sync=barrier)
    return {"elapsed_s": elapsed, "step_times": times, "loss": last[0], "units": m, "unit_samples": size,
            **mem}


def lean_stage(mod: Any) -> Callable[[], None]:
    """Set ``mod`` up to train as a pipetrain stage does (module docstring); returns what to
    call before each step's first backward (it starts a new gradient group)."""
    import torch

    from pipetrain.runtime.engine.fused import AccumulatingLinear, GradSink
    from pipetrain.runtime.process.rss import tune_malloc

    tune_malloc()
    sink = GradSink()
    fed: set[int] = set()
    for name, sub in mod.named_modules():
        if type(sub) is not torch.nn.Linear or not sub.weight.requires_grad:
            continue
        if sub.bias is not None and not sub.bias.requires_grad:
            continue
        sub.__class__ = AccumulatingLinear
        wname, bname = f"{name}.weight", (f"{name}.bias" if sub.bias is not None else None)
        sub._pt_sink, sub._pt_wname, sub._pt_bname = sink, wname, bname
        for pname, p in ((wname, sub.weight), (bname, sub.bias)):
            if pname is not None:
                sink.buffers[pname] = p.grad = torch.zeros_like(p)  # the optimizer reads the buffer
                fed.add(id(p))
    others = [p for p in mod.parameters() if p.requires_grad and id(p) not in fed]

    def begin_group() -> None:
        sink.touched.clear()  # the group's first unit overwrites the buffers
        for p in others:
            if p.grad is not None:
                p.grad.zero_()  # persistent .grad: autograd adds into it

    return begin_group
