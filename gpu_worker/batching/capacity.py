"""Counting room for in-flight jobs between the intake thread and the main loop."""

from __future__ import annotations

import threading


class Capacity:
    """Permits for jobs read but not yet answered.

    The intake thread takes permits before reading (so it reads only what
    fits) and gives back the ones it did not use; the main loop gives one back
    per job once its result is written.
    """

    def __init__(self, permits: int, bulk_limit: int | None = None) -> None:
        self.total = permits
        #: Permits bulk jobs may hold at once; the rest stay free for interactive jobs.
        self.bulk_limit = permits if bulk_limit is None else min(bulk_limit, permits)
        self._free = permits
        self._bulk = 0
        self._cond = threading.Condition()

    def take_up_to(self, n: int, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for room; returns how many permits were taken (maybe 0)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._free > 0, timeout=timeout_s):
                return 0
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
