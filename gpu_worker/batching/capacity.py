"""Counting room for in-flight jobs between the intake thread and the main loop."""

from __future__ import annotations

import threading

#: How long a read waits for a group of places to come free while the worker already holds
#: at least two groups of work, s (NOTE [ Reading in groups ]). Places come free with each
#: write of answers, so under load this ends at the next write.
GROUP_WAIT_S = 0.020


class Capacity:
    """Permits for jobs read but not yet answered.

    The intake thread takes permits before reading (so it reads only what
    fits) and gives back the ones it did not use; the main loop gives one back
    per job once its result is written.

    NOTE [ Reading in groups ]
    Under load, places come free a few at a time (each write of answers frees what it
    wrote), and a reader that read whatever was free would read a few jobs a call: small
    reads make small batches, and small batches make small writes, each costing its
    round trips (tests/test_redis_calls.py counted 69 reads and 98 writes for 1,000 jobs
    queued at once, on a loaded machine). So while the worker holds at least two groups
    (``group``: a batch's worth) of jobs, a read waits up to ``group_wait_s`` for a whole
    group of places. That costs no latency: a job read later would have queued behind the
    two groups held, and one of them is answered before it could run.
    """

    def __init__(self, permits: int, bulk_limit: int | None = None, group: int = 1) -> None:
        self.total = permits
        #: A read's worthwhile size (NOTE [ Reading in groups ]).
        self.group = max(1, min(group, permits // 2))
        #: Permits bulk jobs may hold at once; the rest stay free for interactive jobs.
        self.bulk_limit = permits if bulk_limit is None else min(bulk_limit, permits)
        self._free = permits
        self._bulk = 0
        self._cond = threading.Condition()

    def take_up_to(self, n: int, timeout_s: float, group_wait_s: float = GROUP_WAIT_S) -> int:
        """Wait up to ``timeout_s`` for room, and while the worker is busy up to
        ``group_wait_s`` more for a group of it (NOTE [ Reading in groups ]); returns how
        many permits were taken (maybe 0)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._free > 0, timeout=timeout_s):
                return 0
            if self._free < self.group and self.total - self._free >= 2 * self.group:
                self._cond.wait_for(lambda: self._free >= self.group, timeout=group_wait_s)
            taken = min(n, self._free)
            self._free -= taken
            return taken

    def bulk_room(self) -> int:
        """How many more bulk jobs may be read now."""
        with self._cond:
            return max(0, self.bulk_limit - self._bulk)

    def wait_for_bulk_room(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until a bulk job may be read; True once one may."""
        with self._cond:
            return self._cond.wait_for(lambda: self._bulk < self.bulk_limit, timeout=timeout_s)

    def took_bulk(self, n: int) -> None:
        """Record that ``n`` of the permits taken went to bulk jobs."""
        with self._cond:
            self._bulk += n

    def give_back(self, n: int, bulk: int = 0) -> None:
        """Return ``n`` permits, ``bulk`` of which were held by bulk jobs."""
        if n <= 0:
            return
        with self._cond:
            self._free += n
            self._bulk -= bulk
            if self._free > self.total or self._bulk < 0:
                raise RuntimeError("more permits given back than taken")
            self._cond.notify_all()

    @property
    def in_use(self) -> int:
        with self._cond:
            return self.total - self._free
