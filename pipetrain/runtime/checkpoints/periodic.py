"""Periodic, consistent checkpoints of a distributed run, and resuming from them on any layout.

The worker calls two functions (``--checkpoint-dir DIR``):

- :func:`restore_point` once, after building its stages: every rank loads, from the latest
  complete checkpoint in ``DIR`` (:func:`~pipetrain.checkpoint.latest_checkpoint`, chosen
  by rank 0 and broadcast so that all ranks agree), exactly the parameters, buffers and
  optimizer state of *its* stages, by the model's own names
  (:func:`~pipetrain.checkpoint.load_for_rank`). The plan, schedule and worker count of the
  saving run do not matter. It returns the step to continue from (0: a fresh run; with a
  cut inside a segment of this layout, also its stashed versions, :class:`Restored`); the
  worker skips the segments before it (:func:`pipetrain.job.segments.segments_done`).
- :func:`save_at_boundary` after every segment, on every rank: at a boundary the
  pipeline is **drained to a clean point first** (every unit of the segment has finished its
  backward and every stage its optimizer steps; no older weight version is in flight), so a
  checkpoint holds the newest weights only, and resuming from it equals the uninterrupted run
  *with the same segment boundaries*: for synchronous schedules (a flush every step) the same
  as any uninterrupted run; for asynchronous ones (pipedream, 2bw) the same as an
  uninterrupted run that drains at the same steps. It saves when the step is a multiple of
  ``--checkpoint-every`` or the run's last step.

What a checkpoint holds per rank (:class:`~pipetrain.checkpoint.RankState`): the newest
weights and buffers of the rank's stages (only the first replica of a stage writes them),
their optimizer state and step counts, rank 0's parameters that no stage reads, and the
rank's extras (the torch RNG state, the step). The data position and the learning-rate
schedule follow from the step (minibatch ``t`` uses seed ``seed + t``; the schedule's
position is the stage's optimizer steps, restored with the state). RNG states are restored
only when the layout is unchanged (same world size and stage node lists): under another
layout a rank's random stream is not the same stream.

Learning-rate position under another layout: each stage continues from the largest step
count among its parameters' old stages (synchronous schedules: all equal).

Asynchronous schedules (pipedream, 2bw) are not cut at checkpoint points, since a drain would
make the run with checkpoints another algorithm than the run without. :class:`CutCheckpoints`,
an engine hook, writes the checkpoint of step ``K`` inside a segment at a consistent cut
(:mod:`pipetrain.schedule.resume`): each stage at its own update of minibatch ``K``, with the
weight versions that the later units' actions name (the in-flight units' stashed versions,
copied when they are made) and its optimizer state after that update; the buffers as they
were before the stage's first forward of a later unit. Every rank joins the write at its
pause point (``pause_points``) and the pipeline goes on. A run of the
same layout whose own checkpoint points include ``K`` (an elastic restart, ``--max-restarts``
or torchrun's, or the command launched again; ``job.segments.resumes_inside``) resumes such
a checkpoint exactly: each stage holds those versions again (``WeightVersions.restore``) and
the worker runs the segment's ``suffix``, whose in-flight units run their forwards again
under the versions their actions name; the continued run is the uninterrupted run without
checkpoints. Another layout, schedule or ``--checkpoint-every`` resumes it as if drained at
``K`` (the launcher cuts the segment there, ``cut_at``): the newest weights and optimizer
state only. The manifest says ``"drained": false``.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from ...checkpoint import RankState, check_model, latest_checkpoint, load_for_rank, read_manifest, save_checkpoint_dir
from ...job.parse import parse_debug_fail
from ...job.resolved import ResolvedRun
from ...job.segments import check_optimizer, checkpoint_due, same_layout
from ...schedule.action import Action, Schedule
from ...schedule.resume import needed_versions, pause_points, stage_updates
from ..engine.hooks import EngineHooks, EngineView
from ..engine.stage_runtime import StageRuntime
from ..process.faults import first_attempt, kill_self

__all__ = ["RankView", "CutCheckpoints", "Restored", "every_name", "lookup_any_name", "save_at_boundary", "on_boundary",
           "restore_point", "manifest_info", "rank_state"]

log = logging.getLogger("pipetrain.checkpoint")
V = TypeVar("V")


@dataclass
class RankView:
    """What one worker holds, as checkpoints see it.

    Attributes:
        run: the resolved run (:class:`~pipetrain.job.resolved.ResolvedRun`).
        rank, world: this process's rank and the world size.
        stages: this rank's stages, ``{stage index: StageRuntime}`` (``versions``,
            ``optimizer``, ``stage.module``, ``stage.param_names``).
        extras: rank 0's parameters that no stage reads (saved with the model), else ``{}``.
        device: where the stages live.
    """

    run: ResolvedRun
    rank: int
    world: int
    stages: Mapping[int, Any]
    extras: Mapping[str, Tensor] = field(default_factory=dict)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def cfg(self) -> Any:
        return self.run.config

    def first_replica(self, k: int) -> bool:
        """Whether this rank is the first replica of stage ``k`` (the one that writes it)."""
        return int(self.run.schedule.stage_ranks[k][0]) == self.rank


# --------------------------------------------------------------------------- tied names


def every_name(stage: Any, by_name: Mapping[str, V]) -> dict[str, V]:
    """``by_name`` (values keyed by the stage's own parameter names) also keyed by every other
    model name of a tied tensor (``StageModule.aliases``: a stage holding ``lm_head.weight``
    adds ``transformer.wte.weight``), as :func:`pipetrain.stages.tied.alias_state` does for
    tensors. Checkpoints key weights, optimizer state and step counts this way, so a layout
    that holds the tensor under another name (another cut, one stage, one process) finds
    its state; the copies of a tied tensor are equal (synchronous schedules), so whichever
    copy a key comes from is the same value."""
    out = dict(by_name)
    for name, others in (getattr(stage, "aliases", None) or {}).items():
        if name in by_name:
            for other in others:
                out.setdefault(other, by_name[name])
    return out


def lookup_any_name(stage: Any, name: str, by_name: Mapping[str, V]) -> V | None:
    """``by_name[name]``, else the value under another model name of the same tied tensor
    (a checkpoint keyed by one of its names only, e.g. by one process under the first name)."""
    if name in by_name:
        return by_name[name]
    for other in (getattr(stage, "aliases", None) or {}).get(name, ()):
        if other in by_name:
            return by_name[other]
    return None


# --------------------------------------------------------------------------- saving


def manifest_info(run: ResolvedRun, step: int) -> dict[str, Any]:
    """The run description stored in the manifest (JSON): what produced the checkpoint."""
    cfg = run.config
    plan = run.plan
    return {
        "model": cfg.model.name, "model_options": dict(cfg.model.options),
        "optimizer": cfg.to_dict()["optimizer"], "schedule": cfg.parallel.schedule,
        "schedule_options": dict(run.schedule_options),
        "plan": {"config": plan.config, "stages": [list(s.nodes) for s in plan.stages]} if plan is not None else None,
        "world_size": run.world_size, "batch_size": run.batch_size, "microbatches": run.microbatches,
        "seed": cfg.training.seed, "lr_schedule": cfg.to_dict()["training"]["lr_schedule"],
        "step": step, "data_offset": step, "total_steps": run.total_steps, "drained": True,
    }


def rank_state(view: RankView, step: int) -> RankState:
    """This rank's :class:`RankState` at a drained boundary (no stashed versions)."""
    model: dict[str, Tensor] = {}
    optimizer: dict[str, dict[str, Any]] = {}
    stage_steps: dict[str, int] = {}
    for k, st in view.stages.items():
        if not view.first_replica(k):
            continue  # replicas hold identical values: the first one writes them
        # every model name of a tied tensor (every_name): another layout may hold it by another name
        model.update(every_name(st.stage, {n: t.detach() for n, t in st.versions.latest.items()}))
        model.update({n: b.detach() for n, b in st.stage.module.named_buffers()})
        sd = st.optimizer.state_dict()
        optimizer.update(every_name(st.stage, sd["state"]))
        stage_steps.update(every_name(st.stage, {n: int(sd["steps"]) for n in st.stage.param_names}))
    for n, t in view.extras.items():
        model.setdefault(n, t.detach())
    extras: dict[str, Any] = {"torch_rng": torch.get_rng_state(), "step": step}
    if view.device.type == "cuda":
        extras["cuda_rng"] = torch.cuda.get_rng_state(view.device)
    return RankState(model=model, stashed={}, optimizer=optimizer, stage_steps=stage_steps, extras=extras)


#: (checkpoint dir, step) of the last checkpoint this process wrote: a boundary reported twice
#: (by the worker's loop and by a boundary hook) is saved once.
_last_saved: list[tuple[str, int]] = []


def save_at_boundary(view: RankView, step: int, due: bool | None = None) -> Path | None:
    """At a drained segment boundary ``step`` (minibatches done): write a checkpoint if due.

    A collective over the world (every rank calls it at every boundary, the same way).
    ``due``: whether this boundary checkpoints (the segment's ``checkpoint`` flag, or the
    run's end); ``None``: :func:`checkpoint_due`. Returns the checkpoint's path, or ``None``.
    """
    cfg = view.cfg
    ck = cfg.checkpoint
    if ck.checkpoint_dir is None:
        return None
    if due is None:
        due = checkpoint_due(ck.checkpoint_every, step, view.run.total_steps)
    if not due or (str(ck.checkpoint_dir), step) in _last_saved:
        return None
    return _save(view, step, rank_state(view, step), manifest_info(view.run, step))


def _save(view: RankView, step: int, state: RankState, info: dict[str, Any]) -> Path:
    """Write the checkpoint of ``step`` (a collective over the world)."""
    ck = view.cfg.checkpoint
    die = _kill_in_save(view.cfg, view.rank, step)
    path = save_checkpoint_dir(ck.checkpoint_dir, step, rank_state=state, manifest_info=info, keep=ck.keep,
                               before_manifest=die)
    _last_saved[:] = [(str(ck.checkpoint_dir), step)]
    if view.rank == 0:
        log.info("checkpoint of step %d written to %s", step, path)
    return path


def on_boundary(ctx: Any) -> None:
    """The boundary hook (:class:`pipetrain.runtime.worker.pipeline_eval.BoundaryContext`): every rank,
    after every segment, with the pipeline drained. Saves when the segment is a checkpoint
    point (its ``checkpoint`` flag, else :func:`checkpoint_due`) or the run ends here."""
    run = ctx.run
    seg = run.segments[ctx.segment]
    flag = getattr(seg, "checkpoint", None)
    due = checkpoint_due(run.config.checkpoint.checkpoint_every, ctx.step, run.total_steps) if flag is None else flag
    device = getattr(getattr(ctx, "comm", None), "device", torch.device("cpu"))
    view = RankView(run, ctx.rank, run.world_size, ctx.stages, dict(ctx.extras or {}), device)
    save_at_boundary(view, ctx.step, due=bool(due or ctx.final))


def _kill_in_save(cfg: Any, rank: int, step: int) -> Callable[[], None] | None:
    """``--debug-fail RANK:STEP:kill-save``: RANK dies inside the write of the checkpoint at
    ``step >= STEP`` (first attempt only). Rank 0 dies after every rank's tensor files and
    DCP's metadata are on disk but before the manifest (the checkpoint stays a ``.tmp``
    directory): the returned hook, which the store calls there; another rank dies here, as
    the write begins (rank 0 has created the ``.tmp``). ``None``: no failure to inject."""
    spec = cfg.debug.debug_fail
    if spec is None:
        return None
    r, s, mode = parse_debug_fail(spec)
    if mode != "kill-save" or r != rank or step < s or not first_attempt():
        return None
    if rank != 0:
        kill_self()
    return kill_self


# --------------------------------------------------------------------------- inside a segment


@dataclass
class _Cut:
    """One checkpoint at step ``step`` inside the segment: this rank's pause point and state."""

    step: int
    done: int                                   # minibatches of the segment done at the cut
    point: int                                  # actions of this rank's list before the write
    updates: dict[int, int]                     # stage -> its version at the cut
    needed: dict[int, set[int]]                 # stage -> versions the later actions name
    versions: dict[int, dict[int, dict[str, Tensor]]] = field(default_factory=dict)  # stage -> v -> copy
    optimizer: dict[int, dict[str, Any]] = field(default_factory=dict)               # stage -> state_dict
    buffers: dict[int, dict[str, Tensor]] = field(default_factory=dict)              # stage -> copy
    written: bool = False


def _copy(value: Any) -> Any:
    """A deep copy of tensors in dicts and lists (an optimizer's state_dict)."""
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v) for v in value)
    return value


class CutCheckpoints(EngineHooks):
    """Writes the checkpoints inside a segment of an asynchronous schedule at a consistent
    cut (module docstring). :meth:`arm` before each segment; the write is a collective that
    every rank joins at its own pause point."""

    def __init__(self, view: Callable[[], RankView]) -> None:
        self.view = view
        self._cuts: list[_Cut] = []

    def arm(self, schedule: Schedule, rank: int, offset: int, steps: list[int]) -> None:
        """Expect the checkpoints of ``steps`` (from the run's first minibatch) in the segment
        ``schedule`` starting at step ``offset``; ``schedule`` is what this rank runs."""
        self._cuts = []
        for t in steps:
            done = t - offset
            stages = schedule.stages_of_rank(rank)
            self._cuts.append(_Cut(t, done, pause_points(schedule, done)[rank],
                                   {k: stage_updates(schedule, k, done) for k in stages},
                                   needed_versions(schedule, done, rank)))

    def _keep(self, st: StageRuntime, v: int) -> None:
        for cut in self._cuts:
            if v in cut.needed.get(st.index, ()):
                copy = {n: t.detach().clone() for n, t in st.versions.get(v).items()}
                cut.versions.setdefault(st.index, {})[v] = copy
            if cut.updates.get(st.index) == v:
                cut.optimizer[st.index] = _copy(st.optimizer.state_dict())

    def before_run(self, ex: EngineView) -> None:
        for st in ex.stages.values():
            self._keep(st, st.versions.newest)

    def after_update(self, ex: EngineView, st: StageRuntime, a: Action) -> None:
        self._keep(st, st.versions.newest)

    def forward_scope(self, ex: EngineView, a: Action) -> Any:
        st = ex.stages[a.stage]
        for cut in self._cuts:  # the buffers before the first forward after the cut
            if not cut.written and a.mb // max(1, ex.data.m) >= cut.done and a.stage not in cut.buffers:
                cut.buffers[a.stage] = {n: b.detach().clone() for n, b in st.stage.module.named_buffers()}
        return super().forward_scope(ex, a)

    def after_action(self, ex: EngineView, a: Action) -> None:
        for cut in self._cuts:
            if ex.position + 1 == cut.point:
                self._write(ex, cut)

    def _write(self, ex: EngineView, cut: _Cut) -> None:
        view = self.view()
        model: dict[str, Tensor] = {}
        stashed: dict[int, dict[str, Tensor]] = {}
        optimizer: dict[str, dict[str, Any]] = {}
        stage_steps: dict[str, int] = {}
        for k, st in ex.stages.items():
            if not view.first_replica(k):
                continue
            u = cut.updates[k]
            held = cut.versions[k]
            model.update(every_name(st.stage, held[u]))
            model.update(cut.buffers.get(k) or {n: b.detach() for n, b in st.stage.module.named_buffers()})
            for v, tensors in held.items():
                if v != u:
                    stashed.setdefault(v, {}).update(tensors)
            sd = cut.optimizer[k]
            optimizer.update(every_name(st.stage, sd["state"]))
            stage_steps.update(every_name(st.stage, {n: int(sd["steps"]) for n in st.stage.param_names}))
        for n, t in view.extras.items():
            model.setdefault(n, t.detach())
        extras: dict[str, Any] = {"step": cut.step}
        state = RankState(model=model, stashed=stashed, optimizer=optimizer, stage_steps=stage_steps, extras=extras)
        info = manifest_info(view.run, cut.step)
        info.update(drained=False, segment_done=cut.done)
        _save(view, cut.step, state, info)
        if dist.is_initialized():
            dist.barrier()  # the manifest is on disk before any rank goes on
        cut.versions, cut.optimizer, cut.buffers = {}, {}, {}  # written: the copies go
        cut.needed, cut.updates, cut.written = {}, {}, True


# --------------------------------------------------------------------------- resuming


def _pick(root: str | Path, world: int) -> str | None:
    """Rank 0's choice of checkpoint, broadcast: every rank resumes from the same one."""
    box: list[Any] = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        path = latest_checkpoint(root)
        box[0] = str(path) if path is not None else None
    if dist.is_initialized() and world > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


@dataclass
class Restored:
    """What :func:`restore_point` loaded: the step, and for a checkpoint cut inside a segment
    (``drained`` false) of this same layout, the older weight versions it holds
    (``{version: {name: tensor}}``, the segment's own indices; :class:`CutCheckpoints`)."""

    step: int = 0
    drained: bool = True
    stashed: dict[int, dict[str, Tensor]] = field(default_factory=dict)


@torch.no_grad()
def restore_point(view: RankView) -> Restored:
    """Load this rank's part of the latest complete checkpoint in ``--checkpoint-dir``.

    A collective (rank 0 picks the checkpoint). Returns its step (0: nothing to resume) and,
    for a checkpoint inside a segment of this layout, its stashed versions. Raises
    :class:`CheckpointError` (one line) for a checkpoint of another model or optimizer, or a
    damaged one.
    """
    cfg = view.cfg
    root = cfg.checkpoint.checkpoint_dir
    if root is None:
        return Restored()
    picked = _pick(root, view.world)
    if picked is None:
        return Restored()
    man = read_manifest(picked)
    check_model(man, cfg.model.name, dict(cfg.model.options))
    check_optimizer(man, cfg)
    wanted: dict[str, tuple[int, ...]] = {}
    source: dict[str, str] = {}  # own name -> the name it is stored under (a tied tensor: maybe another of its names)
    for st in view.stages.values():
        for n, t in st.versions.latest.items():
            stored = n if n in man.model else next((o for o in st.stage.aliases.get(n, ()) if o in man.model), n)
            source[n] = stored
            wanted[stored] = tuple(t.shape)
        wanted.update({n: tuple(b.shape) for n, b in st.stage.module.named_buffers()})
    same = same_layout(man.info, man.world_size, view.run)
    cut = man.info.get("drained") is False and same
    part = load_for_rank(picked, wanted, rank=view.rank if same else None, device=view.device, stash=cut)
    for st in view.stages.values():
        names = list(st.stage.param_names)
        st.versions.load({n: part.model[source.get(n, n)] for n in names})
        for n, b in st.stage.module.named_buffers():
            b.copy_(part.model[n].to(b.device))
        steps = max([lookup_any_name(st.stage, n, part.stage_steps) or 0 for n in names] + [0])
        state = {n: lookup_any_name(st.stage, n, part.optimizer) for n in names}  # a tied tensor's: under any name
        st.optimizer.load_state_dict({"steps": steps, "state": {n: v for n, v in state.items() if v is not None}},
                                     view.device)
    rng = part.extras.get("torch_rng")
    if same and isinstance(rng, Tensor):
        torch.set_rng_state(rng.to("cpu", torch.uint8))
        cuda_rng = part.extras.get("cuda_rng")
        if isinstance(cuda_rng, Tensor) and view.device.type == "cuda":
            torch.cuda.set_rng_state(cuda_rng.to("cpu", torch.uint8), view.device)
    if view.rank == 0:
        saved_plan = (man.info.get("plan") or {}).get("config")
        how = "the same layout" if same else (f"another layout (saved by {man.world_size} workers, "
                                              f"{man.info.get('schedule')}, plan {saved_plan})")
        log.info("resuming from %s (step %d, %s)", picked, man.step, how)
    return Restored(int(man.step), not cut, {v: dict(ts) for v, ts in part.stashed.items()} if cut else {})
