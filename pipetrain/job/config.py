"""The typed configuration of one training run, in sections, with validation.

:class:`TrainConfig` is a set of frozen sections, the shape of torchtitan's ``JobConfig``::

    TrainConfig
      model        ModelSection        which model, with which options
      data         DataSection         --data, --data-dir, --seq-len, --loader-workers
      parallel     ParallelSection     workers, plan / --config / --cut, schedule and its options
      training     TrainingSection     steps (or epochs), batch, seed, learning-rate schedule, clipping
      evaluation   EvaluationSection   --eval-every, --eval-batch-size, --target-accuracy / --target-loss
      optimizer    OptimizerConfig     torch.optim's hyper-parameters
      checkpoint   CheckpointSection   --save / --resume, --checkpoint-dir/-every, --keep, --max-restarts, --restart
      output       OutputSection       trace, progress lines, --json, --log-dir
      performance  PerformanceSection  threads, timeouts, allocator and kernel knobs
      debug        DebugSection        --debug (tracebacks); test hooks, not shown in --help

Every field is declared with :func:`~pipetrain.job.settings.setting`: its default, its
documentation, and how it appears on the command line (:class:`~pipetrain.job.settings.Flag`:
the flag, its parser from :mod:`pipetrain.job.parse`, choices, hidden or not).
``pipetrain train``'s arguments are derived from these declarations
(:func:`pipetrain.cli.train_cmd.register`), so adding a field to a section adds its flag.
Each field also has a *flat key* (its name, unless declared otherwise: ``model``,
``model_options``, ``optimizer``), unique over all sections, used by
``TrainConfig.of(steps=3, lr=0.1, schedule='flush')`` and ``cfg.replace(...)``.

Each section checks its own fields in ``__post_init__``; :class:`TrainConfig` checks the
combinations (``--plan`` with ``--config``, a schedule option given to a schedule without it,
...) by asking the schedule's :class:`~pipetrain.schedule.ScheduleSpec`. Checks that need
the model or the number of workers happen when the run is resolved
(:func:`pipetrain.run.resolve_run`). Every failure is a one-line
:class:`~pipetrain.errors.RuntimeConfigError` with the rule, the values and the fix.

Learning-rate schedules are given as ``NAME[:key=value,...]``:

    constant                          lr at every step
    step:size=30,gamma=0.1            lr * gamma ** (k // size)
    cosine:warmup=5,total=100,min=0   linear warm-up over ``warmup`` steps, then a cosine from
                                      lr to ``min`` at step ``total`` (default: the stage's
                                      last step in the run)

``warmup=W`` also works with ``constant`` and ``step``. ``k`` counts the optimizer steps of
the stage (a PipeDream stage with ``r`` replicas steps once per ``r`` minibatches).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import PipetrainError, RuntimeConfigError
from ..schedule.registry import SCHEDULE_NAMES
from .parse import parse_betas, parse_config, parse_cut, parse_debug_fail, parse_model_options
from .settings import setting, settings

OPTIMIZERS = ("sgd", "adam", "adamw")
#: The schedule a run uses unless told: the registry's first, PipeDream's 1F1B with weight
#: stashing (tests/job/test_job_config.py checks it).
DEFAULT_SCHEDULE: str = SCHEDULE_NAMES[0]
#: ``--schedule auto``: the planner chooses (pipetrain.auto.choose)
AUTO = "auto"
LR_SCHEDULES = ("constant", "step", "cosine")
DEVICES = ("cpu", "cuda")
#: ``--precision`` values (pipetrain.runtime.engine.precision; fp16 is refused)
PRECISIONS = ("fp32", "bf16", "fp16")
#: Steps a run trains when neither ``--steps`` nor ``--epochs`` (nor a target on real data) says.
DEFAULT_STEPS = 10
#: The epochs a run that trains until its target (a target on real data, neither ``--steps``
#: nor ``--epochs``) takes at most, unless ``--max-epochs`` says (pipetrain.run.resolve).
DEFAULT_MAX_EPOCHS = 50

__all__ = [
    "SECTIONS", "TrainConfig", "ModelSection", "ParallelSection", "TrainingSection", "OptimizerConfig",
    "CheckpointSection", "DataSection", "EvaluationSection", "OutputSection", "PerformanceSection", "DebugSection",
    "LRSchedule", "OPTIMIZERS", "LR_SCHEDULES", "DEVICES", "PRECISIONS", "AUTO", "DEFAULT_SCHEDULE", "DEFAULT_STEPS",
    "DEFAULT_MAX_EPOCHS",
]


@dataclass(frozen=True)
class LRSchedule:
    """A learning-rate multiplier per optimizer step of a stage (see the module docstring)."""

    name: str = "constant"
    step_size: int = 30         # step: steps between decays
    gamma: float = 0.1          # step: decay factor
    warmup: int = 0             # linear warm-up steps (lr * (k+1)/warmup), any schedule
    total: int | None = None    # cosine: step at which lr reaches min_lr (None: the run's last)
    min_lr: float = 0.0         # cosine: final learning rate

    @staticmethod
    def parse(text: str) -> LRSchedule:
        """``"cosine:warmup=5,total=100"`` -> LRSchedule; a bad spec is a RuntimeConfigError."""
        name, _, rest = text.partition(":")
        name = name.strip().lower()
        if name not in LR_SCHEDULES:
            raise RuntimeConfigError(
                f"unknown learning-rate schedule {name!r}; valid: {', '.join(LR_SCHEDULES)} "
                f"(e.g. --lr-schedule cosine:warmup=5,total=100)")
        keys = {"size": ("step_size", int), "gamma": ("gamma", float), "warmup": ("warmup", int),
                "total": ("total", int), "min": ("min_lr", float)}
        kw: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in rest.split(","))):
            k, eq, v = part.partition("=")
            if not eq or k not in keys:
                raise RuntimeConfigError(
                    f"bad learning-rate schedule option {part!r} in {text!r}; options are "
                    f"size=, gamma= (step), warmup= (any), total=, min= (cosine)")
            attr, typ = keys[k]
            try:
                kw[attr] = typ(v)
            except ValueError:
                raise RuntimeConfigError(f"learning-rate schedule option {k} must be a {typ.__name__}, "
                                         f"got {v!r}") from None
        sched = LRSchedule(name=name, **kw)
        if sched.step_size < 1 or sched.warmup < 0 or (sched.total is not None and sched.total < 1):
            raise RuntimeConfigError(
                f"learning-rate schedule {text!r}: size and total must be >= 1 and warmup >= 0")
        return sched

    def lr(self, base_lr: float, k: int, total_steps: int) -> float:
        """Learning rate of optimizer step ``k`` (0-based); ``total_steps`` is the default horizon."""
        if self.warmup and k < self.warmup:
            return base_lr * (k + 1) / self.warmup
        if self.name == "constant":
            return base_lr
        if self.name == "step":
            return base_lr * self.gamma ** (k // self.step_size)
        total = self.total if self.total is not None else total_steps
        span = max(1, total - self.warmup)
        progress = min(1.0, max(0.0, (k - self.warmup) / span))
        return self.min_lr + (base_lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))



@dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer hyper-parameters, with torch.optim's meaning and defaults."""

    name: str = setting("sgd", "optimizer", key="optimizer", choices=OPTIMIZERS)
    lr: float = setting(0.01, "base learning rate", type=float)
    momentum: float = setting(0.0, "SGD momentum", type=float)
    dampening: float = setting(0.0, "SGD dampening", flag=None)
    nesterov: bool = setting(False, "SGD Nesterov momentum", kind="true")
    weight_decay: float = setting(0.0, "weight decay: L2 (sgd, adam) or decoupled (adamw)", type=float)
    betas: tuple[float, float] = setting((0.9, 0.999), "Adam betas (default: 0.9,0.999)", convert=parse_betas,
                                         metavar="B1,B2")
    eps: float = setting(1e-8, "Adam epsilon", type=float)

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise RuntimeConfigError(f"unknown optimizer {self.name!r}; valid: {', '.join(OPTIMIZERS)}")
        # Each value is checked against the range its update rule is defined on (torch.optim
        # raises on most of these only at the first step, as a traceback; a non-finite lr
        # would turn every weight into nan without any error).
        if not (math.isfinite(self.lr) and 0 < self.lr <= 1e6):
            raise RuntimeConfigError(
                f"learning rate must be a finite number in (0, 1e6], got {self.lr}; pass e.g. --lr 0.01")
        if not 0 <= self.momentum < 1:
            raise RuntimeConfigError(
                f"momentum must be in [0, 1), got {self.momentum}; pass e.g. --momentum 0.9 (or 0 for none)")
        if not 0 <= self.dampening <= 1:
            raise RuntimeConfigError(f"dampening must be in [0, 1], got {self.dampening}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise RuntimeConfigError(
                f"weight decay must be a finite number >= 0, got {self.weight_decay}; pass e.g. --weight-decay 1e-4 "
                f"(or 0 for none)")
        betas = tuple(self.betas) if isinstance(self.betas, (tuple, list)) else ()
        if len(betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
            raise RuntimeConfigError(
                f"Adam betas must be two numbers in [0, 1), got {self.betas}; pass e.g. --betas 0.9,0.999")
        if not (math.isfinite(self.eps) and self.eps > 0):
            raise RuntimeConfigError(f"Adam eps must be a finite number > 0, got {self.eps}; pass e.g. --eps 1e-8")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise RuntimeConfigError(
                f"nesterov momentum needs momentum > 0 and zero dampening (got momentum={self.momentum}); "
                f"pass --momentum 0.9 with --nesterov")


# --------------------------------------------------------------------------- converters


def parse_memory(value: Any) -> float:
    """``--memory``: bytes as a number (``2e9``) or with a unit (``2GB``, ``2GiB``), positive and finite."""
    from ..errors import PlanError
    from ..plan.topology import parse_quantity

    try:
        n = parse_quantity(value, "--memory") if not isinstance(value, bool) else math.nan
    except PlanError:
        n = math.nan
    if not 0 < n < math.inf:
        raise RuntimeConfigError(f"--memory takes positive bytes per worker, as a number or with a unit (2e9, 2GB, "
                                 f"2GiB), got {value!r}; fix the value")
    return float(n)


def _threads(value: int | None) -> int | None:
    """``--threads 0`` means torch's default (None)."""
    return None if value == 0 else value


def _lr_schedule(value: Any) -> LRSchedule:
    return value if isinstance(value, LRSchedule) else LRSchedule.parse(str(value))


def _microbatched() -> str:
    """The schedules whose unit is a microbatch, for messages: ``flush, gpipe or 2bw``."""
    from ..schedule import SCHEDULES

    names = [s.name for s in SCHEDULES.values() if s.unit == "microbatch"]
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else "".join(names)


# --------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class ModelSection:
    """Which model to train."""

    name: str = setting("mlp", "zoo model (mlp, alexnet, vgg16, resnet50, gnmt, gpt, hf-gpt2), "
                               "package.module:function, or hf:DIR (a Hugging Face model directory)", key="model")
    options: Mapping[str, Any] = setting(
        None, "model option, repeatable (e.g. --option depth=4 --option width=256)", factory=dict,
        key="model_options", flag="--option", kind="append", convert=parse_model_options, metavar="KEY=VALUE")
    init_from: str | None = setting(None, "initial weights by parameter name: a safetensors file or directory, or "
                                          "the file --save wrote (each worker reads only its stages' tensors)",
                                    metavar="PATH")

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise RuntimeConfigError(f"--model takes a zoo name or package.module:function, got {self.name!r}")
        object.__setattr__(self, "options", parse_model_options(self.options))


@dataclass(frozen=True)
class ParallelSection:
    """How the model is split over workers and which schedule runs it.

    ``plan``, ``config`` and ``cut`` choose the stages (at most one of ``plan`` / ``config``;
    ``cut`` with or without ``config``); none of them: the planner chooses from a quick
    profile (straight pipelines), or the schedule's own layout (``dp``, ``interleaved``).
    Fields declared with ``schedule_option=True`` are the schedule builder's options.
    """

    workers: int | None = setting(None, "worker processes (default: what --config/--plan needs, else 1; under "
                                        "torchrun: its world size)", type=int)
    plan: str | None = setting(None, "plan JSON written by `pipetrain plan --output`", exclusive="stages")
    calibration: str | None = setting(None, "without --plan/--config/--cut: plan on the link costs measured by "
                                            "`pipetrain calibrate --output FILE` (or 'measure': on loopback now)",
                                      metavar="FILE")
    config: str | None = setting(None, "replicas per stage, e.g. 2-1-1 (stages cut by balanced estimated compute)",
                                 exclusive="stages")
    cut: str | None = setting(None, "where stages 1, 2, ... begin: a node name or a module name of the captured "
                                    "model (e.g. blocks.4, or 16 for child 16 of an nn.Sequential); with --config "
                                    "for replicas, else one worker per stage", metavar="NAME[,NAME...]")
    schedule: str = setting(DEFAULT_SCHEDULE, f"the pipeline schedule, one of {', '.join(sorted(SCHEDULE_NAMES))}, "
                                              f"or {AUTO}: the planner chooses the schedule, microbatches and stages "
                                              f"(the default of `pipetrain train` on local workers without "
                                              f"--plan/--config/--cut, on runs of {DEFAULT_STEPS} steps or more)")
    #: ``--schedule auto`` (set by it; ``schedule`` then holds the default until the run is
    #: resolved, when pipetrain.auto.choose's choice replaces both)
    auto: bool = setting(False, "the planner chooses the schedule and microbatches (--schedule auto)", flag=None)
    #: ``auto`` chooses on measurements only for a run of at least this many steps; a shorter
    #: run trains the default schedule on a straight pipeline split by estimated compute,
    #: measuring nothing (``pipetrain train`` sets it when it leaves the schedule open; 0: always)
    auto_from_steps: int = setting(0, "the fewest steps for which auto measures before choosing", flag=None)
    microbatches: int | None = setting(None, "units per minibatch (default: the schedule's: 1 for pipedream, else "
                                             "the pipeline depth, at least the largest replica count)", type=int)
    vertical_sync: bool = setting(False, "pipedream: vertical sync of weight versions", kind="true",
                                  schedule_option=True)
    stashing: bool = setting(True, "pipedream without weight stashing: each backward uses its stage's newest "
                                   "weights, recomputing the forward under them (docs/schedules.md)",
                             flag="--no-stashing", kind="false", schedule_option=True)
    virtual_stages: int | None = setting(None, "interleaved: model chunks per rank (default 2)", type=int,
                                         schedule_option=True)
    device: str = setting("cpu", "cpu (gloo) or cuda (NCCL)", choices=DEVICES)
    memory: float | None = setting(None, "bytes each worker may use (e.g. 2e9 or 2GiB): the launcher refuses, before "
                                         "any worker starts, a plan whose predicted peak of a worker exceeds it",
                                   convert=parse_memory, metavar="BYTES")

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedule", str(self.schedule).lower())
        if self.schedule == AUTO:
            object.__setattr__(self, "schedule", DEFAULT_SCHEDULE)
            object.__setattr__(self, "auto", True)
        if self.schedule not in SCHEDULE_NAMES:
            raise RuntimeConfigError(
                f"unknown schedule {self.schedule!r}; valid schedules: {', '.join(sorted(SCHEDULE_NAMES))}")
        for name in ("workers", "microbatches", "virtual_stages"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        if self.device not in DEVICES:
            raise RuntimeConfigError(f"unknown device {self.device!r}; valid: {', '.join(DEVICES)}")
        if self.memory is not None:
            object.__setattr__(self, "memory", parse_memory(self.memory))
        if self.plan is not None and self.config is not None:
            raise RuntimeConfigError("give either --plan or --config, not both")
        if self.config is not None:
            parse_config(self.config)
        if self.cut is not None:
            parse_cut(self.cut)
            if self.plan is not None:
                raise RuntimeConfigError("--cut fixes the stages itself: give --cut or --plan, not both")
        if self.auto:
            self._check_auto()
            return
        spec = self.spec
        for f, fl in settings(type(self)):  # an option the schedule does not take
            if fl.schedule_option and getattr(self, f.name) != f.default and f.name not in spec.options:
                from ..schedule import SCHEDULES

                takers = [s.name for s in SCHEDULES.values() if f.name in s.options]
                raise RuntimeConfigError(
                    f"{fl.flag} applies to the {'/'.join(takers)} schedule only (got --schedule {self.schedule}); "
                    f"drop {fl.flag} or pass --schedule {takers[0]}")
        if spec.unit == "minibatch" and self.microbatches not in (None, 1):
            raise RuntimeConfigError(
                f"{self.schedule} moves whole minibatches, so --microbatches must be 1 (got {self.microbatches}); "
                f"use {_microbatched()} for microbatches")
        if self.cut is not None:
            cuts = parse_cut(self.cut)
            if spec.one_stage:
                raise RuntimeConfigError(
                    f"--cut splits a model into pipeline stages; the {self.schedule} schedule has one stage")
            if self.config is not None:
                stages = spec.model_stages(len(parse_config(self.config)), self.schedule_options)
                if stages != len(cuts) + 1:
                    raise RuntimeConfigError(
                        f"--cut {self.cut} makes {len(cuts) + 1} stages but --config {self.config} has {stages}; "
                        f"give one cut name fewer than the stages")

    def _check_auto(self) -> None:
        """``--schedule auto`` chooses the stages and tries every schedule at its defaults."""
        fixed = [flag for flag, v in (("--plan", self.plan), ("--config", self.config), ("--cut", self.cut))
                 if v is not None]
        if fixed:
            raise RuntimeConfigError(
                f"--schedule auto chooses the stages itself, but {' and '.join(fixed)} fixes them; drop "
                f"{' and '.join(fixed)} or name a schedule (one of {', '.join(sorted(SCHEDULE_NAMES))})")
        for f, fl in settings(type(self)):
            if fl.schedule_option and getattr(self, f.name) != f.default:
                raise RuntimeConfigError(
                    f"--schedule auto tries each schedule with its default options, but {fl.flag} was given; "
                    f"drop {fl.flag} or name the schedule it applies to")

    @property
    def spec(self) -> Any:
        """The schedule's :class:`~pipetrain.schedule.ScheduleSpec`."""
        from ..schedule import get_schedule

        return get_schedule(self.schedule)

    @property
    def schedule_options(self) -> dict[str, Any]:
        """The schedule builder's options, defaults filled in (``ScheduleSpec.check_options``)."""
        given = {f.name: getattr(self, f.name) for f, fl in settings(type(self))
                 if fl.schedule_option and getattr(self, f.name) != f.default}
        try:
            return dict(self.spec.check_options(given))
        except PipetrainError as e:
            raise RuntimeConfigError(str(e)) from None


#: The environment variable of the documentation test's fast mode (tests/docs/): when set (to
#: anything but ``0``), every run is cut to at most :data:`FAST_STEPS` steps and :data:`FAST_EPOCHS`
#: epochs, so each documented command runs as written, only shorter; profiles are cut to one
#: timed run a node (pipetrain.profile.profiler reads the same variable).
DOCS_FAST_ENV = "PIPETRAIN_DOCS_FAST"
#: Steps in the fast mode: a multiple of every replica count up to 4 (pipedream steps a stage
#: with r replicas once per r minibatches, so a run's steps are a multiple of r).
FAST_STEPS = 12
FAST_EPOCHS = 1


def docs_fast() -> bool:
    """Whether the documentation test's fast mode is on (:data:`DOCS_FAST_ENV`)."""
    import os

    return os.environ.get(DOCS_FAST_ENV, "0") not in ("", "0")


def _fast_length(section: Any) -> None:
    """In the fast mode, cut ``section``'s steps and epochs (any that are set) to their caps."""
    for name, cap in (("steps", FAST_STEPS), ("epochs", FAST_EPOCHS), ("max_epochs", FAST_EPOCHS)):
        value = getattr(section, name, None)
        if isinstance(value, int) and value > cap:
            object.__setattr__(section, name, cap)


@dataclass(frozen=True)
class TrainingSection:
    """What is trained: steps, batch, seed, learning-rate schedule, clipping.

    A *step* is one minibatch of ``batch_size`` samples and one optimizer step of the last
    stage. The run's length is ``steps``, else ``epochs`` of real data, else, with a target
    on real data, up to ``max_epochs`` epochs until the target (:data:`DEFAULT_MAX_EPOCHS`),
    else :data:`DEFAULT_STEPS` steps; :func:`pipetrain.run.resolve.resolve_length` decides.
    """

    steps: int | None = setting(None, f"minibatches to train, i.e. optimizer steps (timed; default: "
                                      f"{DEFAULT_STEPS}, or with --target-accuracy / --target-loss on real data "
                                      f"until the target, at most --max-epochs)", type=int)
    epochs: int | None = setting(None, "passes over the train split of real data: sets the steps to epochs * "
                                       "(train samples // batch size); not with --steps", type=int)
    max_epochs: int | None = setting(None, f"a run that trains until --target-accuracy / --target-loss (neither "
                                           f"--steps nor --epochs given) stops after this many epochs if the "
                                           f"target is not reached (default: {DEFAULT_MAX_EPOCHS})", type=int)
    warmup_steps: int = setting(0, "untimed minibatches before the timed ones (benchmarks)", type=int)
    batch_size: int | None = setting(None, "samples per minibatch (default: the model's)", type=int)
    seed: int = setting(0, "seed of model init and data (minibatch t uses seed + t)", type=int)
    lr_schedule: LRSchedule = setting(
        None, "constant | step:size=N,gamma=G | cosine:warmup=W,total=T,min=M (default: constant)",
        factory=lambda: LRSchedule(),
        convert=_lr_schedule)
    clip_grad_norm: float | None = setting(
        None, "clip gradients to this 2-norm (global for synchronous schedules, per stage for asynchronous ones)",
        type=float)
    precision: str = setting("fp32", "fp32, or bf16: bfloat16 compute (autocast) with float32 master weights, "
                                     "gradients and optimizer state, activations and gradients sent between stages "
                                     "in bfloat16 (fp16 is not built)", choices=PRECISIONS)
    skip_nonfinite: bool = setting(False, "skip a step whose loss or gradient is NaN/Inf (every stage drops it; "
                                          "synchronous schedules) instead of stopping the run", kind="true")

    def __post_init__(self) -> None:
        object.__setattr__(self, "lr_schedule", _lr_schedule(self.lr_schedule))
        if self.steps is not None:
            _positive_int("steps", self.steps)
        if self.max_epochs is not None:
            _positive_int("max_epochs", self.max_epochs)
        _positive_int("warmup_steps", self.warmup_steps, minimum=0)
        if self.epochs is not None:
            _positive_int("epochs", self.epochs)
        if self.batch_size is not None:
            _positive_int("batch_size", self.batch_size)
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise RuntimeConfigError(f"--clip-grad-norm must be > 0, got {self.clip_grad_norm}")
        if docs_fast():
            _fast_length(self)


@dataclass(frozen=True)
class DataSection:
    """What the run trains on (:func:`pipetrain.data.load_data`).

    ``data`` is ``synthetic`` by default (the model's own random batches, as every throughput
    run and benchmark uses), a built-in data set (``digits``, ``fashion-mnist``,
    ``shakespeare``), ``text:PATH``, a path, or ``package.module:function`` returning
    ``(train_dataset, eval_dataset)``. Real data is loaded once by the launcher (checks and
    model options) and again, deterministically from the seed, by every worker that needs it.
    """

    data: str = setting("synthetic", "synthetic (default: the model's random batches), digits, fashion-mnist, "
                                     "shakespeare, text:PATH, a path, or package.module:function returning "
                                     "(train_dataset, eval_dataset)", metavar="NAME|PATH|MODULE:FUNCTION")
    data_dir: str | None = setting(None, "where fashion-mnist's IDX files are (default: Debian's "
                                         "dataset-fashion-mnist directory)", metavar="DIR")
    seq_len: int | None = setting(None, "tokens per sample of text data (default 128)", type=int)
    loader_workers: int | None = setting(None, "background processes loading units per worker, kept for the whole "
                                               "run (default: 0, loading in the worker, unless a short timing of a "
                                               "few items finds them slow enough to repay 2)", type=int)

    def __post_init__(self) -> None:
        if not isinstance(self.data, str) or not self.data.strip():
            raise RuntimeConfigError(f"--data takes a data set name, a path or package.module:function, got "
                                     f"{self.data!r}; e.g. --data digits")
        if self.seq_len is not None:
            _positive_int("seq_len", self.seq_len)
        if self.loader_workers is not None:
            _positive_int("loader_workers", self.loader_workers, minimum=0)

    @property
    def synthetic(self) -> bool:
        """Whether the run draws the model's synthetic batches (no eval split)."""
        return self.data.strip() == "synthetic"


@dataclass(frozen=True)
class EvaluationSection:
    """Evaluation on the eval split through the pipeline, and the target that ends a run.

    Evaluation runs at segment boundaries (the pipeline drains there, see
    :class:`~pipetrain.job.resolved.Segment`): every ``eval_every`` steps, by default
    every ``round(steps_per_epoch / evals_per_epoch)`` steps of real data (once an epoch unless
    ``evals_per_epoch`` says; ``pipetrain compare`` asks for 10); synthetic data has no eval
    split and is never evaluated.
    """

    eval_every: int | None = setting(None, "evaluate every N steps (default: --evals-per-epoch times an epoch with "
                                           "real data; 0: never)", type=int)
    evals_per_epoch: int | None = setting(None, "with real data and no --eval-every: evaluate about N times an epoch, "
                                                "every round(train steps per epoch / N) steps (default: 1 for train, "
                                                "10 for compare)", type=int)
    eval_batch_size: int | None = setting(None, "eval samples per batch through the pipeline (default: the "
                                                "batch size; a multiple of the microbatch size)", type=int)
    target_accuracy: float | None = setting(None, "stop at the first evaluation with this accuracy (a fraction, "
                                                  "e.g. 0.9)", type=float)
    target_loss: float | None = setting(None, "stop at the first evaluation with at most this eval loss", type=float)

    def __post_init__(self) -> None:
        from ..metrics.target import validate_target_accuracy, validate_target_loss

        if self.eval_every is not None:
            _positive_int("eval_every", self.eval_every, minimum=0)
        if self.evals_per_epoch is not None:
            _positive_int("evals_per_epoch", self.evals_per_epoch)
            if self.eval_every is not None:
                raise RuntimeConfigError(
                    f"--eval-every {self.eval_every} and --evals-per-epoch {self.evals_per_epoch} both set how often "
                    f"to evaluate; pass one of them")
        if self.eval_batch_size is not None:
            _positive_int("eval_batch_size", self.eval_batch_size)
        validate_target_accuracy(self.target_accuracy)
        validate_target_loss(self.target_loss)

    @property
    def has_target(self) -> bool:
        return self.target_accuracy is not None or self.target_loss is not None


@dataclass(frozen=True)
class CheckpointSection:
    """Where the run's final state goes and where it continues from.

    ``checkpoint_dir``, ``checkpoint_every``, ``keep``, ``max_restarts`` and ``restart`` are
    declared and checked here; periodic checkpoints and restarts are implemented by
    :mod:`pipetrain.runtime.checkpoints.periodic` (``save_at_boundary``, called by every rank after
    each segment) and the launcher (:mod:`pipetrain.run.launcher`: which checkpoint to resume).
    Checkpoint points split the run into segments (:func:`pipetrain.run.resolve.segment_plan`),
    so every checkpoint is at a drained boundary.
    """

    save: str | None = setting(None, "write the final model state_dict (and PATH.trainer) to PATH", metavar="PATH")
    save_hf: str | None = setting(None, "hf: models: write the final weights as a Hugging Face directory DIR "
                                        "(sharded safetensors, one shard per rank, its index and config.json) "
                                        "that from_pretrained loads", metavar="DIR")
    resume: str | None = setting(None, "continue from a checkpoint written by --save", metavar="PATH")
    checkpoint_dir: str | None = setting(None, "write periodic checkpoints into DIR (and resume from its latest)",
                                         metavar="DIR")
    checkpoint_every: int | None = setting(None, "checkpoint every K steps (needs --checkpoint-dir; default: at "
                                                 "the end only)", type=int)
    keep: int | None = setting(None, "keep the newest N checkpoints in --checkpoint-dir (default: all)", type=int)
    max_restarts: int = setting(0, "restart the workers from the latest checkpoint up to R times after a failure",
                                type=int)
    restart: bool = setting(False, "start over from step 0 although --checkpoint-dir holds checkpoints (they are "
                                   "moved into DIR/set-aside-TIME/, not resumed from)", kind="true")

    def __post_init__(self) -> None:
        for name in ("checkpoint_every", "keep"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        _positive_int("max_restarts", self.max_restarts, minimum=0)
        if self.checkpoint_dir is None:
            for name in ("checkpoint_every", "keep"):
                if getattr(self, name) is not None:
                    flag = "--" + name.replace("_", "-")
                    raise RuntimeConfigError(f"{flag} needs --checkpoint-dir DIR (where the checkpoints go); pass "
                                             f"--checkpoint-dir or drop {flag}")
            if self.max_restarts:
                raise RuntimeConfigError(f"--max-restarts {self.max_restarts} restarts from the latest checkpoint, "
                                         f"so it needs --checkpoint-dir DIR; pass --checkpoint-dir or drop it")
            if self.restart:
                raise RuntimeConfigError("--restart starts over instead of resuming from --checkpoint-dir, so it "
                                         "needs --checkpoint-dir DIR; pass --checkpoint-dir or drop --restart")


@dataclass(frozen=True)
class OutputSection:
    """What the run reports while and after it runs."""

    trace: str | None = setting(None, "write each worker's measured timeline as Chrome traces in DIR (and the "
                                      "resolved run as run.json)", metavar="DIR")
    log_every: int = setting(10, "log the loss every n steps (0: never)", type=int)
    json: bool = setting(False, "print one JSON object with the run's figures at the end (progress lines go to "
                                "stderr)", kind="true")
    quiet: bool = setting(False, "no progress lines", flag=None)
    log_dir: str | None = setting(None, "write metrics.jsonl, TensorBoard events, config.json, plan.json and "
                                        "schedule.txt into DIR", metavar="DIR")

    def __post_init__(self) -> None:
        _positive_int("log_every", self.log_every, minimum=0)

    @property
    def progress_to_stderr(self) -> bool:
        """Progress lines go to stderr when stdout carries the JSON result."""
        return self.json


@dataclass(frozen=True)
class PerformanceSection:
    """Knobs that change speed or memory, never the numbers."""

    timeout: float = setting(120.0, "seconds any receive or collective may wait", type=float)
    threads: int | None = setting(1, "torch threads per worker on CPU (default: 1; 0: torch's default)", type=int,
                                  convert=_threads)
    lookahead: int = setting(8, "actions ahead to post receives for", type=int, hidden=True)
    tune_malloc: bool = setting(True, "leave glibc's malloc thresholds alone (by default freed memory is kept for "
                                      "reuse, see runtime.process.rss.tune_malloc)", flag="--no-malloc-tuning",
                                kind="false")
    bucket_mb: float | None = setting(None, "MiB per all-reduce bucket of a replicated stage's gradients, started "
                                            "in the group's last backward as each fills (DDP's bucket_cap_mb; the "
                                            "first bucket 1 MiB; 0: one all-reduce after the backward; default: 25, "
                                            "or 0 when every rank is on one host whose cores the ranks' threads "
                                            "fill: gloo's all-reduce is then CPU work taken from the backward)",
                                      type=float)
    fused_grads: bool = setting(True, "accumulate Linear weight gradients through autograd (by default the "
                                      "backward's GEMM adds them into the accumulator in place)",
                                flag="--no-fused-grads", kind="false")
    cache: bool = setting(True, "measure again instead of reusing the profiles and calibrations --schedule auto "
                                "measured before on this machine for the same model and settings (kept in "
                                "$PIPETRAIN_CACHE, default ~/.cache/pipetrain)", flag="--no-cache", kind="false")
    measure_memory: bool = setting(False, "count the tensor memory each worker holds, by kind, and report its peak "
                                          "(tensor_peak_bytes in --json); costs time on every action, so it is off "
                                          "by default (benchmarks/run.py turns it on)", kind="true")
    recompute: bool = setting(False, "activation recomputation: every stage keeps only its input per unit in "
                                     "flight and recomputes its forward in the backward (same results, less "
                                     "memory, one more forward; a plan may also mark single stages)", kind="true")

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise RuntimeConfigError(f"timeout must be > 0 seconds, got {self.timeout}; pass e.g. --timeout 120")
        if self.threads is not None:
            _positive_int("threads", self.threads)
        _positive_int("lookahead", self.lookahead)
        if self.bucket_mb is not None and not (isinstance(self.bucket_mb, (int, float)) and self.bucket_mb >= 0):
            raise RuntimeConfigError(f"--bucket-mb must be >= 0 MiB, got {self.bucket_mb!r}; pass e.g. --bucket-mb 25 "
                                     f"(0: one all-reduce after the backward)")


@dataclass(frozen=True)
class DebugSection:
    """Debugging: the traceback of an error (``--debug``), and test hooks not shown in ``--help``."""

    show_traceback: bool = setting(False, "print an error's traceback too (errors are one line otherwise; on a "
                                          "pipeline run each failing worker prints its own)", flag="--debug",
                                   kind="true")
    debug_fail: str | None = setting(None, "RANK:STEP[:hang|kill|kill-save] makes RANK raise (hang, SIGKILL itself, "
                                           "or SIGKILL itself inside the checkpoint write) at STEP", hidden=True)
    return_state: bool = setting(False, "gather the final parameters into the result (library, tests)", flag=None)

    def __post_init__(self) -> None:
        if self.debug_fail is not None:
            parse_debug_fail(self.debug_fail)


# --------------------------------------------------------------------------- the run's config


#: Section attribute of :class:`TrainConfig` -> its class, in command-line order.
SECTIONS: dict[str, type] = {
    "model": ModelSection, "data": DataSection, "parallel": ParallelSection, "training": TrainingSection,
    "evaluation": EvaluationSection, "optimizer": OptimizerConfig, "checkpoint": CheckpointSection,
    "output": OutputSection, "performance": PerformanceSection, "debug": DebugSection,
}


def _flat_keys() -> dict[str, tuple[str, str]]:
    """flat key -> (section attribute, field name); keys are unique over all sections."""
    out: dict[str, tuple[str, str]] = {}
    for attr, cls in SECTIONS.items():
        for f, fl in settings(cls):
            if fl.key in out:
                raise TypeError(f"config key {fl.key!r} is declared twice ({out[fl.key][0]} and {attr})")
            out[fl.key] = (attr, f.name)
    return out


@dataclass(frozen=True)
class TrainConfig:
    """One training run (the ``pipetrain train`` options), in sections (module docstring).

    Build it from sections, or from flat keys::

        TrainConfig(parallel=ParallelSection(workers=2, config='1-1', schedule='flush'))
        TrainConfig.of(workers=2, config='1-1', schedule='flush', steps=3, lr=0.1)
    """

    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    output: OutputSection = field(default_factory=OutputSection)
    performance: PerformanceSection = field(default_factory=PerformanceSection)
    debug: DebugSection = field(default_factory=DebugSection)
    data: DataSection = field(default_factory=DataSection)
    evaluation: EvaluationSection = field(default_factory=EvaluationSection)

    def __post_init__(self) -> None:
        for attr, cls in SECTIONS.items():
            value = getattr(self, attr)
            if isinstance(value, Mapping):
                object.__setattr__(self, attr, cls(**value))
            elif not isinstance(value, cls):
                raise RuntimeConfigError(f"TrainConfig.{attr} must be a {cls.__name__}, got {type(value).__name__}")
        _check_precision(self.training.precision, self.parallel.device)
        if self.checkpoint.save_hf is not None and not self.model.name.startswith("hf:"):
            raise RuntimeConfigError(f"--save-hf {self.checkpoint.save_hf} writes a Hugging Face directory, so it "
                                     f"needs an hf:DIR model, got --model {self.model.name}; pass --model hf:DIR or "
                                     f"use --save PATH")

    # -- flat keys ---------------------------------------------------------------------
    @classmethod
    def of(cls, **values: Any) -> TrainConfig:
        """A config from flat keys (``steps=3, lr=0.1``) and/or whole sections (``optimizer=OptimizerConfig(...)``)."""
        return cls().replace(**values)

    def replace(self, **values: Any) -> TrainConfig:
        """A copy with flat keys (or whole sections) replaced; every section is checked again."""
        keys = _flat_keys()
        whole: dict[str, Any] = {}
        parts: dict[str, dict[str, Any]] = {}
        for k, v in values.items():
            if k in SECTIONS and isinstance(v, (SECTIONS[k], Mapping)):
                whole[k] = v
            elif k in keys:
                attr, name = keys[k]
                parts.setdefault(attr, {})[name] = v
            else:
                raise RuntimeConfigError(
                    f"unknown training setting {k!r}; settings are: {', '.join(sorted(keys))}")
        new = {}
        for attr, cls in SECTIONS.items():
            sec = whole.get(attr, getattr(self, attr))
            if isinstance(sec, Mapping):
                sec = cls(**sec)
            if attr in parts:
                sec = dataclasses.replace(sec, **parts[attr])
            new[attr] = sec
        return TrainConfig(**new)

    def get(self, key: str) -> Any:
        """The value of a flat key (``cfg.get("steps")``)."""
        attr, name = _flat_keys()[key]
        return getattr(getattr(self, attr), name)

    # -- derived values ----------------------------------------------------------------
    @property
    def spec(self) -> Any:
        """The schedule's :class:`~pipetrain.schedule.ScheduleSpec`."""
        return self.parallel.spec

    @property
    def synchronous(self) -> bool:
        """Whether every unit of minibatch ``t`` uses version ``t`` (global gradient clipping)."""
        return bool(self.spec.synchronous)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly copy, by section (nested dataclasses as dicts)."""
        def plain(v: Any) -> Any:
            if dataclasses.is_dataclass(v) and not isinstance(v, type):
                return {f.name: plain(getattr(v, f.name)) for f in fields(v)}
            if isinstance(v, Mapping):
                return {str(k): plain(x) for k, x in v.items()}
            if isinstance(v, tuple):
                return list(v)
            return v

        return plain(self)


def _check_precision(precision: str, device: str) -> None:
    """A one-line error for a precision that is not built or that ``device`` cannot compute in."""
    if precision not in PRECISIONS:
        raise RuntimeConfigError(f"unknown precision {precision!r}; valid: fp32, bf16")
    if precision == "fp16":
        raise RuntimeConfigError("--precision fp16 is not built (it needs dynamic loss scaling); pass --precision "
                                 "bf16 (the same wire bytes, no scaling) or fp32")
    if precision == "bf16" and device == "cuda":
        import torch

        if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
            raise RuntimeConfigError(f"--precision bf16 needs a GPU with bfloat16 support, but "
                                     f"{torch.cuda.get_device_name()} has none; pass --precision fp32")


def _positive_int(name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        flag = "--" + name.replace("_", "-")
        raise RuntimeConfigError(f"{flag} must be an integer >= {minimum}, got {value!r}")
