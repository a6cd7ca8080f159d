"""A pool process gives its heap back after an input that made it much bigger.

Pool processes inherit the worker's glibc malloc settings (gpu_worker/device/malloc_tuning.py),
which never return freed memory to the OS: right for the model threads, wrong for a
process that just decoded one huge image. :class:`HeapTrim` trims only then.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable

#: A pool process whose anonymous memory grew past its size at start by more than this,
#: bytes, gives its free heap back to the OS after the task (see HeapTrim).
TRIM_GROWTH_BYTES = 128 * 1024**2


class HeapTrim:
    """Returns a pool process's free heap to the OS after a task that left it much bigger.

    After each task, :meth:`after_task` reads the process's anonymous resident memory (a
    read of /proc/self/statm) and calls glibc's ``malloc_trim(0)``, which gives back every
    free page of the heap, when it exceeds the size at construction by ``growth_bytes``.
    Ordinary inputs never get there and keep MALLOC_ENV's reuse of freed memory, without
    page faults (restoring glibc's default thresholds instead cost the sample photos about
    40% more decode time). Slot pages of the shared segment are not counted: they are
    file-backed. A no-op off glibc, or where /proc/self/statm cannot be read.
    """

    def __init__(self, growth_bytes: int = TRIM_GROWTH_BYTES) -> None:
        self._trim = _malloc_trim()
        start = _anon_rss_bytes() if self._trim is not None else None
        self._limit = None if start is None else start + growth_bytes

    def after_task(self) -> bool:
        """Trim the heap if the process grew past its bound; True if it did."""
        if self._trim is None or self._limit is None:
            return False
        rss = _anon_rss_bytes()
        if rss is None or rss <= self._limit:
            return False
        self._trim(0)
        return True


def _malloc_trim() -> Callable[[int], object] | None:
    """glibc's malloc_trim, or None elsewhere (musl, macOS, Windows)."""
    try:
        if not sys.platform.startswith("linux") or not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, ValueError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def _anon_rss_bytes() -> int | None:
    """Resident memory that is neither file nor shared memory (statm's resident - shared)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            fields = f.read().split()
        return (int(fields[1]) - int(fields[2])) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
