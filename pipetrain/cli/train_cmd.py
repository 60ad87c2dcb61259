"""``pipetrain train``: train a model with a pipeline schedule on local or torchrun workers.

    pipetrain train --model mlp --workers 2 --schedule pipedream --steps 30 --batch-size 32
    pipetrain train --model mlp --data digits --workers 3 --schedule pipedream --epochs 10 --target-accuracy 0.9
    pipetrain train --model vgg16 --workers 4 --config 3-1 --schedule flush --microbatches 4 --json
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        -m pipetrain train --model gpt --config 1-1-1-1 --schedule 2bw --microbatches 4

The arguments are derived from the configuration's sections (:mod:`pipetrain.job.config`):
every field declared with a flag becomes one argument, with the field's documentation as its
help. This module only builds the parser, turns the parsed arguments into a
:class:`~pipetrain.job.config.TrainConfig` and calls :func:`pipetrain.run.train`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from typing import Any

from ..errors import PipetrainError
from ..job.config import AUTO, DEFAULT_STEPS, SECTIONS, TrainConfig
from ..job.settings import Flag, settings
from ..runtime.process.log import setup_logging


def _help(fl: Flag, default: Any) -> str:
    """The field's documentation plus its default (when it has a meaningful one)."""
    text = fl.help
    if fl.kind == "value" and default is not None and "default" not in text:
        text += f" (default: {default})"
    return text


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """One argument per flagged field of every section (attribute ``dest`` = the flat key).

    Arguments not given are absent from the namespace (``default=SUPPRESS``), so the
    dataclass defaults apply and a value such as ``--threads 0`` (torch's default: ``None``)
    is told apart from no value.
    """
    groups: dict[str, Any] = {}
    for cls in SECTIONS.values():
        defaults = cls()
        for f, fl in settings(cls):
            if fl.flag is None:
                continue
            target: Any = parser
            if fl.exclusive is not None:
                if fl.exclusive not in groups:
                    groups[fl.exclusive] = parser.add_mutually_exclusive_group()
                target = groups[fl.exclusive]
            kw: dict[str, Any] = {"dest": fl.key, "default": argparse.SUPPRESS,
                                  "help": argparse.SUPPRESS if fl.hidden else _help(fl, getattr(defaults, f.name))}
            if fl.kind == "true":
                kw["action"] = "store_true"
            elif fl.kind == "false":
                kw["action"] = "store_false"
            else:
                if fl.kind == "append":
                    kw["action"] = "append"
                if fl.type is not None:
                    kw["type"] = fl.type
                if fl.choices is not None:
                    kw["choices"] = fl.choices
                if fl.metavar is not None:
                    kw["metavar"] = fl.metavar
            target.add_argument(fl.flag, **kw)


#: ``pipetrain train`` leaves a schedule it was told nothing about to the planner only for a
#: run of at least this many minibatches (the default run's). The choice measures the machine
#: first: on a machine's first run a 4-worker MLP's choice took 18-21 s of its 23 s, against
#: 3.8 s for the whole run on one worker (2026-12-07), which a shorter run (a smoke test,
#: ``--steps 1``) cannot win back. A shorter run trains the default schedule on a straight
#: pipeline split by estimated compute, measuring nothing (``ParallelConfig.auto_from_steps``);
#: ``--schedule auto`` chooses anyway.
CHOSEN_FROM_STEPS = DEFAULT_STEPS


def config_from_args(args: argparse.Namespace, open_schedule: bool = False) -> TrainConfig:
    """The :class:`TrainConfig` of parsed arguments (raises RuntimeConfigError on bad values).

    ``open_schedule`` (``pipetrain train``): a schedule left open is the planner's to choose
    (``--schedule auto``, :func:`_schedule_open`); other commands (``compare``, which sets the
    schedule of each row itself) keep the default."""
    values = _given(args)
    if "steps" in values and "epochs" in values:
        from ..errors import RuntimeConfigError

        raise RuntimeConfigError(
            f"give --steps or --epochs, not both (got --steps {values['steps']} and --epochs {values['epochs']}): "
            f"--epochs sets the steps to epochs * (train samples // batch size)")
    if open_schedule and _schedule_open(values):
        values.update(schedule=AUTO, auto_from_steps=CHOSEN_FROM_STEPS)
    return TrainConfig.of(**values)


def _given(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the command line gave, by key, converted."""
    values: dict[str, Any] = {}
    for cls in SECTIONS.values():
        for _, fl in settings(cls):
            if fl.flag is None or not hasattr(args, fl.key):
                continue
            value = getattr(args, fl.key)
            values[fl.key] = fl.convert(value) if fl.convert is not None else value
    return values


def _schedule_open(values: dict[str, Any]) -> bool:
    """``pipetrain train`` leaves the schedule to the planner (``--schedule auto``) when the
    user names no schedule, stages or schedule option and runs 2 or more local workers
    (under an outer torchrun the hosts' costs are unknown: the default schedule stays)."""
    from ..run.launcher import under_torchrun

    fixed = ("schedule", "plan", "config", "cut", "vertical_sync", "stashing", "virtual_stages")
    return (not any(k in values for k in fixed) and int(values.get("workers") or 1) > 1
            and not under_torchrun())


def _failed(e: BaseException, debug: bool) -> int:
    """Report the failure ``e`` of ``train`` in one line on stderr (after its traceback with
    ``debug``); its exit code (see :func:`run`). A SystemExit passes on."""
    from ..run.launcher import under_torchrun
    from ..runtime.process.failures import WorkerFailure
    from ..runtime.process.signals import RunInterrupted

    if isinstance(e, SystemExit):
        raise e
    if debug and not isinstance(e, (WorkerFailure, KeyboardInterrupt)):  # a worker printed its own
        traceback.print_exception(e)
    if isinstance(e, RunInterrupted):
        print(f"interrupted: {e.message}", file=sys.stderr)
        return e.exit_code
    if isinstance(e, KeyboardInterrupt):
        print("interrupted", file=sys.stderr)
        return 130
    if isinstance(e, WorkerFailure):
        # A user error in a worker reads as if this process had found it; a crash names the rank.
        print(f"error: {e.message if e.user_error else e}", file=sys.stderr)
        return 2 if e.user_error else 1
    if isinstance(e, PipetrainError):
        print(f"error: {e}", file=sys.stderr)
        return 2
    if under_torchrun():  # this worker's own failure: its rank names it
        print(f"error: rank {os.environ.get('RANK')}: {e}", file=sys.stderr)
        return 1
    text = str(e).strip()
    first = f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__
    print(f"error: {first}{'' if debug else ' (--debug prints the traceback)'}", file=sys.stderr)
    return 1


def register(subparsers: Any) -> None:
    from ..schedule import SCHEDULE_NAMES

    p = subparsers.add_parser(
        "train",
        help=f"train a model with a pipeline schedule ({', '.join(SCHEDULE_NAMES)})",
        description="Train a model on N workers with a pipeline schedule. Starts N local processes through "
                    "torchrun's launcher, or runs as one worker when started by torchrun. --workers 1 trains in "
                    "this process (plain training, the reference).",
    )
    add_config_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Train; the exit code: 0, 2 for a user error (bad input, or the model's own code raised),
    1 for any other failure, ``128 + signal`` when stopped by Ctrl-C or SIGTERM. Every failure
    is one line on stderr; ``--debug`` (or ``PIPETRAIN_DEBUG=1``) prints its traceback too."""
    from ..run.launcher import train

    cfg = config_from_args(args, open_schedule=True)
    if not cfg.output.quiet:
        setup_logging(cfg.output.progress_to_stderr)
    try:
        result = train(cfg)
    except BaseException as e:  # noqa: BLE001 - one line and an exit code for every failure
        return _failed(e, cfg.debug.show_traceback or bool(os.environ.get("PIPETRAIN_DEBUG")))
    if result is None:  # not rank 0 under torchrun
        return 0
    out = result.to_json()
    out["config_detail"] = {"model": cfg.model.name, "model_options": dict(cfg.model.options),
                            "optimizer": cfg.optimizer.name, "lr": cfg.optimizer.lr}
    if cfg.output.json:
        print(json.dumps(out, default=str))
        return 0
    loss = result.final_loss
    steps = f"{result.steps} step{'' if result.steps == 1 else 's'}"
    print(f"trained {steps} of {cfg.model.name} on {result.workers} worker(s): schedule "
          f"{result.schedule}, config {result.config}, batch {result.batch_size} ({result.microbatches} units); "
          f"final loss {loss:.6f}; {result.samples_per_second:.1f} samples/s"
          if loss is not None else f"trained {steps}")
    print(f"plan: {result.plan_source}")
    if result.saved:
        print(f"saved {result.saved} (and {result.saved}.trainer)")
    if cfg.checkpoint.save_hf:
        print(f"saved the Hugging Face directory {cfg.checkpoint.save_hf} (from_pretrained loads it)")
    return 0
