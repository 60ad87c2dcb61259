"""Evaluation through the pipeline, and the hooks every rank runs at a segment boundary.

At a boundary the pipeline has drained (:class:`~pipetrain.job.resolved.Segment`): every
stage holds one version, its newest. Evaluation then sends the eval split through the same
stages, forward only and without autograd:

1. the eval split is cut into fixed batches of ``eval_batch_size`` rows, the tail padded
   (:class:`pipetrain.data.EvalBatches`); each batch into units of the training microbatch
   size (the wire buffers of every cut are sized for it); eval unit ``u`` runs on replica
   ``u mod r`` of a stage with ``r`` replicas;
2. a forward-only schedule (:func:`forward_schedule`): per rank, for every unit in order, the
   F action of each of its stages, with SEND_F / RECV_F inserted by the schedule's own
   communication pass (:func:`pipetrain.schedule.comm.insert_comm`);
3. every rank runs its list (:func:`run_forward`): the first stage reads the units' inputs,
   the others receive; the last stage adds each unit's output and target to an
   :class:`~pipetrain.metrics.EvalAccumulator` (only the real rows of a padded batch count);
4. one all-reduce over all ranks of the packed sums (ranks without a last stage add zeros)
   gives every rank the same :class:`~pipetrain.metrics.EvalResult`, so all ranks can stop
   together when a target is reached.

At every boundary the worker (:func:`pipetrain.runtime.worker.main._train`) evaluates first (when the
segment says ``evaluate``), then calls the checkpoint hook
(:func:`pipetrain.runtime.checkpoints.periodic.save_at_boundary`), then stops if the target was
reached: every rank received the same evaluation, so every rank stops at the same boundary.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.func import functional_call

from ...schedule.action import Action, Op, Schedule
from ...schedule.comm import insert_comm
from ..engine.comm import Comm

__all__ = ["BoundaryContext", "EvalData", "evaluate", "forward_schedule", "run_forward"]


@dataclass
class BoundaryContext:
    """What a boundary hook sees (``pipetrain.runtime.checkpoints.periodic.on_boundary(ctx)``); every
    rank builds its own.

    Attributes:
        run: the :class:`~pipetrain.job.resolved.ResolvedRun`.
        rank: this rank.
        step: minibatches completed since the run's start (warm-up and resumed steps included).
        epoch: fractional epochs completed (``None`` for synthetic data).
        segment: index of the segment just finished in ``run.segments``.
        stages: this rank's :class:`~pipetrain.runtime.engine.stage_runtime.StageRuntime` by stage index
            (drained: ``versions.latest`` is the only version).
        comm: this rank's :class:`~pipetrain.runtime.engine.comm.Comm` (idle).
        eval: the :class:`~pipetrain.metrics.EvalResult` of this boundary, if it evaluated.
        extras: rank 0: state no stage holds (parameters no node reads).
        final: whether the run ends here (its last segment, or a reached target).
    """

    run: Any
    rank: int
    step: int
    epoch: float | None
    segment: int
    stages: dict[int, Any]
    comm: Comm
    eval: Any = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    final: bool = False


# --------------------------------------------------------------------------- the schedule


def forward_schedule(schedule: Schedule, units: int) -> Schedule:
    """A forward-only schedule over ``units`` eval units on the training schedule's ranks:
    unit ``u`` of stage ``k`` runs on ``stage_ranks[k][u % r_k]``; each rank runs its F actions
    unit by unit, stages in order; transfers inserted by :func:`insert_comm`."""
    workers: list[list[Action]] = [[] for _ in range(schedule.num_workers)]
    for u in range(units):
        for k, ranks in enumerate(schedule.stage_ranks):
            workers[ranks[u % len(ranks)]].append(Action(k, Op.F, u))
    fwd = Schedule(f"{schedule.name}-eval", workers, [list(r) for r in schedule.stage_ranks], microbatches=1,
                   steps=units, options={})
    return insert_comm(fwd)


# --------------------------------------------------------------------------- the data


class EvalData:
    """Eval units of one rank: unit ``u`` is part ``u % k`` of eval batch ``u // k``
    (``k = eval_batch_size / unit_batch``), only the part its stages read."""

    def __init__(self, dataset: Any, eval_batch_size: int, unit_batch: int, part: str) -> None:
        from ...data import EvalBatches

        self.batches = EvalBatches(dataset, eval_batch_size, pad=True)
        self.k = eval_batch_size // unit_batch
        self.part = part
        self._cached: tuple[int, list[Any]] | None = None

    @property
    def units(self) -> int:
        return len(self.batches) * self.k

    def unit(self, u: int) -> Any:
        """The :class:`~pipetrain.data.EvalBatch` of unit ``u`` (inputs/target, real rows)."""
        i = u // self.k
        if self._cached is None or self._cached[0] != i:
            self._cached = (i, self.batches.batch(i, self.part).split(self.k))  # type: ignore[arg-type]
        return self._cached[1][u % self.k]


# --------------------------------------------------------------------------- the run


def run_forward(actions: Sequence[Action], stages: dict[int, Any], comm: Comm, data: EvalData | None,
                on_output: Callable[[int, Any, Any], None], timeout: float) -> None:
    """Execute a forward-only action list without autograd; the last stage calls
    ``on_output(unit, output, eval_batch)`` for each of its units."""
    inbox: dict[tuple[int, int], list[torch.Tensor]] = {}
    outbox: dict[tuple[int, int], list[torch.Tensor]] = {}
    for st in stages.values():
        st.stage.module.eval()
    try:
        with torch.no_grad():
            for a in actions:
                if a.op is Op.RECV_F:
                    inbox[(a.stage, a.mb)] = comm.wait(a)
                elif a.op is Op.SEND_F:
                    comm.send(a, outbox.pop((a.stage, a.mb)))
                elif a.op is Op.F:
                    st = stages[a.stage]
                    sm = st.stage
                    batch = data.unit(a.mb) if data is not None and (sm.is_first or sm.is_last) else None
                    if sm.is_first:
                        assert batch is not None  # a first stage always has eval data (EvalData)
                        values = list(batch.inputs)
                    else:
                        codec = sm.in_codec
                        values = codec.decode(inbox.pop((a.stage, a.mb)))
                    out = functional_call(sm.module, st.versions.latest, tuple(values))
                    if sm.is_last:
                        on_output(a.mb, sm.finish_output(out), batch)
                    else:
                        # Clone: a value passed straight through may alias a receive buffer.
                        outbox[(a.stage, a.mb)] = [t.clone() for t in sm.out_codec.encode(out, comm.device)]
        comm.finish(timeout)
    finally:
        for st in stages.values():
            st.stage.module.train()


def evaluate(run: Any, source: Any, schedule: Schedule, rank: int, stages: dict[int, Any], comm: Comm,
             loss_fn: Any, step: int, samples: int, wall_time: float) -> Any:
    """Evaluate the current weights on the eval split through the pipeline (module docstring);
    every rank calls it and gets the same :class:`~pipetrain.metrics.EvalResult`."""
    import torch.distributed as dist

    from ...metrics import EvalAccumulator
    from ..engine.units import stage_part

    spec = run.data
    part = stage_part(schedule, list(stages))
    data = EvalData(source.eval, spec.eval_batch_size, run.unit_batch, part) if part is not None else None
    units = -(-spec.num_eval // spec.eval_batch_size) * (spec.eval_batch_size // run.unit_batch)
    fwd = forward_schedule(schedule, units)
    acc = EvalAccumulator(kind=spec.task if spec.task != "synthetic" else None)

    def add(_unit: int, output: Any, batch: Any) -> None:
        if batch.count:
            acc.update(output, batch.target, loss_fn=loss_fn, count=batch.count)

    run_forward(fwd.workers[rank], stages, comm, data, add, run.config.performance.timeout)
    total = acc.all_reduce(device=comm.device) if dist.is_initialized() and dist.get_world_size() > 1 else acc
    epoch = step / spec.steps_per_epoch
    return total.result(step, epoch, samples, wall_time)
