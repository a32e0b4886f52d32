"""jascl.data.heap: a prepare worker keeps its freed memory, so its next volume's arrays fault no fresh pages."""

import subprocess
import sys

import pytest

from jascl.data import heap

# allocate, fill and free a 128 MiB array, then count the minor page faults of doing it a second time
SECOND_ALLOCATION_FAULTS = """
import resource, sys
import numpy as np
from jascl.data.heap import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
np.ones(2**27, np.uint8).sum()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
np.ones(2**27, np.uint8).sum()
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _second_allocation(mode: str) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", SECOND_ALLOCATION_FAULTS, mode], check=True, capture_output=True, text=True
    ).stdout.split()
    return out[0], int(out[1])


def _glibc() -> bool:
    import platform

    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not _glibc(), reason="mallopt's parameters are glibc's")
def test_freed_memory_is_reused_without_fresh_page_faults():
    kept, kept_faults = _second_allocation("keep")
    _, plain_faults = _second_allocation("plain")
    assert kept == "True"
    # 128 MiB of fresh pages: 32,768 faults of 4 KiB (64 with transparent huge pages); kept pages: none
    assert plain_faults >= 64
    assert kept_faults * 8 < plain_faults


def test_the_trim_threshold_is_glibcs_largest_int():
    # mallopt takes an int: 2 GiB - 1 byte, about one 512 x 512 x 300 CT's preprocessing working set
    assert heap.TRIM_THRESHOLD == 2**31 - 1
    assert (heap.M_TRIM_THRESHOLD, heap.M_MMAP_MAX) == (-1, -4)  # <malloc.h>


def test_without_a_c_library_nothing_changes(monkeypatch):
    monkeypatch.setattr(heap.ctypes.util, "find_library", lambda name: None)
    assert heap.keep_freed_memory() is False
