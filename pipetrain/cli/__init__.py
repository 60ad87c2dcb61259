"""The ``pipetrain`` command: subcommands that parse arguments and call the library.

Each subcommand lives in its own module here, ``NAME_cmd.py``, with a ``register(subparsers)``
function that adds its parser and sets ``func`` (called with the parsed namespace, returns an
exit code); :func:`subcommands` finds them.
"""
from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
from typing import Any

from ..errors import PipetrainError
from ..runtime.process.forkserver import reopen_closed_std_fds, start_server, wants_local_workers

#: Subcommands listed first, in the data flow's order; any other ``NAME_cmd`` module follows.
_FIRST = ["profile", "plan", "simulate", "train"]


def subcommands() -> list[str]:
    """Every subcommand: the modules ``pipetrain/cli/NAME_cmd.py``, data-flow order first."""
    found = {m.name[: -len("_cmd")] for m in pkgutil.iter_modules(__path__) if m.name.endswith("_cmd")}
    return [n for n in _FIRST if n in found] + sorted(found - set(_FIRST))


SUBCOMMANDS = subcommands()


class SubcommandParser(argparse.ArgumentParser):
    """A subcommand's parser: an argument it does not know is its own error, printed with its
    usage (``usage: pipetrain plan ...``) and one ``error:`` line. argparse otherwise hands a
    subparser's leftovers to the top-level parser, whose error shows the top-level usage."""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[Any, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipetrain",
        description="Pipeline-parallel training: profile a model, plan its stages, simulate and run schedules.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=SubcommandParser)
    for name in SUBCOMMANDS:
        importlib.import_module(f"{__name__}.{name}_cmd").register(sub)
    return parser


#: Python's resource tracker warns, after the process has exited, about semaphores still
#: registered: torch elastic's process context leaves some when a worker fails, and the
#: tracker (which does clean them up) then prints a warning after the CLI's one error line.
QUIET_RESOURCE_TRACKER = "ignore:resource_tracker:UserWarning"


def quiet_resource_tracker() -> None:
    """Silence only the resource tracker's leak warning, in the tracker this process will start
    (``PYTHONWARNINGS`` is read by the tracker process; other warning filters are kept)."""
    current = os.environ.get("PYTHONWARNINGS", "")
    if QUIET_RESOURCE_TRACKER not in current.split(","):
        os.environ["PYTHONWARNINGS"] = f"{current},{QUIET_RESOURCE_TRACKER}" if current else QUIET_RESOURCE_TRACKER


def main(argv: list[str] | None = None) -> int:
    reopen_closed_std_fds()  # before any socket: under torchrun too, descriptors pass to workers
    quiet_resource_tracker()  # before any semaphore: the error line stays the last line
    if wants_local_workers(sys.argv[1:] if argv is None else argv):
        start_server()  # its imports overlap this process's (runtime/process/forkserver.py)
    return dispatch(build_parser(), argv)


def cluster_main(argv: list[str]) -> int:
    """``python -m pipetrain.cluster ACTION ...``: ``pipetrain cluster ACTION ...`` (and
    ``python -m pipetrain.cluster calibrate ...``: ``pipetrain calibrate ...``)."""
    from . import calibrate_cmd, cluster_cmd

    parser = argparse.ArgumentParser(prog="python -m pipetrain.cluster")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=SubcommandParser)
    cluster_cmd.register(sub)
    calibrate_cmd.register(sub)
    if argv and argv[0] not in ("cluster", "calibrate", "-h", "--help"):
        argv = ["cluster", *argv]  # `python -m pipetrain.cluster up` = `pipetrain cluster up`
    reopen_closed_std_fds()  # as main() does: `cluster run -- compare` trains from this process
    quiet_resource_tracker()
    return dispatch(parser, argv)


def dispatch(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse ``argv`` with ``parser`` (subparsers registered by ``NAME_cmd.register``) and run
    the chosen subcommand's ``func``: its exit code. No subcommand: the help, exit 2; a
    PipetrainError: one line ``error: ...``, exit 2; Ctrl-C: exit 130; output piped into a
    reader that closed early: exit 0. Used by :func:`main` and ``python -m pipetrain.cluster``."""
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except PipetrainError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and closed early
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 -- stays open as stdout until exit
        except OSError:
            pass
        return 0


if __name__ == "__main__":
    sys.exit(main())
