"""The configurations the benchmark compares, each measured in its own worker processes.

- :mod:`baselines.local`: ``single`` (one process, whole model) and ``ceiling`` (two
  processes each training one stage on its own, no communication).
- :mod:`baselines.torch_pipelining`: PyTorch ``torch.distributed.pipelining`` ScheduleGPipe
  and Schedule1F1B on the same two-stage split.
- :mod:`baselines.ddp`: ``DistributedDataParallel`` on two processes, half the batch each.
- :mod:`baselines.pipetrain_cli`: pipetrain's own schedules through ``pipetrain train``.

Workers are started by :mod:`baselines.worker` (``python benchmarks/run.py _worker SPEC``);
:mod:`baselines.common` holds what every configuration shares (learning rate, fixed batch).
"""
