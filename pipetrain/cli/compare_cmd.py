"""``pipetrain compare``: train one model on one data set with several schedules, compare them.

    pipetrain compare --model mlp --data digits --workers 2 --schedules dp,pipedream,2bw,flush,gpipe \\
        --no-stashing --target-accuracy 0.9 --plot docs/img/compare_digits
    pipetrain compare --model gpt --data shakespeare --workers 2 --schedules dp,pipedream,flush \\
        --target-loss 2.0 --epochs 2 --json

Every configuration trains one after the other with the same seed, data, batch size and
optimizer (:func:`pipetrain.run.compare.compare`); with a target and neither ``--steps`` nor
``--epochs`` each trains until the target, at most ``--max-epochs`` (default 50), and a row
that the limit ended gets one line saying so. Real data is evaluated 10 times an epoch unless
``--eval-every`` / ``--evals-per-epoch`` says. The table (:func:`pipetrain.metrics.format_table`)
gives time (training only) and epochs (fractional) to the target, the last evaluation,
samples/s, the evaluations and the wall time apart, and the bytes all workers sent per
sample. ``--no-stashing`` adds PipeDream without weight stashing as its own row;
``--plot DIR`` writes the accuracy (perplexity for language models) curves against time and
epochs; ``--json`` prints one JSON object ``{"rows": [...]}``. Every ``train`` option is
accepted and passed to every configuration, except the schedule (given by ``--schedules``)
and the single-run checkpoint paths; schedule options go to the schedules that take them.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from ..errors import RuntimeConfigError

if TYPE_CHECKING:
    from ..run.compare import TrainFunction

#: Schedules compared when ``--schedules`` is not given.
DEFAULT_SCHEDULES = "dp,pipedream,2bw,flush,gpipe"

#: Train flags (flat keys) that name one run's files: every configuration would overwrite them.
_REFUSED = {"save": "--save", "resume": "--resume", "checkpoint_dir": "--checkpoint-dir"}


def register(subparsers: Any) -> None:
    from .train_cmd import add_config_arguments

    p = subparsers.add_parser(
        "compare",
        help="train with several schedules and compare time to a target accuracy",
        description="Train the same model on the same data with several schedules, one after the other (same "
                    "seed, data and optimizer), and print a table of time and epochs to the target accuracy "
                    "(or loss), final accuracy, samples/s, the evaluations and wall time apart, and bytes sent "
                    "per sample by all workers. With a target and neither --steps nor --epochs, each schedule "
                    "trains until the target, at most --max-epochs (default 50); real data is evaluated 10 "
                    "times an epoch unless --eval-every / --evals-per-epoch says. Takes every `pipetrain train` "
                    "option except --schedule.",
    )
    p.add_argument("--schedules", default=DEFAULT_SCHEDULES, metavar="NAME[,NAME...]",
                   help=f"the schedules to compare, in row order (default: {DEFAULT_SCHEDULES})")
    p.add_argument("--plot", default=None, metavar="DIR",
                   help="write accuracy (perplexity for language models) against training time and against "
                        "epochs as PNGs into DIR")
    p.add_argument("--auto-plan", action="store_true",
                   help="let the planner choose each pipeline schedule's stages and replicas (default: a "
                        "straight pipeline of --workers stages, unless --config/--plan/--cut is given)")
    add_config_arguments(p)
    # --no-stashing (a pipedream option for train) adds a row here: say so in the help.
    hidden = {"--schedule", *_REFUSED.values()}  # still parsed, to refuse them in one clear line
    for action in p._actions:
        if "--no-stashing" in action.option_strings:
            action.help = "add a row for PipeDream without weight stashing (backward with the newest weights)"
        elif hidden & set(action.option_strings):
            action.help = argparse.SUPPRESS
    p.set_defaults(func=run)


def run(args: argparse.Namespace, train: TrainFunction | None = None) -> int:
    """Compare the schedules of ``args`` and print the table (or JSON); ``train`` trains each
    configuration (default: local processes; ``pipetrain cluster run`` passes the emulated
    cluster's, :func:`pipetrain.run.on_cluster.cluster_train`)."""
    from ..metrics import format_table
    from ..run.compare import compare, schedule_option_keys
    from ..runtime.process.log import setup_logging
    from .train_cmd import config_from_args

    if hasattr(args, "schedule"):
        raise RuntimeConfigError(f"compare runs every schedule of --schedules; drop --schedule {args.schedule} "
                                 f"and pass --schedules {args.schedule},...")
    for key, flag in _REFUSED.items():
        if hasattr(args, key):
            raise RuntimeConfigError(f"{flag} names the files of one run, but compare trains several; drop {flag} "
                                     f"(--log-dir DIR keeps each configuration's logs in DIR/NAME)")
    no_stashing = getattr(args, "stashing", True) is False
    options: dict[str, Any] = {}
    for key in schedule_option_keys():
        if hasattr(args, key):
            value = getattr(args, key)
            delattr(args, key)
            if key != "stashing":
                options[key] = value
    microbatches = getattr(args, "microbatches", None)  # for the schedules with microbatches (not pipedream)
    if hasattr(args, "microbatches"):
        delattr(args, "microbatches")
    schedules = [s for s in str(args.schedules).split(",") if s.strip()]
    plot, auto_plan = args.plot, bool(args.auto_plan)
    base = config_from_args(args)
    if base.parallel.workers is None:
        raise RuntimeConfigError("compare needs --workers N (every configuration runs on N workers), e.g. --workers 2")
    as_json = base.output.json
    base = base.replace(json=True)  # every run's progress (workers' too) on stderr: stdout is the table's
    if not base.output.quiet:
        setup_logging(to_stderr=True)  # progress on stderr; stdout carries the table or the JSON

    def started(entry: Any, cfg: Any) -> None:
        print(f"== {entry.label}: {cfg.parallel.workers} workers, schedule {cfg.parallel.schedule}"
              + (f", config {cfg.parallel.config}" if cfg.parallel.config else ""), file=sys.stderr, flush=True)

    def failed(f: Any) -> None:
        print(f"error: {f.label}: {f.message}", file=sys.stderr, flush=True)

    result = compare(base, schedules, no_stashing=no_stashing, schedule_options=options, auto_plan=auto_plan,
                     microbatches=microbatches, on_start=started, on_failure=failed, train=train)
    ev = base.evaluation
    target = _describe_target(ev.target_accuracy, ev.target_loss)
    plots: list[str] = []
    if plot is not None and result.rows:
        from ..metrics import write_plots

        plots = [str(p) for p in write_plots(result.rows, plot, target_accuracy=ev.target_accuracy,
                                             target_loss=ev.target_loss,
                                             title=None)]
    notices = [n for n in (r.limit_notice(ev.target_accuracy, ev.target_loss) for r in result.rows) if n]
    if as_json:
        for n in notices:  # stdout carries the JSON alone
            print(n, file=sys.stderr, flush=True)
        print(json.dumps(result.to_json(target_accuracy=ev.target_accuracy, target_loss=ev.target_loss,
                                        model=base.model.name, data=base.data.data,
                                        workers=base.parallel.workers, plots=plots), default=str))
    else:
        if result.rows:
            print(format_table(result.rows, target))
        for n in notices:
            print(n)
        for f in result.failures:
            print(f"{f.label}: not run: {f.message}")
        for p in plots:
            print(f"wrote {p}")
    if not result.rows:
        return 1
    return 0 if not result.failures else 1


def _describe_target(accuracy: float | None, loss: float | None) -> str:
    from ..metrics import TargetTracker

    return TargetTracker(accuracy, loss).describe_target()
