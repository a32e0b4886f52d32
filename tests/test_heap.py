"""jascl.data.heap: a prepare worker keeps its freed memory, so its next volume's arrays fault no fresh pages."""

import subprocess
import sys

import pytest

from jascl.data import heap

# allocate, fill and free a 128 MiB array, then count the minor page faults of doing it a second time
SECOND_ALLOCATION_FAULTS = """
import resource, sys
import numpy as np
from jascl.data.heap import freed_memory_kept, keep_freed_memory

def second_allocation():
    np.ones(2**27, np.uint8).sum()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    np.ones(2**27, np.uint8).sum()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

if sys.argv[1] == "scoped":
    with freed_memory_kept() as kept:
        inside = second_allocation()
    print(kept, inside, second_allocation())
else:
    kept = keep_freed_memory() if sys.argv[1] == "keep" else None
    print(kept, second_allocation())
"""


def _second_allocation(mode: str) -> list[str]:
    return subprocess.run(
        [sys.executable, "-c", SECOND_ALLOCATION_FAULTS, mode], check=True, capture_output=True, text=True
    ).stdout.split()


def _glibc() -> bool:
    import platform

    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not _glibc(), reason="mallopt's parameters are glibc's")
def test_freed_memory_is_reused_without_fresh_page_faults():
    kept, kept_faults = _second_allocation("keep")
    plain_faults = int(_second_allocation("plain")[1])
    assert kept == "True"
    # 128 MiB of fresh pages: 32,768 faults of 4 KiB, 64 where all are transparent huge pages; kept pages: none
    assert plain_faults >= 64
    assert int(kept_faults) < 16


@pytest.mark.skipif(not _glibc(), reason="mallopt's parameters are glibc's")
def test_memory_is_kept_inside_the_block_only():
    kept, inside, after = _second_allocation("scoped")
    assert kept == "True"
    assert int(inside) < 16
    # after the block a 128 MiB array is mmapped and unmapped again: fresh pages (at least one fault per 2 MiB)
    assert int(after) >= 64


def test_the_trim_threshold_is_glibcs_largest_int():
    # mallopt takes an int: 2 GiB - 1 byte, about one 512 x 512 x 300 CT's preprocessing working set
    assert heap.TRIM_THRESHOLD == 2**31 - 1
    assert (heap.M_TRIM_THRESHOLD, heap.M_MMAP_THRESHOLD, heap.M_MMAP_MAX) == (-1, -3, -4)  # <malloc.h>
    # malloc.c: DEFAULT_MMAP_THRESHOLD_MAX on 64-bit (4 * 1024 * 1024 * sizeof(long)), and twice that kept
    assert (heap.RESTORED_MMAP_THRESHOLD, heap.RESTORED_TRIM_THRESHOLD) == (4 * 1024 * 1024 * 8, 2 * 32 * 2**20)


def test_without_a_c_library_nothing_changes(monkeypatch):
    monkeypatch.setattr(heap.ctypes.util, "find_library", lambda name: None)
    assert heap.keep_freed_memory() is False
    with heap.freed_memory_kept() as kept:
        assert kept is False
