"""Periodic, consistent, layout-free checkpoints (torch.distributed.checkpoint underneath).

Every rank saves only what it holds, keyed by the model's own parameter names; any later
layout (another plan, schedule or worker count) loads what it needs by name; a checkpoint is
complete exactly when its manifest is written and its directory renamed. See
docs/checkpoints.md for the on-disk layout and how the runtime calls this package.

    save_checkpoint_dir(root, step, rank_state=RankState(...), manifest_info={...}, keep=3)
    path = latest_checkpoint(root)                      # None: nothing to resume
    path = resume_point(root)                           # the launcher's choice: a damaged latest one is refused
    part = load_for_rank(path, {name: shape, ...}, rank=rank)
    load_into_model(path, model)                        # plain nn.Module
"""
from __future__ import annotations

from .manifest import CheckpointError, Manifest, TensorSpec, check_model, check_params, read_manifest
from .retention import (
    Survey,
    complete_checkpoints,
    latest_checkpoint,
    prune,
    remove_partial,
    require_latest,
    resume_point,
    set_aside,
    survey,
)
from .state import RankState
from .store import (
    RankLoad,
    export_state_dict,
    load_for_rank,
    load_into_model,
    load_rank_extras,
    read_state_dict,
    save_checkpoint_dir,
)

__all__ = ["CheckpointError", "Manifest", "TensorSpec", "RankState", "RankLoad", "save_checkpoint_dir",
           "latest_checkpoint", "require_latest", "complete_checkpoints", "prune", "read_manifest", "check_params",
           "Survey", "survey", "resume_point", "remove_partial", "set_aside",
           "check_model",
           "load_for_rank", "load_rank_extras", "read_state_dict", "load_into_model", "export_state_dict"]
