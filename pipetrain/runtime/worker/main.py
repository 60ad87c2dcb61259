"""One worker (rank) of a training run: set up, run the schedule, report.

:func:`run_rank` is what every process executes, whether started by ``pipetrain train
--workers N`` (through torchrun's launcher API, :mod:`pipetrain.runtime.launch`) or by
``torchrun ... -m pipetrain train`` directly. It receives a
:class:`~pipetrain.job.resolved.ResolvedRun` (every decision made) and

1. joins the process group (gloo on CPU, NCCL on CUDA; every wait bounded by ``--timeout``);
2. builds the model from the seed, captures it and cuts it into the plan's stage node lists;
3. builds this rank's stage modules, weight versions, optimizers and communication;
4. runs the schedule's action list of every segment (an optional untimed warm-up first);
5. gathers its :class:`~pipetrain.job.result.RankReport` to rank 0, which writes the
   checkpoint and the merged trace and returns the run's :class:`~pipetrain.job.result.RunResult`.

A rank that fails posts a :class:`~pipetrain.runtime.process.failures.FailureRecord` before it exits;
a rank whose transfer then breaks finds that record and names that rank as the cause
("rank 0 stopped because rank 1 failed: ...") instead of a bare connection error.
"""
from __future__ import annotations

import itertools
import json
import os
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ...errors import PipetrainError, RuntimeConfigError
from ...job.config import TrainConfig
from ...job.model import build_stages
from ...job.parse import parse_debug_fail
from ...job.resolved import ResolvedRun, Segment
from ...job.result import RankReport, RunResult
from ...job.segments import inner_checkpoints, inner_point, segments_done, stage_step_count
from ...models.bundle import ModelBundle
from ...plan.cuts import node_modules, stage_first_nodes
from ...plan.traffic import predict_traffic
from ...schedule.action import Schedule
from ...schedule.events import steady_state_rates, write_chrome_trace
from ...schedule.resume import stage_updates, suffix
from ...schedule.traffic import ReduceBuffer, TiedBuffer, Traffic, bytes_per_sample, traffic_report
from ...stages.boundary import BoundaryCodec
from ...stages.partition import build_stage_modules
from ...stages.tied import alias_state, check_ties, stage_parameters, tied_buffers
from ..checkpoints.export import check_resumable, load_checkpoint, save_final, save_hf_final
from ..checkpoints.periodic import (
    CutCheckpoints,
    RankView,
    Restored,
    every_name,
    lookup_any_name,
    restore_point,
    save_at_boundary,
)
from ..engine.comm import Comm, cut_bytes, reduce_buffers
from ..engine.executor import Executor
from ..engine.hooks import EngineHooks
from ..engine.precision import wire_dtype
from ..engine.stage_runtime import StageRuntime, stage_runtimes
from ..engine.tied_sync import TiedSync
from ..engine.units import UnitData, stage_part, unit_source
from ..guards.numerics import NumericsGuard
from ..guards.tensor_ledger import TensorMemory
from ..process.failures import BoardAddress, FailureBoard, FailureRecord, connect_board
from ..process.orphans import exit_launcher_gone
from ..process.peers import naming_peer, restart_store
from ..process.rss import peak_rss_life_mib, proc_status_mib, reset_peak_rss
from ..process.setup import process_device, setup_process
from ..process.signals import exit_on_signal
from .forward_errors import ForwardErrors
from .monitor import TrainMonitor
from .pipeline_eval import EvalSnapshots, evaluate

__all__ = ["worker_main", "run_rank", "init_distributed", "shutdown_process_group"]


def init_distributed(cfg: TrainConfig) -> tuple[int, int, torch.device]:
    """Join (or reuse) the default process group; returns (rank, world size, device)."""
    device = process_device(cfg, int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        backend = "nccl" if cfg.parallel.device == "cuda" else "gloo"
        kwargs: dict[str, Any] = {}
        if backend == "nccl":
            kwargs["device_id"] = device
        restarted = restart_store(cfg.performance.timeout)  # a restarted elastic attempt: its own keys (peers.py)
        if restarted is not None:
            kwargs.update(store=restarted[0], rank=restarted[1], world_size=restarted[2])
        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.performance.timeout), **kwargs)
    return dist.get_rank(), dist.get_world_size(), device


def worker_main(runs: Sequence[ResolvedRun], board_address: BoardAddress | None = None) -> list[RunResult | None]:
    """Entry point of each process started by the local launcher: run every resolved run in turn.
    Ctrl-C (SIGINT) or SIGTERM ends the process at once and quietly: the launcher stops every
    worker and removes what they left half written (:func:`~pipetrain.runtime.process.signals.exit_on_signal`)."""
    exit_on_signal()
    results = []
    try:
        for run in runs:
            results.append(run_rank(run, board_address))
    finally:
        shutdown_process_group()
    return results


def shutdown_process_group() -> None:
    """Tear the process group down before the interpreter exits; every process calls it last.

    A worker that exits with its group alive leaves the group's C++ threads (gloo's transport
    loop, the store client) to static destruction, which sometimes aborted a run that had
    succeeded ("terminate called without an active exception", SIGABRT: measured 4 in 60
    two-agent torchrun launches; none in 60 with this teardown). A barrier first, so that no
    rank closes its connections while a peer still reads from them; it is bounded by the
    group's timeout, and skipped when a peer has already failed.
    """
    if not dist.is_initialized():
        return
    try:
        if dist.get_world_size() > 1:
            dist.barrier()
    except Exception:  # noqa: BLE001 - a peer already failed: its error is reported on its own
        pass
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - already torn down by the failure path
        pass


def run_rank(run: ResolvedRun, board_address: BoardAddress | None = None) -> RunResult | None:
    """Run this process's part of a resolved run; rank 0 returns the run's result.

    ``board_address``: the launcher's failure store (local launches); ``None``: the process
    group's store (under torchrun).
    """
    cfg = run.config
    rank, world, device = init_distributed(cfg)
    board = connect_board(board_address, cfg.performance.timeout)
    try:
        return _run(run, rank, world, device)
    except BaseException as e:
        if board is not None and board.host_pid is not None and board.host_gone():
            exit_launcher_gone(board.host_pid)  # the launcher's end broke this rank: nothing to report
        if cfg.debug.show_traceback:  # --debug: this rank's traceback, before its one line
            traceback.print_exc()
        root = _root_failure(board, rank) if not isinstance(e, PipetrainError) else None
        if root is not None:
            if board is not None:
                board.post(FailureRecord.of(rank, e, caused_by=root.rank))
            raise RuntimeError(f"rank {rank} stopped because rank {root.rank} failed: {root.type}: "
                               f"{root.message}") from e
        if board is not None:
            board.post(FailureRecord.of(rank, e))
        if dist.is_initialized() and dist.get_world_size() > 1:
            # Close our connections so that ranks waiting on us fail now (naming us, from the
            # board) instead of at their timeout; give them a moment to report first (a
            # configuration error is usually raised by every rank alike: no need to wait).
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
            if not isinstance(e, PipetrainError):
                time.sleep(1.0)
        raise


def _root_failure(board: FailureBoard | None, rank: int, wait_s: float = 2.0) -> FailureRecord | None:
    """The failure of another rank that started it all, waiting briefly for it to appear."""
    if board is None:
        return None
    root = board.root(wait_s)
    return root if root is not None and root.rank != rank else None


# --------------------------------------------------------------------------- the run


@dataclass
class _Setup:
    """What a worker builds before training, from the resolved run."""

    bundle: ModelBundle
    stages: dict[int, StageRuntime]      # this rank's stages
    codecs: list[BoundaryCodec]
    original_keys: list[str]             # the model's state_dict keys, in order
    extras: dict[str, torch.Tensor]      # rank 0: state no stage holds
    start_step: int = 0
    stage_first_nodes: list[str] = field(default_factory=list)     # first node of each stage
    stage_first_modules: list[str] = field(default_factory=list)   # that node's innermost module
    rss_setup_mib: float | None = None   # RSS once the stages are built (the peak's baseline)
    peak_reset: bool = False             # whether VmHWM was reset after setup
    resumed_at: int = 0                  # step restored from --checkpoint-dir (0: fresh), runtime/checkpoints
    timed_steps: int = 0                 # timed steps run (fewer than planned when a target stopped the run)
    monitor: TrainMonitor | None = None  # progress, logs, evaluations (runtime/worker/monitor.py)
    skipped: list[int] = field(default_factory=list)    # minibatches --skip-nonfinite dropped (the guard's list)
    tensor_memory: TensorMemory | None = None            # --measure-memory: the tensor ledger
    # -- communication accounting (docs/traffic.md): what the prediction needs, what was counted --
    stage_buffers: list[list[ReduceBuffer]] = field(default_factory=list)  # every stage's replica all-reduce
    tied_buffers: list[TiedBuffer] = field(default_factory=list)           # ties across stages (stages/tied.py)
    timed_schedules: list[Schedule] = field(default_factory=list)          # the timed segments that ran
    timed_traffic: Traffic = field(default_factory=Traffic)   # Comm's counts over those segments, summed
    eval_traffic: Traffic = field(default_factory=Traffic)    # Comm's counts during evaluations
    evaluated: bool = False                                   # whether any evaluation ran
    snapshots: EvalSnapshots | None = None    # asynchronous schedules' evaluations inside a segment (pipeline_eval.py)
    cuts: CutCheckpoints | None = None        # asynchronous schedules' checkpoints inside a segment (periodic.py)
    restored: Restored = field(default_factory=Restored)  # what --checkpoint-dir's resume loaded


def _run(run: ResolvedRun, rank: int, world: int, device: torch.device) -> RunResult | None:
    cfg = run.config
    if world != run.world_size:
        raise RuntimeConfigError(
            f"the run was resolved for {run.world_size} workers but the process group has {world} ranks; pass "
            f"--workers {world} or start {run.world_size} processes")
    setup_process(cfg, device)
    setup = _setup(run, rank, device)
    executor, step_losses, wall, end_step = _train(run, setup, rank, device)
    if cfg.checkpoint.save is not None:  # --save: every rank writes its part, rank 0 exports PATH
        save_final(_ckpt_view(run, setup, rank, device), cfg.checkpoint.save, end_step, setup.original_keys)
    if cfg.checkpoint.save_hf is not None:  # --save-hf: every rank writes its own shard
        save_hf_final(_ckpt_view(run, setup, rank, device), setup.original_keys)
    mine = _report(run, setup, rank, executor, step_losses, wall)
    gathered: list[Any] = [None] * world if rank == 0 else []
    dist.gather_object(mine, gathered if rank == 0 else None, dst=0)
    if cfg.output.trace is not None:
        _write_trace(cfg.output.trace, rank, mine, run.schedule, gathered if rank == 0 else None,
                     _traffic_summary(run, setup, gathered) if rank == 0 else None)
        if rank == 0:
            (Path(cfg.output.trace) / "run.json").write_text(json.dumps(run.to_json(), indent=1, default=str))
    if rank != 0:
        return None
    return _result(run, setup, gathered, device, end_step)


def _setup(run: ResolvedRun, rank: int, device: torch.device) -> _Setup:
    """Model, capture, the plan's stages, this rank's stage modules, optimizers and resume."""
    cfg = run.config
    schedule = run.schedule
    mine = schedule.stages_of_rank(rank)
    staged = build_stages(run, mine, unread=rank == 0)  # storage for this rank's tensors only
    bundle, captured, part, codecs = staged.bundle, staged.captured, staged.partition, staged.codecs
    original_keys = list(staged.state_keys)
    modules = build_stage_modules(captured, part, codecs, mine)
    extras: dict[str, torch.Tensor] = {}
    if rank == 0:  # parameters no node reads: no stage holds them, checkpoints need them
        held = set(part.param_stage) | _buffer_names(captured)
        extras = {k: v.detach().clone() for k, v in staged.state_dict().items() if k not in held}
    stages = stage_runtimes(run, modules, device, int((cfg.performance.bucket_mb or 0.0) * 2 ** 20))
    first_nodes = stage_first_nodes(run.plan, [n.name for n in captured.graph.nodes if n.is_input])  # type: ignore[arg-type]
    first_modules = {n.name: (node_modules(n) or [""])[-1] for n in captured.gm.graph.nodes}
    # every stage's all-reduce buffers and the ties across stages: what the traffic prediction needs
    named = staged.named_parameters()
    stage_buffers = [reduce_buffers(ps) for ps in stage_parameters(named, part.param_stage, part.tied,
                                                                   schedule.num_stages)]
    ties = tied_buffers(named, part.tied)
    del named
    del bundle.model, captured, staged  # the stage modules now hold what this rank needs
    setup = _Setup(bundle, stages, list(codecs), original_keys, extras)
    setup.stage_buffers, setup.tied_buffers = stage_buffers, ties
    setup.stage_first_nodes = first_nodes
    setup.stage_first_modules = [first_modules.get(n, "") for n in first_nodes]
    if cfg.checkpoint.resume:
        setup.start_step = _resume(cfg, stages, device)
    # resume from the latest complete checkpoint in --checkpoint-dir, if any (runtime/checkpoints/periodic.py)
    setup.restored = restore_point(_ckpt_view(run, setup, rank, device))
    setup.resumed_at = setup.restored.step
    # Peak memory counts the training phase of this rank's own stages, not the building of
    # the whole model (which every rank does): reset the kernel's high-water mark here.
    setup.peak_reset = reset_peak_rss()
    setup.rss_setup_mib = proc_status_mib("VmRSS")
    return setup


def _train(run: ResolvedRun, setup: _Setup, rank: int,
           device: torch.device) -> tuple[Executor, dict[int, list[float]], float, int]:
    """Run the segments; returns the executor, losses per step, timed seconds and the end step."""
    cfg = run.config
    comm = Comm(rank, run.schedule, setup.codecs, device, cfg.performance.timeout,
                global_clip=cfg.synchronous and cfg.training.clip_grad_norm is not None,
                wire_dtype=wire_dtype(cfg.training.precision))  # --precision bf16: bf16 wires
    tied = _tied_sync(run, setup, rank, comm)  # creates its process groups right after Comm's, on every rank
    # Real data (--data): loaded by the ranks whose stages read it (data.unit_source).
    reads = stage_part(run.schedule, list(setup.stages)) is not None
    source = run.data.load() if run.data is not None and reads else None
    monitor = setup.monitor = TrainMonitor(run, rank, run.schedule, setup.start_step)
    data = _unit_data(run, setup, rank, device, source, setup.start_step, run.schedule)
    hooks = _hooks(run, setup, rank, tied=tied is not None)
    if any(seg.evals for seg in run.segments):  # weights copied at their updates, evaluated at the segment's end
        setup.snapshots = EvalSnapshots(monitor.clock.elapsed)
        hooks.append(setup.snapshots)
    ends = list(itertools.accumulate(s.steps for s in run.segments))
    if any(inner_checkpoints(run, seg, end) for seg, end in zip(run.segments, ends)) or not setup.restored.drained:
        setup.cuts = CutCheckpoints(lambda: _ckpt_view(run, setup, rank, device))  # a consistent cut, no drain
        hooks.append(setup.cuts)
    executor = _executor(run, setup, rank, comm, data, monitor, tied, hooks)
    if setup.tensor_memory is not None:
        setup.tensor_memory.refresh_all(executor)  # counted from here on
    loop = _Segments(run, setup, rank, device, comm, executor, monitor, source)
    end_step = loop.run_all()
    return executor, loop.step_losses, loop.wall, end_step


def _hooks(run: ResolvedRun, setup: _Setup, rank: int, tied: bool) -> list[EngineHooks]:
    """The executor's hooks: the naming of the model's exceptions, the numerics guard and, with
    --measure-memory, the tensor ledger.
    Every rank builds them at the same point (the guard may create a process group)."""
    cfg = run.config
    guard = NumericsGuard(rank, cfg.checkpoint.checkpoint_dir, skip=cfg.training.skip_nonfinite,
                          synchronous=cfg.synchronous, schedule=cfg.parallel.schedule,
                          timeout=cfg.performance.timeout, tied=tied)
    setup.skipped = guard.skipped
    # the model's own exceptions in a forward name their step, unit and node (forward_errors.py)
    hooks: list[EngineHooks] = [ForwardErrors(rank, debug=cfg.debug.show_traceback), guard]
    if cfg.performance.measure_memory:
        setup.tensor_memory = TensorMemory()
        hooks.append(setup.tensor_memory)
    return hooks


def _executor(run: ResolvedRun, setup: _Setup, rank: int, comm: Comm, data: UnitData, monitor: TrainMonitor,
              tied: TiedSync | None, hooks: list[EngineHooks]) -> Executor:
    """This rank's executor over its stages."""
    cfg = run.config
    schedule = run.schedule
    mine = list(setup.stages)
    # (a --checkpoint-dir resume skips segments already counted in run.schedules: no base steps)
    lr_totals = {k: (0 if setup.resumed_at else setup.stages[k].optimizer.steps)
                 + sum(stage_step_count(s, k) for s in run.schedules)
                 for k in mine}
    is_logger = schedule.num_stages - 1 in mine and rank == schedule.stage_ranks[-1][0] and not cfg.output.quiet
    debug_fail = cfg.debug.debug_fail
    return Executor(rank, setup.stages, comm, data, _loss_fn(run, setup), cfg.optimizer.lr,
                    cfg.training.lr_schedule, clip=cfg.training.clip_grad_norm, global_clip=cfg.synchronous,
                    lookahead=cfg.performance.lookahead, record=cfg.output.trace is not None,
                    fail_at=parse_debug_fail(debug_fail) if debug_fail else None,
                    log_every=1 if monitor.wants_steps else cfg.output.log_every if is_logger else 0,
                    lr_totals=lr_totals, tied=tied, hooks=hooks,
                    on_step=monitor.on_step if monitor.wants_steps else None,  # the driving rank's progress
                    seed=cfg.training.seed)  # the random nodes' per-unit stream (graph/random_ops.py)


def _loss_fn(run: ResolvedRun, setup: _Setup) -> Callable[[Any, Any], torch.Tensor]:
    """The model's loss; with real data, the targets' unless the model brings its own (pipetrain.data.loss_for)."""
    if run.data is not None and setup.bundle.default_loss:
        from ...data import loss_for

        return loss_for(run.data.target_dtype)
    return setup.bundle.loss_fn


def _unit_data(run: ResolvedRun, setup: _Setup, rank: int, device: torch.device, source: Any, offset: int,
               sched: Schedule) -> UnitData:
    """The units of a segment starting at minibatch ``offset``: synthetic, or ``source``'s (--data)."""
    if run.data is None:
        return UnitData(setup.bundle.make_batch, run.batch_size, run.microbatches, run.config.training.seed, offset,
                        device)
    return unit_source(source, run.data, sched, rank, run.batch_size, run.microbatches, offset, device)


@dataclass
class _Segments:
    """The segment loop of one rank: train each segment, then its boundary (evaluate, checkpoint, stop)."""

    run: ResolvedRun
    setup: _Setup
    rank: int
    device: torch.device
    comm: Comm
    executor: Executor
    monitor: TrainMonitor
    source: Any                          # the --data source, or None
    step_losses: dict[int, list[float]] = field(default_factory=dict)  # minibatch -> its units' losses
    wall: float = 0.0                    # seconds of the timed segments so far

    def run_all(self) -> int:
        """Every segment after those a resumed checkpoint holds, until the end or a reached
        target; returns the step reached."""
        segments = self.run.segments
        offset = self.setup.start_step
        skip, inside = _resume_segment(self.run, self.setup.resumed_at)
        for i, seg in enumerate(segments):
            if i < skip:  # done before the checkpoint this run resumed from
                offset += seg.steps
                continue
            # a checkpoint inside this segment: its suffix (schedule/resume.py), the stashed versions restored
            self._train(seg, offset, done=inside if i == skip else 0)
            offset += seg.steps
            if self._boundary(seg, offset):  # the target is reached: every rank saw the same evaluation
                break
        self.monitor.close(offset)
        return offset

    def _train(self, seg: Segment, offset: int, done: int = 0) -> None:
        """Run one segment's actions (from a checkpoint after ``done`` of its minibatches: the
        rest, :func:`pipetrain.schedule.resume.suffix`); a timed one extends the timeline,
        the clock and the traffic."""
        sched = seg.schedule
        assert sched is not None  # a distributed run has a schedule per segment (ResolvedRun.check)
        ex, setup, rank = self.executor, self.setup, self.rank
        if done:
            sched = suffix(sched, done)
            _restore_versions(setup, sched, done)
        ex.data = _unit_data(self.run, setup, rank, self.device, self.source, offset, sched)
        if any(st.stage.is_first or st.stage.is_last for st in setup.stages.values()):
            ex.data.prefetch(seg.steps)  # data generation stays out of the timed window
        if setup.snapshots is not None:
            setup.snapshots.arm(sched, rank, offset,
                                [t for t in self._inner_evals(seg, offset + seg.steps) if t > offset + done])
        if setup.cuts is not None:
            setup.cuts.arm(sched, rank, offset,
                           [t for t in inner_checkpoints(self.run, seg, offset + seg.steps) if t > offset + done])
        dist.barrier()
        traffic0 = self._start_clock(time.perf_counter()) if seg.timed else None
        with naming_peer(rank, ex, sched.workers[rank]):  # a broken wait names its peer (peers.py)
            ex.run(sched.workers[rank])
        with naming_peer(rank, ex, []):
            self.comm.finish(self.run.config.performance.timeout)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            dist.barrier()
        if traffic0 is not None:
            self.monitor.clock.pause()
            self.wall = self.monitor.clock.elapsed()
            setup.timed_steps += seg.steps - done
            setup.timed_traffic = setup.timed_traffic + self.comm.traffic_since(traffic0)
            setup.timed_schedules.append(sched)
        for u, loss in ex.unit_losses().items():
            self.step_losses.setdefault(ex.data.step_of(u), []).append(loss)
        ex.losses = {}

    def _start_clock(self, t0: float) -> Traffic:
        """One timeline over the timed segments, without the time between them; returns the
        traffic counted so far (the timed segments' traffic is summed, docs/traffic.md)."""
        ex, clock = self.executor, self.monitor.clock
        if self.setup.timed_steps == 0:
            ex.t0, ex.events = t0, []
            clock.start()
        else:
            ex.t0 = t0 - clock.elapsed()
            clock.resume()
        return self.comm.traffic.copy()

    @staticmethod
    def _inner_evals(seg: Segment, end: int) -> list[int]:
        """The evaluation steps inside ``seg`` when it ends at step ``end`` (its first part, cut
        for a resume, may list steps of its second)."""
        return [t for t in seg.evals if end - seg.steps < t < end]

    def _boundary(self, seg: Segment, offset: int) -> bool:
        """The drained boundary after a segment: evaluate (the snapshots inside it, then its
        end), checkpoint; whether to stop here."""
        run, setup = self.run, self.setup
        stop = False
        evals: list[tuple[int, Any]] = []
        clocks: list[float] = []
        if setup.snapshots is not None:  # each stage's weights after its update of step t (pipeline_eval.py)
            evals = list(setup.snapshots.take(setup.snapshots.armed, list(setup.stages)))
            clocks = _latest_clocks([max(s.clock for s in snaps.values()) for _, snaps in evals], self.device)
        if seg.evaluate:  # every stage holds its newest weights (runtime/worker/pipeline_eval.py)
            evals.append((offset, None))
        for i, (step, snaps) in enumerate(evals):
            eval0 = self.comm.traffic.copy()  # evaluation's forward messages: counted apart from training
            eval_loss = None if setup.bundle.default_loss else setup.bundle.loss_fn
            result = evaluate(run, self.source, run.schedule, self.rank, setup.stages, self.comm, eval_loss, step,
                              step * run.batch_size, self.wall if snaps is None else clocks[i], weights=snaps)
            setup.eval_traffic = setup.eval_traffic + self.comm.traffic_since(eval0)
            setup.evaluated = True
            stop = self.monitor.on_eval(result)
            if stop:  # the target is reached at this step: later evaluations are not the run's
                break
        # a checkpoint when the segment's flag (resolve.segment_plan) or a stop says so
        save_at_boundary(_ckpt_view(run, setup, self.rank, self.device), offset, due=seg.checkpoint or stop)
        return stop


def _resume_segment(run: ResolvedRun, step: int) -> tuple[int, int]:
    """(segments done before ``step``, minibatches of the next one done): ``(i, 0)`` at a
    segment boundary, ``(i, d)`` for a checkpoint cut inside segment ``i``."""
    inside = inner_point(run, step)
    return inside if inside is not None else (segments_done([s.steps for s in run.segments], step), 0)


def _restore_versions(setup: _Setup, sched: Schedule, done: int) -> None:
    """Each stage holds the versions of a checkpoint cut after ``done`` minibatches again:
    the newest (loaded by restore_point) and the stashed ones the suffix ``sched`` names."""
    stashed = setup.restored.stashed
    if setup.restored.drained:
        raise RuntimeError("a checkpoint inside a segment must be resumed from its own versions; it was drained")
    for k, st in setup.stages.items():
        u = stage_updates(sched, k, done)
        versions = {v: {n: ts[n] for n in st.stage.param_names if n in ts} for v, ts in stashed.items()}
        held = {v: ts for v, ts in versions.items() if ts}
        held[u] = dict(st.versions.latest)
        st.versions.restore(held, newest=u)


def _latest_clocks(clocks: list[float], device: torch.device) -> list[float]:
    """The latest of every rank's clock readings, element by element (one collective)."""
    if not clocks or not dist.is_initialized() or dist.get_world_size() == 1:
        return clocks
    t = torch.tensor(clocks, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(x) for x in t.tolist()]


def _report(run: ResolvedRun, setup: _Setup, rank: int, executor: Executor, step_losses: dict[int, list[float]],
            wall: float) -> RankReport:
    """This rank's contribution to the result (and to the checkpoint, from replica 0 of a stage)."""
    cfg = run.config
    stages = setup.stages
    peak = proc_status_mib("VmHWM") if setup.peak_reset else None
    out = RankReport(
        rank=rank, stages=list(stages), losses=step_losses, seconds=wall,
        steady={k: rate for (_, k), rate in steady_state_rates(executor.events, setup.timed_steps).items()},
        peak_versions={k: st.versions.peak for k, st in stages.items()},
        alive_versions={k: st.versions.alive() for k, st in stages.items()},
        bytes_sent=int(setup.timed_traffic.total_sent), traffic=setup.timed_traffic, eval_traffic=setup.eval_traffic,
        peak_rss_mib=peak if peak is not None else peak_rss_life_mib(),
        rss_end_mib=proc_status_mib("VmRSS"), rss_setup_mib=setup.rss_setup_mib, peak_reset=setup.peak_reset,
        peak_rss_life_mib=peak_rss_life_mib())
    if setup.tensor_memory is not None:
        out.tensor_memory = setup.tensor_memory.summary()
    if cfg.debug.return_state:  # the state in the result (a --save checkpoint is written per rank by save_final)
        for k, st in stages.items():
            if run.schedule.stage_ranks[k][0] != rank:
                continue
            out.state.update(alias_state(st.stage, {n: t.detach().to("cpu", copy=True)  # under every model name
                                                    for n, t in st.versions.latest.items()}))
            out.state.update({n: b.detach().to("cpu", copy=True) for n, b in st.stage.module.named_buffers()})
            sd = st.optimizer.state_dict()
            out.optimizer_state.update(every_name(st.stage, sd["state"]))  # under every model name
            out.stage_steps.update(every_name(st.stage, {n: sd["steps"] for n in st.stage.param_names}))
        out.state.update({k: v for k, v in setup.extras.items() if k not in out.state})
    if cfg.output.trace is not None:
        out.events = list(executor.events)
    return out


def _result(run: ResolvedRun, setup: _Setup, gathered: list[RankReport], device: torch.device,
            end_step: int) -> RunResult:
    """Rank 0: the run's result, and the checkpoint."""
    cfg = run.config
    steps = setup.timed_steps
    merged: dict[int, list[float]] = {}
    for g in gathered:
        for step, ls in g.losses.items():
            merged.setdefault(step, []).extend(ls)

    def mean_losses(span: range) -> list[float]:
        return [sum(merged[t]) / len(merged[t]) for t in span if t in merged]

    losses = mean_losses(range(end_step - steps, end_step))
    seconds = max(g.seconds for g in gathered)
    plan = run.plan
    assert plan is not None  # a distributed run has a plan (ResolvedRun.check)
    rates = [r for g in gathered for r in g.steady.values()]
    result = RunResult(
        steps=steps, samples_per_second=run.batch_size * steps / seconds if seconds > 0 else 0.0,
        final_loss=losses[-1] if losses else None, losses=losses, config=plan.config,
        schedule=cfg.parallel.schedule, workers=run.world_size, batch_size=run.batch_size,
        microbatches=run.microbatches, seconds=seconds, warmup_steps=cfg.training.warmup_steps,
        warmup_losses=mean_losses(range(setup.start_step, end_step - steps)), start_step=setup.start_step,
        plan_source=run.plan_note, stages=plan.num_stages, device=str(device),
        samples_per_second_steady=run.batch_size * min(rates) if rates else None,
        peak_rss_mib=[g.peak_rss_mib for g in gathered],
        peak_rss_scope="training" if all(g.peak_reset for g in gathered) else "process",
        rss_setup_mib=[g.rss_setup_mib for g in gathered], rss_end_mib=[g.rss_end_mib for g in gathered],
        peak_rss_life_mib=[g.peak_rss_life_mib for g in gathered],
        peak_versions={str(k): v for g in gathered for k, v in g.peak_versions.items()},
        bytes_sent=[g.bytes_sent for g in gathered], stage_nodes=[len(s.nodes) for s in plan.stages],
        stage_first_nodes=setup.stage_first_nodes, stage_first_modules=setup.stage_first_modules,
        run=run.to_json())
    result.add_traffic(_traffic_summary(run, setup, gathered))
    auto = plan.extra.get("auto") if plan.extra else None  # --schedule auto: what was chosen and predicted
    if auto:
        result.auto, result.predicted_time_per_minibatch = auto, auto.get("predicted_time_per_minibatch")
    result.skipped_steps = len(setup.skipped)  # every rank skips the same steps
    result.add_tensor_memory([g.tensor_memory for g in gathered])
    if setup.monitor is not None:  # evaluations and the target (every rank saw them)
        result.add_evaluation(setup.monitor.summary(end_step), run.data)
    if cfg.checkpoint.save is not None:  # written by every rank in _run (save_final)
        result.saved = cfg.checkpoint.save
    if cfg.debug.return_state:
        full: dict[str, torch.Tensor] = {}
        opt_state: dict[str, dict[str, Any]] = {}
        stage_steps: dict[str, int] = {}
        for g in gathered:
            full.update(g.state)
            opt_state.update(g.optimizer_state)
            stage_steps.update(g.stage_steps)
        missing = [k for k in setup.original_keys if k not in full]
        if missing:
            raise RuntimeError(f"checkpoint assembly lacks {len(missing)} tensors (first {missing[0]!r})")
        ordered = {k: full[k] for k in setup.original_keys}
        result.state = ordered
        result.alive_versions = {str(k): v for g in gathered for k, v in g.alive_versions.items()}
    return result


def _tied_sync(run: ResolvedRun, setup: _Setup, rank: int, comm: Comm) -> TiedSync | None:
    """The gradient exchange of parameters tied across stages (runtime/engine/tied_sync.py), or None.
    Every rank calls it at the same point (it creates process groups)."""
    local = {k: st.stage for k, st in setup.stages.items()}
    ties = next(iter(local.values())).ties if local else ()
    check_ties(ties, run.schedule.stage_ranks, run.config.synchronous, run.config.parallel.schedule)
    sync = TiedSync(rank, run.schedule.stage_ranks, ties, local, run.config.performance.timeout, comm.traffic)
    return sync if sync.active else None


def _buffer_names(captured: Any) -> set[str]:
    """Qualified names of the buffers any stage reads (module buffers and get_attr targets)."""
    gm = captured.gm
    names: set[str] = set()
    for n in gm.graph.nodes:
        if n.op == "call_module":
            names.update(qn for qn, _ in gm.get_submodule(str(n.target)).named_buffers(prefix=str(n.target)))
        elif n.op == "get_attr":
            names.add(str(n.target))
    return names


def _resume(cfg: TrainConfig, stages: dict[int, StageRuntime], device: torch.device) -> int:
    path = str(cfg.checkpoint.resume)
    state, trainer = load_checkpoint(path)
    check_resumable(path, trainer, cfg)
    for st in stages.values():
        missing = [n for n in st.stage.param_names if n not in state]
        if missing:
            raise RuntimeConfigError(f"checkpoint {path} lacks parameter {missing[0]!r} of this model")
        st.versions.load({n: state[n] for n in st.stage.param_names})
        with torch.no_grad():
            for n, b in st.stage.module.named_buffers():
                if n in state:
                    b.copy_(state[n].to(b.device))
        # a tied tensor's state under any of its names (runtime/checkpoints/periodic.py)
        steps = max([lookup_any_name(st.stage, n, trainer.stage_steps) or 0 for n in st.stage.param_names] + [0])
        opt = {n: lookup_any_name(st.stage, n, trainer.optimizer_state) for n in st.stage.param_names}
        st.optimizer.load_state_dict({"steps": steps, "state": {n: v for n, v in opt.items() if v is not None}},
                                     device)
    return trainer.step


def _ckpt_view(run: ResolvedRun, setup: _Setup, rank: int, device: torch.device) -> RankView:
    """What checkpoints see of this worker (runtime/checkpoints/periodic.py)."""
    return RankView(run, rank, run.world_size, setup.stages, setup.extras, device)


def _traffic_summary(run: ResolvedRun, setup: _Setup, gathered: list[RankReport]) -> dict[str, Any]:
    """Rank 0: the timed segments' traffic, measured and predicted (docs/traffic.md)::

        {"traffic": [per rank], "bytes_per_sample": ..., "bytes_per_minibatch": ...,   (traffic_report)
         "predicted_traffic": [per rank], "predicted_bytes_per_sample": ...,
         "eval_traffic": [per rank] (only when an evaluation ran)}

    The prediction is :func:`~pipetrain.plan.traffic.predict_traffic` of every timed segment
    that ran, with the codecs' cut sizes, the stages' all-reduce buffers and the ties across
    stages; samples are ``batch_size * timed steps``.
    """
    cfg = run.config
    steps = setup.timed_steps
    samples = run.batch_size * steps
    measured = traffic_report([g.traffic for g in gathered], samples or None, steps or None)
    cuts = cut_bytes(setup.codecs, wire_dtype(cfg.training.precision))
    clip = cfg.synchronous and cfg.training.clip_grad_norm is not None
    predicted = {r: Traffic() for r in range(run.world_size)}
    for sched in setup.timed_schedules:
        for r, t in predict_traffic(sched, cuts, setup.stage_buffers, global_clip=clip,
                                    tied=setup.tied_buffers).items():
            predicted[r] = predicted[r] + t
    out = dict(measured)
    out["predicted_traffic"] = [predicted[r].to_json() for r in sorted(predicted)]
    out["predicted_bytes_per_sample"] = bytes_per_sample(predicted, samples) if samples else None
    if setup.evaluated:
        out["eval_traffic"] = [g.eval_traffic.to_json() for g in gathered]
    return out


def _write_trace(directory: str, rank: int, mine: RankReport, schedule: Schedule,
                 gathered: list[RankReport] | None, summary: dict[str, Any] | None) -> None:
    """``DIR/rank{R}.json`` per rank and, on rank 0 (``gathered`` given), the merged
    ``DIR/trace.json``: the simulator's trace writer
    (:func:`~pipetrain.schedule.events.write_chrome_trace`), so measured and predicted
    timelines are the same format and figures. ``otherData`` carries the traffic: each rank's
    own (``{"traffic": ...}``), the merged trace the run's :func:`_traffic_summary`."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    write_chrome_trace(mine.events, d / f"rank{rank}.json", schedule=schedule, measured=True,
                       meta={"traffic": mine.traffic.to_json()})
    if gathered is not None:
        write_chrome_trace([e for g in gathered for e in g.events], d / "trace.json", schedule=schedule,
                           measured=True, meta=summary)
