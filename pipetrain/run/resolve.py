"""From a :class:`~pipetrain.job.config.TrainConfig` to a :class:`~pipetrain.job.resolved.ResolvedRun`.

:func:`resolve_run` makes every decision of a run, once, in this order, asking the
schedule's :class:`~pipetrain.schedule.ScheduleSpec` wherever the schedule matters:

1. the world size (``--workers``, or what ``--config`` / ``--plan`` / ``--cut`` need);
2. the batch size (``--batch-size``, else the model's) and the microbatches (``--microbatches``,
   else ``spec.default_microbatches``), which must divide it;
3. the model, weightless (no parameter storage: :mod:`pipetrain.job.model`; real weights only
   for a quick profile), and its capture;
4. the plan: ``--plan`` loaded, ``--cut`` / ``--config`` / the schedule's own layout cut by
   :mod:`pipetrain.plan.cuts`, or the planner's from a quick profile (:mod:`pipetrain.plan.quick`);
   checked against the captured graph (every node in one stage, stages in graph order), and
   its ties across stages against the schedule (:func:`pipetrain.stages.tied.check_ties`:
   asynchronous schedules and two tied stages on one rank are refused here, before any
   worker starts);
5. the complete schedule of every segment: the warm-up, then the timed steps split at every
   boundary step (evaluations, checkpoints, the end: :func:`segment_plan`).

Real data (``--data``) is loaded here first (:func:`resolve_data`): the model options that fit
it are merged under the user's (``model_options_for``), the run's length becomes steps
(:func:`resolve_length`: ``--steps``, ``--epochs``, or until the target, at most
``--max-epochs``), and the model is checked against the samples (``check_fits``) before any worker starts. The resolved
run carries the data's description (:class:`~pipetrain.job.data.DataSpec`), not its
tensors; workers reload it from the seed.

The result is checked (:meth:`ResolvedRun.check`) and handed, unchanged, to every worker.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from ..auto.choose import summary_lines
from ..errors import DataError, PipetrainError, RuntimeConfigError
from ..job.config import DEFAULT_MAX_EPOCHS, DEFAULT_STEPS, TrainConfig
from ..job.data import DataSpec
from ..job.model import load_bundle, load_captured, load_shipped, model_batch_size
from ..job.parse import parse_config, parse_cut
from ..job.resolved import ResolvedRun, Segment
from ..plan.cuts import split_at_cuts, split_by_config
from ..plan.types import Plan
from ..runtime.process.rss import workers_allocator

log = logging.getLogger(__name__)

__all__ = ["resolve_run", "resolve_with_bundle", "resolve_batch_size", "implied_workers", "ONE_PROCESS_NOTE",
           "resolve_data", "resolve_length", "segment_plan", "inner_evals", "bucket_mb", "OVERLAP_BUCKET_MB"]

ONE_PROCESS_NOTE = "one process (plain training with torch.optim)"


def resolve_batch_size(cfg: TrainConfig) -> int:
    """``--batch-size``, else the model's default batch size."""
    if cfg.training.batch_size is not None:
        return cfg.training.batch_size
    name = cfg.model.name
    if ":" not in name:
        from ..models import default_batch_size

        return int(default_batch_size(name))
    return model_batch_size(cfg)


def _chunks(cfg: TrainConfig) -> int:
    """Model stages per rank (``virtual_stages`` for interleaved, else 1)."""
    return int(cfg.spec.chunks_per_rank(cfg.parallel.schedule_options))


def _config_replicas(cfg: TrainConfig) -> list[int]:
    """``--config``'s replicas per rank stage, as replicas per *model* stage."""
    par, spec = cfg.parallel, cfg.spec
    reps = parse_config(par.config)  # type: ignore[arg-type]
    if not spec.replicates and any(r != 1 for r in reps):
        raise RuntimeConfigError(
            f"{par.schedule} does not replicate stages: --config must be all 1s (one per rank), got {par.config}")
    if spec.one_stage and len(reps) != 1:
        raise RuntimeConfigError(
            f"{par.schedule} runs one stage on every worker: --config must be one number (e.g. {sum(reps)}), got "
            f"{par.config}")
    v = _chunks(cfg)
    return [r for r in reps for _ in range(v)]


def _given_replicas(cfg: TrainConfig) -> list[int] | None:
    """Replicas per model stage fixed by ``--plan`` / ``--cut`` / ``--config`` (no model needed)."""
    par = cfg.parallel
    if par.plan is not None:
        return Plan.load(par.plan).replicas
    if par.cut is not None:
        return _config_replicas(cfg) if par.config is not None else [1] * (len(parse_cut(par.cut)) + 1)
    if par.config is not None:
        return _config_replicas(cfg)
    return None


def implied_workers(cfg: TrainConfig) -> int | None:
    """Workers that ``--plan`` / ``--config`` / ``--cut`` need (cheap, no model), else ``None``."""
    reps = _given_replicas(cfg)
    return None if reps is None else int(cfg.spec.ranks_needed(reps, cfg.parallel.schedule_options))


def _check_workers(cfg: TrainConfig, workers: int) -> None:
    need = implied_workers(cfg)
    if need is not None and need != workers:
        par = cfg.parallel
        src = (f"--config {par.config}" if par.config is not None else
               f"the plan {par.plan}" if par.plan is not None else f"--cut {par.cut}")
        v = _chunks(cfg)
        extra = f" ({v} stages per rank)" if v > 1 else ""
        raise RuntimeConfigError(
            f"--workers {workers} does not match {src}, which needs {need} workers{extra}; pass --workers {need} "
            f"or change the {'config' if par.config is not None else 'plan'}")


def _too_short_to_choose(cfg: TrainConfig) -> bool:
    """A run shorter than ``auto_from_steps`` (``pipetrain train`` with the schedule left open):
    the choice measures for longer than such a run trains (pipetrain.cli.train_cmd.CHOSEN_FROM_STEPS)."""
    steps = cfg.training.steps
    return steps is not None and steps < cfg.parallel.auto_from_steps


def _unchosen(cfg: TrainConfig, workers: int) -> TrainConfig:
    """A run :func:`_too_short_to_choose`: its default schedule, no choice (the caller lays a
    straight pipeline of ``workers`` stages), said in one line."""
    steps, par = cfg.training.steps, cfg.parallel
    log.info("plan: a run of %d step%s (fewer than %d) that names no schedule or stages: %s on %d stages split by "
             "estimated compute, nothing measured; --schedule auto chooses on measurements",
             steps, "" if steps == 1 else "s", par.auto_from_steps, par.schedule, workers)
    return cfg.replace(auto=False)


def _layout_replicas(cfg: TrainConfig, workers: int) -> list[int] | None:
    """Replicas per model stage, when the configuration or the schedule's layout fixes them;
    ``None`` when the planner chooses."""
    given = _given_replicas(cfg)
    if given is not None:
        return given
    if workers == 1:
        return [1]
    if cfg.spec.one_stage:
        return [workers]
    if _chunks(cfg) > 1:
        return [1] * (workers * _chunks(cfg))
    return None


def _microbatches(cfg: TrainConfig, model_replicas: list[int]) -> int:
    if cfg.parallel.microbatches is not None:
        return cfg.parallel.microbatches
    ranks = cfg.spec.rank_replicas(model_replicas, cfg.parallel.schedule_options)
    return int(cfg.spec.default_microbatches(len(ranks), ranks))


def _check_divides(batch: int, m: int) -> None:
    if batch % m:
        lower = max(d for d in range(1, m + 1) if batch % d == 0)
        raise RuntimeConfigError(
            f"batch size {batch} is not divisible by microbatches {m}: every microbatch must have the same size; "
            f"use --microbatches {lower} or --batch-size {(batch // m + 1) * m}")


def _period(cfg: TrainConfig, model_replicas: list[int]) -> int:
    ranks = cfg.spec.rank_replicas(model_replicas, cfg.parallel.schedule_options)
    return int(cfg.spec.steps_period(ranks))


def _check_steps_period(cfg: TrainConfig, model_replicas: list[int], source: str) -> None:
    """Steps must be a multiple of ``spec.steps_period`` (pipedream: every replica count);
    steps counted from epochs are rounded down to one instead (:func:`_boundaries`)."""
    period = _period(cfg, model_replicas)
    checks: list[tuple[int | None, str]] = [(cfg.training.warmup_steps, "--warmup-steps")]
    if not _steps_from_epochs(cfg):
        checks.append((cfg.training.steps, "--steps"))
    for flag, every in (("--eval-every", cfg.evaluation.eval_every),
                        ("--checkpoint-every", cfg.checkpoint.checkpoint_every)):
        if every:
            checks.append((every, flag))
    for n, what in checks:
        if n and n % period:
            raise RuntimeConfigError(
                f"{cfg.parallel.schedule} steps a stage with r replicas once per r minibatches, so {what} must be a "
                f"multiple of every replica count of {source}: got {what} {n}; use {what} {(n // period + 1) * period}")


def _one_stage_names() -> str:
    """The schedules that run one stage on every worker (dp), for messages."""
    from ..schedule import SCHEDULES

    return " / ".join(s.name for s in SCHEDULES.values() if s.one_stage)


def _too_many_stages(cfg: TrainConfig, workers: int, layers: int, stages: int) -> RuntimeConfigError:
    model = cfg.model.name
    v = _chunks(cfg)
    if v > 1:
        flag = "--" + str(cfg.spec.chunks_option).replace("_", "-")
        return RuntimeConfigError(
            f"--workers {workers} with {flag} {v} needs {stages} stages but model {model} has only {layers} "
            f"layers; use at most --workers {max(1, layers // v)}, or fewer {flag}")
    rest = workers - layers + 1
    example = "-".join([str(rest)] + ["1"] * (layers - 1)) if layers > 1 else str(workers)
    return RuntimeConfigError(
        f"--workers {workers} needs {stages} pipeline stages (one per worker) but model {model} has only "
        f"{layers} layers; use at most --workers {layers}, or replicate stages with --config (e.g. --config "
        f"{example}) or --schedule {_one_stage_names()}")


def _check_layers(cfg: TrainConfig, workers: int, captured: Any) -> None:
    """More model stages than ``captured``'s layers (its graph's nodes but the inputs): say
    how many workers fit."""
    par, spec = cfg.parallel, cfg.spec
    if spec.one_stage or par.plan is not None or par.cut is not None:
        return
    layers = sum(1 for n in captured.graph.nodes if not n.is_input)
    if par.config is None:
        stages = int(spec.model_stages(workers, par.schedule_options))
        if stages > layers:
            raise _too_many_stages(cfg, workers, layers, stages)
        return
    n = len(_config_replicas(cfg))
    if n > layers:
        v = _chunks(cfg)
        raise RuntimeConfigError(
            f"--config {par.config} has {n} stages but model {cfg.model.name} has only {layers} layers; use at most "
            f"{layers} stages (replicate stages instead, e.g. --config {workers - layers + 1}{'-1' * (layers - 1)})"
            if v == 1 else
            f"--config {par.config} with {v} stages per rank has {n} stages but model {cfg.model.name} has only "
            f"{layers} layers; use at most {max(1, layers // v)} ranks")


#: DDP's ``bucket_cap_mb``: the buckets when the all-reduce does not take the backward's cores.
OVERLAP_BUCKET_MB = 25.0


def bucket_mb(cfg: TrainConfig, workers: int, world: int | None) -> float:
    """The run's all-reduce buckets (``--bucket-mb``; when not given: decided here, once).

    Overlapping a replicated stage's all-reduce with its backward (DDP's buckets) pays when the
    all-reduce has resources of its own: NCCL on a GPU, or a network between hosts whose
    transfers the CPU only waits for. On one host whose cores the ranks' threads fill, gloo's
    all-reduce over loopback is CPU work (copies and sums) taken from the backward it overlaps:
    measured here (2 cores, 2 ranks) the GPT's ``dp`` ran 7-12% slower with 25 MiB buckets than
    with none, a T5's 4% (docs/performance.md). So: 25 MiB, or 0 when every rank is on this
    host and ranks x threads >= its cores."""
    import os

    given = cfg.performance.bucket_mb
    if given is not None:
        return float(given)
    if cfg.parallel.device == "cuda" or not _one_host():
        return OVERLAP_BUCKET_MB
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or workers) if world is not None else workers
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = cfg.performance.threads or cores
    return OVERLAP_BUCKET_MB if local * threads < cores else 0.0


def _one_host() -> bool:
    """Under torchrun: every rank runs on this host (loopback costs are the run's costs)."""
    import os

    return os.environ.get("LOCAL_WORLD_SIZE") == os.environ.get("WORLD_SIZE")


def _auto(cfg: TrainConfig, workers: int, batch: int, world: int | None,
          traced: tuple[Any, Any, Any]) -> tuple[TrainConfig, Any]:
    """``--schedule auto``: the fastest predicted configuration (pipetrain.auto.choose) whose
    replicas suit the run's step counts; the configuration with its schedule and microbatches.
    ``traced``: the bundle, capture and shipped model at ``batch`` samples already made
    (:func:`_load_shipped`: a choice whose unit is the whole minibatch ships that trace to the
    workers), what the choice takes for its whole-minibatch unit and its rehearsals, and whose
    graph it takes at the other unit sizes where that holds
    (:func:`pipetrain.graph.capture.rebatched`). A capture the workers take is traced for its
    own bundle (:func:`~pipetrain.job.model.ship_model` ships a graph that holds that
    bundle's tensors)."""
    from dataclasses import replace

    from ..auto.choose import choose

    par = cfg.parallel
    if par.calibration is None and world is not None and not _one_host():
        raise RuntimeConfigError(
            "--schedule auto across hosts needs the links' measured costs: run `pipetrain calibrate --output FILE` "
            "on these hosts and pass --calibration FILE, or name a schedule")

    whole, shipped_whole = traced[:2], traced[1:]
    captures = {batch: whole}  # by unit size: one trace, taken at the others

    def model_at(samples: int) -> tuple[Any, tuple[Any, ...]]:
        # captured as the workers capture it (weightless: on meta where it can be), so the
        # plan's node names are the workers' (a model's graph may depend on its tensors'
        # device); the profile holds a few of its tensors at a time (pipetrain.graph.held).
        # A factory may size its model by the batch it is given: built per unit size, its
        # graph the whole minibatch's where the structure and the tracer's guards allow.
        if samples not in captures:
            captures[samples] = _load_captured(cfg, samples, like=whole[1])
        bundle, captured = captures[samples]
        inputs = bundle.make_batch(samples, torch.Generator().manual_seed(cfg.training.seed))[0]
        return captured, tuple(inputs)

    def accept(c: Any, captured: Any) -> str | None:
        from ..stages.partition import partition_graph
        from ..stages.tied import check_ties

        chosen = replace(cfg, parallel=replace(par, schedule=c.schedule, microbatches=c.microbatches, auto=False))
        spec = chosen.spec
        if cfg.training.skip_nonfinite and not spec.synchronous:
            return "--skip-nonfinite needs a synchronous schedule"
        try:
            _check_steps_period(chosen, list(c.plan.replicas), f"the plan ({c.plan.config})")
            part = partition_graph(captured.gm, [list(s.nodes) for s in c.plan.stages])
            sched = spec.build(c.plan.replicas, c.microbatches, int(spec.steps_period(c.plan.replicas)))
            check_ties(part.tied, sched.stage_ranks, spec.synchronous, spec.name)
        except PipetrainError as e:
            return str(e)
        return None

    from ..profile.cache import MeasurementCache
    from ..runtime.process.forkserver import server_processes
    from .rehearse import CandidateRehearsal

    cache = MeasurementCache(enabled=cfg.performance.cache)
    with workers_allocator(cfg.performance.tune_malloc) as tuned:  # timed under the workers' allocator
        choice = choose(model_at, batch_size=batch, workers=workers, optimizer=cfg.optimizer.name,
                        momentum=cfg.optimizer.momentum, threads=cfg.performance.threads, model_name=cfg.model.name,
                        calibration=par.calibration, microbatches=par.microbatches, accept=accept,
                        cache=cache, cache_key={"model": cfg.model.name, "options": dict(cfg.model.options)},
                        rehearse=CandidateRehearsal(cfg, workers, batch, shipped_whole), malloc_tuned=tuned,
                        processes=server_processes() if world is None else None)
    choice.reused = cache.reuse_note()
    best = choice.best
    log.info("%s", "\n".join(summary_lines(choice)))
    return replace(cfg, parallel=replace(par, schedule=best.schedule, microbatches=best.microbatches,
                                         auto=False)), choice


def _choose_plan(cfg: TrainConfig, captured: Any, bundle: Any, batch: int, workers: int, m: int,
                 replicas: list[int] | None, auto: Any = None) -> tuple[Plan, str]:
    """The plan and where it came from (module docstring, step 4); ``auto``: the automatic
    choice (pipetrain.auto.choose.AutoChoice) already made."""
    par, spec = cfg.parallel, cfg.spec
    name = str(getattr(bundle, "name", cfg.model.name))
    if auto is not None:
        plan = auto.best.plan
        plan.extra["auto"] = auto.to_json()
        return plan, auto.note()
    if par.plan is not None:
        return Plan.load(par.plan), f"plan file {par.plan}"
    if par.cut is not None:
        note = f"--cut {par.cut}" + (f" with --config {par.config}" if par.config is not None else "")
        return split_at_cuts(captured, parse_cut(par.cut), replicas or [], name, batch), note
    if par.config is not None:
        note = f"--config {par.config} split by estimated compute"
        return split_by_config(captured, replicas or [], name, batch), note
    if replicas is not None:
        if spec.one_stage:
            return split_by_config(captured, replicas, name, batch), f"one stage on every worker ({spec.name})"
        if workers == 1:
            return split_by_config(captured, replicas, name, batch), "one stage"
        v = _chunks(cfg)
        return (split_by_config(captured, replicas, name, batch),
                f"{len(replicas)} stages ({v} per rank) split by estimated compute")
    from ..auto.quick import quick_plan

    inputs = bundle.make_batch(batch, torch.Generator().manual_seed(cfg.training.seed))[0]
    with workers_allocator(cfg.performance.tune_malloc):  # profiled under the workers' allocator
        return quick_plan(captured, tuple(inputs), batch_size=batch, workers=workers, schedule=spec.name,
                          microbatches=m, schedule_options=par.schedule_options, optimizer=cfg.optimizer.name,
                          momentum=cfg.optimizer.momentum, threads=cfg.performance.threads, model_name=name,
                          calibration=par.calibration)


def resolve_length(cfg: TrainConfig, steps_per_epoch: int | None) -> TrainConfig:
    """The run's steps, decided once (``steps_per_epoch``: of real data; ``None``: synthetic):

    - ``--epochs E``: ``E * steps_per_epoch``;
    - ``--steps N``: N;
    - neither, with a target on real data: until the target, at most ``--max-epochs M``
      (default :data:`~pipetrain.job.config.DEFAULT_MAX_EPOCHS`) epochs: ``M * steps_per_epoch``
      steps, and the configuration records ``max_epochs = M`` (the workers stop together at
      the first evaluation that meets the target, :class:`pipetrain.metrics.TargetTracker`);
    - neither: :data:`~pipetrain.job.config.DEFAULT_STEPS`.

    Raises RuntimeConfigError for ``--max-epochs`` with ``--steps`` / ``--epochs`` or without
    a target.
    """
    tr, ev = cfg.training, cfg.evaluation
    if tr.max_epochs is not None:
        fixed = "--steps" if tr.steps is not None else "--epochs" if tr.epochs is not None else None
        if fixed is not None:
            raise RuntimeConfigError(
                f"--max-epochs {tr.max_epochs} bounds a run that trains until its target, but {fixed} "
                f"{tr.steps if tr.steps is not None else tr.epochs} fixes the length; drop --max-epochs or {fixed}")
        if not ev.has_target:
            raise RuntimeConfigError(
                f"--max-epochs {tr.max_epochs} bounds a run that trains until --target-accuracy or --target-loss, "
                f"and none is given; pass a target, or --epochs {tr.max_epochs} for a fixed length")
    if steps_per_epoch is not None and tr.epochs is not None:
        return cfg.replace(steps=tr.epochs * steps_per_epoch)
    if tr.steps is not None:
        return cfg
    if steps_per_epoch is not None and ev.has_target:
        limit = tr.max_epochs if tr.max_epochs is not None else DEFAULT_MAX_EPOCHS
        return cfg.replace(steps=limit * steps_per_epoch, max_epochs=limit)
    return cfg.replace(steps=DEFAULT_STEPS)


def _steps_from_epochs(cfg: TrainConfig) -> bool:
    """Whether the steps were counted from epochs (``--epochs``, or up to ``max_epochs`` until
    the target): rounded down to the schedule's period rather than refused (:func:`_boundaries`)."""
    return cfg.training.epochs is not None or cfg.training.max_epochs is not None


def resolve_data(cfg: TrainConfig) -> tuple[TrainConfig, Any]:
    """Load ``--data`` (launcher side) and fold what it decides into the configuration.

    Returns the configuration with the model options that fit the data (the user's
    ``--option`` values win) and the run's steps (:func:`resolve_length`), and the
    :class:`~pipetrain.data.DataSource` (``None`` for synthetic data).

    Raises:
        DataError: the data cannot be loaded (unknown name, missing directory, a factory
            returning the wrong thing) or the model cannot read it.
        RuntimeConfigError: ``--epochs`` / ``--max-epochs`` / ``--eval-every`` /
            ``--evals-per-epoch`` / a target on synthetic data.
    """
    if cfg.data.synthetic:
        ev = cfg.evaluation
        for flag, given in (("--epochs", cfg.training.epochs is not None),
                            ("--max-epochs", cfg.training.max_epochs is not None),
                            ("--eval-every", bool(ev.eval_every)),
                            ("--evals-per-epoch", ev.evals_per_epoch is not None),
                            ("--target-accuracy", ev.target_accuracy is not None),
                            ("--target-loss", ev.target_loss is not None)):
            if given:
                raise RuntimeConfigError(
                    f"{flag} needs real data with an eval split, but the run trains on synthetic batches; pass "
                    f"--data digits (or fashion-mnist, shakespeare, text:PATH, package.module:function)")
        return resolve_length(cfg, None), None
    ev = cfg.evaluation
    if ev.eval_every == 0 and ev.has_target:
        flag = "--target-accuracy" if ev.target_accuracy is not None else "--target-loss"
        raise RuntimeConfigError(f"{flag} is checked at evaluations, but --eval-every 0 turns them off; drop "
                                 f"--eval-every 0 (default: every epoch) or the target")
    from ..data import load_data, model_options_for

    d = cfg.data
    source = load_data(d.data, data_dir=d.data_dir, seed=cfg.training.seed, seq_len=d.seq_len)
    options = {**model_options_for(cfg.model.name, source), **dict(cfg.model.options)}
    cfg = cfg.replace(model_options=options)
    spe = None
    if cfg.training.steps is None or cfg.training.epochs is not None:
        batch = resolve_batch_size(cfg)
        if source.num_train < batch:
            raise DataError(f"the train split of {source.name!r} has {source.num_train} samples, fewer than one "
                            f"minibatch of {batch}; pass --batch-size {source.num_train} or less")
        spe = source.num_train // batch
    return resolve_length(cfg, spe), source


def _data_spec(cfg: TrainConfig, source: Any, batch: int, unit_batch: int) -> DataSpec | None:
    """The description of ``source`` that the resolved run carries (``None``: synthetic)."""
    if source is None:
        return None
    from ..data import suggested_workers

    if source.num_train < batch:
        raise DataError(f"the train split of {source.name!r} has {source.num_train} samples, fewer than one "
                        f"minibatch of {batch}; pass --batch-size {source.num_train} or less")
    eb = cfg.evaluation.eval_batch_size or batch
    if eb % unit_batch:
        raise RuntimeConfigError(
            f"--eval-batch-size {eb} is not a multiple of the microbatch size {unit_batch}: eval batches go through "
            f"the pipeline in units of the training microbatch; pass --eval-batch-size "
            f"{max(unit_batch, eb // unit_batch * unit_batch)}")
    d = cfg.data
    # unset: 0 (load in each reading rank) unless a timing of a few items says workers pay off
    steps = cfg.training.steps
    workers = d.loader_workers if d.loader_workers is not None else \
        suggested_workers(source.train, samples=None if steps is None else steps * batch)
    return DataSpec(name=d.data, data_dir=d.data_dir, seq_len=d.seq_len, seed=cfg.training.seed, task=source.task,
                    target_dtype=source.target_dtype, num_train=source.num_train, num_eval=source.num_eval,
                    steps_per_epoch=source.num_train // batch, eval_batch_size=eb, loader_workers=workers,
                    description=source.description)


def segment_plan(steps: int, warmup: int, eval_every: int | None, checkpoint_every: int | None,
                 checkpoint_end: bool = False, cut_evals: bool = True,
                 stop_every: int | None = None, cut_checkpoints: bool = True) -> list[tuple[str, int, bool, bool]]:
    """The segments of a run as ``(kind, steps, evaluate, checkpoint)``: the warm-up (if any),
    then the timed steps cut at every multiple of ``eval_every`` and of ``checkpoint_every``
    and at the end. Steps are counted from the run's first minibatch, warm-up included (the
    count :func:`pipetrain.job.segments.checkpoint_due` uses). The end evaluates when
    ``eval_every`` is set and checkpoints when ``checkpoint_end``. ``cut_evals=False``
    (asynchronous schedules): evaluation points do not cut (:func:`inner_evals` lists them);
    ``cut_checkpoints=False`` (the same): nor do checkpoint points (the worker writes them
    inside the segment, :class:`pipetrain.runtime.checkpoints.periodic.CutCheckpoints`);
    ``stop_every``: also cut at its multiples, where a run with a target can stop.

    >>> segment_plan(10, 0, 4, None)
    [('timed', 4, True, False), ('timed', 4, True, False), ('timed', 2, True, False)]
    >>> segment_plan(10, 0, 4, None, cut_evals=False)
    [('timed', 10, True, False)]
    """
    total = warmup + steps
    marks: set[int] = {total}
    for every in (eval_every if cut_evals else None, checkpoint_every if cut_checkpoints else None, stop_every):
        if every:
            marks.update(b for b in range(every, total, every) if b > warmup)
    out: list[tuple[str, int, bool, bool]] = [("warmup", warmup, False, False)] if warmup else []
    prev = warmup
    for b in sorted(marks):
        ev = bool(eval_every) and (b % eval_every == 0 or b == total)  # type: ignore[operator]
        ck = bool(checkpoint_every and b % checkpoint_every == 0) or (checkpoint_end and b == total)
        out.append(("timed", b - prev, ev, ck))
        prev = b
    return out


def inner_evals(plan: list[tuple[str, int, bool, bool]], eval_every: int | None) -> list[tuple[int, ...]]:
    """Per segment of ``plan``, the multiples of ``eval_every`` strictly inside its timed steps
    (counted from the run's first minibatch): the evaluations an uncut segment takes.

    >>> inner_evals([('timed', 10, True, False)], 4)
    [(4, 8)]
    """
    out, at = [], 0
    for kind, n, _, _ in plan:
        out.append(tuple(b for b in range(at + 1, at + n) if kind == "timed" and eval_every and b % eval_every == 0))
        at += n
    return out


def _boundaries(cfg: TrainConfig, data: DataSpec | None, period: int,
                cut_evals: bool = True) -> tuple[TrainConfig, list[tuple[str, int, bool, bool]], list[tuple[int, ...]]]:
    """Steps rounded to the schedule's period (counted from epochs only), the segment plan and
    each segment's inner evaluation steps (``cut_evals=False``: asynchronous schedules, whose
    evaluations must not drain the pipeline)."""
    steps = cfg.training.steps
    assert steps is not None  # resolve_length decided it
    if _steps_from_epochs(cfg) and steps % period:
        steps = max(period, steps // period * period)
        cfg = cfg.replace(steps=steps)
    eval_every = cfg.evaluation.eval_every
    if data is None:
        eval_every = None
    elif eval_every is None:  # evals_per_epoch times an epoch, on steps the schedule can stop at
        spacing = max(1, round(data.steps_per_epoch / (cfg.evaluation.evals_per_epoch or 1)))
        eval_every = max(period, spacing // period * period)
    ck = cfg.checkpoint
    every = ck.checkpoint_every if ck.checkpoint_dir is not None else None
    ev = cfg.evaluation
    # an asynchronous run with a target stops at a segment's end: one cut (a drain) an epoch
    stop_every = None
    if not cut_evals and data is not None and (ev.target_accuracy is not None or ev.target_loss is not None):
        stop_every = max(period, data.steps_per_epoch // period * period)
    plan = segment_plan(steps, cfg.training.warmup_steps, eval_every or None, every,
                        checkpoint_end=ck.checkpoint_dir is not None, cut_evals=cut_evals, stop_every=stop_every,
                        cut_checkpoints=cut_evals)
    return cfg, plan, inner_evals(plan, None if cut_evals else eval_every)


def _load(cfg: TrainConfig, unit_batch: int) -> Any:
    """The model bundle, weightless, leaving this process's random state as it was."""
    with torch.random.fork_rng(devices=[]):
        return load_bundle(cfg, unit_batch, weights=False, warn=True)


def _load_captured(cfg: TrainConfig, unit_batch: int, like: Any = None) -> tuple[Any, Any]:
    """The model bundle and its capture, weightless (a profile holds a few tensors at a time);
    ``like``: a capture at another batch whose graph is taken where it holds at this one."""
    with torch.random.fork_rng(devices=[]):
        return load_captured(cfg, unit_batch, warn=True, like=like)


def _load_shipped(cfg: TrainConfig, unit_batch: int) -> tuple[Any, Any, Any]:
    """:func:`_load_captured`, weightless, and the capture as the workers take it (or ``None``)."""
    with torch.random.fork_rng(devices=[]):
        return load_shipped(cfg, unit_batch, warn=True)


def resolve_with_bundle(cfg: TrainConfig, world: int | None = None) -> tuple[ResolvedRun, Any]:
    """:func:`resolve_run`, also returning the model bundle it built (for cheap checks)."""
    from ..stages.partition import partition_graph
    from ..stages.tied import check_ties

    cfg, source = resolve_data(cfg)
    par, spec = cfg.parallel, cfg.spec
    options = par.schedule_options
    workers = world if world is not None else (par.workers or implied_workers(cfg) or 1)
    _check_workers(cfg, workers)
    cfg = cfg.replace(bucket_mb=bucket_mb(cfg, workers, world))
    batch = resolve_batch_size(cfg)
    auto, traced = None, None  # traced: the choice's capture at the whole minibatch, as the workers take it
    straight = par.auto and workers > 1 and _too_short_to_choose(cfg)
    if straight:  # the default schedule on a straight pipeline, nothing measured
        cfg = _unchosen(cfg, workers)
        par = cfg.parallel
    if par.auto and workers > 1:  # --schedule auto: the schedule, microbatches and stages chosen here
        traced = _load_shipped(cfg, batch)
        _check_layers(cfg, workers, traced[1])  # before measuring
        cfg, auto = _auto(cfg, workers, batch, world, traced)
        par, spec = cfg.parallel, cfg.spec
        options = par.schedule_options
    if workers == 1:
        m = par.microbatches or 1
        _check_divides(batch, m)
        data = _data_spec(cfg, source, batch, batch)
        cfg, counts, _ = _boundaries(cfg, data, 1)
        bundle = _load(cfg, batch)
        _check_fits(bundle, source)
        if cfg.parallel.memory is not None:  # the whole model in this process: one stage
            _one_process_memory(cfg, batch, m)
        run = ResolvedRun(cfg, 1, batch, m, None, ONE_PROCESS_NOTE, options,
                          tuple(Segment(kind, n, None, ev, ck) for kind, n, ev, ck in counts), data)
        run.check()
        return run, bundle
    replicas = _layout_replicas(cfg, workers)
    if replicas is None and straight:
        replicas = [1] * workers
    m = _microbatches(cfg, replicas if replicas is not None else [1] * workers)
    _check_divides(batch, m)
    if replicas is not None:
        _check_steps_period(cfg, replicas, f"--config {par.config}" if par.config is not None else "the plan")
    # weightless (no parameter storage here; the quick plan's profile holds a few tensors at a time)
    captured_unit = batch // m  # the samples of the capture's example batch
    # traced for its bundle (ship_model's rule): the choice's own trace when it is at this batch
    bundle, captured, shipped = traced if traced is not None and captured_unit == batch else \
        _load_shipped(cfg, captured_unit)
    _check_fits(bundle, source)
    _check_layers(cfg, workers, captured)
    plan, note = _choose_plan(cfg, captured, bundle, batch, workers, m, replicas, auto)
    if replicas is None and auto is None:  # a configuration the user did not name: say what and why, now
        log.info("plan: %s", note)
    if replicas is None:  # the planner chose the replicas: the default microbatches follow them
        _check_steps_period(cfg, plan.replicas, f"the plan ({plan.config})")
        m2 = _microbatches(cfg, plan.replicas)
        if m2 != m:
            _check_divides(batch, m2)
            m, bundle = m2, _load(cfg, batch // m2)
    need = int(spec.ranks_needed(plan.replicas, options))
    if need != workers:
        raise RuntimeConfigError(
            f"the plan ({plan.config}) needs {need} workers but the run has {workers}; pass --workers {need} or "
            f"another plan")
    part = partition_graph(captured.gm, [list(s.nodes) for s in plan.stages])  # the plan fits the captured graph
    data = _data_spec(cfg, source, batch, batch // m)
    cfg, counts, inner = _boundaries(cfg, data, _period(cfg, plan.replicas), cut_evals=spec.synchronous)
    built: dict[int, Any] = {}  # one schedule per segment length, shared by the segments of that length
    for _, n, _, _ in counts:
        if n not in built:
            built[n] = spec.build(plan.replicas, m, n, **options)
    segments = tuple(Segment(kind, n, built[n], ev, ck, evals) for (kind, n, ev, ck), evals in zip(counts, inner))
    # ties across stages the schedule cannot keep equal: one line now, not a failure in every worker
    first = segments[0].schedule
    assert first is not None  # a distributed run has a schedule per segment
    check_ties(part.tied, first.stage_ranks, spec.synchronous, spec.name)
    if shipped is not None:  # the plan's wires, found here once (on meta) for every worker
        shipped = shipped.with_codecs(captured, part) if shipped.unit_batch == batch // m else None
    run = ResolvedRun(cfg, workers, batch, m, plan, note, options, segments, data, model=shipped)
    run.check()
    _predict_memory(run, captured, captured_unit)  # --memory: refused here, before any worker starts
    return run, bundle


def _worker_memory(cfg: TrainConfig, captured: Any, plan: Plan, stage_ranks: Any, batch: int, unit: int, m: int,
                   recompute: Any = ()) -> list[Any]:
    """Every worker's predicted peak (:mod:`pipetrain.plan.worker_memory`), with the sizes
    from the captured graph, whose example batch has ``unit`` of the minibatch's ``batch`` samples."""
    from ..plan.worker_memory import graph_profile, worker_memory
    from ..profile.profiler import optimizer_state_factor

    opt = cfg.optimizer
    profile = graph_profile(captured.graph, str(cfg.model.name), batch, batch / unit,
                            optimizer_state_factor(opt.name, opt.momentum))
    return worker_memory(profile, plan, stage_ranks, cfg.parallel.schedule, m, recompute=recompute)


def _predict_memory(run: ResolvedRun, captured: Any, unit: int) -> None:
    """Every worker's predicted peak into ``plan.extra["worker_memory"]`` (``--json``'s
    ``run.plan``), and ``--memory``'s refusal, before any worker starts."""
    from ..plan.worker_memory import check_memory, memory_json

    cfg, plan = run.config, run.plan
    assert plan is not None  # a distributed run has a plan
    workers = _worker_memory(cfg, captured, plan, run.schedule.stage_ranks, run.batch_size, unit, run.microbatches,
                             run.recompute_stages)
    plan.extra["worker_memory"] = dict(memory_json(workers, cfg.parallel.memory, "captured graph (parameter and "
                                                   "output bytes)"))
    if cfg.parallel.memory is not None:
        check_memory(workers, cfg.parallel.memory, plan.config, cfg.parallel.schedule, run.microbatches)


def _one_process_memory(cfg: TrainConfig, batch: int, m: int) -> None:
    """``--memory`` on one process: the whole model as one stage, captured weightless."""
    from ..plan.worker_memory import check_memory

    _, captured = _load_captured(cfg, batch // m)
    plan = split_by_config(captured, [1], str(cfg.model.name), batch)
    check_memory(_worker_memory(cfg, captured, plan, [[0]], batch, batch // m, m), float(cfg.parallel.memory or 0),
                 "1 (one process)", cfg.parallel.schedule, m)


def _check_fits(bundle: Any, source: Any) -> None:
    """The model reads the data's samples (``pipetrain.data.check_fits``), random state kept."""
    if source is None:
        return
    from ..data import check_fits

    check_fits(bundle, source)


def resolve_run(cfg: TrainConfig, world: int | None = None) -> ResolvedRun:
    """Every decision of the run (module docstring); raises a PipetrainError on bad input.

    Args:
        cfg: the configuration.
        world: the number of ranks when it is fixed from outside (an outer ``torchrun``);
            ``None``: ``--workers``, else what the configuration needs, else 1.
    """
    return resolve_with_bundle(cfg, world)[0]
