"""What a run reports: each rank's :class:`RankReport`, the run's :class:`RunResult`.

Every rank builds a :class:`RankReport` after training and ``gather_object``-s it to rank 0,
which merges them into the :class:`RunResult` (:func:`merge_reports`). The one-process path
builds the same :class:`RunResult` directly, so both report the same fields.
``RunResult.to_json()`` is what ``pipetrain train --json`` prints.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

from ..schedule.events import Event
from ..schedule.traffic import Traffic

__all__ = ["RankReport", "RunResult"]


@dataclass
class RankReport:
    """One rank's measurements (and, for checkpoints, its stages' state)."""

    rank: int
    stages: list[int]
    losses: dict[int, list[float]]               # step -> unit losses of this rank's last stage
    seconds: float                               # the timed segment, wall clock
    steady: dict[int, float]                     # stage -> minibatches/s between its first and last STEP
                                                 # (schedule.events.steady_state_rates)
    peak_versions: dict[int, int]
    alive_versions: dict[int, int]
    bytes_sent: int                              # = traffic.total_sent (the timed segments, every kind)
    peak_rss_mib: float | None
    rss_end_mib: float | None
    rss_setup_mib: float | None
    peak_reset: bool
    peak_rss_life_mib: float
    state: dict[str, torch.Tensor] = field(default_factory=dict)          # replica 0 of each stage
    optimizer_state: dict[str, dict[str, Any]] = field(default_factory=dict)
    stage_steps: dict[str, int] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)                    # with --trace: every action
    tensor_memory: dict[str, Any] = field(default_factory=dict)  # TensorLedger.summary() (--measure-memory)
    traffic: Traffic = field(default_factory=Traffic)        # Comm's counts over the timed segments, by kind
    eval_traffic: Traffic = field(default_factory=Traffic)   # Comm's counts during evaluations (not training)


@dataclass
class RunResult:
    """A finished run's figures (rank 0's, or the one process's).

    ``losses`` are the mean loss of every timed step; ``samples_per_second`` counts the whole
    timed window, ``samples_per_second_steady`` the slowest stage's rate between its first
    and last step (the one definition the simulator uses too:
    :func:`pipetrain.schedule.events.steady_state_rates`; ``None`` for one process or
    under two steps).
    Memory figures are per rank in MiB. ``state`` (not in JSON) holds the final parameters
    when ``return_state`` was asked.

    Communication (docs/traffic.md): ``traffic`` is every rank's
    :class:`~pipetrain.schedule.traffic.Traffic` (``to_json()``) over the timed segments only,
    summed when evaluations or checkpoints split them; the warm-up, evaluation and setup are
    not in it. ``bytes_sent[r] == traffic[r]["total_sent"]``. ``bytes_per_sample`` (by kind and
    ``"total"``) divides the bytes sent over all ranks by ``batch_size * steps``;
    ``predicted_traffic`` / ``predicted_bytes_per_sample`` are
    :func:`~pipetrain.plan.traffic.predict_traffic` of the same segments (exact cut sizes,
    all-reduce buffers, ties), equal to the measured figures for the runtime's own schedules.
    ``eval_traffic``: the evaluations' forward messages per rank (empty when none ran).
    """

    steps: int
    samples_per_second: float
    final_loss: float | None
    losses: list[float]
    config: str                                   # replicas per stage, e.g. "2-1"
    schedule: str
    workers: int
    batch_size: int
    microbatches: int
    seconds: float
    warmup_steps: int
    warmup_losses: list[float]
    start_step: int
    plan_source: str
    stages: int
    device: str
    peak_rss_mib: list[float | None]
    peak_rss_scope: str                           # "training" (peak reset after setup) | "process"
    rss_setup_mib: list[float | None]
    rss_end_mib: list[float | None]
    peak_rss_life_mib: list[float | None]
    samples_per_second_steady: float | None = None
    peak_versions: dict[str, int] = field(default_factory=dict)
    bytes_sent: list[int] = field(default_factory=list)           # per rank, timed segments (= traffic's total_sent)
    traffic: list[dict[str, Any]] = field(default_factory=list)   # per rank, Traffic.to_json(), timed segments
    bytes_per_sample: dict[str, float] | None = None              # sent over all ranks / samples, by kind + "total"
    bytes_per_minibatch: dict[str, float] | None = None
    predicted_traffic: list[dict[str, Any]] = field(default_factory=list)
    predicted_bytes_per_sample: dict[str, float] | None = None
    eval_traffic: list[dict[str, Any]] = field(default_factory=list)
    # -- tensors held per rank (runtime/guards/tensor_ledger.py, docs/performance.md "Memory")
    tensor_peak_bytes: list[int | None] = field(default_factory=list)     # peak of distinct storages held
    tensor_peak_mib: list[float | None] = field(default_factory=list)
    tensor_peak_by_kind: list[dict[str, int]] = field(default_factory=list)   # the breakdown at that peak
    tensor_max_by_kind: list[dict[str, int]] = field(default_factory=list)    # each kind's own maximum
    # -- the plan's stages: nodes per stage, where each begins
    stage_nodes: list[int] = field(default_factory=list)
    stage_first_nodes: list[str] = field(default_factory=list)
    stage_first_modules: list[str] = field(default_factory=list)
    saved: str | None = None
    skipped_steps: int = 0                    # steps dropped by --skip-nonfinite
    alive_versions: dict[str, int] | None = None
    run: dict[str, Any] = field(default_factory=dict)       # ResolvedRun.to_json()
    # -- --schedule auto (pipetrain.auto.choose): the choice, every candidate, the predicted time
    auto: dict[str, Any] | None = None
    predicted_time_per_minibatch: float | None = None       # seconds, steady state (auto's prediction)
    state: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    # -- real data: evaluation through the pipeline and time to a target (runtime/worker/monitor.py) --
    data: str | None = None                       # --data (None: synthetic batches)
    eval_accuracy: float | None = None            # the last evaluation's (None: regression / none)
    eval_loss: float | None = None
    eval_perplexity: float | None = None          # language models
    reached: bool | None = None                   # None: no target given
    time_to_accuracy: float | None = None         # training seconds (evaluation excluded) to the target
    epochs_to_accuracy: float | None = None
    steps_to_accuracy: int | None = None
    epochs: float | None = None                   # epochs trained (fractional when stopped early)
    target_summary: str | None = None             # one line: reached at ..., or not reached in ...
    eval_history: list[dict[str, Any]] = field(default_factory=list)   # EvalResult.to_dict() per evaluation
    time_excludes_eval: bool = True               # seconds, samples/s and times to target count training only

    def add_evaluation(self, summary: dict[str, Any], data: Any) -> None:
        """Fill the evaluation fields from :meth:`TrainMonitor.summary` (``{}``: none ran)."""
        self.data = data.name if data is not None else None
        if not summary:
            return
        for key in ("eval_accuracy", "eval_loss", "eval_perplexity", "time_to_accuracy", "epochs_to_accuracy",
                    "steps_to_accuracy", "epochs", "target_summary", "eval_history"):
            setattr(self, key, summary.get(key))
        has_target = summary.get("target_accuracy") is not None or summary.get("target_loss") is not None
        self.reached = bool(summary.get("reached")) if has_target else None

    def add_traffic(self, summary: dict[str, Any]) -> None:
        """Fill the communication fields from the worker's traffic summary (its keys are the
        field names: ``traffic``, ``bytes_per_sample``, ``predicted_*``, ``eval_traffic``)."""
        for key in ("traffic", "bytes_per_sample", "bytes_per_minibatch", "predicted_traffic",
                    "predicted_bytes_per_sample", "eval_traffic"):
            if key in summary:
                setattr(self, key, summary[key])

    def add_tensor_memory(self, summaries: list[dict[str, Any]]) -> None:
        """The ``tensor_*`` fields from each rank's ``TensorLedger.summary()``."""
        self.tensor_peak_bytes = [s.get("peak_bytes") for s in summaries]
        self.tensor_peak_mib = [None if b is None else b / 2.0 ** 20 for b in self.tensor_peak_bytes]
        self.tensor_peak_by_kind = [s.get("peak_by_kind", {}) for s in summaries]
        self.tensor_max_by_kind = [s.get("max_by_kind", {}) for s in summaries]

    def to_json(self) -> dict[str, Any]:
        """Every field but ``state``, as JSON-friendly values."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "state"}
