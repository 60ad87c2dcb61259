"""One worker (rank) of a training run: set up, run the schedule, report.

:func:`run_rank` is what every process executes, whether started by ``pipetrain train
--workers N`` (through torchrun's launcher API, :mod:`pipetrain.runtime.launch`) or by
``torchrun ... -m pipetrain train`` directly:

1. join the process group (gloo on CPU, NCCL on CUDA; every wait bounded by ``--timeout``);
2. build the model from the seed, capture it, resolve the plan and the schedule;
3. build this rank's stage modules, weight versions, optimizers and communication;
4. run the schedule's action list (an optional untimed warm-up segment first);
5. gather losses (and, when asked, weights and optimizer state) to rank 0, which writes the
   checkpoint and the merged trace and returns the run's summary.

A rank that fails records ``rank R: error`` in the rendezvous store before it exits; a rank
whose transfer then breaks reports that rank as the cause ("rank 0 stopped: rank 1 failed:
...") instead of a bare connection error.
"""
from __future__ import annotations

import os
import resource
import sys
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..errors import PipetrainError, RuntimeConfigError
from ..plan.types import Plan
from ..schedule.action import Op, Schedule
from .checkpoint import TrainerState, load_checkpoint, save_checkpoint
from .comm import Comm
from .config import TrainConfig, parse_debug_fail
from .data import UnitData
from .executor import Executor, StageRuntime
from .optim import FunctionalOptimizer
from .reference import stage_step_count
from .resolve import build_run_schedule, check_workers, load_bundle, resolve_batch_size, resolve_plan
from .stage import (boundary_codecs, build_stage_modules, node_modules, partition_graph, stage_first_nodes,
                    stage_nodes_of_plan)

__all__ = ["worker_main", "run_rank", "init_distributed", "tune_malloc", "FAILURE_KEY", "STOPPED_MARK"]

FAILURE_KEY = "pipetrain/failed"
STOPPED_MARK = "stopped because rank"


def tune_malloc() -> bool:
    """Keep freed memory in the process instead of returning it to the kernel (glibc only).

    Every backward allocates fresh weight-gradient tensors; with glibc's defaults large ones
    are ``mmap``-ed and unmapped on free, and the heap top is trimmed, so each step pays
    page faults and kernel zeroing for the same sizes again (a third of a small microbatch's
    backward on a 2-core machine). Raising the mmap and trim thresholds lets the allocator
    reuse those pages, as a caching allocator would; and since glibc caps the mmap threshold
    at 32 MiB, larger tensors (an LM's logits: 16 x 128 x 8192 floats = 64 MiB, and their
    gradient) are kept off mmap altogether (``M_MMAP_MAX`` 0): a GPT step went from 65,000
    page faults to none, 7% less CPU time. Returns whether the settings took.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_threshold, m_mmap_max = -1, -3, -4
        ok = libc.mallopt(m_mmap_threshold, 32 << 20) == 1   # glibc's largest allowed threshold
        ok = libc.mallopt(m_trim_threshold, (1 << 31) - 1) == 1 and ok
        # Tensors above 32 MiB (an LM's logits and their gradient) would still be mmap-ed
        # and unmapped every step: no mmap at all, so they come from (and go back to) the heap.
        ok = libc.mallopt(m_mmap_max, 0) == 1 and ok
        return ok
    except (OSError, AttributeError):
        return False


def _proc_status_mib(field_name: str) -> float | None:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in MiB, or None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Free what setup dropped (gc, ``malloc_trim``), then restart the kernel's peak-RSS count
    (``VmHWM``) from the current RSS (Linux ``/proc/self/clear_refs`` 5). True if reset."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def init_distributed(cfg: TrainConfig) -> tuple[int, int, torch.device]:
    """Join (or reuse) the default process group; returns (rank, world size, device)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cfg.device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeConfigError("--device cuda but CUDA is not available on this machine; use --device cpu")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        backend = "nccl" if cfg.device == "cuda" else "gloo"
        kwargs: dict[str, Any] = {}
        if backend == "nccl":
            kwargs["device_id"] = device
        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.timeout), **kwargs)
    return dist.get_rank(), dist.get_world_size(), device


def _store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: failures are reported by the launcher only
        return None


def _record_failure(rank: int, exc: BaseException) -> None:
    store = _store()
    if store is None:
        return
    first = str(exc).splitlines()[0] if str(exc) else ""
    msg = f"{rank} failed: {type(exc).__name__}: {first}"
    try:
        store.compare_set(FAILURE_KEY, "", msg)
    except Exception:  # noqa: BLE001
        pass


def _failure_of_other(rank: int, wait_s: float = 2.0) -> str | None:
    """The failure another rank recorded, waiting briefly for it to appear."""
    store = _store()
    if store is None:
        return None
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if store.check([FAILURE_KEY]):
                msg = store.get(FAILURE_KEY).decode()
                if msg and not msg.startswith(f"{rank} failed:"):
                    return msg
                return None
        except Exception:  # noqa: BLE001
            return None
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def worker_main(cfgs: list[TrainConfig]) -> list[dict[str, Any]]:
    """Entry point of each process started by the local launcher: run every config in turn."""
    results = []
    for cfg in cfgs:
        results.append(run_rank(cfg))
    if dist.is_initialized():
        dist.destroy_process_group()
    return results


def run_rank(cfg: TrainConfig) -> dict[str, Any]:
    """Run this process's part of a training run; rank 0 returns the run's summary."""
    rank, world, device = init_distributed(cfg)
    try:
        return _run(cfg, rank, world, device)
    except BaseException as e:
        other = _failure_of_other(rank) if not isinstance(e, PipetrainError) else None
        if other is not None:
            raise RuntimeError(f"rank {rank} {STOPPED_MARK} {other}") from e
        _record_failure(rank, e)
        if dist.is_initialized() and dist.get_world_size() > 1:
            # Close our connections so that ranks waiting on us fail now (naming us, from the
            # store) instead of at their timeout; give them a moment to report first (a
            # configuration error is usually raised by every rank alike: no need to wait).
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
            if not isinstance(e, PipetrainError):
                time.sleep(1.0)
        raise


# --------------------------------------------------------------------------- the run


@dataclass
class _Setup:
    """What a worker builds before training (identical decisions on every rank)."""

    batch_size: int
    microbatches: int
    bundle: Any
    plan: Plan
    plan_note: str
    segments: list[tuple[str, int]]      # ("warmup" | "timed", steps)
    schedules: list[Schedule]            # one per segment
    stages: dict[int, StageRuntime]      # this rank's stages
    codecs: list[Any]
    original_keys: list[str]             # the model's state_dict keys, in order
    extras: dict[str, torch.Tensor]      # rank 0: state no stage holds
    start_step: int = 0
    stage_first_nodes: list[str] = field(default_factory=list)     # first node of each stage
    stage_first_modules: list[str] = field(default_factory=list)   # that node's innermost module
    rss_setup_mib: float | None = None   # RSS once the stages are built (the peak's baseline)
    peak_reset: bool = False             # whether VmHWM was reset after setup

    @property
    def schedule(self) -> Schedule:
        return self.schedules[-1]


def _run(cfg: TrainConfig, rank: int, world: int, device: torch.device) -> dict[str, Any]:
    if cfg.threads is not None and device.type == "cpu":
        torch.set_num_threads(cfg.threads)
    if cfg.tune_malloc:
        tune_malloc()
    setup = _setup(cfg, rank, world, device)
    executor, step_losses, wall, end_step = _train(cfg, setup, rank, device)
    mine = _report(cfg, setup, rank, executor, step_losses, wall)
    gathered: list[Any] = [None] * world if rank == 0 else []
    dist.gather_object(mine, gathered if rank == 0 else None, dst=0)
    if cfg.trace is not None:
        _write_trace(cfg.trace, rank, mine.get("events", []), setup.schedule, gathered if rank == 0 else None)
    if rank != 0:
        return {"rank": rank}
    return _summary(cfg, setup, gathered, world, device, end_step)


def _setup(cfg: TrainConfig, rank: int, world: int, device: torch.device) -> _Setup:
    """Model, capture, plan, schedules, this rank's stage modules, optimizers and resume."""
    from ..graph.capture import capture

    if cfg.workers is not None and cfg.workers != world:
        raise RuntimeConfigError(
            f"--workers {cfg.workers} but the process group has {world} ranks; pass --workers {world} or start "
            f"{cfg.workers} processes")
    check_workers(cfg, world)
    batch_size = resolve_batch_size(cfg)
    cfg_w = cfg if cfg.workers == world else replace(cfg, workers=world)
    m = cfg_w.resolved_microbatches()
    cfg_w.check_counts(batch_size)
    bundle = load_bundle(cfg, batch_size // m)
    original_keys = list(bundle.model.state_dict().keys())
    captured = capture(bundle.model, bundle.example_inputs)
    plan, plan_note = resolve_plan(cfg_w, captured, bundle, batch_size, world)
    segments = ([("warmup", cfg.warmup_steps)] if cfg.warmup_steps else []) + [("timed", cfg.steps)]
    schedules = [build_run_schedule(cfg_w, plan, m, n) for _, n in segments]
    if schedules[-1].num_workers != world:
        raise RuntimeConfigError(
            f"the {cfg.schedule} schedule for plan {plan.config} uses {schedules[-1].num_workers} workers but the run "
            f"has {world}; pass --workers {schedules[-1].num_workers}")
    part = partition_graph(captured.gm, stage_nodes_of_plan(plan))
    codecs = boundary_codecs(captured.gm, part, bundle.example_inputs)
    mine = schedules[-1].stages_of_rank(rank)
    modules = build_stage_modules(captured, part, codecs, mine)
    extras: dict[str, torch.Tensor] = {}
    if rank == 0:  # parameters no node reads: no stage holds them, checkpoints need them
        held = set(part.param_stage) | _buffer_names(captured)
        extras = {k: v.detach().clone() for k, v in bundle.model.state_dict().items() if k not in held}
    # Linear weight gradients straight into the accumulators (fused.py), unless the
    # schedule splits backwards into I and W.
    split_backward = any(a.op in (Op.I, Op.W) for a in schedules[-1].workers[rank])
    fuse = cfg.fused_grads and not split_backward
    stages = {k: StageRuntime(modules[k], FunctionalOptimizer(cfg.optimizer), len(schedules[-1].stage_ranks[k]),
                              device, fuse_linear=fuse) for k in mine}
    first_nodes = stage_first_nodes(plan, [n.name for n in captured.graph.nodes if n.is_input])
    first_modules = {n.name: (node_modules(n) or [""])[-1] for n in captured.gm.graph.nodes}
    del bundle.model, captured  # the stage modules now hold what this rank needs
    setup = _Setup(batch_size, m, bundle, plan, plan_note, segments, schedules, stages, list(codecs),
                   original_keys, extras)
    setup.stage_first_nodes = first_nodes
    setup.stage_first_modules = [first_modules.get(n, "") for n in first_nodes]
    if cfg.resume:
        setup.start_step = _resume(cfg, stages, device)
    # Peak memory counts the training phase of this rank's own stages, not the building of
    # the whole model (which every rank does): reset the kernel's high-water mark here.
    setup.peak_reset = reset_peak_rss()
    setup.rss_setup_mib = _proc_status_mib("VmRSS")
    return setup


def _train(cfg: TrainConfig, setup: _Setup, rank: int,
           device: torch.device) -> tuple[Executor, dict[int, list[float]], float, int]:
    """Run the segments; returns the executor, losses per step, timed seconds and the end step."""
    schedule = setup.schedule
    mine = list(setup.stages)
    comm = Comm(rank, schedule, setup.codecs, device, cfg.timeout,
                global_clip=cfg.synchronous and cfg.clip_grad_norm is not None)
    lr_totals = {k: setup.stages[k].optimizer.steps + sum(stage_step_count(s, k) for s in setup.schedules)
                 for k in mine}
    is_logger = schedule.num_stages - 1 in mine and rank == schedule.stage_ranks[-1][0] and not cfg.quiet
    log = (sys.stderr if cfg.log_to_stderr else sys.stdout, cfg.log_every) if is_logger and cfg.log_every else None

    def data(offset: int) -> UnitData:
        return UnitData(setup.bundle.make_batch, setup.batch_size, setup.microbatches, cfg.seed, offset, device)

    executor = Executor(rank, setup.stages, comm, data(setup.start_step), setup.bundle.loss_fn, cfg.optimizer.lr,
                        cfg.lr_schedule, clip=cfg.clip_grad_norm, global_clip=cfg.synchronous,
                        lookahead=cfg.lookahead, record=cfg.trace is not None,
                        fail_at=parse_debug_fail(cfg.debug_fail) if cfg.debug_fail else None,
                        log=log, lr_totals=lr_totals)
    step_losses: dict[int, list[float]] = {}
    offset, wall = setup.start_step, 0.0
    needs_data = any(setup.stages[k].stage.is_first or setup.stages[k].stage.is_last for k in mine)
    for (kind, n), sched in zip(setup.segments, setup.schedules):
        executor.data = data(offset)
        if needs_data:  # data generation stays out of the timed window
            executor.data.prefetch(n)
        dist.barrier()
        t0 = time.perf_counter()
        if kind == "timed":
            executor.t0, executor.events, executor.step_ends = t0, [], {}
        executor.run(sched.workers[rank])
        comm.finish(cfg.timeout)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        if kind == "timed":
            wall = time.perf_counter() - t0
        for u, loss in executor.unit_losses().items():
            step_losses.setdefault(executor.data.step_of(u), []).append(loss)
        executor.losses = {}
        offset += n
    return executor, step_losses, wall, offset


def _report(cfg: TrainConfig, setup: _Setup, rank: int, executor: Executor, step_losses: dict[int, list[float]],
            wall: float) -> dict[str, Any]:
    """This rank's contribution to the summary (and to the checkpoint, from replica 0 of a stage)."""
    stages = setup.stages
    out: dict[str, Any] = {
        "rank": rank, "stages": list(stages), "losses": step_losses, "seconds": wall,
        "steady": _steady_rates(executor.step_ends, cfg.steps),
        "peak_versions": {k: st.versions.peak for k, st in stages.items()},
        "alive_versions": {k: st.versions.alive() for k, st in stages.items()},
        "bytes_sent": executor.comm.bytes_sent,
        "peak_rss_mib": _proc_status_mib("VmHWM") if setup.peak_reset else None,
        "rss_end_mib": _proc_status_mib("VmRSS"),
        "rss_setup_mib": setup.rss_setup_mib,
        "peak_reset": setup.peak_reset,
        "peak_rss_life_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
    }
    if out["peak_rss_mib"] is None:
        out["peak_rss_mib"] = out["peak_rss_life_mib"]
    if cfg.return_state or cfg.save is not None:
        state: dict[str, torch.Tensor] = {}
        opt_state: dict[str, dict[str, Any]] = {}
        stage_steps: dict[str, int] = {}
        for k, st in stages.items():
            if setup.schedule.stage_ranks[k][0] != rank:
                continue
            state.update({n: t.detach().to("cpu", copy=True) for n, t in st.versions.latest.items()})
            state.update({n: b.detach().to("cpu", copy=True) for n, b in st.stage.module.named_buffers()})
            sd = st.optimizer.state_dict()
            opt_state.update(sd["state"])
            stage_steps.update({n: sd["steps"] for n in st.stage.param_names})
        state.update({k: v for k, v in setup.extras.items() if k not in state})
        out.update(state=state, optimizer_state=opt_state, stage_steps=stage_steps)
    if cfg.trace is not None:
        out["events"] = [(str(e.action), e.action.op.value, e.action.stage, e.action.mb, e.action.version,
                          e.action.peer, e.start, e.end) for e in executor.events]
    return out


def _steady_of(gathered: list[dict[str, Any]], batch_size: int) -> float | None:
    """Steady-state samples/s of the run: the slowest stage's rate (see :func:`_steady_rates`)."""
    rates = [r for g in gathered for r in g.get("steady", {}).values()]
    return batch_size * min(rates) if rates else None


def _steady_rates(step_ends: dict[int, list[float]], minibatches: int) -> dict[int, float]:
    """Per stage: minibatches per second between its first and last STEP of the timed segment.

    The timed window also holds the pipeline's fill (stage 0 waits for the first backward)
    and drain (the last stage idles after its last step); in a long run they happen once.
    This is the rate in between: ``(n - 1)`` steps of ``minibatches / n`` minibatches each
    over the time from the end of STEP 1 to the end of STEP ``n``. Needs ``n >= 2``.
    """
    out: dict[int, float] = {}
    for k, ends in step_ends.items():
        n = len(ends)
        if n >= 2 and ends[-1] > ends[0]:
            out[k] = (n - 1) * (minibatches / n) / (ends[-1] - ends[0])
    return out


def _summary(cfg: TrainConfig, setup: _Setup, gathered: list[dict[str, Any]], world: int, device: torch.device,
             end_step: int) -> dict[str, Any]:
    """Rank 0: the run's summary (``--json``), and the checkpoint."""
    merged: dict[int, list[float]] = {}
    for g in gathered:
        for step, ls in g["losses"].items():
            merged.setdefault(step, []).extend(ls)

    def mean_losses(steps: range) -> list[float]:
        return [sum(merged[t]) / len(merged[t]) for t in steps if t in merged]

    losses = mean_losses(range(end_step - cfg.steps, end_step))
    seconds = max(g["seconds"] for g in gathered)
    plan = setup.plan
    result: dict[str, Any] = {
        "steps": cfg.steps, "samples_per_second": setup.batch_size * cfg.steps / seconds if seconds > 0 else 0.0,
        "final_loss": losses[-1] if losses else None, "losses": losses, "config": plan.config,
        "schedule": cfg.schedule, "workers": world, "batch_size": setup.batch_size,
        "microbatches": setup.microbatches, "seconds": seconds, "warmup_steps": cfg.warmup_steps,
        "warmup_losses": mean_losses(range(setup.start_step, end_step - cfg.steps)), "start_step": setup.start_step,
        "plan_source": setup.plan_note, "stages": plan.num_stages, "device": str(device),
        "samples_per_second_steady": _steady_of(gathered, setup.batch_size),
        "peak_rss_mib": [g["peak_rss_mib"] for g in gathered],
        "peak_rss_scope": "training" if all(g.get("peak_reset") for g in gathered) else "process",
        "rss_setup_mib": [g.get("rss_setup_mib") for g in gathered],
        "rss_end_mib": [g.get("rss_end_mib") for g in gathered],
        "peak_rss_life_mib": [g.get("peak_rss_life_mib") for g in gathered],
        "peak_versions": {str(k): v for g in gathered for k, v in g["peak_versions"].items()},
        "bytes_sent": [g["bytes_sent"] for g in gathered],
        "stage_nodes": [len(s.nodes) for s in plan.stages],
        "stage_first_nodes": setup.stage_first_nodes,
        "stage_first_modules": setup.stage_first_modules,
    }
    if cfg.return_state or cfg.save is not None:
        full: dict[str, torch.Tensor] = {}
        opt_state: dict[str, dict[str, Any]] = {}
        stage_steps: dict[str, int] = {}
        for g in gathered:
            full.update(g.get("state", {}))
            opt_state.update(g.get("optimizer_state", {}))
            stage_steps.update(g.get("stage_steps", {}))
        missing = [k for k in setup.original_keys if k not in full]
        if missing:
            raise RuntimeError(f"checkpoint assembly lacks {len(missing)} tensors (first {missing[0]!r})")
        ordered = {k: full[k] for k in setup.original_keys}
        if cfg.save is not None:
            save_checkpoint(cfg.save, ordered, TrainerState(
                end_step, cfg.model, dict(cfg.model_options), cfg.to_dict()["optimizer"], opt_state, stage_steps))
            result["saved"] = cfg.save
        if cfg.return_state:
            result["state"] = ordered
            result["alive_versions"] = {str(k): v for g in gathered for k, v in g["alive_versions"].items()}
    return result


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
    state, trainer = load_checkpoint(cfg.resume)  # type: ignore[arg-type]
    if trainer.model != cfg.model or trainer.model_options != dict(cfg.model_options):
        raise RuntimeConfigError(
            f"checkpoint {cfg.resume} is for model {trainer.model} {trainer.model_options}, not {cfg.model} "
            f"{dict(cfg.model_options)}; resume with the same --model and --option values")
    if trainer.optimizer.get("name") != cfg.optimizer.name:
        raise RuntimeConfigError(
            f"checkpoint {cfg.resume} was trained with {trainer.optimizer.get('name')}, not {cfg.optimizer.name}; "
            f"resume with --optimizer {trainer.optimizer.get('name')}")
    for st in stages.values():
        missing = [n for n in st.stage.param_names if n not in state]
        if missing:
            raise RuntimeConfigError(f"checkpoint {cfg.resume} lacks parameter {missing[0]!r} of this model")
        st.versions.load({n: state[n] for n in st.stage.param_names})
        with torch.no_grad():
            for n, b in st.stage.module.named_buffers():
                if n in state:
                    b.copy_(state[n].to(b.device))
        steps = max([trainer.stage_steps.get(n, 0) for n in st.stage.param_names] + [0])
        st.optimizer.load_state_dict({"steps": steps, "state": {n: trainer.optimizer_state[n]
                                                                for n in st.stage.param_names
                                                                if n in trainer.optimizer_state}}, device)
    return trainer.step


def _write_trace(directory: str, rank: int, events: list[tuple], schedule: Schedule,
                 gathered: list[Any] | None) -> None:
    from ..simulate.trace import save_trace, trace_event, trace_process_name, trace_thread_name

    def to_events(r: int, evs: list[tuple]) -> list[dict[str, Any]]:
        stages = "/".join(str(k) for k in schedule.stages_of_rank(r))
        out = [trace_process_name(r, f"rank {r} (stage {stages})"), trace_thread_name(r, 0, "compute"),
               trace_thread_name(r, 1, "comm")]
        for short, op, stage, unit, version, peer, start, end in evs:
            args: dict[str, Any] = {"stage": stage, "unit": unit, "op": op}
            if version is not None:
                args["version"] = version
            if peer is not None:
                args["peer"] = peer
            comm = op in ("SEND_F", "SEND_B", "RECV_F", "RECV_B", "ALLREDUCE")
            out.append(trace_event(r, short, start, end, "comm" if comm else "compute", args,
                                   tid=1 if comm and op != "ALLREDUCE" else 0))
        return out

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    save_trace({"traceEvents": to_events(rank, events), "displayTimeUnit": "ms"}, d / f"rank{rank}.json")
    if gathered is not None:
        merged: list[dict[str, Any]] = []
        for g in gathered:
            merged.extend(to_events(g["rank"], g.get("events", [])))
        save_trace({"traceEvents": merged, "displayTimeUnit": "ms",
                    "otherData": {"schedule": schedule.name, "measured": True}}, d / "trace.json")
