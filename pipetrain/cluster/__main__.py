"""``python -m pipetrain.cluster ACTION ...``: the same as ``pipetrain cluster ACTION ...``
(and ``python -m pipetrain.cluster calibrate ...`` as ``pipetrain calibrate ...``)."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from ..cli import calibrate_cmd, cluster_cmd, dispatch

    parser = argparse.ArgumentParser(prog="python -m pipetrain.cluster")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    cluster_cmd.register(sub)
    calibrate_cmd.register(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in ("cluster", "calibrate", "-h", "--help"):
        argv = ["cluster", *argv]  # `python -m pipetrain.cluster up` = `pipetrain cluster up`
    return dispatch(parser, argv)


if __name__ == "__main__":
    sys.exit(main())
