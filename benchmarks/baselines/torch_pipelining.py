"""PyTorch ``torch.distributed.pipelining`` (torch 2.13) on the same two-stage split.

Each rank wraps its half (``bench_models.split_stages``) in a ``PipelineStage`` built from
example *microbatch* tensors (``input_args``/``output_args``: the schedule splits the
minibatch along dimension 0 into ``m`` chunks), then runs ``ScheduleGPipe`` (all forwards,
then all backwards) or ``Schedule1F1B`` (one forward, one backward in steady state) with the
loss on the last stage. Gradients are scaled by 1/m (``scale_grads``), so the SGD step
after ``schedule.step`` uses the full batch's mean gradient, like ``single``.

``loss_fn`` goes to every rank's schedule (torch 2.13 sets ``has_backward`` from it: without
it stage 0 skips its backwards, which earlier versions of this harness did by mistake, so
stage 0 never trained and the PyTorch figures were too high); the stage's shapes are
inferred from the first microbatch. The worker checks after the timed steps that every
rank's weights moved (``trained``).
"""
from __future__ import annotations

from typing import Any

from bench_models import BenchModel, split_stages
from timing import timed_loop

from baselines.common import LR, barrier, begin_training_phase, fixed_batch
from baselines.local import stage_activations


def run_torch_pipe(spec: dict[str, Any], bm: BenchModel) -> dict[str, Any]:
    """Stage ``rank`` of ScheduleGPipe / Schedule1F1B with ``microbatches`` chunks."""
    import torch
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank, world, m = spec["rank"], spec["world"], spec["microbatches"]
    if bm.batch_size % m:
        raise SystemExit(f"batch {bm.batch_size} is not divisible by {m} microbatches")
    stages = split_stages(bm.layers, world, spec.get("cuts"))
    inputs, target = fixed_batch(bm, spec["seed"])
    mb_acts = stage_activations(stages, tuple(a[: bm.batch_size // m] for a in inputs))
    mod = stages[rank]
    is_first, is_last = rank == 0, rank == world - 1
    # Shapes (and which inputs need a gradient) are inferred from the first microbatch: with
    # static example args computed without grad, stage 1's input is taken as not needing a
    # gradient and stage 0 receives none.
    static = False
    stage = PipelineStage(mod, rank, world, torch.device("cpu"))
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[spec["schedule"]]
    # loss_fn on every rank: a schedule built without one sets has_backward = False, and a
    # first stage built that way runs forwards only (no weight gradients: it never trains).
    sched = cls(stage, n_microbatches=m, loss_fn=bm.loss_fn)
    opt = torch.optim.SGD(mod.parameters(), lr=LR)
    if not is_first:
        inputs = ()  # only stage 0 reads the minibatch
    del stages, mb_acts
    before = [p.detach().clone() for p in mod.parameters()][:1]  # taken before the peak reset
    mem = begin_training_phase(bm)
    last: list[float] = [float("nan")]

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        if is_first:
            sched.step(*inputs, return_outputs=False)
        elif is_last:
            losses: list[Any] = []
            sched.step(target=target, losses=losses, return_outputs=False)
            last[0] = float(torch.stack([loss.detach() for loss in losses]).mean())
        else:
            sched.step(return_outputs=False)
        opt.step()

    elapsed, times = timed_loop(step, spec["warmup"], spec["steps"], sync=barrier)
    trained = bool(before) and not torch.equal(before[0], next(iter(mod.parameters())).detach())
    return {"elapsed_s": elapsed, "step_times": times, "loss": last[0], "static_stage": static,
            "trained": trained, **mem}
