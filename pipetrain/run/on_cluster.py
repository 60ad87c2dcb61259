"""Training runs on an emulated cluster, for commands that run several (``pipetrain compare``).

:func:`cluster_train` returns a function with :func:`pipetrain.run.train`'s signature that
trains a :class:`~pipetrain.job.config.TrainConfig` across the hosts of an
:class:`~pipetrain.cluster.EmulatedCluster` (one torchrun agent per host, gloo on the hosts'
bandwidth-limited interfaces) and returns rank 0's :class:`~pipetrain.job.result.RunResult`.
``compare(base, schedules, train=cluster_train(cluster))`` (:func:`pipetrain.run.compare.compare`)
is then the paper's comparison (time to accuracy of each schedule at low bandwidth) on
emulated hosts; from a shell, ``pipetrain cluster run`` makes the cluster, runs the
comparison in it and removes it::

    pipetrain cluster run --hosts 2 --bandwidth 50Mbit -- \
        compare --model mlp --data digits --workers 2 --epochs 3 --target-accuracy 0.9 --schedules dp,pipedream

How a run travels: the configuration is pickled into a file the hosts read (network
namespaces share the filesystem); each host's torchrun agent starts ``python -m
pipetrain.run.on_cluster FILE``, whose workers call :func:`pipetrain.run.train` under the
outer torchrun (the runtime's own path for ``torchrun ... pipetrain train``); rank 0 prints
its result as one JSON line, which becomes the returned RunResult (without ``state``).
"""
from __future__ import annotations

import dataclasses
import json
import os
import pickle
import sys
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import RuntimeConfigError

if TYPE_CHECKING:
    from ..cluster.netns import EmulatedCluster
    from ..job.config import TrainConfig
    from ..job.result import RunResult

__all__ = ["cluster_train", "result_from_json"]

_MARK = "PIPETRAIN_ON_CLUSTER_RESULT "


def result_from_json(d: dict[str, Any]) -> RunResult:
    """A RunResult from its :meth:`~pipetrain.job.result.RunResult.to_json` form (unknown keys dropped)."""
    from ..job.result import RunResult

    names = {f.name for f in dataclasses.fields(RunResult)}
    return RunResult(**{k: v for k, v in d.items() if k in names})


def cluster_train(cluster: EmulatedCluster, *, nproc_per_node: int = 1,
                  timeout: float = 3600.0) -> Callable[[TrainConfig], RunResult]:
    """``train(cfg) -> RunResult`` across ``cluster`` (module docstring).

    The configuration's ``workers`` must equal the cluster's processes (hosts x
    ``nproc_per_node``), or be unset. Raises RuntimeConfigError for a mismatch and
    RuntimeError (with the failing hosts' last stderr lines) when the run fails.
    """
    world = cluster.hosts * nproc_per_node

    def train(cfg: TrainConfig) -> RunResult:
        from ..cluster.launch import launch_torchrun

        workers = cfg.parallel.workers
        if workers is not None and workers != world:
            raise RuntimeConfigError(f"the run asks for --workers {workers} but the emulated cluster has {world} "
                                     f"processes ({cluster.hosts} hosts x {nproc_per_node}); pass --workers {world}")
        fd, path = tempfile.mkstemp(prefix="pipetrain-cluster-cfg-", suffix=".pkl")
        try:
            with os.fdopen(fd, "wb") as f:
                pickle.dump(cfg.replace(workers=world), f)
            r = launch_torchrun(cluster, [path], nproc_per_node=nproc_per_node, timeout=timeout,
                                module="pipetrain.run.on_cluster")
        finally:
            os.unlink(path)
        for a in r.agents:
            for line in a.stdout.splitlines():
                if line.startswith(_MARK):
                    if not r.ok:
                        break
                    return result_from_json(json.loads(line[len(_MARK):]))
        raise RuntimeError(f"the run on the emulated cluster failed (exit {r.returncode}): {r.describe_failure()}")

    return train


def _worker_main(path: str) -> int:
    """One worker under the outer torchrun: train the pickled configuration; rank 0 prints it."""
    from .launcher import train

    with open(path, "rb") as f:
        cfg = pickle.load(f)
    result = train(cfg)
    if result is not None:
        sys.stdout.write(_MARK + json.dumps(result.to_json(), default=str) + "\n")
        sys.stdout.flush()
    return 0


def main(argv: list[str]) -> int:
    """``python -m pipetrain.run.on_cluster CONFIG.pkl``: one worker of :func:`cluster_train`'s run."""
    if len(argv) == 1 and argv[0].endswith(".pkl"):
        return _worker_main(argv[0])
    print("usage: python -m pipetrain.run.on_cluster CONFIG.pkl (started by cluster_train on every host); "
          "to compare on an emulated cluster: pipetrain cluster run --hosts N --bandwidth R -- compare ...",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
