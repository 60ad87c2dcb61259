"""A per-layer table of a profile, for the terminal.

Works for any :class:`Profile`: measured by :func:`~pipetrain.profile.profile_model`, loaded
from JSON, or imported from a PipeDream ``.txt`` file.
"""
from __future__ import annotations

from .types import Profile

__all__ = ["format_bytes", "format_profile_table"]

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: float) -> str:
    """Human-readable binary size: ``0 B``, ``512 B``, ``1.5 MiB``."""
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _truncate(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def format_profile_table(profile: Profile, *, op_width: int = 40, name_width: int = 28) -> str:
    """Render ``profile`` as a table, one row per node, with a totals line.

    Columns: index, name, op (truncated to ``op_width``), forward and backward milliseconds,
    activation bytes, parameter bytes, and the node's share of the total compute time
    (forward + backward over all non-input nodes). Input nodes cost nothing.

    Example (abridged)::

          #  name   op                    fwd ms   bwd ms  activation  parameters  compute %
          0  x      Input                  0.000    0.000     1.0 KiB         0 B        0.0
          1  fc1    Linear(in_features...  0.021    0.040     2.0 KiB    32.2 KiB       60.1
        total: 2 nodes, forward 0.035 ms, backward 0.066 ms, activations 2.0 KiB, parameters 32.2 KiB
    """
    total_compute = sum(n.compute_time for n in profile.nodes if not n.is_input)
    nw = max([4] + [min(len(n.name), name_width) for n in profile.nodes])
    ow = max([2] + [min(len(" ".join(n.op.split())), op_width) for n in profile.nodes])
    iw = max(1, len(str(max(len(profile.nodes) - 1, 0))))
    header = (
        f"{'#':>{iw}}  {'name':<{nw}}  {'op':<{ow}}  {'fwd ms':>9}  {'bwd ms':>9}  "
        f"{'activation':>11}  {'parameters':>11}  {'compute %':>9}"
    )
    batch = profile.batch_size if profile.batch_size is not None else "unknown"
    lines = [
        f"profile of {profile.model or 'unnamed model'}: batch size {batch}, device {profile.device}, "
        f"optimizer {profile.optimizer} ({profile.optimizer_state_bytes_per_parameter_byte:g} bytes of state "
        f"per parameter byte)",
        header,
        "-" * len(header),
    ]
    for i, n in enumerate(profile.nodes):
        share = 100.0 * n.compute_time / total_compute if total_compute > 0 and not n.is_input else 0.0
        lines.append(
            f"{i:>{iw}}  {_truncate(n.name, nw):<{nw}}  {_truncate(n.op, ow):<{ow}}  "
            f"{n.forward_time * 1e3:>9.3f}  {n.backward_time * 1e3:>9.3f}  "
            f"{format_bytes(n.activation_bytes):>11}  {format_bytes(n.parameter_bytes):>11}  {share:>9.1f}"
        )
    activations = sum(n.activation_bytes for n in profile.nodes if not n.is_input)
    lines.append("-" * len(header))
    lines.append(
        f"total: {len(profile.nodes)} nodes, forward {profile.total_forward_time * 1e3:.3f} ms, "
        f"backward {profile.total_backward_time * 1e3:.3f} ms, activations {format_bytes(activations)}, "
        f"parameters {format_bytes(profile.total_parameter_bytes)}"
    )
    return "\n".join(lines)
