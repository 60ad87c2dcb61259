"""Training runs on an emulated cluster, for commands that run several (``pipetrain compare``).

:func:`cluster_train` returns a function with :func:`pipetrain.run.train`'s signature that
trains a :class:`~pipetrain.runtime.config.TrainConfig` across the hosts of an
:class:`~pipetrain.cluster.EmulatedCluster` (one torchrun agent per host, gloo on the hosts'
bandwidth-limited interfaces) and returns rank 0's :class:`~pipetrain.runtime.result.RunResult`.
``compare(base, schedules, train=cluster_train(cluster))`` is then the paper's comparison
(time to accuracy of each schedule at low bandwidth) on emulated hosts;
:func:`run_on_cluster` makes the cluster, runs a ``pipetrain`` command line's comparison or
training in it and removes it; from a shell::

    python -m pipetrain.run.on_cluster --hosts 2 --bandwidth 50Mbit -- \
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
    from ..runtime.config import TrainConfig
    from ..runtime.result import RunResult

__all__ = ["cluster_train", "run_on_cluster", "result_from_json"]

_MARK = "PIPETRAIN_ON_CLUSTER_RESULT "


def result_from_json(d: dict[str, Any]) -> RunResult:
    """A RunResult from its :meth:`~pipetrain.runtime.result.RunResult.to_json` form (unknown keys dropped)."""
    from ..runtime.result import RunResult

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


def run_on_cluster(argv: list[str], hosts: int, bandwidth: str | int | None, *, nproc_per_node: int = 1,
                   timeout: float = 3600.0) -> int:
    """Run ``pipetrain ARGV`` (``compare ...`` or ``train ...``) with its training runs on a new
    emulated cluster of ``hosts`` hosts at ``bandwidth``; the cluster is removed afterwards.

    ``compare`` runs here, each of its configurations across the hosts (:func:`cluster_train`);
    anything else goes through torchrun on every host like ``pipetrain cluster run``.
    Returns the command's exit code.
    """
    from ..cluster.netns import EmulatedCluster

    with EmulatedCluster(hosts, bandwidth) as c:
        if argv and argv[0] == "compare":
            from ..cli import main as cli_main

            _TRAIN_OVERRIDE.append(cluster_train(c, nproc_per_node=nproc_per_node, timeout=timeout))
            try:
                return int(cli_main(argv) or 0)
            finally:
                _TRAIN_OVERRIDE.pop()
        from ..cluster.launch import launch_torchrun

        r = launch_torchrun(c, argv, nproc_per_node=nproc_per_node, timeout=timeout)
        for a in r.agents:
            sys.stdout.write(a.stdout)
            for line in a.stderr.splitlines():
                print(f"[h{a.host}] {line}", file=sys.stderr)
        return r.returncode


#: The training function ``compare`` should use while :func:`run_on_cluster` runs it (a stack;
#: empty: local runs). ``pipetrain.cli.compare_cmd`` passes ``current_train()`` as ``train=``.
_TRAIN_OVERRIDE: list[Callable[[TrainConfig], RunResult]] = []


def current_train() -> Callable[[TrainConfig], RunResult] | None:
    """The training function a comparison started by :func:`run_on_cluster` must use, or None."""
    return _TRAIN_OVERRIDE[-1] if _TRAIN_OVERRIDE else None


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
    """``python -m pipetrain.run.on_cluster --hosts N [--bandwidth R] [--timeout S] -- compare ...``
    (or ``-- train ...``): :func:`run_on_cluster`. With one ``.pkl`` argument: a worker."""
    if len(argv) == 1 and argv[0].endswith(".pkl"):
        return _worker_main(argv[0])
    import argparse

    if "--" not in argv:
        print("usage: python -m pipetrain.run.on_cluster --hosts N [--bandwidth R] -- compare|train ARGS",
              file=sys.stderr)
        return 2
    i = argv.index("--")
    p = argparse.ArgumentParser(prog="python -m pipetrain.run.on_cluster")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--bandwidth", default=None)
    p.add_argument("--nproc-per-node", type=int, default=1)
    p.add_argument("--timeout", type=float, default=3600.0)
    a = p.parse_args(argv[:i])
    return run_on_cluster(argv[i + 1:], a.hosts, a.bandwidth, nproc_per_node=a.nproc_per_node, timeout=a.timeout)


if __name__ == "__main__":
    # through the package's module object, not this __main__ copy: compare_cmd reads the
    # training function from pipetrain.run.on_cluster's own stack
    from pipetrain.run.on_cluster import main as _main

    sys.exit(_main(sys.argv[1:]))
