"""The per-layer profiler: forward and backward time, activation and parameter bytes per node.

PipeDream's planner needs, for every layer ``l`` of the graph, the forward and backward
compute time ``T_l``, the size of its output activations ``a_l`` (what crosses a stage
boundary cut after ``l``) and the size of its weights ``w_l`` (what data parallelism
all-reduces and what the optimizer keeps state for) (PipeDream, SOSP'19, section 3.1).

How a node is measured (:func:`profile_captured`): the graph runs once, node by node, in
topological order. Each node is run in isolation ``warmup + repeats`` times on detached
copies of its real inputs (``requires_grad`` set where the real value depends on trainable
parameters, so the first layer computes no input gradient, as in training). A run times
the node's forward with autograd recording, then ``torch.autograd.backward`` of the node's
differentiable outputs with a random gradient of their shape; the reported times are the
medians over the ``repeats`` timed runs. Nodes with no differentiable output get backward 0.
In-place nodes run on fresh clones each time, so repeats never compound. On CUDA the device
is synchronized around every timed region.

Activation bytes come from the capture's shape propagation (every output tensor of the
node); parameter bytes from the graph (each parameter counted once, see
:mod:`pipetrain.graph.capture`). Model inputs are nodes of kind ``"input"`` with zero times.
The model's buffers, parameter gradients and the global RNG are left as they were.
"""
from __future__ import annotations

import contextlib
import functools
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.utils import _pytree as pytree

from ..errors import ProfileError
from ..graph.capture import CapturedModel, capture, is_inplace_node, node_op_name, preserved_state
from .types import NodeProfile, Profile

__all__ = ["OPTIMIZER_STATE_FACTORS", "optimizer_state_factor", "profile_captured", "profile_model", "resolve_device"]

#: Optimizer state kept per byte of parameters: SGD with momentum keeps one buffer, Adam two.
OPTIMIZER_STATE_FACTORS = {"sgd": 1.0, "adam": 2.0, "adamw": 2.0}


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


def _as_leaf(t: torch.Tensor) -> torch.Tensor:
    """A graph-free copy of a value that keeps whether it needs a gradient."""
    return t.detach().requires_grad_(t.requires_grad)


def _leafify(value: Any) -> Any:
    return pytree.tree_map(lambda t: _as_leaf(t) if isinstance(t, torch.Tensor) else t, value)


def _fresh_clone(t: torch.Tensor) -> torch.Tensor:
    """An input for an in-place node: a private copy (non-leaf if it needs a gradient)."""
    leaf = t.detach().clone().requires_grad_(t.requires_grad)
    return leaf.clone() if leaf.requires_grad else leaf


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


class _NodeTimer:
    """Times single nodes of a GraphModule (forward, then backward of its outputs)."""

    def __init__(self, gm: torch.fx.GraphModule, device: torch.device, warmup: int, repeats: int) -> None:
        self.gm = gm
        self.interp = torch.fx.Interpreter(gm)
        self.warmup = warmup
        self.repeats = repeats
        self.sync: Callable[[], None] = (
            (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        )

    def _args(self, node: torch.fx.Node, env: dict[str, Any], inplace: bool) -> tuple[Any, Any]:
        prepare = _fresh_clone if inplace else _as_leaf

        def load(src: torch.fx.Node) -> Any:
            value = env[src.name]
            if src.op == "get_attr":
                return value  # parameters themselves: their gradients are part of backward
            return pytree.tree_map(lambda t: prepare(t) if isinstance(t, torch.Tensor) else t, value)

        args = torch.fx.node.map_arg(node.args, load)
        kwargs = torch.fx.node.map_arg(node.kwargs, load)
        return args, kwargs

    def time(self, node: torch.fx.Node, env: dict[str, Any]) -> tuple[float, float, Any]:
        """Median forward and backward seconds of ``node``, and its output (leafified)."""
        inplace = is_inplace_node(node, self.gm)
        call = getattr(self.interp, node.op)
        fwd: list[float] = []
        bwd: list[float] = []
        out: Any = None
        for i in range(self.warmup + self.repeats):
            args, kwargs = self._args(node, env, inplace)
            self.sync()
            t0 = time.perf_counter()
            with torch.enable_grad():
                out = call(node.target, args, kwargs)
            self.sync()
            t1 = time.perf_counter()
            diff = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            t_bwd = 0.0
            if diff:
                grads = [torch.randn_like(t) for t in diff]
                self.sync()
                t2 = time.perf_counter()
                try:
                    torch.autograd.backward(diff, grads)
                except RuntimeError as e:
                    first = (str(e).strip().splitlines() or [""])[0]
                    raise ProfileError(
                        f"node {node.name!r} ({node_op_name(node, self.gm)}) has no usable backward: {first}; "
                        "a model must be differentiable to be trained; replace that operation"
                    ) from None
                self.sync()
                t_bwd = time.perf_counter() - t2
            if i >= self.warmup:
                fwd.append(t1 - t0)
                bwd.append(t_bwd)
        return statistics.median(fwd), statistics.median(bwd), _leafify(out)

    def run_once(self, node: torch.fx.Node, env: dict[str, Any]) -> Any:
        """One untimed forward of ``node`` with autograd recording; its raw output."""
        args, kwargs = self._args(node, env, is_inplace_node(node, self.gm))
        with torch.enable_grad():
            return getattr(self.interp, node.op)(node.target, args, kwargs)


class _SavedBytes:
    """What each node's forward saves for its backward, storage by storage (the memory model).

    ``owner`` maps a storage to the node whose output first held it (a view's storage stays
    its root's), so a saved tensor is either a weight (left out: counted once per version),
    an earlier node's output (``saved_inputs``: that node's), or new (``saved_bytes``).
    """

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.weights = {t.untyped_storage().data_ptr() for t in [*gm.parameters(), *gm.buffers()]}
        self.owner: dict[int, str] = {}

    def register(self, name: str, value: Any) -> None:
        for t in pytree.tree_leaves(value):
            if isinstance(t, torch.Tensor):
                self.owner.setdefault(t.untyped_storage().data_ptr(), name)

    def measure(self, run: Callable[[], Any]) -> tuple[Any, int, list[str], bool]:
        """``run()`` under saved-tensor hooks: (output, new bytes, saved earlier nodes, output saved)."""
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            st = t.untyped_storage()
            saved[st.data_ptr()] = st.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = run()
        outs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)}
        new, inputs, output_saved = 0, [], False
        for ptr, nbytes in saved.items():
            if ptr == 0 or ptr in self.weights:
                continue
            if ptr in self.owner:
                if self.owner[ptr] not in inputs:
                    inputs.append(self.owner[ptr])
                continue
            new += nbytes
            output_saved = output_saved or ptr in outs
        return out, new, inputs, output_saved


def profile_captured(captured: CapturedModel, example_inputs: tuple[Any, ...] | torch.Tensor, *,
                     batch_size: int | None = None, device: str | torch.device = "cpu",
                     warmup: int = 2, repeats: int = 5, optimizer: str = "sgd",
                     momentum: float = 0.9, model_name: str = "",
                     threads: int | None = None, loss_fn: Callable[[Any, Any], Any] | None = None,
                     target: Any = None) -> Profile:
    """Profile an already captured model (its ``gm`` and ``example_inputs`` on ``device``).

    Same measurements and arguments as :func:`profile_model`; node names are
    ``captured.graph``'s. Use this when the caller also needs the capture. With ``loss_fn``
    and ``target`` the profile also records what the loss saves for backward.
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
        first = next((x for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 0), None)
        batch_size = int(first.shape[0]) if first is not None else None

    _warm_autograd(dev)
    timer = _NodeTimer(gm, dev, warmup, repeats)
    env: dict[str, Any] = {}
    times: dict[str, tuple[float, float]] = {}
    saved = _SavedBytes(gm)
    kept: dict[str, tuple[int, list[str], bool]] = {}
    loss_saved: tuple[int, bool] | None = None
    with num_threads(threads), _saved_grads([gm]), preserved_state(gm, [dev]):
        feed = iter(inputs)
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                env[node.name] = _leafify(next(feed))
                saved.register(node.name, env[node.name])
            elif node.op == "get_attr":
                env[node.name] = timer.interp.fetch_attr(str(node.target))
            elif node.op == "output":
                if loss_fn is not None and target is not None:
                    loss_saved = _loss_saved(saved, loss_fn, torch.fx.node.map_arg(node.args[0], lambda n: env[n.name]),
                                             _to_device(target, dev))
                break
            else:
                f, b, _ = timer.time(node, env)
                # One more (untimed) run under saved-tensor hooks: what this node keeps for backward.
                out, nbytes, ins, own = saved.measure(functools.partial(timer.run_once, node, env))
                env[node.name] = _leafify(out)
                saved.register(node.name, env[node.name])
                kept[node.name] = (nbytes, ins, own)
                times[node.name] = (f, b)
    env.clear()

    nodes = []
    for ln in captured.graph:
        f, b = times.get(ln.name, (0.0, 0.0))
        nodes.append(NodeProfile(
            name=ln.name, op=ln.op, forward_time=0.0 if ln.is_input else f,
            backward_time=0.0 if ln.is_input else b, activation_bytes=ln.activation_bytes,
            parameter_bytes=ln.parameter_bytes, inputs=list(ln.inputs), kind=ln.kind,
            **({} if ln.is_input else _saved_fields(kept.get(ln.name))),
        ))
    return Profile(
        model=model_name, batch_size=batch_size, nodes=nodes, device=str(dev),
        optimizer=optimizer.lower(), optimizer_state_bytes_per_parameter_byte=factor,
        loss_saved_bytes=loss_saved[0] if loss_saved else None, loss_saves_output=bool(loss_saved and loss_saved[1]),
    )


def _saved_fields(kept: tuple[int, list[str], bool] | None) -> dict[str, Any]:
    """NodeProfile's saved-for-backward fields (a node the graph never ran saves nothing)."""
    nbytes, ins, own = kept if kept is not None else (0, [], False)
    return {"saved_bytes": nbytes, "saved_inputs": list(ins), "output_saved": own}


def _loss_saved(saved: _SavedBytes, loss_fn: Callable[[Any, Any], Any], output: Any,
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
                  model_name: str = "", threads: int | None = None) -> Profile:
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
        warmup: untimed runs of each node before the timed ones.
        repeats: timed runs of each node; times are their median.
        optimizer: ``"sgd"``, ``"adam"`` or ``"adamw"``: sets
            ``optimizer_state_bytes_per_parameter_byte`` (SGD with momentum 1, without 0,
            Adam 2).
        momentum: SGD momentum (0 means no momentum buffer).
        model_name: recorded in the profile (default: the bundle's name or the class name).
        threads: if given, ``torch.set_num_threads`` for the measurement (restored after).

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
        captured = capture(model, inputs)
        loss_fn, target = _loss_and_target(model_or_bundle, inputs)
        return profile_captured(
            captured, inputs, batch_size=batch_size, device=dev, warmup=warmup, repeats=repeats,
            optimizer=optimizer, momentum=momentum, model_name=name, threads=threads,
            loss_fn=loss_fn, target=target,
        )
    finally:
        if moved:
            model.to(home)


def _loss_and_target(bundle: Any, inputs: tuple[Any, ...]) -> tuple[Any, Any]:
    """A bundle's loss and a target for ``inputs``' batch size (``(None, None)`` for a bare module)."""
    loss_fn, make_batch = getattr(bundle, "loss_fn", None), getattr(bundle, "make_batch", None)
    first = next((x for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 0), None)
    if loss_fn is None or make_batch is None or first is None:
        return None, None
    try:
        _, target = make_batch(int(first.shape[0]), torch.Generator().manual_seed(0))
    except Exception:  # noqa: BLE001 - a bundle whose make_batch cannot make this size
        return None, None
    return loss_fn, target
