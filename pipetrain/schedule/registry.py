"""Schedules by name: ``build_schedule(name, replicas, microbatches, steps, **options)``.

The builders produce the compute order (F, B or I+W, STEP, with weight versions); this
function then applies the communication pass (:func:`pipetrain.schedule.comm.insert_comm`),
so every schedule it returns is complete: what the runtime, the validator and the
simulator execute.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from ..errors import ScheduleError
from .action import Schedule
from .comm import insert_comm
from .dp import build_dp
from .flush import build_flush
from .gpipe import build_gpipe
from .interleaved import build_interleaved
from .pipedream import build_pipedream
from .twobw import build_twobw
from .zerobubble import build_zerobubble


def _pipedream(replicas: Sequence[int], microbatches: int, steps: int, vertical_sync: bool = False) -> Schedule:
    if microbatches != 1:
        raise ScheduleError(
            f"pipedream moves whole minibatches (one unit per minibatch), so microbatches must be 1 "
            f"(got {microbatches}); pass the number of minibatches as steps, or use flush/2bw for microbatches"
        )
    return build_pipedream(replicas, steps, vertical_sync=vertical_sync)


def _interleaved(replicas: Sequence[int], microbatches: int, steps: int, virtual_stages: int = 2) -> Schedule:
    return build_interleaved(replicas, microbatches, steps, virtual_stages=virtual_stages)


#: name -> (builder(replicas, microbatches, steps, **options), allowed option names)
_BUILDERS: dict[str, tuple[Callable[..., Schedule], tuple[str, ...]]] = {
    "pipedream": (_pipedream, ("vertical_sync",)),
    "2bw": (build_twobw, ()),
    "flush": (build_flush, ()),
    "gpipe": (build_gpipe, ()),
    "dp": (build_dp, ()),
    "interleaved": (_interleaved, ("virtual_stages",)),
    "zerobubble": (build_zerobubble, ()),
}

#: Every schedule name :func:`build_schedule` accepts.
SCHEDULE_NAMES: tuple[str, ...] = tuple(_BUILDERS)

#: Schedules whose unit is a microbatch and that flush before every step.
FLUSHED_SCHEDULES = frozenset({"flush", "gpipe", "dp", "interleaved", "zerobubble"})


def build_schedule(name: str, replicas: Sequence[int], microbatches: int = 1, steps: int = 1,
                   **options: Any) -> Schedule:
    """Build a complete schedule (compute, transfers with peers, all-reduces, steps).

    Args:
        name: one of :data:`SCHEDULE_NAMES`.
        replicas: replica count per stage, ranks laid out stage by stage (``[2,1,1]``).
            For ``interleaved``, one ``1`` per model chunk: ``P * virtual_stages`` entries.
            For ``dp``, ``[N]``.
        microbatches: units per minibatch (``1`` for ``pipedream``, whose unit is the minibatch).
        steps: minibatches (optimizer steps) the lists cover.
        options: ``vertical_sync`` (pipedream, default False), ``virtual_stages`` (interleaved,
            default 2).

    Example:
        >>> s = build_schedule("flush", [1, 1], microbatches=2)
        >>> [a.long for a in s.workers[1]]
        ['1RECV_F0<0', '1F0v0', '1B0v0', '1SEND_B0>0', '1RECV_F1<0', '1F1v0', '1B1v0', '1SEND_B1>0', '1STEP0']
    """
    if name not in _BUILDERS:
        raise ScheduleError(f"unknown schedule {name!r}; valid names: {', '.join(SCHEDULE_NAMES)}")
    builder, allowed = _BUILDERS[name]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ScheduleError(
            f"schedule {name!r} takes no option {', '.join(unknown)}; its options: {', '.join(allowed) or 'none'}"
        )
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise ScheduleError(f"microbatches must be an integer >= 1 (got {microbatches!r}); use 1 or more")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ScheduleError(f"steps must be an integer >= 1 (got {steps!r}); use 1 or more")
    return insert_comm(builder(replicas, microbatches, steps, **options))
