"""Exact evaluation over batches: :class:`EvalAccumulator`.

The accumulator keeps *sums*, never means, so its result does not depend on how the eval
split was cut into batches, nor on how the batches were spread over replicas:

    loss     = sum over target elements of their loss   / number of target elements
    accuracy = number of target elements predicted right / number of target elements
    perplexity = exp(loss)                                  (language models)

The model's output is taken as it comes (:func:`pipetrain.models.output.output_logits`: a
tensor, a Hugging Face ``ModelOutput``'s ``.logits``, a dict or a tuple). A *target element*
is one class label (a target of shape ``(B,)``), one token (``(B, T)``:
the token targets of a language model count per token), or one value of a floating-point
target (regression). Predictions are the argmax over the output's last dimension.

Without a ``loss_fn`` the loss is computed here: integer targets give cross entropy over the
last dimension (``ignore_index`` elements count nowhere), floating-point targets give squared
error. With a ``loss_fn`` (a model's own, a mean over its batch) the batch mean is weighted by
the number of target elements, which is exact for any loss that is a mean over elements or
over samples of equal size.

Merging over ranks: :meth:`EvalAccumulator.merge` adds two accumulators;
:meth:`EvalAccumulator.to_tensor` packs one into a small float64 tensor whose element-wise
sum over ranks (``dist.all_reduce``) unpacks with :meth:`EvalAccumulator.from_tensor` into
the accumulator of all of them (:meth:`EvalAccumulator.all_reduce` does both). Ranks that
saw no eval batch contribute zeros.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import RuntimeConfigError
from ..models.output import output_logits
from .records import TASK_KINDS, EvalResult, TaskKind, perplexity_of

LossFn = Callable[[Any, Tensor], Tensor]

# Layout of the packed tensor: sums first, then one count per task kind (a one-hot of this
# accumulator's kind, so a sum over ranks keeps the kind and reveals disagreement).
_FIELDS = ("loss_sum", "correct", "targets", "samples", "batches")
PACKED_SIZE = len(_FIELDS) + len(TASK_KINDS)
_INTEGER_KINDS = {"classification", "language"}


def task_kind_of(output: Tensor, target: Tensor) -> TaskKind:
    """The task a (model output, target) pair belongs to.

    Floating-point targets: regression. Integer targets of one dimension (one label per
    sample): classification. Integer targets of two or more dimensions (one label per token):
    a language model.
    """
    if target.is_floating_point() or target.is_complex():
        return "regression"
    return "classification" if target.dim() <= 1 else "language"


@dataclass
class EvalAccumulator:
    """Sums over the eval batches of one evaluation (see the module docstring).

    Args:
        kind: the task (``DataSource.task`` values; ``"synthetic"`` or None: take it from
            the first batch, :func:`task_kind_of`). ``"language"`` also reports perplexity
            where each sample has one target token.
        ignore_index: integer targets equal to this are skipped (cross entropy's default).

    Invariant: ``loss_sum``, ``correct``, ``targets``, ``samples`` and ``batches`` are sums
    over every batch added (through :meth:`update`, :meth:`add` or :meth:`merge`), so
    ``result()`` is the same however the split was batched, padded or sharded.
    """

    kind: TaskKind | None = None
    ignore_index: int = -100
    loss_sum: float = 0.0
    correct: int = 0
    targets: int = 0
    samples: int = 0
    batches: int = 0

    def __post_init__(self) -> None:
        if self.kind == "synthetic":  # type: ignore[comparison-overlap]
            self.kind = None
        if self.kind is not None and self.kind not in TASK_KINDS:
            raise RuntimeConfigError(f"unknown evaluation task {self.kind!r}; valid: {', '.join(TASK_KINDS)}")

    def update(self, output: Any, target: Tensor, loss_fn: LossFn | None = None, count: int | None = None) -> None:
        """Add one eval batch: the model's ``output`` for it and its ``target``.

        ``loss_fn(output, target)`` (a mean over the batch) gives the loss where given;
        otherwise cross entropy (integer targets) or squared error (floating point).
        ``count``: only the first ``count`` rows are real samples (a padded last batch,
        :class:`pipetrain.data.EvalBatch`); the rest count nowhere.
        """
        logits = output_logits(output)
        if count is not None and count < int(target.shape[0]):
            logits, target = logits[:count], target[:count]
            output = logits  # the loss sees the real rows only
        kind = task_kind_of(logits, target)
        self._set_kind(kind)
        samples = int(target.shape[0]) if target.dim() else 1
        if samples == 0:
            return
        with torch.no_grad():
            if kind == "regression":
                n = target.numel()
                if loss_fn is not None:
                    loss_sum = float(loss_fn(output, target)) * n
                elif logits.numel() != n:
                    raise RuntimeConfigError(
                        f"evaluation of floating-point targets needs one output value per target value, got output "
                        f"{tuple(logits.shape)} for target {tuple(target.shape)}; match the shapes or give a loss_fn")
                else:
                    loss_sum = float(F.mse_loss(logits.reshape(target.shape).double(), target.double(),
                                                reduction="sum"))
                self.add(loss_sum, 0, n, samples)
                return
            if logits.shape[:-1] != target.shape:
                raise RuntimeConfigError(
                    f"evaluation needs outputs of shape target.shape + (classes,), got output {tuple(logits.shape)} "
                    f"for target {tuple(target.shape)}; return one row of class scores per target element")
            flat_logits = logits.reshape(-1, logits.shape[-1])
            flat_target = target.reshape(-1).long()
            keep = flat_target != self.ignore_index
            n = int(keep.sum())
            if loss_fn is not None:
                loss_sum = float(loss_fn(output, target)) * n if n else 0.0
            else:
                loss_sum = float(F.cross_entropy(flat_logits.double(), flat_target, ignore_index=self.ignore_index,
                                                 reduction="sum"))
            correct = int(((flat_logits.argmax(dim=-1) == flat_target) & keep).sum())
            self.add(loss_sum, correct, n, samples)

    def add(self, loss_sum: float, correct: int, targets: int, samples: int, batches: int = 1) -> None:
        """Add sums measured elsewhere (e.g. a loss already summed by the last stage)."""
        self.loss_sum += float(loss_sum)
        self.correct += int(correct)
        self.targets += int(targets)
        self.samples += int(samples)
        self.batches += int(batches)

    def merge(self, other: EvalAccumulator) -> EvalAccumulator:
        """A new accumulator holding the sums of both (as if one had seen every batch)."""
        out = EvalAccumulator(kind=self.kind, ignore_index=self.ignore_index)
        out._set_kind(other.kind)
        out.add(self.loss_sum + other.loss_sum, self.correct + other.correct, self.targets + other.targets,
                self.samples + other.samples, self.batches + other.batches)
        return out

    def to_tensor(self) -> Tensor:
        """Pack into a float64 tensor of :data:`PACKED_SIZE`; the sum of several packs
        unpacks (:meth:`from_tensor`) into their merge. Exact for counts below 2**53."""
        one_hot = [1.0 if self.kind == k else 0.0 for k in TASK_KINDS]
        values = [self.loss_sum, float(self.correct), float(self.targets), float(self.samples),
                  float(self.batches), *one_hot]
        return torch.tensor(values, dtype=torch.float64)

    @staticmethod
    def from_tensor(packed: Tensor, ignore_index: int = -100) -> EvalAccumulator:
        """Unpack :meth:`to_tensor` or an element-wise sum of several (e.g. after all_reduce)."""
        v = [float(x) for x in packed.detach().to("cpu", torch.float64).reshape(-1).tolist()]
        if len(v) != PACKED_SIZE:
            raise ValueError(f"a packed EvalAccumulator has {PACKED_SIZE} values, got {len(v)}")
        kinds = [k for k, c in zip(TASK_KINDS, v[len(_FIELDS):]) if c > 0]
        if set(kinds) == _INTEGER_KINDS:
            kinds = ["language"]
        if len(kinds) > 1:
            raise RuntimeConfigError(f"eval batches of different tasks were merged ({', '.join(kinds)}); "
                                     f"every rank must evaluate the same kind of targets")
        acc = EvalAccumulator(kind=kinds[0] if kinds else None, ignore_index=ignore_index)
        acc.add(v[0], round(v[1]), round(v[2]), round(v[3]), round(v[4]))
        return acc

    def to_dict(self) -> dict[str, Any]:
        """The sums as a small dict (for ``gather_object`` or a log)."""
        return {"kind": self.kind, "loss_sum": self.loss_sum, "correct": self.correct, "targets": self.targets,
                "samples": self.samples, "batches": self.batches}

    @staticmethod
    def from_dict(d: dict[str, Any], ignore_index: int = -100) -> EvalAccumulator:
        """Inverse of :meth:`to_dict`."""
        acc = EvalAccumulator(kind=d.get("kind"), ignore_index=ignore_index)
        acc.add(d["loss_sum"], d["correct"], d["targets"], d["samples"], d["batches"])
        return acc

    @property
    def loss(self) -> float:
        """Mean loss per target element (nan before any target)."""
        return self.loss_sum / self.targets if self.targets else float("nan")

    @property
    def accuracy(self) -> float | None:
        """Fraction of target elements predicted right; None for regression or before any."""
        if self.kind == "regression" or not self.targets:
            return None
        return self.correct / self.targets

    @property
    def perplexity(self) -> float | None:
        """``exp(loss)`` for a language model, else None."""
        return perplexity_of(self.loss) if self.kind == "language" and self.targets else None

    def result(self, step: int, epoch: float, samples: int, wall_time: float) -> EvalResult:
        """The :class:`EvalResult` of these sums at the given point of training."""
        if not self.targets:
            raise RuntimeConfigError(
                "the eval split gave no targets to evaluate (empty eval set, or every target equals the "
                f"ignore index {self.ignore_index}); give an eval split with at least one sample")
        return EvalResult(step=step, epoch=epoch, samples=samples, loss=self.loss, accuracy=self.accuracy,
                          perplexity=self.perplexity, wall_time=wall_time, task=self.kind or "classification",
                          eval_samples=self.samples, eval_targets=self.targets)

    def all_reduce(self, group: Any = None, device: torch.device | str | None = None) -> EvalAccumulator:
        """The merge of this rank's accumulator with every other rank's in ``group`` (a
        collective: every rank of the group calls it; ranks without eval batches pass an empty
        accumulator). Needs an initialized ``torch.distributed`` process group; ``device`` is
        where the packed tensor travels from (the rank's GPU under NCCL; CPU by default)."""
        import torch.distributed as dist

        packed = self.to_tensor() if device is None else self.to_tensor().to(device)
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
        return EvalAccumulator.from_tensor(packed, ignore_index=self.ignore_index)

    def _set_kind(self, kind: TaskKind | None) -> None:
        if kind is None:
            return
        if self.kind is None or {self.kind, kind} == _INTEGER_KINDS:
            # A language model is a classifier per token: it wins (it reports perplexity too),
            # whichever side said so first, so merges do not depend on order.
            self.kind = "language" if self.kind in _INTEGER_KINDS else kind
        elif self.kind != kind:
            raise RuntimeConfigError(
                f"eval batches disagree on the task: {self.kind} then {kind}; every eval batch needs targets of "
                f"the same dtype and rank")
