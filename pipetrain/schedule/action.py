"""Actions and schedules as plain data.

An :class:`Action` is one thing a worker does: ``0F3`` (stage 0, forward of unit 3),
``1B3`` (stage 1, backward of unit 3), ``0SEND_F3`` (send stage 0's output of unit 3 to the
next stage), ``1RECV_F3``, ``1SEND_B3``, ``0RECV_B3``, ``0ALLREDUCE2`` (all-reduce stage 0's
gradients among its replicas, before its step 2), ``0STEP2`` (stage 0's optimizer step 2),
and, for zero-bubble schedules, ``1I3`` / ``1W3`` (input-gradient and weight-gradient halves
of a backward). A *unit* is a microbatch (``flush``, ``gpipe``, ``2bw``, ``interleaved``,
``dp``) or a whole minibatch (``pipedream``), numbered globally from 0 across steps.

Optional fields, shown in the long form: ``version`` (``0F3v2``: the weight version, i.e.
the number of optimizer steps of that stage, that this forward/backward uses) and ``peer``
(``0SEND_F3>1``: the rank a transfer goes to; ``1RECV_F3<0``: the rank it comes from).

A :class:`Schedule` is, for every worker (rank), the ordered list of its actions, plus the
map from stages to the ranks that hold them. The simulator, the validator, the pictures and
the runtime all execute these same lists.
"""
from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any


class Op(str, Enum):
    F = "F"
    B = "B"
    I = "I"  # noqa: E741  backward for the input gradient only (zero-bubble)
    W = "W"  # backward for the weight gradient only (zero-bubble)
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    ALLREDUCE = "ALLREDUCE"
    STEP = "STEP"

    def __str__(self) -> str:
        return self.value


COMPUTE_OPS = frozenset({Op.F, Op.B, Op.I, Op.W})
COMM_OPS = frozenset({Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B})

_ACTION_RE = re.compile(
    r"^(?P<stage>\d+)(?P<op>SEND_F|RECV_F|SEND_B|RECV_B|ALLREDUCE|STEP|F|B|I|W)(?P<mb>\d+)"
    r"(?:v(?P<version>\d+))?(?:(?P<dir>[<>])(?P<peer>\d+))?$"
)


@dataclass(frozen=True)
class Action:
    """One action of one worker. For ``ALLREDUCE`` and ``STEP``, ``mb`` is the stage's step index."""

    stage: int
    op: Op
    mb: int
    version: int | None = None
    peer: int | None = None

    def __str__(self) -> str:
        """Short form, ``1F3``: stage, operation, unit."""
        return f"{self.stage}{self.op.value}{self.mb}"

    @property
    def long(self) -> str:
        """Long form with version and peer: ``1F3v2``, ``0SEND_F3>1``."""
        s = str(self)
        if self.version is not None:
            s += f"v{self.version}"
        if self.peer is not None:
            s += (">" if self.op in (Op.SEND_F, Op.SEND_B) else "<") + str(self.peer)
        return s

    @staticmethod
    def parse(text: str) -> Action:
        from ..errors import ScheduleError

        m = _ACTION_RE.match(text.strip())
        if not m:
            raise ScheduleError(
                f"cannot parse action {text!r}: the form is STAGE OP UNIT [vVERSION] [>PEER|<PEER], "
                f"e.g. '1F3', '0B2v1', '0SEND_F3>1'"
            )
        g = m.groupdict()
        return Action(
            stage=int(g["stage"]),
            op=Op(g["op"]),
            mb=int(g["mb"]),
            version=int(g["version"]) if g["version"] is not None else None,
            peer=int(g["peer"]) if g["peer"] is not None else None,
        )


@dataclass
class Schedule:
    """Per-worker action lists.

    Attributes:
        name: the schedule's name (``pipedream``, ``flush``...).
        workers: ``workers[rank]`` is that rank's ordered list of actions.
        stage_ranks: ``stage_ranks[stage]`` lists the ranks holding a replica of that stage
            (interleaved schedules put several stages on one rank).
        microbatches: units per optimizer step of one replica group (``1`` for pipedream).
        steps: minibatches (optimizer steps of the last stage) the lists cover.
        options: the builder's options (``vertical_sync``, ``virtual_stages``...).
    """

    name: str
    workers: list[list[Action]]
    stage_ranks: list[list[int]]
    microbatches: int = 1
    steps: int = 1
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    @property
    def num_stages(self) -> int:
        return len(self.stage_ranks)

    def stages_of_rank(self, rank: int) -> list[int]:
        return [s for s, ranks in enumerate(self.stage_ranks) if rank in ranks]

    # -- text / CSV ------------------------------------------------------------------
    def to_csv(self) -> str:
        """One row per worker: ``rank,action,action,...`` in long form."""
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(["# schedule", self.name, "stage_ranks",
                    ";".join("/".join(map(str, r)) for r in self.stage_ranks),
                    "microbatches", self.microbatches, "steps", self.steps])
        for rank, actions in enumerate(self.workers):
            w.writerow([rank] + [a.long for a in actions])
        return buf.getvalue()

    @staticmethod
    def from_csv(text: str) -> Schedule:
        from ..errors import ScheduleError

        rows = [r for r in csv.reader(io.StringIO(text)) if r]
        if not rows or rows[0][0] != "# schedule":
            raise ScheduleError("not a pipetrain schedule file: the first row must start with '# schedule'")
        head = rows[0]
        stage_ranks = [[int(x) for x in part.split("/")] for part in head[3].split(";")]
        workers = [[Action.parse(a) for a in r[1:] if a] for r in rows[1:]]
        return Schedule(head[1], workers, stage_ranks, microbatches=int(head[5]), steps=int(head[7]))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_csv())

    @staticmethod
    def load(path: str | Path) -> Schedule:
        return Schedule.from_csv(Path(path).read_text())

    def grid(self, compute_only: bool = True, mark: dict[int, int] | None = None) -> str:
        """The schedule as a grid: one row per worker, one column per action slot.

        ``mark`` maps a rank to the index of an action to flag with ``*`` (where a dry run
        stopped).
        """
        rows = []
        for rank, actions in enumerate(self.workers):
            cells = []
            for i, a in enumerate(actions):
                if compute_only and a.op not in COMPUTE_OPS and not (mark and mark.get(rank) == i):
                    continue
                c = str(a)
                if mark and mark.get(rank) == i:
                    c = "*" + c
                cells.append(c)
            rows.append(cells)
        width = max((len(c) for r in rows for c in r), default=3)
        out = []
        for rank, cells in enumerate(rows):
            out.append(f"rank {rank:>2} | " + " ".join(c.rjust(width) for c in cells))
        return "\n".join(out)
