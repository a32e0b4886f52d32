"""Keeping a preprocessing worker's freed memory for its next volume (glibc ``mallopt``).

Preprocessing one 512 x 512 x 300 CT allocates about 2.2 GiB in a dozen arrays of 80-320 MiB each (the decoded
volume, its float32 and C-order copies, MONAI's sampling grids and outputs, the label's float copy), and frees
them all before the next volume. glibc serves blocks that large with ``mmap`` and returns them to the kernel with
``munmap`` when they are freed, so each volume's arrays are fresh pages: the kernel zeroes and maps every 4 KiB
page on its first write, 583,000 minor page faults per volume. On the 2-core virtual machine of
``docs/performance.md`` they cost 3.7 s of system time per volume, more than the decoding and resampling
themselves (3.4 s of user time; one thread, in one process, ``benchmarks/first_pass_scaling.py``'s volumes).

:func:`keep_freed_memory` tells glibc to serve large blocks from its heap and to keep what is freed there: the
next volume's arrays reuse the pages already mapped (26,000 faults per volume; 0.9 s of system time). The cost
is memory held between volumes: a worker keeps its largest volume's working set mapped until it exits, and the
heap may hold some more where freed blocks do not fit the next request (a one-thread worker's peak RSS on those
volumes: 2,110 MiB before, 2,461 MiB after). It is meant for processes that do nothing else, such as
``jascl data prepare``'s worker processes (:mod:`jascl.data.prepare`); a training process is left as it is.
:func:`freed_memory_kept` does the same for one block of work, then has large blocks mmapped again and returns
the kept memory (``jascl data check``, which decodes every volume in the command's own process).

Since volumes are resampled axis by axis (:mod:`jascl.data.resample`) a volume allocates less, and keeping it still
pays: 2.67-2.72 -> 2.29-2.38 s per volume (231,600 -> 20-6,500 faults), the peak RSS up by 0.03-0.2 GiB (same probe).

On other C libraries (macOS, musl) there is no ``mallopt`` with these parameters and nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: glibc's ``mallopt`` parameter numbers (``<malloc.h>``)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
#: what :func:`freed_memory_kept` restores (``malloc/malloc.c``): at most 65,536 mmapped blocks (the default), and
#: the largest thresholds glibc's own adaptation reaches (it raises the mmap threshold to each mmapped block of up
#: to 32 MiB that is freed, and keeps twice that at the heap's top): blocks from 32 MiB on are mmapped
RESTORED_MMAP_MAX = 65536
RESTORED_MMAP_THRESHOLD = 32 * 2**20
RESTORED_TRIM_THRESHOLD = 64 * 2**20

#: free memory at the heap's top that glibc keeps instead of returning it: the largest ``int`` (2 GiB), about
#: a 512 x 512 x 300 CT's working set; a volume needing more extends the heap and keeps that too
TRIM_THRESHOLD = 2**31 - 1


def _libc() -> Any | None:
    """The C library's handle when it has glibc's ``mallopt`` (None otherwise)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def keep_freed_memory() -> bool:
    """Serve large allocations of this process from glibc's heap and keep freed memory mapped (see the module
    docstring). Returns whether glibc accepted both settings (False on other C libraries: nothing changed)."""
    libc = _libc()
    if libc is None:
        return False
    # the trim threshold first: once blocks come from the heap, its top must not be returned after each volume
    return bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and bool(libc.mallopt(M_MMAP_MAX, 0))


@contextmanager
def freed_memory_kept() -> Iterator[bool]:
    """:func:`keep_freed_memory` for the ``with`` block (yields its result); on leaving it, large blocks are
    mmapped again and the heap's free memory is returned to the kernel (``malloc_trim``). Arrays allocated inside
    the block and still alive stay where they are.

    glibc stops adapting its thresholds once they are set, so the block leaves them where the adaptation ends
    (:data:`RESTORED_MMAP_THRESHOLD`, :data:`RESTORED_TRIM_THRESHOLD`) rather than at a fresh process's 128 KiB.
    """
    kept = keep_freed_memory()
    try:
        yield kept
    finally:
        libc = _libc() if kept else None
        if libc is not None:
            libc.mallopt(M_MMAP_MAX, RESTORED_MMAP_MAX)
            libc.mallopt(M_MMAP_THRESHOLD, RESTORED_MMAP_THRESHOLD)
            libc.mallopt(M_TRIM_THRESHOLD, RESTORED_TRIM_THRESHOLD)
            libc.malloc_trim(0)
