"""The workers' allocator tuning around a block that times what they run
(pipetrain.runtime.process.rss.workers_allocator): inside it a large tensor allocated again
reuses its pages (as in the workers), after it glibc's defaults are back. Measured by the
kernel's count of page faults, which the machine's load does not move."""

from __future__ import annotations

import resource
import sys

import pytest
import torch

from pipetrain.runtime.process.rss import default_malloc, workers_allocator

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")


def faults(times: int = 6, mib: int = 64) -> int:
    """Minor page faults of allocating, writing and freeing ``mib`` MiB ``times`` times."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(times):
        t = torch.ones(mib << 18)  # float32
        del t
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_the_workers_allocator_reuses_pages_inside_the_block_and_not_after_it() -> None:
    default_malloc()
    pages = 6 * (64 << 20) // resource.getpagesize()
    assert faults() > 0.8 * pages  # glibc maps a tensor this large afresh every time
    with workers_allocator() as tuned:
        assert tuned
        faults(1)  # the heap grows once
        assert faults() < 0.3 * pages  # at most the first of the six faults its pages in
    assert faults() > 0.8 * pages  # the defaults back: the launcher keeps no more heap than before


def test_without_the_tuning_the_block_changes_nothing() -> None:
    default_malloc()
    pages = 6 * (64 << 20) // resource.getpagesize()
    with workers_allocator(False) as tuned:
        assert not tuned
        assert faults() > 0.8 * pages
