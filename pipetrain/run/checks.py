"""Preflight: resolve the run plus cheap checks, in the launching process, before any worker starts.

Bad input gives one ``error: ...`` line (exit 2) within a second or so, and no process is
started. :func:`preflight` is

1. output paths (``--save``, ``--trace``) can be written (:func:`check_output_paths`);
2. the run resolved (:func:`pipetrain.run.resolve.resolve_run`: workers, batch,
   microbatches, model, capture, plan checked against the graph, every segment's schedule);
3. the model has trainable parameters and its ``make_batch`` gives inputs the model and the
   loss accept, with the example batch's shapes and dtypes (:func:`check_model_batch`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import ModelError, PipetrainError, RuntimeConfigError
from ..job.config import TrainConfig
from ..job.resolved import ResolvedRun
from ..models.materialize import is_weightless, meta_limit, on_device_of

__all__ = ["preflight", "check_output_paths", "check_model_batch"]


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
    ``--trace DIR`` / ``--log-dir DIR`` a directory (created if missing), all writable."""
    save, trace = cfg.checkpoint.save, cfg.output.trace
    if save is not None:
        path = Path(save)
        side = Path(str(save) + ".trainer")
        if path.is_dir() or side.is_dir():
            which = path if path.is_dir() else side
            raise RuntimeConfigError(
                f"--save {save}: {str(which)!r} is a directory, but --save writes the checkpoint file PATH and "
                f"PATH.trainer; pass a file name, e.g. --save {path / 'checkpoint.pt'}")
        _probe_dir("--save", save, path.parent)
    if cfg.checkpoint.save_hf is not None:
        _check_save_hf(cfg.checkpoint.save_hf, cfg.model.name)
    if trace is not None:
        path = Path(trace)
        if path.exists() and not path.is_dir():
            raise RuntimeConfigError(
                f"--trace {trace}: {str(path)!r} is an existing file, but --trace takes a directory (it writes "
                f"rank0.json, ... and trace.json into it); pass a directory name, e.g. --trace {path.stem or 'trace'}"
                f"_trace")
        _probe_dir("--trace", trace, path)
    log_dir = cfg.output.log_dir
    if log_dir is not None:
        path = Path(log_dir)
        if path.exists() and not path.is_dir():
            raise RuntimeConfigError(f"--log-dir {log_dir}: {str(path)!r} is an existing file, but --log-dir takes a "
                                     f"directory (metrics.jsonl, config.json, ... go into it); pass a directory name")
        _probe_dir("--log-dir", log_dir, path)


def _check_save_hf(out: str, model: str) -> None:
    """``--save-hf DIR``: a directory (created if missing), writable, not the ``hf:`` one read."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise RuntimeConfigError(f"--save-hf {out}: {str(path)!r} is an existing file, but --save-hf writes a "
                                 f"Hugging Face directory (shards, index, config.json); pass a directory name")
    source = Path(model.removeprefix("hf:")).expanduser()
    if path.exists() and source.exists() and path.resolve() == source.resolve():
        raise RuntimeConfigError(f"--save-hf {out} is the directory --model {model} reads its weights from; pass "
                                 f"another directory (the trained weights go there, the pretrained ones stay)")
    _probe_dir("--save-hf", out, path)


def _describe(ts: Any) -> str:
    if isinstance(ts, torch.Tensor):
        ts = (ts,)
    if isinstance(ts, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in ts):
        return ", ".join(f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in ts)
    return type(ts).__name__


def check_model_batch(cfg: TrainConfig, bundle: Any, unit_batch: int) -> None:
    """The bundle trains: it has trainable parameters, and one unit from ``make_batch`` has
    the example batch's shapes and dtypes and goes through the model and the loss."""
    name = cfg.model.name
    if not any(p.requires_grad for p in bundle.model.parameters()):
        raise ModelError(
            f"model {name!r} has no trainable parameters (none with requires_grad=True), so there is nothing to "
            f"train; give the model parameters or set requires_grad=True on them")
    try:
        batch = bundle.make_batch(unit_batch, torch.Generator().manual_seed(cfg.training.seed))
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
            # a weightless model (the launcher's) runs for shapes on meta
            model = bundle.model
            loss = bundle.loss_fn(model(*on_device_of(model, inputs)), on_device_of(model, target))
    except PipetrainError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's model or loss: one line
        if is_weightless(bundle.model) and meta_limit(exc):
            return  # the forward needs values: the workers run it on their stages' own
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


def preflight(cfg: TrainConfig, world: int | None = None) -> ResolvedRun:
    """Resolve the run and make the cheap checks (module docstring); raises a
    :class:`~pipetrain.errors.PipetrainError` before any process starts."""
    from .resolve import resolve_with_bundle

    check_output_paths(cfg)
    run, bundle = resolve_with_bundle(cfg, world)
    check_model_batch(cfg, bundle, run.batch_size if run.in_process else run.unit_batch)
    return run
