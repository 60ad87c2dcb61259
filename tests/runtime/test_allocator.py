"""The workers' allocator tuning around a block that times what they run
(pipetrain.runtime.process.rss.workers_allocator): inside it a large tensor comes from the
heap, whose pages are kept for the next (as in the workers); after it the kept pages are
returned and glibc's thresholds are back. Read off glibc's own count of mapped bytes
(``mallinfo2().hblkhd``) and the resident set, in a fresh process (an allocator that earlier
tests used may hold free chunks a request is served from, whatever the thresholds). Sizes
stay below a thread arena's heap (64 MiB), which maps anything larger."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = r"""
import ctypes, ctypes.util, json, sys
import torch
from pipetrain.runtime.process.rss import proc_status_mib, workers_allocator

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
info = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
info.restype = MallInfo2

def mapped_for(mib):
    before = info().hblkhd
    t = torch.ones(mib << 18)
    during = info().hblkhd
    del t
    return (during - before) / 2**20

out = {"default": mapped_for(16), "rss_start": proc_status_mib("VmRSS")}
with workers_allocator(sys.argv[1] == "on") as tuned:
    out["tuned"] = tuned
    out["inside"] = [mapped_for(16), mapped_for(30)]
    out["rss_inside"] = proc_status_mib("VmRSS")
out["rss_after"] = proc_status_mib("VmRSS")
out["after"] = mapped_for(48)
print(json.dumps(out))
"""


def probe(mode: str) -> dict:
    try:
        import ctypes
        import ctypes.util

        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2  # noqa: B018 - glibc 2.33+
    except (OSError, AttributeError):
        pytest.skip("needs glibc 2.33 or later (mallinfo2)")
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_large_tensor_comes_from_the_heap_inside_the_block_and_its_pages_go_back_after_it() -> None:
    got = probe("on")
    assert got["default"] >= 16  # glibc's defaults map a 16 MiB tensor
    assert got["tuned"] and got["inside"] == [0, 0]  # the tuning: from the heap
    assert got["rss_inside"] - got["rss_start"] >= 16  # whose pages are kept for the next
    assert got["rss_after"] - got["rss_start"] < 8  # and returned after the block
    assert got["after"] >= 48  # the defaults back: a size no free chunk holds is mapped


def test_without_the_tuning_the_block_changes_nothing() -> None:
    got = probe("off")
    # glibc's own dynamic threshold rises to a freed mapped chunk's size (16 MiB), not beyond
    assert not got["tuned"] and got["inside"][1] >= 30
