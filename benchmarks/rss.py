"""Resident memory of processes, read from ``/proc``: this process's peak and current RSS,
resetting the peak, handing freed pages back, and the peaks of whole process trees.
"""
from __future__ import annotations

import os
import resource


def _proc_status_mib(field_name: str, pid: int | str = "self") -> float | None:
    """A ``/proc/PID/status`` memory field (``VmRSS``, ``VmHWM``) in MiB, if readable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) / 1024.0  # the file says kB
    except (OSError, ValueError):
        pass
    return None


def rss_mib() -> float:
    """Peak resident set size of this process, MiB, since the last :func:`reset_peak_rss`.

    ``VmHWM`` of ``/proc/self/status`` (which :func:`reset_peak_rss` can reset), else
    ``ru_maxrss`` (KiB on Linux; never reset).
    """
    hwm = _proc_status_mib("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def current_rss_mib() -> float:
    """Resident set size of this process now, MiB."""
    now = _proc_status_mib("VmRSS")
    return now if now is not None else rss_mib()


def release_memory() -> None:
    """Collect garbage and hand freed heap pages back to the OS (glibc ``malloc_trim``)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_peak_rss() -> bool:
    """Restart the peak-RSS count from the current RSS (Linux ``clear_refs`` 5); True if done.

    Workers call it once set up (other stages dropped), so that their peak measures the
    training phase of their own stage and not the building of the whole model.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class TreeMemory:
    """Peak RSS of every process of some process trees, sampled from ``/proc``.

    ``VmHWM`` is a process's own peak since its ``exec``, so a sample taken shortly before
    it exits sees (nearly) its whole-life peak. Used for launches whose processes do not
    report their memory themselves (``pipetrain train`` and the workers it starts).
    ``rusage`` cannot serve: a child's ``ru_maxrss`` starts from the forking parent's RSS.
    """

    def __init__(self) -> None:
        self.peaks: dict[int, float] = {}  # pid -> MiB

    @staticmethod
    def _children(pid: int) -> list[int]:
        kids: list[int] = []
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    kids += [int(x) for x in f.read().split()]
        except (OSError, ValueError):
            pass
        return kids

    def sample(self, root: int) -> None:
        """Record the current peak of ``root`` and all its descendants."""
        stack = [root]
        while stack:
            pid = stack.pop()
            hwm = _proc_status_mib("VmHWM", pid)
            if hwm is not None:
                self.peaks[pid] = max(self.peaks.get(pid, 0.0), hwm)
            stack += self._children(pid)

    def of_tree(self, pids: set[int]) -> list[float]:
        """The peaks of the given pids (in pid order)."""
        return [self.peaks[p] for p in sorted(pids) if p in self.peaks]
