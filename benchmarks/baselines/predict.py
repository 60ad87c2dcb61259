"""The simulator's peak-memory prediction for each two-stage configuration (optional).

For the harness's split, each stage's :class:`pipetrain.simulate.StageCost` gets
``parameter_bytes`` (one weight version; the simulator also counts one gradient of that
size), ``optimizer_bytes`` 0 (plain SGD keeps no state) and ``activation_bytes`` (the bytes
autograd saves for backward in one unit's forward, loss included on the last stage, the
stage's own weights left out, measured with ``torch.autograd.graph.saved_tensors_hooks``).
``pipetrain.simulate.simulate`` then runs the schedule (``get_schedule(name).build([1, 1], m, steps)``,
forward 1 and backward 2 time units per stage: only the order of actions matters here) and
returns each worker's peak: the weights' gradient, the live weight versions and the units in
flight.

The prediction is model state only; the measured peak RSS also holds the torch runtime (the
RSS after ``import torch``, reported beside it), the minibatch, communication buffers and
allocator slack. The orchestrator calls this once per model before the first round.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench_models import BenchModel, split_stages

MIB = 1024.0 * 1024.0

# The pipetrain schedule that has the order of each torch.distributed.pipelining schedule.
TORCH_AS_PIPETRAIN = {"gpipe": "gpipe", "1f1b": "flush"}


def saved_bytes(stage: Any, inputs: tuple[Any, ...], loss: Any = None, target: Any = None) -> float:
    """Bytes of distinct storages autograd saves for backward in one forward of ``stage``.

    The stage's own parameters (which ``Linear`` saves for its input gradient) are not
    activations and are left out: they are counted once per weight version.
    """
    import torch

    params = {p.untyped_storage().data_ptr() for p in stage.parameters()}
    seen: dict[Any, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[(st.data_ptr(), st.nbytes())] = st.nbytes()
        return t

    x = tuple(a.clone().requires_grad_(a.is_floating_point()) for a in inputs)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = stage(*x)
        if loss is not None:
            out = loss(out, target)
    del out
    return float(sum(seen.values()))


def stage_costs(bm: BenchModel, cuts: Sequence[int], units: int, seed: int = 0) -> list[Any]:
    """One ``StageCost`` per stage for units of ``batch / units`` samples."""
    import torch

    from pipetrain.simulate import StageCost

    stages = split_stages(bm.layers, len(cuts) + 1, cuts)
    inputs, target = bm.make_batch(bm.batch_size // units, torch.Generator().manual_seed(seed + 1))
    costs = []
    x: tuple[Any, ...] = tuple(inputs)
    for k, s in enumerate(stages):
        last = k == len(stages) - 1
        act = saved_bytes(s, x, bm.loss_fn if last else None, target if last else None)
        params = float(sum(p.numel() * p.element_size() for p in s.parameters()))
        # optimizer_bytes 0: plain SGD keeps no state (the simulator already counts one
        # gradient of parameter_bytes besides the live weight versions).
        costs.append(StageCost(1.0, 2.0, parameter_bytes=params, activation_bytes=act,
                               optimizer_bytes=0.0))
        with torch.no_grad():
            out = s(*x)
        x = out if isinstance(out, tuple) else (out,)
    return costs


def predict(bm: BenchModel, cuts: Sequence[int], kind: str, schedule: str,
            microbatches: int, steps: int = 6, cache: dict[int, Any] | None = None) -> list[float] | None:
    """Predicted peak MiB per worker of a ``torch_pipe`` or ``pipetrain`` configuration (else None).

    ``cache`` (unit count -> stage costs) saves re-measuring the same unit size.
    """
    from pipetrain.schedule import SCHEDULE_NAMES, get_schedule
    from pipetrain.simulate import StageCosts, simulate

    if kind == "torch_pipe":
        spec = get_schedule(TORCH_AS_PIPETRAIN[schedule])
    elif kind == "pipetrain" and schedule in SCHEDULE_NAMES:
        spec = get_schedule(schedule)
    else:
        return None  # other kinds, and ``auto`` (its configuration is known only once it ran)
    units = 1 if spec.unit == "minibatch" else microbatches
    cache = {} if cache is None else cache
    if spec.one_stage:  # data parallelism: the whole model, one replica per worker
        key = -units
        if key not in cache:
            cache[key] = stage_costs(bm, [], units)
        sched = spec.build([len(cuts) + 1], microbatches=units, steps=steps)
        return [b / MIB for b in simulate(sched, StageCosts(cache[key])).peak_memory]
    if units not in cache:
        cache[units] = stage_costs(bm, cuts, units)
    sched = spec.build([1] * (len(cuts) + 1), microbatches=units, steps=steps)
    return [b / MIB for b in simulate(sched, StageCosts(cache[units])).peak_memory]
