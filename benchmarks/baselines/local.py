"""``single`` (the whole model in one process) and ``ceiling`` (stages side by side, alone).

``ceiling`` is the most a P-stage pipeline can deliver on this machine at this moment: P
processes start together (one barrier) and each runs only its own stage's forward,
backward and optimizer step on the full batch, with activations and gradients that are
fixed tensors of the right shapes instead of messages. Its throughput is
batch / (step time of the slower worker), computed by the orchestrator from every rank's
timed window.
"""
from __future__ import annotations

from typing import Any

from bench_models import BenchModel, split_stages
from timing import timed_loop
from baselines.worker import LR, barrier, begin_training_phase, fixed_batch


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
    """Stage ``rank`` alone: forward, backward (to its input too, as a pipeline must) and step."""
    import torch

    rank, world = spec["rank"], spec["world"]
    stages = split_stages(bm.layers, world, spec.get("cuts"))
    inputs, target = fixed_batch(bm, spec["seed"])
    acts = stage_activations(stages, inputs)
    mod = stages[rank]
    opt = torch.optim.SGD(mod.parameters(), lr=LR)
    is_first, is_last = rank == 0, rank == world - 1
    # A later stage receives activations and must return their gradient to its predecessor.
    x = acts[rank] if is_first else tuple(
        a.clone().requires_grad_(a.is_floating_point()) for a in acts[rank])
    grad_out = None if is_last else tuple(torch.randn_like(a) for a in acts[rank + 1])
    del stages, acts
    mem = begin_training_phase(bm)
    last: list[float] = [float("nan")]

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        for a in x:
            a.grad = None
        out = mod(*x)
        if is_last:
            loss = bm.loss_fn(out, target)
            loss.backward()
            last[0] = float(loss.detach())
        else:
            outs = out if isinstance(out, tuple) else (out,)
            torch.autograd.backward(outs, grad_out)
        opt.step()

    elapsed, times = timed_loop(step, spec["warmup"], spec["steps"], sync=barrier)
    return {"elapsed_s": elapsed, "step_times": times, "loss": last[0], **mem}
