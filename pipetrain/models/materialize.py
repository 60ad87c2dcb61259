"""Models built without their weights, and every tensor's initial value from the seed and its name.

Pipeline parallelism exists for models that do not fit one process (GPipe, Megatron): a
process should hold the tensors of its own stages only. A model is therefore made in two
passes.

1. **Weightless build** (:func:`build_weightless`). The factory runs as it is, on the CPU,
   except that every parameter and buffer a module registers is swapped, at registration
   (torch's global registration hooks), for a tensor of the same shape and dtype on the
   ``meta`` device: the model holds no storage whatever its size, and can still be traced,
   run for shapes and cut into stages. Kept aside: each buffer's value as built (a causal
   mask, a position table: small) and each parameter's of at most :data:`KEPT_ELEMENTS`
   elements (a norm's scale made with ``torch.ones``). Every in-place call on the model's
   tensors during the build (``nn.init.*``, ``normal_``, ``copy_``, ``w[0] = 0``, on the tensor or a view of
   it) is recorded per tensor: the *construction calls*.

2. **Initialisation** (:meth:`WeightlessModel.materialize`). The tensors asked for get CPU
   storage (their kept value, if any), then the model's *init pass* runs over the whole model: for
   every module, children before parents (the order of Hugging Face's ``initialize_weights``), its
   ``reset_parameters()`` (torch's convention; torch's own modules also ``_reset_parameters()``),
   then, inside a Hugging Face ``PreTrainedModel``, that model's ``_init_weights(module)``. Calls on tensors
   still on ``meta`` do nothing. Before and after every in-place call on a tensor, the CPU
   generator is seeded from (seed, the tensor's name, the number of calls on it so far): a
   tensor's initial value depends on the seed and its name only, never on which other tensors
   the process holds, so one worker, two stages and four stages start from the same weights.

The init pass reproduces the factory's initialisation when it makes, on every tensor, the same
in-place calls with the same arguments as the construction did, from the last call that
overwrites the whole tensor on (:meth:`WeightlessModel.problem` checks it, on the meta model).
A factory for which it does not (an ``nn.init`` call in ``__init__`` outside
``reset_parameters``; a large parameter made with its value, ``nn.Parameter(torch.randn(n, m))``)
cannot be built without its weights: :class:`NotWeightless` says why, and the caller builds
it whole instead.
"""
from __future__ import annotations

import contextlib
import hashlib
import sys
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ..errors import ModelError
from ..graph.held import on_meta

__all__ = ["KEPT_ELEMENTS", "NotWeightless", "WeightlessModel", "build_weightless", "hold_values", "is_weightless",
           "meta_limit",
           "name_seed", "on_device_of"]

KEPT_ELEMENTS = 1 << 16
"""Parameters of at most this many elements keep their value as built (a norm's ``torch.ones``
scale); larger ones must get theirs from an init call."""

T = TypeVar("T")

# Calls that overwrite every element they reach, whatever was there before.
_OVERWRITES = frozenset({
    "uniform_", "normal_", "fill_", "zero_", "copy_", "random_", "bernoulli_", "exponential_", "geometric_",
    "log_normal_", "cauchy_", "constant_", "ones_", "zeros_", "eye_", "dirac_", "xavier_uniform_", "xavier_normal_",
    "kaiming_uniform_", "kaiming_normal_", "trunc_normal_", "orthogonal_", "sparse_",
})
_IN_PLACE_OPERATORS = frozenset({
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
    "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__",
})
# In-place by name, but they change no value.
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "retain_grad_", "record_stream_"})
# Calls whose result is the tensor itself under another object (not a view).
_ALIASES = frozenset({"data.__get__", "detach"})

Call = tuple[str, tuple[str, ...], bool]
"""One in-place call on a tensor: its name, its arguments (tensors as ``"tensor"``), and
whether it reached only part of the tensor (a view with fewer elements)."""


class TensorSource(Protocol):
    """Initial values by name (pretrained weights: :class:`pipetrain.models.pretrained.TensorFiles`)."""

    def read(self, name: str) -> Tensor | None:
        """The tensor ``name``, or ``None`` when the source does not hold it."""
        ...

    def names(self) -> list[str]:
        """Every tensor name the source holds."""
        ...

    def close(self) -> None:
        """Let go of open files until the next read."""
        ...


class NotWeightless(ModelError):
    """The factory cannot be built without its weights (the message says why)."""


def name_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed from ``seed`` and names (``blake2b``: the same in every process)."""
    text = "\x1f".join([str(seed), *(str(p) for p in parts)])
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & (2 ** 63 - 1)


def _call_name(func: Any) -> str:
    name = str(getattr(func, "__name__", ""))
    if name == "__get__":  # a property read: Tensor.data
        return f"{getattr(getattr(func, '__self__', None), '__name__', '')}.__get__"
    return name


def _writes(name: str) -> bool:
    if name in _IN_PLACE_OPERATORS:
        return True
    if name.endswith(".__get__"):
        return False
    return name.endswith("_") and not name.startswith("_") and name not in _NOT_WRITES


def _describe_arg(v: Any) -> str:
    if isinstance(v, Tensor):
        return "tensor"
    if isinstance(v, (bool, int, float, str, type(None), torch.dtype)):
        return repr(v)
    if isinstance(v, torch.Generator):
        return "generator"
    if isinstance(v, (tuple, list)):
        return "(" + ",".join(_describe_arg(x) for x in v) + ")"
    return type(v).__name__


class _CallLog(TorchFunctionMode):
    """Records the in-place calls on tracked tensors (and on their views and ``.data``); with
    names and a seed, seeds the CPU generator before and after each from (seed, name, count)."""

    def __init__(self, names: Mapping[int, str] | None = None, seed: int | None = None,
                 frozen: Collection[int] = ()) -> None:
        super().__init__()
        self._frozen = frozen                  # ids of tensors no call may write (loaded values)
        self._base: dict[int, Tensor] = {}     # id of a tracked tensor or of an alias -> the tracked tensor
        self._aliases: list[Tensor] = []       # kept alive, so that their ids stay theirs
        self.calls: dict[int, list[Call]] = {}
        self._names = names or {}
        self._seed = seed
        self._foreign: Collection[int] = ()

    def track(self, t: Tensor) -> None:
        self._base[id(t)] = t

    def forget_aliases(self) -> None:
        """Drop the views followed so far (the tracked tensors and their calls stay)."""
        tracked = {id(t): t for t in self._base.values()}
        self._base = tracked
        self._aliases = []

    def start_module(self, qualname: str, foreign: Collection[int] = ()) -> None:
        """Seed the generator for the init calls of module ``qualname`` (draws of scratch
        tensors); ``foreign``: the ids of the tensors it holds under another module's name
        (a tied weight), whose writes it skips: a shared tensor keeps its first holder's
        initialisation, as when the factory ties it after building both."""
        self._foreign = foreign
        if self._seed is not None:
            torch.default_generator.manual_seed(name_seed(self._seed, "module", qualname))

    def _reseed(self, base: Tensor, count: int, when: str) -> None:
        name = self._names.get(id(base))
        if self._seed is not None and name is not None:
            torch.default_generator.manual_seed(name_seed(self._seed, name, count, when))

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        # torch.nn.init's functions hand their tensor over as the keyword ``tensor``
        target = args[0] if args and isinstance(args[0], Tensor) else kwargs.get("tensor")
        base = self._base.get(id(target)) if isinstance(target, Tensor) else None
        if base is None or not isinstance(target, Tensor):
            return func(*args, **kwargs)
        name = _call_name(func)
        if not _writes(name):
            out = func(*args, **kwargs)
            self._follow(out, base, name)
            return out
        if id(base) in self._foreign or id(base) in self._frozen:
            return target
        calls = self.calls.setdefault(id(base), [])
        described = tuple(_describe_arg(a) for a in args[1:]) + tuple(
            f"{k}={_describe_arg(v)}" for k, v in sorted(kwargs.items()))
        calls.append((name, described, target.numel() != base.numel()))
        self._reseed(base, len(calls), "before")
        out = func(*args, **kwargs)
        self._reseed(base, len(calls), "after")
        return out

    def _follow(self, out: Any, base: Tensor, name: str) -> None:
        """Track the results that alias ``base``: ``.data``, ``detach()`` and views."""
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(o, Tensor) or id(o) in self._base:
                continue
            if name in _ALIASES or (o._is_view() and self._base.get(id(o._base)) is base):
                self._base[id(o)] = base
                self._aliases.append(o)


def _meta_parameter(param: nn.Parameter) -> nn.Parameter:
    meta = on_meta(param)
    meta.__dict__.update(param.__dict__)  # what a model wrote on its parameter (sharding hints...)
    return meta


@contextlib.contextmanager
def _registered_on_meta(log: _CallLog, kept: dict[int, Tensor]) -> Iterator[None]:
    """Every parameter and buffer registered inside the block lands on ``meta`` (tracked by
    ``log``; buffers' and small parameters' values kept in ``kept`` by the meta tensor's id)."""
    from torch.nn.modules.module import (
        register_module_buffer_registration_hook,
        register_module_parameter_registration_hook,
    )

    def on_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
        if param is None or param.is_meta:
            return None
        if type(param) is not nn.Parameter:
            raise NotWeightless(f"parameter {name!r} of {type(module).__name__} is a {type(param).__name__}")
        meta = _meta_parameter(param)
        if param.numel() <= KEPT_ELEMENTS:
            kept[id(meta)] = param.detach()
        log.track(meta)
        return meta

    def on_buffer(module: nn.Module, name: str, buffer: Tensor | None) -> Tensor | None:
        if buffer is None or buffer.is_meta:
            return None
        meta = on_meta(buffer)
        kept[id(meta)] = buffer.detach()
        log.track(meta)
        return meta

    # torch types the hooks as returning None; a returned tensor replaces the registered one (documented)
    handles = [register_module_parameter_registration_hook(on_parameter),  # type: ignore[arg-type]
               register_module_buffer_registration_hook(on_buffer)]  # type: ignore[arg-type]
    try:
        with log:
            yield
    finally:
        for h in handles:
            h.remove()


def _tensors(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Every (name, tensor) of the model's parameters and buffers, every name of a shared one."""
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


def _canonical_names(model: nn.Module) -> dict[int, str]:
    """Tensor id -> its first name (``state_dict`` order): the name its initial value comes from."""
    out: dict[int, str] = {}
    for name, t in _tensors(model):
        out.setdefault(id(t), name)
    return out


def _pretrained_class() -> type | None:
    """``transformers.PreTrainedModel`` when transformers is loaded (a model of it can exist only then)."""
    tf = sys.modules.get("transformers")
    return getattr(tf, "PreTrainedModel", None) if tf is not None else None


def _post_order(model: nn.Module) -> Iterator[tuple[str, nn.Module, Any]]:
    """``(qualified name, module, its Hugging Face model or None)``, children before parents."""
    pretrained = _pretrained_class()
    seen: set[int] = set()

    def walk(prefix: str, module: nn.Module, owner: Any) -> Iterator[tuple[str, nn.Module, Any]]:
        seen.add(id(module))
        if pretrained is not None and isinstance(module, pretrained):
            owner = module
        for name, child in module.named_children():
            if id(child) not in seen:
                yield from walk(f"{prefix}.{name}" if prefix else name, child, owner)
        yield prefix, module, owner

    yield from walk("", model, None)


def _hf_guard() -> contextlib.AbstractContextManager[Any]:
    """Hugging Face's context for ``_init_weights`` (torch's init functions made flag-aware)."""
    init = sys.modules.get("transformers.initialization")
    guard = getattr(init, "guard_torch_init_functions", None) if init is not None else None
    return guard() if guard is not None else contextlib.nullcontext()


def _init_module(module: nn.Module, owner: Any) -> None:
    """The init calls of one module: ``reset_parameters``, torch's ``_reset_parameters``, then
    its Hugging Face model's ``_init_weights``."""
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()
    own = getattr(module, "_reset_parameters", None)
    if callable(own) and type(module).__module__.startswith("torch.nn."):
        own()
    if owner is not None:
        with _hf_guard():
            owner._init_weights(module)


def _foreign_tensors(model: nn.Module) -> dict[int, set[int]]:
    """Module id -> ids of the tensors it holds directly under a name that is not the tensor's
    first (:func:`_canonical_names`): the later holders of tied weights."""
    first = _canonical_names(model)
    out: dict[int, set[int]] = {}
    for qualname, module in model.named_modules():  # a shared module under its first name
        prefix = f"{qualname}." if qualname else ""
        held = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        foreign = {id(t) for n, t in held if first.get(id(t)) != prefix + n}
        if foreign:
            out.setdefault(id(module), set()).update(foreign)
    return out


def _init_pass(model: nn.Module, log: _CallLog) -> None:
    foreign = _foreign_tensors(model)
    with torch.random.fork_rng(devices=[]), torch.no_grad(), log:
        for qualname, module, owner in _post_order(model):
            log.start_module(qualname, foreign.get(id(module), ()))
            _init_module(module, owner)


def _effective(calls: list[Call]) -> tuple[bool, list[Call]]:
    """Whether a call overwrites the whole tensor, and the calls from the last such one on."""
    last = max((i for i, c in enumerate(calls) if c[0] in _OVERWRITES and not c[2]), default=None)
    return (False, calls) if last is None else (True, calls[last:])


def _describe_calls(calls: list[Call]) -> str:
    return ", ".join(f"{c[0]}({', '.join(c[1])})" + (" on part of it" if c[2] else "") for c in calls) or "none"


@dataclass
class WeightlessModel:
    """A model built by :func:`build_weightless`: its tensors on ``meta`` until materialised.

    Attributes:
        model: the module (shared with whatever holds it: a bundle, a captured graph).
        seed: the run's seed, which every initial value derives from.
        source: pretrained values by name; a tensor it holds (under any of its names) takes
            that value, and the init pass leaves it alone.
    """

    model: nn.Module
    seed: int
    construction: dict[int, list[Call]] = field(repr=False)
    kept: dict[int, Tensor] = field(repr=False)
    source: TensorSource | None = None
    materialized: bool = False
    _loaded: set[int] = field(default_factory=set, repr=False)
    _buffers: dict[str, Tensor] = field(default_factory=dict, repr=False)
    _named: dict[str, Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._buffers = dict(self.model.named_buffers(remove_duplicate=False))

    def rebind(self) -> None:
        """Bind every buffer name to its tensor of the build again: a forward run for shapes
        may have assigned new ones (``self.count = self.count + 1``), which hold no kept value."""
        for name, b in self._buffers.items():
            owner, _, leaf = name.rpartition(".")
            module = self.model.get_submodule(owner) if owner else self.model
            if getattr(module, leaf, None) is not b:
                setattr(module, leaf, b)

    def problem(self) -> str | None:
        """Why the init pass would not reproduce the factory's initialisation (module
        docstring), or ``None``. Runs the init pass on the meta model (no storage)."""
        log = _CallLog()
        names = _canonical_names(self.model)
        tensors = {id(t): t for _, t in _tensors(self.model)}
        for t in tensors.values():
            log.track(t)
        try:
            _init_pass(self.model, log)
        except Exception as exc:  # noqa: BLE001 - any failure of the init methods on meta
            return f"its init methods fail on the meta device ({type(exc).__name__}: {str(exc).strip()[:160]})"
        for tid, t in tensors.items():
            if not t.is_meta:
                continue
            name = names[tid]
            _, built = _effective(self.construction.get(tid, []))
            init_full, init = _effective(log.calls.get(tid, []))
            if built != init:
                return (f"tensor {name!r} is initialised by the factory with {_describe_calls(built)} but by its "
                        f"init methods (reset_parameters) with {_describe_calls(init)}")
            if not init_full and tid not in self.kept:
                return (f"tensor {name!r} ({t.numel()} elements) gets its value when it is created and no init "
                        f"method (reset_parameters) sets it")
        return None

    def materialize(self, names: Iterable[str] | None = None, holders: Sequence[nn.Module] = ()) -> None:
        """Give the tensors ``names`` (every name of a shared tensor counts; ``None``: all) CPU
        storage and their initial values (module docstring); the others stay on ``meta``.
        ``holders``: other modules that hold the model's tensors (its captured graph), kept
        pointing at the same tensors."""
        if self.materialized:
            raise ModelError("a weightless model is materialised once (its init pass would run twice on the tensors "
                             "it holds); pass every name to one materialize() call")
        self.materialized = True
        by_name = dict(_tensors(self.model))
        chosen = list(by_name.values()) if names is None else [by_name[n] for n in names if n in by_name]
        fresh = {id(t): t for t in chosen if t.is_meta}
        self._hold(fresh.values(), holders)
        if fresh:
            try:
                self._init_pass()
            except Exception:  # noqa: BLE001 - an init method mixing held and meta tensors: hold them all
                every = list({id(t): t for t in by_name.values()}.values())
                for t in every:
                    if not t.is_meta and id(t) in self.kept:
                        t.data.copy_(self.kept[id(t)])
                self._hold([t for t in every if t.is_meta], holders)
                self._init_pass()
        self.kept = {}

    def initial_value(self, name: str) -> Tensor | None:
        """The value tensor ``name`` starts from where it is known without the init pass, or
        ``None``: the source's under any name of the tensor (a tie: ``lm_head.weight`` is
        stored as ``shared.weight``), else the value kept at the build when nothing wrote the
        tensor after it was created (a kept ``nn.Linear`` weight is ``torch.empty``'s memory
        until ``reset_parameters`` runs: not a value)."""
        if not self._named:
            self._named = dict(_tensors(self.model))
        t = self._named.get(name)
        if self.source is not None:
            names = [name] if t is None else self._names_of().get(id(t), [name])
            value = self._read(t, names) if t is not None else self.source.read(name)
            if value is not None:
                return value
        if t is None or id(t) not in self.kept or self.construction.get(id(t)):
            return None
        return self.kept[id(t)]

    def _hold(self, tensors: Iterable[Tensor], holders: Sequence[nn.Module]) -> None:
        """CPU storage for meta ``tensors``, in place (or, for those that cannot be swapped, by
        re-pointing the model's and ``holders``' attributes)."""
        replaced: dict[int, Tensor] = {}
        names = self._names_of()
        for t in tensors:
            loaded = self._read(t, names.get(id(t), []))
            new = _give_storage(t, loaded if loaded is not None else self.kept.get(id(t)))
            if loaded is not None:
                self._loaded.update({id(t)} | ({id(new)} if new is not None else set()))
            if new is not None:
                replaced[id(t)] = new
                if id(t) in self.kept:
                    self.kept[id(new)] = self.kept[id(t)]
        if replaced:
            _replace([m for root in (self.model, *holders) for m in root.modules()], replaced)

    def _names_of(self) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for name, t in _tensors(self.model):
            out.setdefault(id(t), []).append(name)
        return out

    def _read(self, t: Tensor, names: list[str]) -> Tensor | None:
        """``t``'s value from the source (its first name the source holds), in ``t``'s dtype."""
        if self.source is None:
            return None
        for name in names:
            value = self.source.read(name)
            if value is not None:
                return value.to(t.dtype)
        return None

    def _init_pass(self) -> None:
        log = _CallLog(_canonical_names(self.model), self.seed, frozen=self._loaded)
        for _, t in _tensors(self.model):
            log.track(t)
        _init_pass(self.model, log)


def _give_storage(t: Tensor, value: Tensor | None) -> Tensor | None:
    """Swap meta tensor ``t`` for a CPU one (``value``'s copy, else uninitialised), in place:
    every module and graph holding ``t`` holds the new storage (``torch.utils.swap_tensors``).
    A tensor that cannot be swapped (weakly referenced: an LSTM's flat weights) is left as it
    is and its CPU replacement returned, for its holders to take."""
    real = value.clone() if value is not None else torch.empty_like(t, device="cpu")
    new: Tensor = nn.Parameter(real, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else real
    new.__dict__.update(t.__dict__)
    try:
        torch.utils.swap_tensors(t, new)
    except RuntimeError:
        return new
    return None


def _replace(modules: Iterable[nn.Module], replaced: Mapping[int, Tensor]) -> None:
    """Point every attribute holding a replaced tensor (by identity) at its replacement."""
    for module in modules:
        held = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
        for name, t in held:
            if id(t) in replaced:
                setattr(module, name, replaced[id(t)])


def hold_values(root: nn.Module, names: Collection[str] | None, value: Callable[[list[str]], Tensor | None],
                holders: Sequence[nn.Module] = ()) -> None:
    """Give ``root``'s meta tensors named ``names`` (any name of a shared tensor; ``None``:
    all) CPU storage holding ``value(every name of the tensor)``, in the tensor's dtype, in
    place (``holders``: other modules holding the same tensors, kept pointing at them): a
    model whose every value is known without its init methods (files, kept buffers).

    Raises:
        ModelError: ``value`` has nothing for a tensor asked for.
    """
    asked = None if names is None else set(names)
    names_of: dict[int, list[str]] = {}
    wanted: dict[int, Tensor] = {}
    for name, t in _tensors(root):
        names_of.setdefault(id(t), []).append(name)
        if t.is_meta and (asked is None or name in asked):
            wanted[id(t)] = t
    replaced: dict[int, Tensor] = {}
    for tid, t in wanted.items():
        v = value(names_of[tid])
        if v is None:
            raise ModelError(f"no value for tensor {names_of[tid][0]!r}: neither the files nor the build hold it")
        new = _give_storage(t, v.to(t.dtype))
        if new is not None:
            replaced[tid] = new
    if replaced:
        _replace([m for r in (root, *holders) for m in r.modules()], replaced)


def build_weightless(build: Callable[[], T], model_of: Callable[[T], nn.Module],
                     seed: int) -> tuple[T, WeightlessModel]:
    """Run ``build()`` with every parameter and buffer registered on ``meta`` (module docstring).

    Args:
        build: the factory call; its random draws come from torch's generator seeded with ``seed``.
        model_of: the ``nn.Module`` in ``build()``'s result.
        seed: the run's seed.

    Raises:
        NotWeightless: the model cannot be built without its weights (the message says why).
    """
    log = _CallLog()
    kept: dict[int, Tensor] = {}
    torch.manual_seed(seed)
    with _registered_on_meta(log, kept):
        result = build()
    log.forget_aliases()
    model = model_of(result)
    weightless = WeightlessModel(model, seed, log.calls, kept)
    reason = weightless.problem()
    if reason is not None:
        raise NotWeightless(reason)
    owned = set(_canonical_names(model))
    weightless.kept = {k: v for k, v in kept.items() if k in owned}
    return result, weightless


def is_weightless(model: nn.Module) -> bool:
    """Whether any of the model's parameters or buffers is still on ``meta``."""
    return any(t.is_meta for _, t in _tensors(model))


def on_device_of(model: nn.Module, value: Any) -> Any:
    """``value`` with its tensors on ``meta`` when the model has meta tensors (a model run
    for shapes: a weightless launcher's checks), else unchanged."""
    if not is_weightless(model):
        return value
    return pytree.tree_map(lambda x: x.to("meta") if isinstance(x, Tensor) else x, value)


def meta_limit(exc: BaseException) -> bool:
    """Whether ``exc`` is torch refusing an op on ``meta`` tensors (no meta kernel, or a value
    asked of one: ``.item()``, a data-dependent branch), not an error of the model: a run for
    shapes of a weightless model cannot check what it would have checked."""
    text = str(exc)
    return "meta tensor" in text.lower() or (isinstance(exc, NotImplementedError) and "Meta" in text)
