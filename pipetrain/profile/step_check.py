"""Whether a profile adds up: its forward + backward against the whole model's, measured in the same run.

The profiler ends every measurement with one whole-model forward + backward (the captured
graph as one ``GraphModule``, backward from a random gradient of its output: what a single
stage holding every node runs, without the loss). A profile whose nodes sum to something
else would mislead the planner, so :func:`step_check` compares the two::

    ratio = (sum of the nodes' forward + backward) / (measured whole-model step)

(A model whose activations exceed the check's memory bound is checked on the tail of its
graph from ``Profile.measured_from``: the sum then runs over those nodes.)

and flags a ratio outside ``1 +- STEP_TOLERANCE``. On a quiet machine the profiler's segments
are within a few percent of the step (docs/performance.md); a busy one can push them apart,
which is what the warning is for.
"""
from __future__ import annotations

from dataclasses import dataclass

from .types import Profile

__all__ = ["STEP_TOLERANCE", "StepCheck", "step_check"]

#: Largest relative difference between a profile's total and the measured step that agrees.
STEP_TOLERANCE = 0.15


@dataclass(frozen=True)
class StepCheck:
    """A profile's forward + backward total against the measured whole-model step (seconds)."""

    total: float
    measured: float
    tolerance: float = STEP_TOLERANCE
    first_node: str | None = None        # the region's first node (None: the whole model)
    share: float = 1.0                   # the region's part of the profile's total

    @property
    def ratio(self) -> float:
        return self.total / self.measured if self.measured > 0 else float("inf")

    @property
    def agrees(self) -> bool:
        return abs(self.ratio - 1.0) <= self.tolerance

    @property
    def what(self) -> str:
        return ("whole-model step" if self.first_node is None else
                f"step of the nodes from {self.first_node} on ({self.share:.0%} of the profile)")

    def line(self) -> str:
        """``step check: profile total 88.100 ms / measured whole-model step 87.000 ms = 1.01 (within 15%)``."""
        return (f"step check: profile total {self.total * 1e3:.3f} ms / measured {self.what} "
                f"{self.measured * 1e3:.3f} ms = {self.ratio:.2f} "
                + (f"(within {self.tolerance:.0%})" if self.agrees else f"(outside {self.tolerance:.0%})"))

    def warning(self) -> str | None:
        """One line when the two disagree beyond the tolerance, else None."""
        if self.agrees:
            return None
        return (f"warning: the profile's forward + backward ({self.total * 1e3:.3f} ms) is {self.ratio:.2f}x the "
                f"{self.what} measured in the same run ({self.measured * 1e3:.3f} ms), beyond the "
                f"{self.tolerance:.0%} tolerance; the machine was probably busy: profile again when it is quiet, "
                f"or with more --repeats")


def step_check(profile: Profile, tolerance: float = STEP_TOLERANCE) -> StepCheck | None:
    """The check of ``profile`` (None when it carries no measured step, e.g. a PipeDream file)."""
    measured = profile.measured_step_time
    if measured is None:
        return None
    everything = profile.total_forward_time + profile.total_backward_time
    first = profile.measured_from
    nodes = profile.nodes[profile.index(first):] if first is not None else profile.nodes
    total = sum(n.compute_time for n in nodes if not n.is_input)
    return StepCheck(total, measured, tolerance, first, total / everything if everything > 0 else 1.0)
