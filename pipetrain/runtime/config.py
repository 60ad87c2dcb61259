"""The typed configuration of one training run, with validation.

:class:`TrainConfig` holds everything ``pipetrain train`` accepts; each field documents its
unit and default. ``__post_init__`` checks each field alone; :meth:`TrainConfig.check_counts`
checks the combinations that need the number of stages (batch divisible by microbatches...).
Every failure is a one-line :class:`~pipetrain.errors.RuntimeConfigError` with the rule, the
values and the fix.

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

import math
from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import RuntimeConfigError

#: Schedules whose every forward of minibatch ``t`` uses version ``t`` (no staleness).
SYNC_SCHEDULES = frozenset({"flush", "gpipe", "dp", "interleaved", "zerobubble"})
#: Schedules with stale weights (weight stashing / double buffering).
ASYNC_SCHEDULES = frozenset({"pipedream", "2bw"})
SCHEDULES = tuple(sorted(SYNC_SCHEDULES | ASYNC_SCHEDULES))
OPTIMIZERS = ("sgd", "adam", "adamw")
LR_SCHEDULES = ("constant", "step", "cosine")
DEVICES = ("cpu", "cuda")


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
    def parse(text: str) -> "LRSchedule":
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
                raise RuntimeConfigError(f"learning-rate schedule option {k} must be a {typ.__name__}, got {v!r}") from None
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

    name: str = "sgd"                   # sgd | adam | adamw
    lr: float = 0.01                    # base learning rate
    momentum: float = 0.0               # sgd momentum
    dampening: float = 0.0              # sgd dampening
    nesterov: bool = False              # sgd Nesterov momentum
    weight_decay: float = 0.0           # L2 (sgd, adam) or decoupled (adamw)
    betas: tuple[float, float] = (0.9, 0.999)   # adam/adamw
    eps: float = 1e-8                   # adam/adamw

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


@dataclass
class TrainConfig:
    """One training run (the ``pipetrain train`` options).

    A *step* is one minibatch of ``batch_size`` samples and one optimizer step of the last
    stage. ``microbatches`` splits each minibatch into units for the microbatched schedules
    (``pipedream`` moves whole minibatches, so it needs 1).
    """

    model: str = "mlp"                                  # zoo name or package.module:function
    model_options: dict[str, Any] = field(default_factory=dict)   # --option key=value
    workers: int | None = None                          # processes (ranks); None: from the plan/config, else 1
    plan: str | None = None                             # plan JSON (pipetrain plan --output)
    config: str | None = None                           # replicas per stage, e.g. "2-1-1"
    cut: str | None = None                              # where stages 1.. begin: "NAME[,NAME...]" (node or module)
    schedule: str = "pipedream"                         # see SCHEDULES
    batch_size: int | None = None                       # samples per minibatch (None: model default)
    microbatches: int | None = None                     # units per minibatch (None: 1 for pipedream, else workers)
    steps: int = 10                                     # minibatches to train (timed)
    warmup_steps: int = 0                               # extra untimed minibatches first (benchmarks)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_schedule: LRSchedule = field(default_factory=LRSchedule)
    clip_grad_norm: float | None = None                 # max gradient 2-norm (None: no clipping)
    seed: int = 0                                       # model init and data (batch t uses seed + t)
    vertical_sync: bool = False                         # pipedream: vertical sync of versions
    virtual_stages: int = 2                             # interleaved: model chunks per rank
    device: str = "cpu"                                 # cpu (gloo) | cuda (NCCL)
    save: str | None = None                             # checkpoint path written at the end
    resume: str | None = None                           # checkpoint path to continue from
    trace: str | None = None                            # directory for Chrome traces
    log_every: int = 10                                 # print the loss every n steps (0: never)
    timeout: float = 120.0                              # seconds any collective/receive may wait
    threads: int | None = 1                             # torch threads per worker on CPU (None: torch default)
    lookahead: int = 8                                  # actions ahead to post receives for
    tune_malloc: bool = True                            # keep freed pages (glibc mallopt), see worker.tune_malloc
    fused_grads: bool = True                            # Linear weight grads accumulated in the GEMM (fused.py)
    quiet: bool = False                                 # no progress lines
    log_to_stderr: bool = False                         # progress lines on stderr (--json keeps stdout clean)
    debug_fail: str | None = None                       # hidden: "RANK:STEP" makes RANK raise at STEP
    return_state: bool = False                          # library/tests: gather final parameters

    def __post_init__(self) -> None:
        if isinstance(self.optimizer, dict):
            self.optimizer = OptimizerConfig(**self.optimizer)
        if isinstance(self.lr_schedule, str):
            self.lr_schedule = LRSchedule.parse(self.lr_schedule)
        self.schedule = str(self.schedule).lower()
        if self.schedule not in SCHEDULES:
            raise RuntimeConfigError(f"unknown schedule {self.schedule!r}; valid schedules: {', '.join(SCHEDULES)}")
        for name in ("steps", "virtual_stages", "lookahead"):
            _positive_int(name, getattr(self, name))
        if self.workers is not None:
            _positive_int("workers", self.workers)
        _positive_int("warmup_steps", self.warmup_steps, minimum=0)
        _positive_int("log_every", self.log_every, minimum=0)
        if self.batch_size is not None:
            _positive_int("batch_size", self.batch_size)
        if self.microbatches is not None:
            _positive_int("microbatches", self.microbatches)
        if self.threads is not None:
            _positive_int("threads", self.threads)
        if self.device not in DEVICES:
            raise RuntimeConfigError(f"unknown device {self.device!r}; valid: {', '.join(DEVICES)}")
        if not self.timeout > 0:
            raise RuntimeConfigError(f"timeout must be > 0 seconds, got {self.timeout}; pass e.g. --timeout 120")
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise RuntimeConfigError(f"--clip-grad-norm must be > 0, got {self.clip_grad_norm}")
        if self.plan is not None and self.config is not None:
            raise RuntimeConfigError("give either --plan or --config, not both")
        if self.config is not None:
            parse_config(self.config)
        if self.cut is not None:
            cuts = parse_cut(self.cut)
            if self.plan is not None:
                raise RuntimeConfigError("--cut fixes the stages itself: give --cut or --plan, not both")
            if self.schedule == "dp":
                raise RuntimeConfigError("--cut splits a model into pipeline stages; the dp schedule has one stage")
            if self.config is not None:
                reps = parse_config(self.config)
                stages = len(reps) * (self.virtual_stages if self.schedule == "interleaved" else 1)
                if stages != len(cuts) + 1:
                    raise RuntimeConfigError(
                        f"--cut {self.cut} makes {len(cuts) + 1} stages but --config {self.config} has {stages}; "
                        f"give one cut name fewer than the stages")
        if self.vertical_sync and self.schedule != "pipedream":
            raise RuntimeConfigError(
                f"--vertical-sync applies to the pipedream schedule only (got --schedule {self.schedule})")
        if self.schedule == "pipedream" and self.microbatches not in (None, 1):
            raise RuntimeConfigError(
                f"pipedream moves whole minibatches, so --microbatches must be 1 (got {self.microbatches}); "
                f"use flush, gpipe or 2bw for microbatches")
        if self.debug_fail is not None:
            parse_debug_fail(self.debug_fail)

    # -- derived values ----------------------------------------------------------------
    @property
    def synchronous(self) -> bool:
        """Whether every unit of minibatch ``t`` uses version ``t`` (global gradient clipping)."""
        return self.schedule in SYNC_SCHEDULES

    def resolved_microbatches(self) -> int:
        """Units per minibatch: the given value, else 1 for pipedream and ``workers`` otherwise."""
        if self.microbatches is not None:
            return self.microbatches
        return 1 if self.schedule == "pipedream" else (self.workers or 1)

    def check_counts(self, batch_size: int) -> None:
        """Cross-field checks once the batch size is known."""
        m = self.resolved_microbatches()
        if batch_size % m:
            lower = max(d for d in range(1, m + 1) if batch_size % d == 0)
            raise RuntimeConfigError(
                f"batch size {batch_size} is not divisible by microbatches {m}: every microbatch must have the "
                f"same size; use --microbatches {lower} or --batch-size {(batch_size // m + 1) * m}")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly copy (nested dataclasses as dicts)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (OptimizerConfig, LRSchedule)):
                v = {g.name: getattr(v, g.name) for g in fields(v)}
            out[f.name] = v
        return out


def _positive_int(name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        flag = "--" + name.replace("_", "-")
        raise RuntimeConfigError(f"{flag} must be an integer >= {minimum}, got {value!r}")


def parse_config(text: str) -> list[int]:
    """PipeDream's configuration string ``"2-1-1"`` -> replicas per stage ``[2, 1, 1]``."""
    try:
        reps = [int(x) for x in str(text).split("-")]
    except ValueError:
        reps = []
    if not reps or any(r < 1 for r in reps):
        raise RuntimeConfigError(
            f"--config must list replicas per stage joined by '-', each >= 1 (e.g. 2-1-1), got {text!r}")
    return reps


def parse_cut(text: str) -> list[str]:
    """``--cut blocks.4`` / ``--cut _16,_24`` -> the names where stages 1, 2, ... begin."""
    names = [x.strip() for x in str(text).split(",")]
    if not names or any(not n for n in names):
        raise RuntimeConfigError(
            f"--cut takes node or module names joined by ',' (where stages 1, 2, ... begin, e.g. blocks.4), "
            f"got {text!r}")
    return names


def parse_debug_fail(text: str) -> tuple[int, int, str]:
    """Hidden ``--debug-fail RANK:STEP[:hang]`` -> (rank, step, "raise" | "hang")."""
    parts = str(text).split(":")
    try:
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("raise", "hang")):
            raise ValueError
        return int(parts[0]), int(parts[1]), parts[2] if len(parts) == 3 else "raise"
    except ValueError:
        raise RuntimeConfigError(f"--debug-fail takes RANK:STEP[:hang], got {text!r}") from None


def parse_model_option(text: str) -> tuple[str, Any]:
    """``--option key=value``: the value is read as Python literal when possible (int, float,
    bool, None, tuple), else kept as a string."""
    import ast

    key, eq, raw = text.partition("=")
    if not eq or not key.strip():
        raise RuntimeConfigError(f"--option takes key=value, got {text!r} (e.g. --option depth=4)")
    raw = raw.strip()
    lowered = {"true": True, "false": False, "none": None}
    if raw.lower() in lowered:
        return key.strip(), lowered[raw.lower()]
    try:
        return key.strip(), ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return key.strip(), raw
