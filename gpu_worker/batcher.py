"""The batching policy: when to hand which waiting requests to the model.

Pure: no I/O, no threads, and the clock is injected (every method takes ``now``).

Semantics follow Triton's dynamic batcher:

* the wait clock starts at the *oldest* waiting request's arrival;
* a batch is only formed when the model is free (the caller asks
  ``pop_ready`` then), so the queue keeps growing while a batch runs;
* a batch is released when it is full, when the oldest request has waited
  ``max_wait_s``, or when waiting any longer would make the earliest
  deadline unreachable given the expected run time of the batch;
* requests whose deadline has already passed are taken out by
  ``pop_expired`` and are never computed.

Times are seconds on one monotonic clock chosen by the caller.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar


class Batchable(Protocol):
    @property
    def arrival_s(self) -> float: ...

    @property
    def deadline_s(self) -> float | None: ...


T = TypeVar("T", bound=Batchable)

RunTimeModel = Callable[[int], float]
"""Expected seconds to run a batch of n requests."""


def no_run_time(n: int) -> float:
    return 0.0


class LatencyEstimator:
    """Expected batch run time by size, learnt from observed runs (moving average).

    Sizes never seen are interpolated linearly from the nearest seen sizes
    (and extrapolated proportionally above the largest), so the deadline rule
    has an estimate from the first batch on.
    """

    def __init__(self, smoothing: float = 0.2) -> None:
        self._smoothing = smoothing
        self._by_size: dict[int, float] = {}

    def observe(self, size: int, seconds: float) -> None:
        old = self._by_size.get(size)
        self._by_size[size] = seconds if old is None else old + self._smoothing * (seconds - old)

    def __call__(self, size: int) -> float:
        if size in self._by_size:
            return self._by_size[size]
        if not self._by_size:
            return 0.0
        below = [s for s in self._by_size if s < size]
        above = [s for s in self._by_size if s > size]
        if not above:
            top = max(below)
            return self._by_size[top] * size / top
        if not below:
            return self._by_size[min(above)]
        lo, hi = max(below), min(above)
        frac = (size - lo) / (hi - lo)
        return self._by_size[lo] + frac * (self._by_size[hi] - self._by_size[lo])


class Batcher(Generic[T]):
    """A FIFO of waiting requests with the release rules above."""

    def __init__(self, max_batch_size: int, max_wait_s: float,
                 run_time: RunTimeModel = no_run_time) -> None:
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if max_wait_s < 0:
            raise ValueError("max_wait_s must be >= 0")
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.run_time = run_time
        self._queue: deque[T] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, item: T) -> None:
        self._queue.append(item)

    def _earliest_deadline(self) -> float | None:
        deadlines = [i.deadline_s for i in self._queue if i.deadline_s is not None]
        return min(deadlines) if deadlines else None

    def _release_at(self) -> float | None:
        """The moment the current queue must be released (None when empty)."""
        if not self._queue:
            return None
        release = self._queue[0].arrival_s + self.max_wait_s
        deadline = self._earliest_deadline()
        if deadline is not None:
            size = min(len(self._queue), self.max_batch_size)
            release = min(release, deadline - self.run_time(size))
        return release

    def pop_ready(self, now: float) -> list[T]:
        """The next batch if one is due at ``now``, else an empty list.

        Call it only when the model is free. A returned batch always holds at
        least one and at most ``max_batch_size`` requests, oldest first.
        """
        release = self._release_at()
        if release is None:
            return []
        if len(self._queue) < self.max_batch_size and now < release:
            return []
        n = min(len(self._queue), self.max_batch_size)
        return [self._queue.popleft() for _ in range(n)]

    def pop_expired(self, now: float) -> list[T]:
        """Requests whose deadline is already past; they must be answered, not run."""
        expired = [i for i in self._queue if i.deadline_s is not None and i.deadline_s <= now]
        if expired:
            keep = [i for i in self._queue if i.deadline_s is None or i.deadline_s > now]
            self._queue = deque(keep)
        return expired

    def next_wakeup(self, now: float) -> float | None:
        """When ``pop_ready``/``pop_expired`` may next have work; None when empty."""
        release = self._release_at()
        if release is None:
            return None
        deadline = self._earliest_deadline()
        if deadline is not None:
            release = min(release, deadline)
        return max(now, release)
