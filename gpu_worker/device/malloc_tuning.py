"""Keep glibc from returning activation memory to the OS after every forward pass.

With glibc's default thresholds, each CPU forward pass at batch 8 or more
maps its large activation buffers with mmap and unmaps them again, paying
hundreds of thousands of page faults per batch: throughput then *falls* as
the batch grows (measured here with EfficientNet-Lite0: 29 img/s at batch 8
on one thread against 45 with these settings, and flat up to batch 32).
glibc reads these variables only at process start, so the worker command
re-executes itself once with them set.

The model runs in a thread of its own, and glibc gives other threads their own
arenas, whose heaps hold at most 64 MiB: a larger activation (batch 16 of
EfficientNet-Lite0 has a 77 MB one) is then mapped and unmapped on every
forward pass whatever the thresholds say (measured in the worker at batch 16:
7.8 ms of kernel time per image on top of 16.7 ms of compute, 40 against 56
img/s end to end). One arena (MALLOC_ARENA_MAX=1) puts every thread on the
main heap, where the thresholds above apply.

The preprocessing pool's processes inherit these variables (multiprocessing's
spawn passes the worker's environment, and changing os.environ while the
worker's threads run would race with their getenv), so glibc never gives their
freed heap back either: one 8000x8000 RGBA PNG, within the pixel limit, would
keep a pool process at 1.2 GiB for good. preproc_worker/heap.py bounds them.
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger(__name__)

MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(16 * 1024**3),
    "MALLOC_TRIM_THRESHOLD_": str(16 * 1024**3),
    "MALLOC_TOP_PAD_": str(1024**3),
    "MALLOC_ARENA_MAX": "1",
}
#: Set to 0 to keep the process's malloc settings as they are.
OPT_OUT = "REDBATCH_MALLOC_TUNING"


def wanted() -> bool:
    """True on glibc Linux when the variables are not set yet and not opted out."""
    return (sys.platform.startswith("linux") and os.environ.get(OPT_OUT, "1") != "0"
            and os.confstr("CS_GNU_LIBC_VERSION") is not None
            and any(k not in os.environ for k in MALLOC_ENV))


def reexec_with_malloc_tuning(module: str) -> None:
    """Replace this process with ``python -m module <same args>`` under MALLOC_ENV; no-op
    when not wanted. Call before any thread or child process is started."""
    if not wanted():
        return
    env = {**os.environ, **MALLOC_ENV}
    os.execve(sys.executable, [sys.executable, "-m", module, *sys.argv[1:]], env)


def describe() -> str:
    """What the start-up log says about it."""
    if all(k in os.environ for k in MALLOC_ENV):
        return ("glibc malloc keeps freed memory in one arena (MALLOC_*): no page faults "
                "per batch")
    return "glibc malloc defaults: large batches on CPU pay page faults"
