"""Checks run in the launching process before any worker starts.

Every worker repeats the same deterministic decisions (batch size, model, capture, plan,
schedule), so a mistake in any of them would be found by every worker at once, after the
processes and the rendezvous are up, and reported as a worker failure. :func:`preflight`
makes those decisions once here instead, so that bad input gives one ``error: ...`` line
(exit 2) within a second or so, and no process is started:

1. output paths (``--save``, ``--trace``) can be written;
2. ``--workers`` agrees with ``--config`` / ``--plan`` / ``--cut``;
3. the batch divides into microbatches;
4. the model builds, has trainable parameters, and its ``make_batch`` gives inputs the model
   and the loss accept, with the example batch's shapes and dtypes;
5. the plan (except one the planner chooses from a measured profile: then the number of
   stages is checked against the model's layers), and the schedule of every segment,
   which needs exactly ``workers`` ranks.
"""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..errors import ModelError, PipetrainError, RuntimeConfigError
from .config import TrainConfig, parse_config

__all__ = ["preflight", "check_output_paths", "check_model_batch"]

#: Parameters above which the launcher does not capture and partition the model itself.
CAPTURE_LIMIT = 20_000_000


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def _probe_dir(flag: str, value: str, directory: Path) -> None:
    """Create ``directory`` (with parents) and write a file in it, or raise a one-line error.

    Creating it is what the run would do at the end anyway; doing it now turns a path that
    cannot be written (a file in the way, a read-only or virtual file system) into an error
    before training instead of after it.
    """
    import tempfile

    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=str(directory)):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
        raise RuntimeConfigError(
            f"{flag} {value}: cannot write into {str(directory)!r}: {reason}{where}; pass a path in a writable "
            f"directory") from None


def check_output_paths(cfg: TrainConfig) -> None:
    """``--save PATH`` must name a file (missing parent directories are created) and
    ``--trace DIR`` a directory (created if missing), both writable."""
    if cfg.save is not None:
        path = Path(cfg.save)
        side = Path(str(cfg.save) + ".trainer")
        if path.is_dir() or side.is_dir():
            which = path if path.is_dir() else side
            raise RuntimeConfigError(
                f"--save {cfg.save}: {str(which)!r} is a directory, but --save writes the checkpoint file PATH and "
                f"PATH.trainer; pass a file name, e.g. --save {path / 'checkpoint.pt'}")
        _probe_dir("--save", cfg.save, path.parent)
    if cfg.trace is not None:
        path = Path(cfg.trace)
        if path.exists() and not path.is_dir():
            raise RuntimeConfigError(
                f"--trace {cfg.trace}: {str(path)!r} is an existing file, but --trace takes a directory (it writes "
                f"rank0.json, ... and trace.json into it); pass a directory name, e.g. --trace {path.stem or 'trace'}"
                f"_trace")
        _probe_dir("--trace", cfg.trace, path)


def _describe(ts: Any) -> str:
    if isinstance(ts, torch.Tensor):
        ts = (ts,)
    if isinstance(ts, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in ts):
        return ", ".join(f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in ts)
    return type(ts).__name__


def check_model_batch(cfg: TrainConfig, bundle: Any, unit_batch: int) -> None:
    """The bundle trains: it has trainable parameters, and one unit from ``make_batch`` has
    the example batch's shapes and dtypes and goes through the model and the loss."""
    name = cfg.model
    if not any(p.requires_grad for p in bundle.model.parameters()):
        raise ModelError(
            f"model {name!r} has no trainable parameters (none with requires_grad=True), so there is nothing to "
            f"train; give the model parameters or set requires_grad=True on them")
    try:
        batch = bundle.make_batch(unit_batch, torch.Generator().manual_seed(cfg.seed))
        inputs, target = batch
    except PipetrainError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's make_batch: one line
        raise ModelError(
            f"make_batch of model {name!r} failed for a microbatch of {unit_batch}: {_first_line(exc)}; make it "
            f"return (inputs, target) for any batch size") from None
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    want = tuple(bundle.example_inputs)
    ok = (isinstance(inputs, (tuple, list)) and len(inputs) == len(want)
          and all(isinstance(t, torch.Tensor) and t.shape == e.shape and t.dtype == e.dtype
                  for t, e in zip(inputs, want)))
    if not ok:
        raise ModelError(
            f"make_batch of model {name!r} gives inputs {_describe(inputs)} for a microbatch of {unit_batch}, but "
            f"the example batch is {_describe(want)}; the pipeline needs make_batch to match the example batch's "
            f"shapes and dtypes")
    if not isinstance(target, torch.Tensor):
        raise ModelError(
            f"make_batch of model {name!r} returns target {type(target).__name__}; it must return (inputs, target) "
            f"with target a tensor")
    saved = {k: b.detach().clone() for k, b in bundle.model.named_buffers()}
    try:
        import warnings

        # Warnings (a broadcasting loss) would break the one-line error; training shows them.
        with torch.no_grad(), torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = bundle.loss_fn(bundle.model(*inputs), target)
    except PipetrainError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's model or loss: one line
        raise ModelError(
            f"model {name!r} fails on a batch from its make_batch (inputs {_describe(inputs)}, target "
            f"{_describe(target)}): {_first_line(exc)}; make make_batch return what the model and its loss "
            f"expect") from None
    finally:
        with torch.no_grad():
            for k, b in bundle.model.named_buffers():
                if k in saved:
                    b.copy_(saved[k])
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.dtype.is_floating_point:
        raise ModelError(
            f"the loss of model {name!r} returns {_describe(loss)}, not one floating-point number; make loss_fn "
            f"return the batch's mean loss")


def _too_many_stages(cfg: TrainConfig, workers: int, layers: int, stages: int) -> RuntimeConfigError:
    if cfg.schedule == "interleaved":
        most = max(1, layers // cfg.virtual_stages)
        return RuntimeConfigError(
            f"--workers {workers} with --virtual-stages {cfg.virtual_stages} needs {stages} stages but model "
            f"{cfg.model} has only {layers} layers; use at most --workers {most}, or fewer --virtual-stages")
    rest = workers - layers + 1
    example = "-".join([str(rest)] + ["1"] * (layers - 1)) if layers > 1 else str(workers)
    return RuntimeConfigError(
        f"--workers {workers} needs {stages} pipeline stages (one per worker) but model {cfg.model} has only "
        f"{layers} layers; use at most --workers {layers}, or replicate stages with --config (e.g. --config "
        f"{example}) or --schedule dp")


def preflight(cfg: TrainConfig, workers: int) -> None:
    """Validate everything a run on ``workers`` local workers decides before it starts
    (see the module docstring); raises a :class:`~pipetrain.errors.PipetrainError`."""
    from ..graph.capture import capture
    from .resolve import (build_run_schedule, check_workers, expected_workers, load_bundle, resolve_batch_size,
                          resolve_plan)
    from .stage import partition_graph, split_by_config, stage_nodes_of_plan

    check_output_paths(cfg)
    check_workers(cfg, workers)
    cfg_w = replace(cfg, workers=workers)
    batch_size = resolve_batch_size(cfg)
    m = cfg_w.resolved_microbatches()
    cfg_w.check_counts(batch_size)
    # The config's replica counts bound the steps (pipedream steps an r-replica stage once
    # per r minibatches); cheap, and independent of the model.
    if workers > 1 and cfg.config is not None and cfg.schedule == "pipedream":
        reps = parse_config(cfg.config)
        for n, what in ((cfg.warmup_steps, "--warmup-steps"), (cfg.steps, "--steps")):
            bad = [r for r in reps if n and n % r]
            if bad:
                import math
                from functools import reduce

                period = reduce(lambda a, b: a * b // math.gcd(a, b), reps, 1)
                raise RuntimeConfigError(
                    f"pipedream steps a stage with r replicas once per r minibatches, so {what} must be a multiple "
                    f"of every replica count of --config {cfg.config}: got {what} {n}; use {what} "
                    f"{(n // period + 1) * period}")
    if workers == 1:
        return  # the in-process run builds the model once and checks it (single.py)
    state = torch.random.get_rng_state()
    try:
        bundle = load_bundle(cfg, batch_size // m)
    finally:
        torch.random.set_rng_state(state)
    check_model_batch(cfg, bundle, batch_size // m)
    if sum(p.numel() for p in bundle.model.parameters()) > CAPTURE_LIMIT:
        return  # capturing a large model twice is not cheap: the workers check the rest
    captured = capture(bundle.model, bundle.example_inputs)
    layers = sum(1 for n in captured.graph.nodes if not n.is_input)
    planned = cfg.plan is None and cfg.cut is None and cfg.config is None and cfg.schedule not in ("dp", "interleaved")
    stages = workers * (cfg.virtual_stages if cfg.schedule == "interleaved" else 1)
    if cfg.plan is None and cfg.cut is None and cfg.config is None and cfg.schedule != "dp" and stages > layers:
        raise _too_many_stages(cfg, workers, layers, stages)
    if cfg.config is not None and cfg.cut is None and cfg.schedule != "dp":
        n = len(parse_config(cfg.config)) * (cfg.virtual_stages if cfg.schedule == "interleaved" else 1)
        if n > layers:
            raise RuntimeConfigError(
                f"--config {cfg.config} has {n} stages but model {cfg.model} has only {layers} layers; use at most "
                f"{layers} stages (replicate stages instead, e.g. --config {workers - layers + 1}"
                f"{'-1' * (layers - 1)})" if cfg.schedule != "interleaved" else
                f"--config {cfg.config} with --virtual-stages {cfg.virtual_stages} has {n} stages but model "
                f"{cfg.model} has only {layers} layers; use at most {max(1, layers // cfg.virtual_stages)} ranks")
    if planned:  # the planner's choice is made by the workers; its fallback is checked here
        plan = split_by_config(captured, [1] * workers, cfg.model, batch_size)
    else:
        plan, _ = resolve_plan(cfg_w, captured, bundle, batch_size, workers, broadcast=False)
    if expected_workers(cfg_w, plan) != workers:
        raise RuntimeConfigError(
            f"the plan ({plan.config}) needs {expected_workers(cfg_w, plan)} workers but the run has {workers}; "
            f"pass --workers {expected_workers(cfg_w, plan)}")
    segments = ([cfg.warmup_steps] if cfg.warmup_steps else []) + [cfg.steps]
    for n in segments:
        sched = build_run_schedule(cfg_w, plan, m, n)
        if sched.num_workers != workers:
            raise RuntimeConfigError(
                f"the {cfg.schedule} schedule for plan {plan.config} uses {sched.num_workers} workers but the run "
                f"has {workers}; pass --workers {sched.num_workers}")
    partition_graph(captured.gm, stage_nodes_of_plan(plan))
