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

Asynchronous schedules (pipedream, 2bw) are not cut at evaluation points: a drain there would
make PipeDream with evaluation another algorithm than PipeDream without. An evaluation at step
``t`` inside a segment (``Segment.evals``) is the model made of each stage's weights after its
update of minibatch ``t``: :class:`EvalSnapshots`, an engine hook, copies a stage's newest
weights (and buffers) right after that update, touching nothing the training reads; the
segment's end evaluates these snapshots in step order, forward only, before its own
evaluation. Training is bitwise the run without evaluation. The cost: one copy of a stage's
weights per evaluation pending until the segment's end, in host memory. The ``wall_time`` of
such an evaluation is the training clock when the last stage's snapshot was taken (the
latest over ranks).

At every boundary the worker (:func:`pipetrain.runtime.worker.main._train`) evaluates first (when the
segment says ``evaluate``), then calls the checkpoint hook
(:func:`pipetrain.runtime.checkpoints.periodic.save_at_boundary`), then stops if the target was
reached: every rank received the same evaluation, so every rank stops at the same boundary.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.func import functional_call

from ...schedule.action import Action, Op, Schedule
from ...schedule.comm import insert_comm
from ...schedule.resume import stage_updates
from ..engine.comm import Comm
from ..engine.hooks import EngineHooks, EngineView
from ..engine.stage_runtime import StageRuntime

__all__ = ["BoundaryContext", "EvalData", "EvalSnapshots", "Snapshot", "evaluate", "forward_schedule", "run_forward"]


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


# --------------------------------------------------------------------------- snapshots


@dataclass
class Snapshot:
    """One stage's weights and buffers right after one of its updates, and the training clock then."""

    params: dict[str, Tensor]
    buffers: dict[str, Tensor]
    clock: float


class EvalSnapshots(EngineHooks):
    """Copies each local stage's newest weights right after the update that completes an
    evaluation step (module docstring); the copies are taken out with :meth:`take`.

    Stage ``k`` makes ``S_k`` updates over a segment of ``n`` minibatches starting at step
    ``o`` (``S_k = n``, or ``n / r`` for a pipedream stage on ``r`` replicas), so the model of
    step ``t`` holds stage ``k``'s version ``(t - o) * S_k / n`` of the segment.
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._wanted: dict[int, dict[int, int]] = {}    # stage -> segment version -> step
        self.armed: list[int] = []                       # the steps expected in this segment
        self._taken: dict[int, dict[int, Snapshot]] = {}  # step -> stage -> snapshot

    def arm(self, schedule: Schedule, rank: int, offset: int, steps: Sequence[int]) -> None:
        """Expect the evaluation ``steps`` (from the run's first minibatch) in the segment
        ``schedule`` starting at step ``offset``; ``schedule`` is what this rank runs (a
        suffix after a resume: versions keep the segment's indices)."""
        self._wanted = {}
        self.armed = list(steps)
        for k in schedule.stages_of_rank(rank):
            n_updates = stage_updates(schedule, k, schedule.steps)  # in the whole segment
            if not n_updates:
                continue
            for t in steps:
                try:
                    version = stage_updates(schedule, k, t - offset)
                except ValueError:  # no update of stage k completes step t
                    version = 0
                if version < 1:
                    raise RuntimeError(f"stage {k} makes {n_updates} updates in {schedule.steps} steps and cannot be "
                                       f"evaluated after step {t}; pass an --eval-every its schedule can stop at")
                self._wanted.setdefault(k, {})[version] = t

    def after_update(self, ex: EngineView, st: StageRuntime, a: Action) -> None:
        t = self._wanted.get(st.index, {}).get(st.versions.newest)
        if t is None:
            return
        with torch.no_grad():  # host memory: a GPU holds only what training holds
            params = {n: v.detach().to("cpu", copy=True) for n, v in st.versions.latest.items()}
            buffers = {n: b.detach().to("cpu", copy=True) for n, b in st.stage.module.named_buffers()}
        self._taken.setdefault(t, {})[st.index] = Snapshot(params, buffers, self.clock())

    def take(self, steps: Sequence[int], stages: Sequence[int]) -> list[tuple[int, dict[int, Snapshot]]]:
        """The snapshots of ``steps`` (in order) for every one of ``stages``; forgets them all."""
        taken, self._taken = self._taken, {}
        out = []
        for t in steps:
            got = taken.get(t, {})
            missing = [k for k in stages if k not in got]
            if missing:
                raise RuntimeError(f"no snapshot of stage {missing[0]} after step {t}: its update of that step "
                                   f"did not run in this segment")
            out.append((t, got))
        return out


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
                on_output: Callable[[int, Any, Any], None], timeout: float,
                weights: Mapping[int, Snapshot] | None = None) -> None:
    """Execute a forward-only action list without autograd; the last stage calls
    ``on_output(unit, output, eval_batch)`` for each of its units. ``weights``: each stage's
    snapshot to run with (default: its newest version and its module's buffers). Every
    forward runs in its stage's compute scope (bf16 autocast), as training's do."""
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
                    snap = weights[a.stage] if weights is not None else None
                    tensors = st.versions.latest if snap is None else \
                        {n: t.to(comm.device) for n, t in {**snap.params, **snap.buffers}.items()}
                    with st.compute_scope():
                        out = functional_call(sm.module, tensors, tuple(values))
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
             loss_fn: Any, step: int, samples: int, wall_time: float,
             weights: Mapping[int, Snapshot] | None = None) -> Any:
    """Evaluate the current weights (or each stage's snapshot in ``weights``) on the eval split
    through the pipeline (module docstring); every rank calls it and gets the same
    :class:`~pipetrain.metrics.EvalResult`."""
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

    run_forward(fwd.workers[rank], stages, comm, data, add, run.config.performance.timeout, weights)
    total = acc.all_reduce(device=comm.device) if dist.is_initialized() and dist.get_world_size() > 1 else acc
    epoch = step / spec.steps_per_epoch
    return total.result(step, epoch, samples, wall_time)
