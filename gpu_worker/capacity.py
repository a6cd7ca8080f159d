"""Counting room for in-flight jobs between the intake thread and the main loop."""

from __future__ import annotations

import threading


class Capacity:
    """Permits for jobs read but not yet answered.

    The intake thread takes permits before reading (so it reads only what
    fits) and gives back the ones it did not use; the main loop gives one back
    per job once its result is written.
    """

    def __init__(self, permits: int) -> None:
        self.total = permits
        self._free = permits
        self._cond = threading.Condition()

    def take_up_to(self, n: int, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for room; returns how many permits were taken (maybe 0)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._free > 0, timeout=timeout_s):
                return 0
            taken = min(n, self._free)
            self._free -= taken
            return taken

    def give_back(self, n: int) -> None:
        if n <= 0:
            return
        with self._cond:
            self._free += n
            if self._free > self.total:
                raise RuntimeError("more permits given back than taken")
            self._cond.notify_all()

    @property
    def in_use(self) -> int:
        with self._cond:
            return self.total - self._free
