"""``python -m pipetrain.cluster ACTION ...``: the same as ``pipetrain cluster ACTION ...``
(and ``python -m pipetrain.cluster calibrate ...`` as ``pipetrain calibrate ...``)."""
from __future__ import annotations

import argparse
import sys

from ..errors import PipetrainError


def main(argv: list[str] | None = None) -> int:
    from ..cli import calibrate_cmd, cluster_cmd

    parser = argparse.ArgumentParser(prog="python -m pipetrain.cluster")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    cluster_cmd.register(sub)
    calibrate_cmd.register(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in ("cluster", "calibrate", "-h", "--help"):
        argv = ["cluster", *argv]  # `python -m pipetrain.cluster up` = `pipetrain cluster up`
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


if __name__ == "__main__":
    sys.exit(main())
