"""From a :class:`TrainConfig` to what runs: batch size, model, plan, schedule.

Every rank calls these with the same configuration and gets the same answers (the model is
built after ``torch.manual_seed(seed)``, plans from ``--plan`` or ``--config`` are
deterministic); only a plan the planner chooses from a measured profile may differ between
ranks, so rank 0 makes it and broadcasts it (:func:`resolve_plan`).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ..errors import PipetrainError, RuntimeConfigError
from ..graph.capture import CapturedModel
from ..plan.types import Plan, Stage, Topology
from ..schedule.action import Schedule
from .config import TrainConfig, parse_config, parse_cut
from .stage import split_at_cuts, split_by_config

__all__ = [
    "resolve_batch_size", "load_bundle", "resolve_plan", "schedule_replicas", "expected_workers",
    "build_run_schedule", "check_workers",
]

#: Bandwidth assumed between local worker processes when the planner is asked (bytes/s).
LOCAL_BANDWIDTH = 2e9


def resolve_batch_size(cfg: TrainConfig) -> int:
    """``--batch-size``, else the model's default batch size."""
    if cfg.batch_size is not None:
        return cfg.batch_size
    if ":" not in cfg.model:
        from ..models import default_batch_size

        return default_batch_size(cfg.model)
    from ..models import load_model

    return load_model(cfg.model, **cfg.model_options).batch_size


def load_bundle(cfg: TrainConfig, unit_batch: int) -> Any:
    """The model bundle, initialised from ``seed`` (same weights in every process), with a
    unit-sized example batch (what shapes of wire tensors are taken from)."""
    from ..models import load_model

    torch.manual_seed(cfg.seed)
    return load_model(cfg.model, batch_size=unit_batch, **cfg.model_options)


def _interleaved(cfg: TrainConfig) -> bool:
    return cfg.schedule == "interleaved"


def expected_workers(cfg: TrainConfig, plan: Plan) -> int:
    """Ranks a plan needs: the sum of replicas, or stages / virtual stages for interleaved."""
    if _interleaved(cfg):
        return plan.num_stages // cfg.virtual_stages
    return plan.num_workers


def config_workers(cfg: TrainConfig) -> int | None:
    """Workers implied by ``--plan`` or ``--config`` alone (cheap, no model), else ``None``."""
    if cfg.config is not None:
        reps = parse_config(cfg.config)
        return len(reps) if _interleaved(cfg) else sum(reps)
    if cfg.plan is not None:
        plan = Plan.load(cfg.plan)
        return plan.num_stages // cfg.virtual_stages if _interleaved(cfg) else plan.num_workers
    if cfg.cut is not None:
        stages = len(parse_cut(cfg.cut)) + 1
        return stages // cfg.virtual_stages if _interleaved(cfg) else stages
    return None


def check_workers(cfg: TrainConfig, workers: int) -> None:
    """``--workers`` must match the plan or ``--config``; raises RuntimeConfigError otherwise."""
    need = config_workers(cfg)
    if need is not None and need != workers:
        src = f"--config {cfg.config}" if cfg.config is not None else f"the plan {cfg.plan}"
        extra = f" ({cfg.virtual_stages} stages per rank)" if _interleaved(cfg) else ""
        raise RuntimeConfigError(
            f"--workers {workers} does not match {src}, which needs {need} workers{extra}; pass --workers {need} "
            f"or change the {'config' if cfg.config is not None else 'plan'}")


def resolve_plan(cfg: TrainConfig, captured: CapturedModel, bundle: Any, batch_size: int, workers: int,
                 broadcast: bool = True) -> tuple[Plan, str]:
    """The plan to run and a note saying where it came from.

    ``--plan`` is loaded; ``--config 2-1-1`` is cut by :func:`split_by_config`; ``dp`` is one
    stage on every worker; ``interleaved`` cuts ``workers * virtual_stages`` stages; otherwise
    the planner chooses from a quick profile (rank 0, broadcast), falling back to a balanced
    split into ``workers`` single-replica stages.
    """
    name = str(getattr(bundle, "name", cfg.model))
    if cfg.plan is not None:
        plan = Plan.load(cfg.plan)
        note = f"plan file {cfg.plan}"
    elif cfg.cut is not None:
        cuts = parse_cut(cfg.cut)
        reps = parse_config(cfg.config) if cfg.config is not None else [1] * (len(cuts) + 1)
        if _interleaved(cfg) and cfg.config is not None:
            reps = [1] * (len(reps) * cfg.virtual_stages)
        plan = split_at_cuts(captured, cuts, reps, name, batch_size)
        note = f"--cut {cfg.cut}" + (f" with --config {cfg.config}" if cfg.config is not None else "")
    elif cfg.config is not None:
        reps = parse_config(cfg.config)
        if _interleaved(cfg):
            if any(r != 1 for r in reps):
                raise RuntimeConfigError(
                    f"interleaved does not replicate stages: --config must be all 1s (one per rank), got {cfg.config}")
            reps = [1] * (len(reps) * cfg.virtual_stages)
        if cfg.schedule == "dp" and len(reps) != 1:
            raise RuntimeConfigError(
                f"dp runs one stage on every worker: --config must be one number (e.g. {sum(reps)}), got {cfg.config}")
        plan = split_by_config(captured, reps, name, batch_size)
        note = f"--config {cfg.config} split by estimated compute"
    elif cfg.schedule == "dp":
        plan = split_by_config(captured, [workers], name, batch_size)
        note = "data parallel: one stage on every worker"
    elif _interleaved(cfg):
        plan = split_by_config(captured, [1] * (workers * cfg.virtual_stages), name, batch_size)
        note = f"{workers * cfg.virtual_stages} stages ({cfg.virtual_stages} per rank) split by estimated compute"
    elif workers == 1:
        plan = split_by_config(captured, [1], name, batch_size)
        note = "one stage"
    else:
        plan, note = _planned(cfg, captured, bundle, batch_size, workers, broadcast)
    if expected_workers(cfg, plan) != workers:
        raise RuntimeConfigError(
            f"the plan ({plan.config}) needs {expected_workers(cfg, plan)} workers but the run has {workers}; "
            f"pass --workers {expected_workers(cfg, plan)} or another plan")
    return plan, note


def _planned(cfg: TrainConfig, captured: CapturedModel, bundle: Any, batch_size: int, workers: int,
             broadcast: bool) -> tuple[Plan, str]:
    """Rank 0 asks the planner (quick profile on this machine); every rank gets its answer."""
    import torch.distributed as dist

    distributed = broadcast and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    result: list[Any] = [None]
    if not distributed or dist.get_rank() == 0:
        result[0] = _ask_planner(cfg, captured, bundle, batch_size, workers)
    if distributed:
        dist.broadcast_object_list(result, src=0)
    plan_dict, note = result[0]
    return Plan.from_dict(plan_dict), note


def _ask_planner(cfg: TrainConfig, captured: CapturedModel, bundle: Any, batch_size: int,
                 workers: int) -> tuple[dict[str, Any], str]:
    fallback = split_by_config(captured, [1] * workers, str(getattr(bundle, "name", "")), batch_size)
    try:
        from ..plan.api import PlanOptions, plan as run_planner
        from ..profile.profiler import profile_captured
    except ImportError as e:
        return fallback.to_dict(), f"balanced split into {workers} stages (planner unavailable: {e})"
    schedule = cfg.schedule if cfg.schedule in ("pipedream", "flush", "2bw", "gpipe") else "flush"
    try:
        inputs = bundle.make_batch(batch_size, torch.Generator().manual_seed(cfg.seed))[0]
        prof = profile_captured(captured, inputs, batch_size=batch_size, warmup=1, repeats=2,
                                optimizer=cfg.optimizer.name, momentum=cfg.optimizer.momentum,
                                model_name=str(getattr(bundle, "name", "")), threads=cfg.threads)
        opts = PlanOptions(schedule=schedule, microbatches=cfg.resolved_microbatches())
        plan = run_planner(prof, Topology.flat(workers, LOCAL_BANDWIDTH), opts)
    except (PipetrainError, Exception) as e:  # noqa: BLE001 - any planner failure falls back
        return fallback.to_dict(), f"balanced split into {workers} stages (planner failed: {type(e).__name__}: {e})"
    if plan.num_workers != workers or (cfg.schedule == "2bw" and any(r > 1 for r in plan.replicas)):
        return fallback.to_dict(), (f"balanced split into {workers} stages (the planner's plan {plan.config} does not "
                                    f"use exactly {workers} workers)")
    return plan.to_dict(), f"planner ({plan.config}) from a quick profile on this machine"


def schedule_replicas(cfg: TrainConfig, plan: Plan) -> list[int]:
    """The ``replicas`` argument of ``build_schedule`` for this plan."""
    return [s.replicas for s in plan.stages]


def build_run_schedule(cfg: TrainConfig, plan: Plan, microbatches: int, steps: int) -> Schedule:
    """The complete schedule of ``steps`` minibatches for this run."""
    from ..schedule import build_schedule

    opts: dict[str, Any] = {}
    if cfg.schedule == "pipedream":
        opts["vertical_sync"] = cfg.vertical_sync
    if cfg.schedule == "interleaved":
        opts["virtual_stages"] = cfg.virtual_stages
    return build_schedule(cfg.schedule, schedule_replicas(cfg, plan), microbatches, steps, **opts)


def plan_of_nodes(stage_nodes: Sequence[Sequence[str]], replicas: Sequence[int] | None = None) -> Plan:
    """A plan from explicit node lists (tests, custom cuts)."""
    reps = list(replicas) if replicas is not None else [1] * len(stage_nodes)
    return Plan(stages=[Stage(nodes=list(n), replicas=r) for n, r in zip(stage_nodes, reps)])
