"""Host memory policy for a process that allocates the same large CPU tensors on every batch.

Why: glibc serves a block above its mmap threshold (128 KiB at first, raised as blocks are freed) with a
fresh mmap and unmaps it on free, and gives the top of its heap back to the kernel once more than the trim
threshold is free there. A CPU target forward or drafter step allocates and frees tens of MiB of
activations per batch, so each batch page-faulted and zero-filled them again: in bench.pipeline's
balanced run, 67,000 page faults a second in the producer (15 % of its CPU time in the kernel) and 32,000
in the consumer (6.5 %). `keep_freed_memory()` sets the mmap threshold to glibc's
maximum (32 MiB; larger blocks still come from mmap and go back on free) and turns trimming off, so a
batch reuses the pages the previous batch freed. The process keeps its peak heap resident, which every
batch reaches anyway. Only CPU compute needs it (a GPU process allocates little on the host); elsewhere
than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit (HEAP_MAX_SIZE / 2); a larger value is refused
NO_TRIM = 2**31 - 1  # an int: mallopt takes one


@functools.cache
def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse (once per process); False where the libc is not glibc."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return False
    ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1 and libc.mallopt(M_TRIM_THRESHOLD, NO_TRIM) == 1
    if not ok:
        log.warning("glibc refused the malloc settings: freed host memory is returned to the kernel per batch")
    return ok
