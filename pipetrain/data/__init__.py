"""Real data for pipelines: data sets, epoch sampling, per-rank unit loading, losses, metrics.

How a pipeline run uses it::

    source  = load_data("digits", seed=seed)                      # or fashion-mnist, shakespeare, ...
    options = {**model_options_for("mlp", source), **user_options}
    bundle  = get_model("mlp", **options); check_fits(bundle, source)
    loss_fn = loss_for_bundle(bundle, source)                      # CE for int targets, MSE for float
    sampler = EpochSampler(source.num_train, batch_size, seed=seed)
    steps   = epochs * sampler.steps_per_epoch
    # each rank: the units its stage replica runs (u % r == i), the part its stage needs
    n       = suggested_workers(source.train, samples=steps * batch_size)  # once (launcher): 0 = here
    workers = kept_workers(source, source.train, sampler, m, part, n)    # kept across segments (or None)
    data    = UnitLoader(source.train, sampler, m, units, part, workers=workers)  # part: inputs|targets|both
    evals   = EvalBatches(source.eval, eval_batch_size, pad=True)  # batch.count rows are real

Modules: :mod:`~.source` (DataSource, ArrayDataset), :mod:`~.registry` (load_data),
:mod:`~.digits`, :mod:`~.fashion` (+ :mod:`~.idx`), :mod:`~.text`, :mod:`~.user`,
:mod:`~.sampler`, :mod:`~.loader`, :mod:`~.eval_batches`, :mod:`~.loss`, :mod:`~.metrics`,
:mod:`~.adapt`.
"""
from __future__ import annotations

from ..models.output import output_logits
from .adapt import check_fits, model_options_for
from .eval_batches import EvalBatch, EvalBatches
from .loader import DATA_WAIT, UnitLoader, UnitWorkers, WaitMeter, gather, kept_workers, suggested_workers
from .loss import CrossEntropy, MeanSquaredError, loss_for, loss_for_bundle
from .metrics import correct_count, loss_sum, token_loss_sum
from .registry import DATA_FORMS, DATA_NAMES, load_data, synthetic_source
from .sampler import EpochSampler
from .source import ArrayDataset, Batch, DataSource, Part, Task

__all__ = [
    "ArrayDataset", "Batch", "CrossEntropy", "DATA_FORMS", "DATA_NAMES", "DATA_WAIT", "DataSource", "EpochSampler",
    "EvalBatch", "EvalBatches", "MeanSquaredError", "Part", "Task", "UnitLoader", "UnitWorkers", "WaitMeter",
    "check_fits", "correct_count", "gather", "kept_workers", "load_data", "loss_for", "loss_for_bundle", "loss_sum",
    "model_options_for", "output_logits", "suggested_workers", "synthetic_source", "token_loss_sum",
]
