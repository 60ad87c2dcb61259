"""``python -m pipetrain.cluster ACTION ...``: the same as ``pipetrain cluster ACTION ...``
(and ``python -m pipetrain.cluster calibrate ...`` as ``pipetrain calibrate ...``)."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from ..cli import cluster_main

    return cluster_main(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
