"""The model a run trains, built the same way in every process, each holding only its part.

Every process builds the model *weightless* (:mod:`pipetrain.models.materialize`: parameters
and buffers on the ``meta`` device) and captures it there; then it gives storage and initial
values to the tensors it needs: all of them for one process and the reference replay
(:func:`load_bundle`), its own stages' for a worker (:func:`build_stages`), none for the
launcher (``weights=False``). A tensor's initial value depends only on the seed and its
name, so every layout starts from the same weights.

A factory whose initialisation cannot be reproduced tensor by tensor (it initialises outside
``reset_parameters``) is built whole on the CPU in every process, from ``torch.manual_seed(seed)``,
with a one-line warning that states the cost; so is a model whose forward cannot run on
``meta`` (it mixes in CPU tensors it creates itself). A model whose forward runs on ``meta``
but whose weightless capture fails is materialised whole by the process that captures it.

Workers need not run the model's code at all when every tensor's value comes from files (an
``hf:DIR``, ``--init-from``) or was kept at the build (a buffer): the launcher then ships its
weightless capture as plain data (:func:`ship_model`, :mod:`pipetrain.graph.portable`) and
each worker rebuilds the graph and reads its own tensors, without importing the model's
library or ``torch.export`` (about 200 MiB of a worker's memory for a Hugging Face model).
Both ways give a worker the same graph, node names and tensor values.
"""
from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .config import TrainConfig
from .resolved import ResolvedRun

if TYPE_CHECKING:
    from ..graph.capture import CapturedModel
    from ..graph.portable import PortableCapture
    from ..models.bundle import ModelBundle
    from ..models.materialize import TensorSource, WeightlessModel
    from ..models.pretrained import TensorFiles
    from ..stages.boundary import BoundaryCodec
    from ..stages.partition import Partition

log = logging.getLogger(__name__)

__all__ = ["ShippedModel", "StagedModel", "build_stages", "ship_model", "load_bundle", "load_captured",
           "load_shipped", "capture_model", "model_batch_size", "retarget_meta", "stage_tensor_names",
           "unread_tensor_names"]


_WARNED: set[str] = set()  # models whose whole build this process has announced


def _mib(model: torch.nn.Module) -> float:
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values()) / 2 ** 20


def _pretrained(cfg: TrainConfig, model: torch.nn.Module) -> TensorFiles | None:
    """The run's pretrained weights (``--init-from``, else an ``hf:DIR``'s files), checked
    against the model's names and shapes (their headers only), or ``None``."""
    from ..models.pretrained import HF_PREFIX, TensorFiles, hf_files

    if cfg.model.init_from is not None:
        files = TensorFiles.at(cfg.model.init_from, f"--init-from {cfg.model.init_from}")
        files.check(model)
    elif cfg.model.name.startswith(HF_PREFIX):
        files = hf_files(cfg.model.name, model)
        files.check(model, getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    else:
        return None
    return files


def _seeded(cfg: TrainConfig, unit_batch: int | None, warn: bool) -> tuple[ModelBundle, WeightlessModel | None]:
    """The bundle, weightless when the factory allows it (its WeightlessModel), else built whole
    from ``torch.manual_seed(seed)`` (``None``)."""
    from ..models import load_model
    from ..models.loader import load_weightless
    from ..models.materialize import NotWeightless
    from ..models.pretrained import load_into

    seed = cfg.training.seed
    try:
        bundle, weightless = load_weightless(cfg.model.name, seed, unit_batch, **cfg.model.options)
    except NotWeightless as exc:
        reason = str(exc)
    else:
        weightless.source = _pretrained(cfg, bundle.model)
        return bundle, weightless
    torch.manual_seed(seed)
    bundle = load_model(cfg.model.name, batch_size=unit_batch, **cfg.model.options)
    files = _pretrained(cfg, bundle.model)
    if files is not None:
        load_into(bundle.model, files)
    if warn and cfg.model.name not in _WARNED:
        _WARNED.add(cfg.model.name)
        log.warning("model %s cannot be built without its weights (%s): every process builds it whole on the CPU, "
                    "%.0f MiB of parameters and buffers each; move its initialisation into reset_parameters() to "
                    "hold only each stage's", cfg.model.name, reason, _mib(bundle.model))
    return bundle, None


def load_bundle(cfg: TrainConfig, unit_batch: int, *, weights: bool = True, warn: bool = False) -> Any:
    """The model bundle with a unit-sized example batch (what the shapes of wire tensors are
    taken from); ``weights``: every tensor with its initial value from ``seed`` (module
    docstring), else weightless where the factory allows it (a model for capture and checks).
    ``warn``: say it when the model must be built whole (the launcher, once)."""
    bundle, weightless = _seeded(cfg, unit_batch, warn)
    if weights and weightless is not None:
        weightless.materialize()
    return bundle


def load_captured(cfg: TrainConfig, unit_batch: int, *, weights: bool = False, warn: bool = False,
                  like: CapturedModel | None = None) -> tuple[Any, CapturedModel]:
    """:func:`load_bundle` and the model's capture (:func:`capture_model`: on ``meta`` when
    weightless, ``like``'s graph where it holds at this batch; ``weights``: every tensor
    materialised after it, for profiling)."""
    bundle, weightless = _seeded(cfg, unit_batch, warn)
    captured = capture_model(bundle, weightless, like)
    if weights and weightless is not None and not weightless.materialized:
        weightless.materialize(holders=[captured.gm])
        retarget_meta(captured.gm)
    return bundle, captured


def load_shipped(cfg: TrainConfig, unit_batch: int, *, warn: bool = False) -> tuple[Any, CapturedModel,
                                                                                  ShippedModel | None]:
    """:func:`load_captured`, weightless, and the capture as workers take it (:func:`ship_model`).
    Traced for this bundle: a graph taken from another capture holds that one's tensors,
    which :func:`ship_model` refuses (workers would capture the model themselves)."""
    bundle, weightless = _seeded(cfg, unit_batch, warn)
    captured = capture_model(bundle, weightless)
    return bundle, captured, ship_model(bundle, captured, weightless, unit_batch)


def model_batch_size(cfg: TrainConfig) -> int:
    """The batch size of the model's own example batch (built weightless where it can be)."""
    with torch.random.fork_rng(devices=[]):
        return int(_seeded(cfg, None, warn=False)[0].batch_size)


def retarget_meta(gm: torch.fx.GraphModule) -> None:
    """``torch.export`` writes the example's device into the ops that create tensors
    (``arange(..., device=meta)``): make it the CPU, where a capture of the built model has
    it (for running the graph once its tensors are materialised)."""
    from ..graph.held import retarget

    retarget(gm, torch.device("cpu"))


def capture_model(bundle: Any, weightless: WeightlessModel | None = None,
                  like: CapturedModel | None = None) -> CapturedModel:
    """``bundle.model`` captured: on ``meta`` when it is weightless (:func:`retarget_meta`
    makes its graph run on the CPU once materialised). A model whose forward cannot run on
    ``meta`` is materialised whole (``weightless``: its WeightlessModel, required then) and
    captured as it is. ``like``: a capture of the same model at another batch, whose graph is
    taken (:func:`~pipetrain.graph.capture.rebatched`) where it is known to hold at this one:
    tracing a Hugging Face model takes seconds, taking its graph a tenth of one. That graph
    holds ``like``'s tensors (the same names and values), so it serves what reads them by
    name (profiles, plans), not :func:`ship_model`."""
    from ..errors import CaptureError
    from ..graph.capture import capture, rebatched
    from ..models.materialize import is_weightless, on_device_of

    model = bundle.model
    if like is not None:
        again = rebatched(like, model, on_device_of(model, bundle.example_inputs))
        if again is not None:
            if weightless is not None:
                again.tensor_values = weightless.initial_value
            return again
    if not is_weightless(model):
        return capture(model, bundle.example_inputs)
    try:
        captured = capture(model, on_device_of(model, bundle.example_inputs), validate=False)
        if weightless is not None:
            captured.tensor_values = weightless.initial_value
    except CaptureError as exc:
        if weightless is None:
            raise
        log.warning("model %s cannot be captured without its weights (%s); this process builds it whole",
                    bundle.name, str(exc).splitlines()[0][:200])
        weightless.materialize()
        return capture(model, bundle.example_inputs)
    return captured


@dataclass(frozen=True)
class ShippedModel:
    """A weightless capture the launcher made, for workers that do not run the model's code.

    Attributes:
        capture: the capture as plain data (:class:`~pipetrain.graph.portable.PortableCapture`).
        bundle: the bundle without its model (a placeholder module): the example batch, the
            loss and the synthetic batches.
        state_keys: the model's ``state_dict`` keys, in order (checkpoints, ``--save-hf``).
        param_names: the model's ``named_parameters()`` names, in order (a tie once).
        source: the files every parameter's value is read from
            (:class:`~pipetrain.models.pretrained.TensorFiles`).
        kept: values of the tensors the files do not hold, as the model built them (buffers).
        unit_batch: the samples of the capture's example batch.
        codecs: every cut's wires for the run's plan (:func:`with_codecs`; running the graph
            on ``meta`` to find them would import ``torch._dynamo`` in a worker).
    """

    capture: PortableCapture
    bundle: ModelBundle
    state_keys: list[str]
    param_names: list[str]
    source: TensorSource
    kept: dict[str, torch.Tensor]
    unit_batch: int
    codecs: list[BoundaryCodec] | None = None

    def with_codecs(self, captured: CapturedModel, part: Partition) -> ShippedModel:
        """This model with the wires of ``part``'s cuts, found on the launcher's weightless ``captured``."""
        import dataclasses

        from ..models.materialize import on_device_of
        from ..stages.partition import boundary_codecs

        inputs = on_device_of(captured.gm, tuple(self.bundle.example_inputs))
        return dataclasses.replace(self, codecs=boundary_codecs(captured.gm, part, inputs))


def _unshippable(weightless: WeightlessModel | None, model: torch.nn.Module, captured: CapturedModel) -> str | None:
    """Why a worker could not take every tensor's value without the model's code, or ``None``."""
    if weightless is None or weightless.materialized:
        return "the model is built whole"
    if weightless.source is None:
        return "its initial values come from its init methods"
    held = set(weightless.source.names())
    params = {id(p) for p in model.parameters()}
    gm_tensors = {n: id(t) for n, t in [*captured.gm.named_parameters(remove_duplicate=False),
                                         *captured.gm.named_buffers(remove_duplicate=False)]}
    names_of: dict[int, list[str]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if gm_tensors.get(name) != id(t):
            return f"the captured graph does not hold {name!r} under the model's name"
        names_of.setdefault(id(t), []).append(name)
    for tid, names in names_of.items():
        if not any(n in held for n in names) and (tid in params or tid not in weightless.kept):
            return f"the files do not hold {names[0]!r}"
    return None


def ship_model(bundle: ModelBundle, captured: CapturedModel, weightless: WeightlessModel | None,
               unit_batch: int) -> ShippedModel | None:
    """The launcher's weightless capture as workers take it (module docstring), or ``None``
    when they must build and capture the model themselves (said at debug level)."""
    import dataclasses
    import pickle

    from ..graph.portable import NotPortable, portable

    model = bundle.model
    reason = _unshippable(weightless, model, captured)
    if reason is None:
        assert weightless is not None and weightless.source is not None
        kept = {n: weightless.kept[id(t)] for n, t in model.named_buffers(remove_duplicate=False)
                if id(t) in weightless.kept}
        stripped = dataclasses.replace(bundle, model=torch.nn.Module())
        try:
            pickle.dumps(stripped)  # portable() checks the capture's own pickling
            return ShippedModel(portable(captured), stripped, list(model.state_dict().keys()),
                                [n for n, _ in model.named_parameters()], weightless.source, kept, unit_batch)
        except NotPortable as exc:
            reason = str(exc)
        except Exception as exc:  # noqa: BLE001 - a bundle part that does not pickle (a user's closure)
            reason = f"the bundle does not pickle ({type(exc).__name__}: {str(exc)[:120]})"
    log.debug("workers capture the model themselves: %s", reason)
    return None


@dataclass(frozen=True)
class StagedModel:
    """A run's model, its capture, and the capture cut into the plan's stages.

    Attributes:
        bundle: the :class:`~pipetrain.models.ModelBundle` (unit-sized example batch); its
            model holds storage only for the tensors asked for (the rest on ``meta``), or is a
            placeholder when the capture was shipped (``holder`` holds the tensors then).
        captured: ``bundle.model`` captured (:func:`capture_model`), sharing its tensors.
        partition: the captured graph's nodes assigned to the plan's stages
            (:func:`pipetrain.stages.partition.partition_graph`).
        codecs: every cut's wires (:func:`pipetrain.stages.partition.boundary_codecs`).
        holder: the module holding every tensor under the model's names.
        state_keys: the model's ``state_dict`` keys, in order.
        param_names: the model's ``named_parameters()`` names, in order.
    """

    bundle: ModelBundle
    captured: CapturedModel
    partition: Partition
    codecs: list[BoundaryCodec]
    holder: torch.nn.Module
    state_keys: list[str]
    param_names: list[str]

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """The model's parameters by name, in the model's order (a tie once)."""
        return {n: self.holder.get_parameter(n) for n in self.param_names}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's ``state_dict`` (the tensors as held: ``meta`` where not materialised)."""
        out = {}
        for k in self.state_keys:
            owner, _, leaf = k.rpartition(".")
            out[k] = getattr(self.holder.get_submodule(owner) if owner else self.holder, leaf)
        return out


def _attribute_tensors(gm: torch.fx.GraphModule, target: str) -> list[str]:
    """The tensor names a ``get_attr`` target stands for (a tensor, or a submodule's tensors)."""
    owner, _, leaf = target.rpartition(".")
    value = getattr(gm.get_submodule(owner) if owner else gm, leaf, None)
    if isinstance(value, torch.nn.Module):
        return [f"{target}.{n}" for n, _ in [*value.named_parameters(remove_duplicate=False),
                                            *value.named_buffers(remove_duplicate=False)]]
    return [target] if isinstance(value, torch.Tensor) else []


def stage_tensor_names(gm: torch.fx.GraphModule, part: Partition, stages: Collection[int]) -> set[str]:
    """The qualified names of the parameters and buffers that stages ``stages`` hold: those of
    the modules their nodes call and the attributes they read (what
    :func:`~pipetrain.stages.partition.build_stage_modules` puts in them)."""
    names: set[str] = set()
    for n in gm.graph.nodes:
        called = n.op == "call_module" and part.stage_of.get(n.name) in stages
        read = n.op == "get_attr" and any(k in stages for k in part.attr_stages.get(n.name, ()))
        if called or read:
            names.update(_attribute_tensors(gm, str(n.target)))
    return names


def unread_tensor_names(gm: torch.fx.GraphModule, part: Partition, state_keys: Collection[str]) -> set[str]:
    """The model's ``state_dict`` entries (``state_keys``) no stage reads (rank 0 saves them)."""
    read = stage_tensor_names(gm, part, range(part.num_stages))
    return {k for k in state_keys if k not in read}


def _from_shipped(run: ResolvedRun, shipped: ShippedModel, stages: Collection[int] | None,
                  unread: bool) -> StagedModel:
    """:func:`build_stages` on the launcher's capture: the graph rebuilt, the tensors of
    ``stages`` read from the files (or the kept values), nothing of the model's code run."""
    from ..errors import RuntimeConfigError
    from ..models.materialize import hold_values
    from ..stages.partition import partition_graph

    captured, root = shipped.capture.rebuild()  # root: every tensor under the model's names
    gm = captured.gm
    part = partition_graph(gm, run.stage_nodes)
    if shipped.codecs is None:
        raise RuntimeConfigError("the launcher shipped a capture without its plan's wires (ShippedModel.with_codecs)")
    codecs = shipped.codecs
    retarget_meta(gm)
    names: set[str] | None = None
    if stages is not None:
        names = stage_tensor_names(gm, part, stages)
        if unread:
            names |= unread_tensor_names(gm, part, shipped.state_keys)

    def value(aliases: list[str]) -> torch.Tensor | None:
        for n in aliases:
            t = shipped.source.read(n)
            if t is not None:
                return t
        return next((shipped.kept[n] for n in aliases if n in shipped.kept), None)

    hold_values(root, names, value, holders=[gm])
    shipped.source.close()  # the files' mapped pages are not this worker's memory once copied
    return StagedModel(shipped.bundle, captured, part, codecs, root, shipped.state_keys, shipped.param_names)


def build_stages(run: ResolvedRun, stages: Collection[int] | None = None, *, unread: bool = False,
                 shipped: bool = True) -> StagedModel:
    """A multi-worker run's model, captured, cut into its stages, with storage and initial
    values for the tensors of ``stages`` only (``None``: every tensor; ``unread``: also
    those no stage reads, which rank 0 saves). The wires of every cut are described first,
    on the weightless model. ``shipped``: take the launcher's capture when the run carries
    one (``run.model``, :func:`ship_model`) instead of building and capturing the model."""
    from ..models.materialize import on_device_of
    from ..stages.partition import boundary_codecs, partition_graph

    if shipped and run.model is not None:
        return _from_shipped(run, run.model, stages, unread)
    bundle, weightless = _seeded(run.config, run.unit_batch, warn=False)
    captured = capture_model(bundle, weightless)
    if weightless is not None and weightless.materialized:
        weightless = None  # captured whole: every tensor holds its value
    part = partition_graph(captured.gm, run.stage_nodes)
    codecs = boundary_codecs(captured.gm, part, on_device_of(bundle.model, bundle.example_inputs))
    if weightless is not None:
        retarget_meta(captured.gm)
        names: set[str] | None = None
        if stages is not None:
            names = stage_tensor_names(captured.gm, part, stages)
            if unread:
                names |= unread_tensor_names(captured.gm, part, bundle.model.state_dict(keep_vars=True))
        weightless.materialize(names, holders=[captured.gm])
    model = bundle.model
    return StagedModel(bundle, captured, part, codecs, model, list(model.state_dict().keys()),
                       [n for n, _ in model.named_parameters()])
