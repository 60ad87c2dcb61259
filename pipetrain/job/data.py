"""The real data set of a run as the resolved run carries it: how to load it, and what it is.

The resolved run holds the description, never the tensors: every process that reads data
(the one process of ``--workers 1``, the first and last stages of a pipeline) reloads it
itself, deterministically from the seed (:meth:`DataSpec.load`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DataSpec"]


@dataclass(frozen=True)
class DataSpec:
    """A real data set as the resolved run carries it: how to load it, and what it is.

    ``load()`` gives the same :class:`~pipetrain.data.DataSource` in every process (the splits
    depend on ``name``, ``data_dir``, ``seq_len`` and ``seed`` only). The other fields are
    what the launcher learnt when it loaded it: they size the run without loading again.
    """

    name: str
    data_dir: str | None
    seq_len: int | None
    seed: int
    task: str                      # DataSource.task
    target_dtype: torch.dtype
    num_train: int
    num_eval: int
    steps_per_epoch: int           # whole minibatches per epoch (the tail is dropped)
    eval_batch_size: int           # rows per eval batch (a multiple of the unit batch)
    loader_workers: int            # background processes of each rank's UnitLoader
    description: str = ""

    def load(self) -> Any:
        """The :class:`~pipetrain.data.DataSource` (raises :class:`~pipetrain.errors.DataError`)."""
        from ..data import load_data

        return load_data(self.name, data_dir=self.data_dir, seed=self.seed, seq_len=self.seq_len)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "data_dir": self.data_dir, "seq_len": self.seq_len, "task": self.task,
                "target_dtype": str(self.target_dtype).replace("torch.", ""), "num_train": self.num_train,
                "num_eval": self.num_eval, "steps_per_epoch": self.steps_per_epoch,
                "eval_batch_size": self.eval_batch_size, "loader_workers": self.loader_workers,
                "description": self.description}
