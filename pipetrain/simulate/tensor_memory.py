"""The tensor memory a run will hold per worker, predicted: the runtime ledger's accounting.

:func:`predict_tensor_memory` simulates the run's own schedule on costs from a profile
(:meth:`StageCosts.from_plan`) and returns each worker's peak bytes, counted as the runtime's
:class:`~pipetrain.runtime.guards.tensor_ledger.TensorLedger` counts them:

- weights: live weight versions (the schedule's version rule: pipedream up to ``P - s`` at
  stage ``s``, 2bw 2, flushed schedules 1) times the stage's weight bytes;
- gradients: one accumulator per weight: fused ``Linear`` sinks (and a replicated stage's
  flat buffers) throughout, the others from a group's first backward to its STEP;
- optimizer state: ``optimizer_state`` bytes per weight byte (SGD 0, with momentum 1, Adam 2);
- activations: per unit in flight, what autograd saves in the stage's forward (the profile's
  per-node ``saved_bytes``, :func:`pipetrain.plan.stage_memory.node_held_bytes`; the loss's on the
  last stage);
- communication: the receive-buffer pool (engine._memory);
- data: ``data_steps`` cached minibatches of inputs (first stage) and targets (last stage).

Not counted, on either side: temporaries inside one action, the torch runtime, the
allocator's free memory (docs/performance.md, "Memory").
"""
from __future__ import annotations

from dataclasses import replace

from ..plan.types import Plan
from ..profile.types import Profile
from ..schedule.action import Schedule
from .costs import StageCosts
from .engine import simulate

__all__ = ["predict_tensor_memory"]


def predict_tensor_memory(schedule: Schedule, plan: Plan, profile: Profile, *,
                          optimizer_state: float | None = None, data_steps: int = 0, target_bytes: float = 0.0,
                          lookahead: int = 8) -> list[float]:
    """Peak bytes per worker of running ``schedule`` on ``plan`` (module docstring).

    Args:
        schedule: the run's schedule (its stages are the plan's, its unit ``1/microbatches``
            of the profile's minibatch).
        plan: the stages' node lists, with the profile's node names.
        profile: per-node sizes for one minibatch; with ``saved_bytes`` (the profiler's) for
            the activations autograd saves.
        optimizer_state: bytes of optimizer state per weight byte (None: the profile's).
        data_steps: minibatches the data object caches (the runtime's synthetic data
            prefetches a segment's steps).
        target_bytes: bytes of one minibatch's target (cached on the last stage).
        lookahead: actions ahead a receive is posted (``--lookahead``).
    """
    costs = StageCosts.from_plan(plan, profile, units=max(1, schedule.microbatches))
    costs.lookahead = lookahead
    factor = profile.optimizer_state_bytes_per_parameter_byte if optimizer_state is None else optimizer_state
    inputs = float(sum(n.activation_bytes for n in profile.nodes if n.is_input))
    last = len(costs) - 1
    data = [(inputs if k == 0 else 0.0) + (target_bytes if k == last else 0.0) for k in range(len(costs))]
    costs.stages = [replace(st, optimizer_bytes=factor * st.parameter_bytes, data_bytes=data_steps * data[k])
                    for k, st in enumerate(costs.stages)]
    return list(simulate(schedule, costs).peak_memory)
