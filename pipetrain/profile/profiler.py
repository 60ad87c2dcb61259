"""The per-layer profiler: forward and backward time, activation and parameter bytes per node.

PipeDream's planner needs, for every layer ``l`` of the graph, the forward and backward
compute time ``T_l``, the size of its output activations ``a_l`` (what crosses a stage
boundary cut after ``l``) and the size of its weights ``w_l`` (what data parallelism
all-reduces and what the optimizer keeps state for) (PipeDream, SOSP'19, section 3.1).

How the times are measured (:func:`profile_captured`, :mod:`pipetrain.profile.measure`):
what a stage will run is timed, not each aten operator alone. The graph runs once, node by
node, in topological order; every node is run alone once (forward on detached copies of its
real inputs, ``requires_grad`` set where the real value depends on trainable parameters,
then backward from a random gradient of its differentiable outputs) for an *estimate* and
for what it saves for backward. Consecutive nodes are joined into *segments* at module
boundaries (:mod:`pipetrain.profile.segments`) of a few milliseconds each, and every
segment, once its last node has run, is timed as its own ``GraphModule``, forward and
backward, ``warmup`` untimed and up to ``repeats`` timed runs (fewer for a long segment,
:class:`~pipetrain.profile.timing.RepeatBudget`), robust statistics of them
(:func:`~pipetrain.profile.timing.robust_seconds`), less the timer's own cost measured on
an empty region. A segment's forward and backward are split over its nodes in proportion to
their estimates, so per-node entries remain for the planner and add up to the segments.
Finally the whole model runs as one segment (a model whose activations exceed
``check_memory``: the longest tail of its graph that fits; one whose forward + backward
exceeds ``check_seconds``: a tail within it): the profile records that step
(``measured_forward_time`` / ``measured_backward_time``, ``measured_from``), and
:func:`~pipetrain.profile.step_check.step_check` compares the profile's total with it.
Nodes with no differentiable output get backward 0. In-place nodes run on fresh clones, so
repeats never compound. On CUDA the device is synchronized around every timed region.
Memory is bounded by the values crossing the current cut plus one segment's saved tensors
and gradients during the per-node pass, and by ``check_memory`` during the final check.

Activation bytes come from the capture's shape propagation (every output tensor of the
node); parameter bytes from the graph (each parameter counted once, see
:mod:`pipetrain.graph.capture`). Model inputs are nodes of kind ``"input"`` with zero times.
The model's buffers, parameter gradients and the global RNG are left as they were.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.utils import _pytree as pytree

from ..errors import ProfileError
from ..graph.capture import CapturedModel, batch_size_of, capture, preserved_state
from ..graph.held import ValueOf
from .measure import CHECK_MEMORY, CHECK_SECONDS, HELD_CHECK_SHARE, MeasureOptions, measure_graph
from .saved import SavedBytes
from .types import NodeProfile, Profile

__all__ = ["OPTIMIZER_STATE_FACTORS", "optimizer_state_factor", "profile_captured", "profile_model", "resolve_device"]

#: The documentation test's fast mode (``pipetrain.job.config.DOCS_FAST_ENV``, the same name):
#: when set (to anything but ``0``), every node is timed once after at most one warm-up run.
DOCS_FAST_ENV = "PIPETRAIN_DOCS_FAST"


def fast_counts(warmup: int, repeats: int) -> tuple[int, int]:
    """``(warmup, repeats)``, cut to at most one each in the fast mode."""
    import os

    if os.environ.get(DOCS_FAST_ENV, "0") in ("", "0"):
        return warmup, repeats
    return min(warmup, 1), min(repeats, 1)


#: Optimizer state kept per byte of parameters: SGD with momentum keeps one buffer, Adam two.
OPTIMIZER_STATE_FACTORS = {"sgd": 1.0, "adam": 2.0, "adamw": 2.0}

#: The batch a profile traces its model at (``capture``'s ``trace_at``) when the profile's is
#: larger than twice this: the graph's values are checked there, and taken to the profile's
#: batch by shape, so a capture costs two forwards of this batch, not of the profile's.
TRACE_BATCH = 2


def optimizer_state_factor(optimizer: str, momentum: float = 0.9) -> float:
    """Bytes of optimizer state per byte of parameters (SGD without momentum keeps none)."""
    if not isinstance(optimizer, str):
        raise ProfileError(f"optimizer must be a name such as 'sgd', got {optimizer!r}; valid optimizers: "
                           f"{', '.join(OPTIMIZER_STATE_FACTORS)}")
    name = optimizer.lower()
    if name not in OPTIMIZER_STATE_FACTORS:
        raise ProfileError(
            f"unknown optimizer {optimizer!r}; valid optimizers: {', '.join(OPTIMIZER_STATE_FACTORS)}"
        )
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < math.inf:
        raise ProfileError(f"momentum must be a finite number >= 0, got {momentum!r}; "
                           "pass e.g. momentum=0.9 (0: no momentum)")
    if name == "sgd" and not momentum:
        return 0.0
    return OPTIMIZER_STATE_FACTORS[name]


def resolve_device(device: str | torch.device) -> torch.device:
    """The ``torch.device`` to profile on; a clear ProfileError if it is unusable here."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ProfileError(f"unknown device {device!r}; use 'cpu' or 'cuda' (or 'cuda:N')") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ProfileError(
            f"device {str(device)!r} was requested but CUDA is not available on this machine "
            f"(torch {torch.__version__}); profile with device 'cpu' or run on a machine with a GPU"
        )
    if dev.type not in ("cpu", "cuda"):
        raise ProfileError(f"unsupported device {device!r}; use 'cpu' or 'cuda'")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _check_counts(warmup: int, repeats: int) -> None:
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ProfileError(f"warmup must be an integer >= 0, got {warmup!r}; pass e.g. warmup=2")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ProfileError(f"repeats must be an integer >= 1, got {repeats!r}; pass e.g. repeats=5")


def _warm_autograd(device: torch.device) -> None:
    """Run one tiny matmul forward and backward on ``device`` so that one-time start-up costs
    (autograd's worker threads, the BLAS library's first GEMMs: about 0.3 s on a CPU) are not
    charged to the first node's backward, even with ``warmup=0``."""
    x = torch.ones(4, 2, device=device, requires_grad=True)
    w = torch.ones(3, 2, device=device, requires_grad=True)
    torch.nn.functional.linear(x, w).backward(torch.ones(4, 3, device=device))


def _to_device(value: Any, device: torch.device) -> Any:
    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, value)


@contextlib.contextmanager
def num_threads(threads: int | None) -> Iterator[None]:
    """``torch.set_num_threads(threads)`` inside the block, restored after; None: unchanged."""
    if threads is None:
        yield
        return
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ProfileError(f"threads must be an integer >= 1, got {threads!r}")
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@contextlib.contextmanager
def _saved_grads(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Restore every parameter's ``.grad`` after the block (isolated backwards accumulate)."""
    params: dict[int, nn.Parameter] = {}
    for m in modules:
        for p in m.parameters():
            params.setdefault(id(p), p)
    saved = [(p, p.grad) for p in params.values()]
    try:
        yield
    finally:
        for p, g in saved:
            p.grad = g


def profile_captured(captured: CapturedModel, example_inputs: tuple[Any, ...] | torch.Tensor, *,
                     batch_size: int | None = None, device: str | torch.device = "cpu",
                     warmup: int = 2, repeats: int = 5, optimizer: str = "sgd",
                     momentum: float = 0.9, model_name: str = "",
                     threads: int | None = None, loss_fn: Callable[[Any, Any], Any] | None = None,
                     target: Any = None, progress: bool = False,
                     check_memory: float | None = CHECK_MEMORY, values: ValueOf | None = None,
                     held_share: float = HELD_CHECK_SHARE, check_seconds: float | None = CHECK_SECONDS) -> Profile:
    """Profile an already captured model (its ``gm`` and ``example_inputs`` on ``device``).

    Same measurements and arguments as :func:`profile_model`; node names are
    ``captured.graph``'s. Use this when the caller also needs the capture. With ``loss_fn``
    and ``target`` the profile also records what the loss saves for backward.
    ``check_memory``: activation bytes the final whole-model check may hold (None: no limit);
    a model with more is checked on the longest tail of its graph that fits
    (:func:`~pipetrain.profile.measure.check_start`); ``check_seconds``: the measured
    forward + backward that region may take (None: no limit), above which a shorter tail of
    it is checked (:data:`~pipetrain.profile.measure.CHECK_SECONDS`). A weightless capture (its tensors on
    meta) is profiled holding a few of its tensors at a time, ``values(name)``'s values
    (default: ``captured.tensor_values``) where it has them, else stand-ins
    (:mod:`pipetrain.graph.held`); it is left weightless; its check holds at most
    ``held_share`` of its tensor bytes (:data:`~pipetrain.profile.measure.HELD_CHECK_SHARE`).
    """
    _check_counts(warmup, repeats)
    dev = resolve_device(device)
    factor = optimizer_state_factor(optimizer, momentum)
    inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    gm = captured.gm
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(inputs) != len(placeholders):
        raise ProfileError(
            f"the captured model takes {len(placeholders)} inputs "
            f"({', '.join(n.name for n in placeholders)}) but {len(inputs)} example inputs were given; "
            "pass one value per model input"
        )
    if batch_size is None:
        batch_size = batch_size_of(inputs)

    def loss(saved: SavedBytes, output: Any) -> tuple[int, bool] | None:
        if loss_fn is None or target is None:
            return None
        return _loss_saved(saved, loss_fn, output, _to_device(target, dev))

    _warm_autograd(dev)
    options = MeasureOptions(*fast_counts(warmup, repeats), progress=progress, check_memory=check_memory,
                             held_share=held_share, check_seconds=check_seconds)
    acts = {n.name: n.activation_bytes for n in captured.graph}
    with num_threads(threads), _saved_grads([gm]), preserved_state(gm, [dev]):
        measured = measure_graph(gm, inputs, dev, options, loss, acts,
                                 values if values is not None else captured.tensor_values)

    nodes = []
    for ln in captured.graph:
        f, b = measured.times.get(ln.name, (0.0, 0.0))
        nodes.append(NodeProfile(
            name=ln.name, op=ln.op, forward_time=0.0 if ln.is_input else f,
            backward_time=0.0 if ln.is_input else b, activation_bytes=ln.activation_bytes,
            parameter_bytes=ln.parameter_bytes, inputs=list(ln.inputs), kind=ln.kind,
            **({} if ln.is_input else _saved_fields(measured.kept.get(ln.name))),
        ))
    loss_saved = measured.loss_saved
    return Profile(
        model=model_name, batch_size=batch_size, nodes=nodes, device=str(dev),
        optimizer=optimizer.lower(), optimizer_state_bytes_per_parameter_byte=factor,
        loss_saved_bytes=loss_saved[0] if loss_saved else None, loss_saves_output=bool(loss_saved and loss_saved[1]),
        measured_forward_time=measured.step[0], measured_backward_time=measured.step[1],
        measured_from=measured.step_from,
    )


def _saved_fields(kept: tuple[int, list[str], bool] | None) -> dict[str, Any]:
    """NodeProfile's saved-for-backward fields (a node the graph never ran saves nothing)."""
    nbytes, ins, own = kept if kept is not None else (0, [], False)
    return {"saved_bytes": nbytes, "saved_inputs": list(ins), "output_saved": own}


def _loss_saved(saved: SavedBytes, loss_fn: Callable[[Any, Any], Any], output: Any,
                target: Any) -> tuple[int, bool] | None:
    """(new bytes, whether the model's output is saved) of ``loss_fn(output, target)``'s forward;
    None if the loss cannot run on the graph's output as captured."""
    saved.register("target", target)
    if isinstance(output, (tuple, list)) and len(output) == 1:
        output = output[0]
    try:
        with torch.enable_grad():
            _, nbytes, ins, _ = saved.measure(lambda: loss_fn(output, target))
    except Exception:  # noqa: BLE001 - a loss that needs the model's own output structure
        return None
    return nbytes, any(n != "target" for n in ins)


def _model_device(model: nn.Module) -> torch.device | None:
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return None


def profile_model(model_or_bundle: Any, example_inputs: tuple[Any, ...] | torch.Tensor | None = None, *,
                  batch_size: int | None = None, device: str | torch.device = "cpu",
                  warmup: int = 2, repeats: int = 5, optimizer: str = "sgd", momentum: float = 0.9,
                  model_name: str = "", threads: int | None = None, progress: bool = False,
                  check_memory: float | None = CHECK_MEMORY, check_seconds: float | None = CHECK_SECONDS) -> Profile:
    """Capture a model and measure every layer's costs for one minibatch.

    Args:
        model_or_bundle: an ``nn.Module`` (then ``example_inputs`` is required) or a
            :class:`~pipetrain.models.ModelBundle`.
        example_inputs: one minibatch of model inputs; for a bundle, defaults to the
            bundle's example (or a fresh ``make_batch(batch_size)`` when ``batch_size``
            differs from it).
        batch_size: the minibatch size the profile is for (default: dimension 0 of the
            first input).
        device: ``"cpu"`` or ``"cuda"``; the model is moved there for the measurement and
            moved back afterwards.
        warmup: untimed runs of each segment before the timed ones (none for a segment
            that takes :data:`~pipetrain.profile.measure.LONG_RUN` or more).
        repeats: timed runs of each segment at most (fewer once they add up to
            :data:`~pipetrain.profile.measure.SEGMENT_BUDGET`; a node that takes that long
            alone is run once); times are their robust mean.
        optimizer: ``"sgd"``, ``"adam"`` or ``"adamw"``: sets
            ``optimizer_state_bytes_per_parameter_byte`` (SGD with momentum 1, without 0,
            Adam 2).
        momentum: SGD momentum (0 means no momentum buffer).
        model_name: recorded in the profile (default: the bundle's name or the class name).
        threads: if given, ``torch.set_num_threads`` for the measurement (restored after).
        progress: show progress on a long profile (a bar on a terminal, else log lines).
        check_memory: activation bytes the final check may hold (:func:`profile_captured`).
        check_seconds: forward + backward seconds the final check's region may take
            (:func:`profile_captured`).

    Returns:
        A :class:`Profile` whose node names are the captured graph's node names.

    Raises:
        CaptureError: the model cannot be captured or fails on the example batch.
        ProfileError: bad arguments (device without CUDA, unknown optimizer...).

    Example:
        >>> prof = profile_model(nn.Sequential(nn.Linear(4, 8)), torch.randn(2, 4), repeats=1)
        >>> prof.names
        ['input_1', '_0']
    """
    _check_counts(warmup, repeats)
    dev = resolve_device(device)
    optimizer_state_factor(optimizer, momentum)
    if isinstance(model_or_bundle, nn.Module):
        model = model_or_bundle
        if example_inputs is None:
            raise ProfileError(
                f"profiling a bare {type(model).__name__} needs example_inputs (one minibatch); "
                "pass profile_model(model, example_inputs) or a ModelBundle"
            )
        name = model_name or type(model).__name__
    elif hasattr(model_or_bundle, "model") and hasattr(model_or_bundle, "example_inputs"):
        bundle = model_or_bundle
        model = bundle.model
        name = model_name or str(getattr(bundle, "name", "") or type(model).__name__)
        if example_inputs is None:
            example_inputs = bundle.example_inputs
            first = example_inputs[0] if isinstance(example_inputs, tuple) else example_inputs
            if batch_size is not None and isinstance(first, torch.Tensor) and first.dim() > 0 \
                    and int(first.shape[0]) != batch_size:
                example_inputs = bundle.make_batch(batch_size, torch.Generator().manual_seed(0))[0]
    else:
        raise ProfileError(
            f"profile_model needs an nn.Module or a ModelBundle, got {type(model_or_bundle).__name__}"
        )
    inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    home = _model_device(model)
    moved = home is not None and home != dev
    if moved:
        model.to(dev)
    try:
        inputs = _to_device(inputs, dev)
        captured = capture(model, inputs, trace_at=_trace_example(model_or_bundle, inputs, dev))
        loss_fn, target = _loss_and_target(model_or_bundle, inputs)
        return profile_captured(
            captured, inputs, batch_size=batch_size, device=dev, warmup=warmup, repeats=repeats,
            optimizer=optimizer, momentum=momentum, model_name=name, threads=threads,
            loss_fn=loss_fn, target=target, progress=progress, check_memory=check_memory, check_seconds=check_seconds,
        )
    finally:
        if moved:
            model.to(home)


def _trace_example(bundle: Any, inputs: tuple[Any, ...], device: torch.device) -> tuple[Any, ...] | None:
    """The example of :data:`TRACE_BATCH` samples the model is traced at (None: ``inputs``'
    batch is at most twice that): a bundle's ``make_batch``, else every input whose first
    dimension is the batch cut to its first samples."""
    batch = batch_size_of(inputs)
    if batch is None or batch <= 2 * TRACE_BATCH:
        return None
    make_batch = getattr(bundle, "make_batch", None)
    if make_batch is not None:
        try:
            small, _ = make_batch(TRACE_BATCH, torch.Generator().manual_seed(0))
        except Exception:  # noqa: BLE001 - a bundle that cannot make this size: traced at its own
            return None
        return _to_device(small if isinstance(small, tuple) else (small,), device)
    return tuple(x[:TRACE_BATCH] if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch else x
                 for x in inputs)


def _loss_and_target(bundle: Any, inputs: tuple[Any, ...]) -> tuple[Any, Any]:
    """A bundle's loss and a target for ``inputs``' batch size (``(None, None)`` for a bare module)."""
    loss_fn, make_batch = getattr(bundle, "loss_fn", None), getattr(bundle, "make_batch", None)
    batch = batch_size_of(inputs)
    if loss_fn is None or make_batch is None or batch is None:
        return None, None
    try:
        _, target = make_batch(batch, torch.Generator().manual_seed(0))
    except Exception:  # noqa: BLE001 - a bundle whose make_batch cannot make this size
        return None, None
    return loss_fn, target
