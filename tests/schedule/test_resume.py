"""A consistent cut of an asynchronous schedule (schedule/resume.py): the suffix runs to its
end without a deadlock, holds exactly the later units and updates, and the pause points let
every rank reach them while the others are still inside the segment."""
from __future__ import annotations

from typing import Any

import pytest

from pipetrain.schedule.action import COMPUTE_OPS, Op, Schedule
from pipetrain.schedule.registry import build_schedule
from pipetrain.schedule.resume import needed_versions, pause_points, stage_updates, suffix
from pipetrain.schedule.validate import dry_run

#: (schedule, replicas, microbatches, options)
CASES: list[tuple[str, list[int], int, dict[str, Any]]] = [
    ("pipedream", [1, 1, 1, 1], 1, {}), ("pipedream", [1, 1], 1, {"stashing": False}),
    ("pipedream", [1, 1, 1], 1, {"vertical_sync": True}), ("2bw", [1, 1], 2, {}), ("2bw", [1, 1, 1], 4, {}),
    ("pipedream", [2, 1], 1, {}), ("pipedream", [1, 2], 1, {})]
STEPS = 8


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}-{c[3]}")
def test_suffix_runs_and_holds_the_later_units(case: tuple[str, list[int], int, dict[str, Any]]) -> None:
    name, replicas, m, opts = case
    s = build_schedule(name, replicas, m, STEPS, **opts)
    assert suffix(s, 0).workers == s.workers
    for done in range(2, STEPS, 2):
        rest = suffix(s, done)
        dry_run(rest)   # no deadlock: every transfer is kept or dropped whole
        for r, (full, kept) in enumerate(zip(s.workers, rest.workers)):
            units = {a.mb for a in kept if a.op in COMPUTE_OPS}
            assert units == {a.mb for a in full if a.op in COMPUTE_OPS and a.mb // m >= done}
            for k in s.stages_of_rank(r):
                u = stage_updates(s, k, done)
                steps = sorted(a.mb for a in kept if a.stage == k and a.op is Op.STEP)
                assert steps == sorted(a.mb for a in full if a.stage == k and a.op is Op.STEP and a.mb >= u)
        points = pause_points(s, done)
        # every rank reaches its pause point: the schedule cut there runs to its end
        dry_run(Schedule("prefix", [w[:p] for w, p in zip(s.workers, points)], s.stage_ranks,
                         microbatches=s.microbatches, steps=s.steps))
        for r, (full, p) in enumerate(zip(s.workers, points)):
            earlier = [i for i, a in enumerate(full) if a not in rest.workers[r]]
            assert max(earlier) < p    # every action of an earlier unit or update is before it
            for k, versions in needed_versions(s, done, r).items():
                assert stage_updates(s, k, done) in versions and max(versions) == stage_updates(s, k, done)


def test_the_pause_points_of_pipedream() -> None:
    s = build_schedule("pipedream", [1, 1], 1, 4)
    assert pause_points(s, 2) == [12, 10]      # after each stage's STEP1 (version 2)
    assert [str(a) for a in s.workers[0][10:12]] == ["0B1", "0STEP1"]
    assert needed_versions(s, 2, 0) == {0: {1, 2}}   # F2 ran under version 1 before the cut
