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
  ``pop_expired`` and are never computed;
* a batch may run padded up to a preferred size (measured faster by
  calibration, see gpu_worker/tuning/profile.py) when that is expected to be no
  slower than its own size (``run_size``).

The expected run times come from a LatencyEstimator seeded with the
calibration profile's latency per batch size and updated from each batch run.

Variable-length requests (text) batch by length buckets under a token budget:
``ShapedBatcher`` in gpu_worker/batching/shaping.py, a Batcher with the same calls.

Times are seconds on one monotonic clock chosen by the caller.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from redbatch.common.config import BatchSettings, default_of


class Batchable(Protocol):
    @property
    def arrival_s(self) -> float: ...

    @property
    def deadline_s(self) -> float | None: ...

    @property
    def bulk(self) -> bool: ...


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

    def seed(self, seconds_by_size: Mapping[int, float]) -> None:
        """Start from measured times (a calibration profile's latency per batch size), so
        the deadline and wait rules use real figures from the first request on; later
        observations move them as usual."""
        self._by_size.update({int(k): float(v) for k, v in seconds_by_size.items() if k > 0})

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


@dataclass(frozen=True, slots=True)
class LanePolicy:
    """How the bulk lane shares the model with the interactive lane.

    Latency: while interactive requests are arriving (one within
    ``interactive_recent_s``), a batch holding bulk requests is kept within
    ``bulk_batch_budget_s`` of expected run time, so an interactive request
    never waits long behind bulk work; with no interactive traffic, bulk
    batches grow to ``max_batch_size``.

    No starvation: when bulk requests have waited ``bulk_starve_s`` without
    any of them being served, the next batch gives them
    ``ceil(bulk_share x max_batch_size)`` places (at least one), however much
    interactive work waits. So while bulk waits, some of it runs at least
    every ``bulk_starve_s`` plus one batch.
    """

    #: Longest the oldest bulk request waits for a fuller batch, seconds (the defaults are
    #: the worker's, common/config.py BatchSettings, in seconds).
    bulk_max_wait_s: float = default_of(BatchSettings, "bulk_max_wait_ms") / 1000
    #: Places of a batch that starving bulk requests get, as a share of max_batch_size.
    bulk_share: float = default_of(BatchSettings, "bulk_share")
    #: How long bulk may go unserved while it waits before it gets reserved places, seconds.
    bulk_starve_s: float = default_of(BatchSettings, "bulk_starve_ms") / 1000
    #: Expected run time of a batch holding bulk requests while interactive traffic is
    #: recent, seconds (None: no limit).
    bulk_batch_budget_s: float | None = None
    #: How recent an interactive arrival must be for the budget to apply, seconds.
    interactive_recent_s: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.bulk_share <= 1:
            raise ValueError("bulk_share must be in (0, 1]")
        if self.bulk_max_wait_s < 0 or self.bulk_starve_s < 0:
            raise ValueError("bulk_max_wait_s and bulk_starve_s must be >= 0")


class Batcher(Generic[T]):
    """Two FIFOs (interactive, bulk) with the release rules above.

    Composition of a released batch: the places starving bulk requests are
    owed (see LanePolicy), then interactive requests, oldest first, then bulk
    requests in the room left within the bulk budget.
    """

    def __init__(self, max_batch_size: int, max_wait_s: float,
                 run_time: RunTimeModel = no_run_time,
                 lanes: LanePolicy | None = None,
                 preferred_sizes: Sequence[int] = (),
                 always_round_up: bool = False) -> None:
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if max_wait_s < 0:
            raise ValueError("max_wait_s must be >= 0")
        #: The configured largest batch; ``max_batch_size`` is the current limit (set_limit).
        self.configured_max = max_batch_size
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.run_time = run_time
        self.lanes = lanes or LanePolicy(bulk_max_wait_s=max_wait_s)
        #: Sizes a batch may run at, padded, when that is expected to be no slower.
        self.preferred_sizes = tuple(sorted(set(preferred_sizes)))
        #: Round up whenever a preferred size holds the batch (compiled models: one graph
        #: per size), not only when it is expected to be faster.
        self.always_round_up = always_round_up
        self._interactive: deque[T] = deque()
        self._bulk: deque[T] = deque()
        self._reserve = max(1, math.ceil(self.lanes.bulk_share * max_batch_size))
        self._last_interactive_s = float("-inf")
        self._bulk_served_s = float("-inf")  # last time bulk got places, or began to wait

    def __len__(self) -> int:
        return len(self._interactive) + len(self._bulk)

    def set_limit(self, n: int) -> None:
        """Cap batches at ``n`` (at least 1, at most the configured max), e.g. while the
        device is short of memory; raising it back never passes the configured max."""
        self.max_batch_size = max(1, min(n, self.configured_max))
        self._reserve = max(1, math.ceil(self.lanes.bulk_share * self.max_batch_size))

    def run_size(self, n: int) -> int:
        """The size a batch of ``n`` requests runs at: the smallest preferred size that
        holds it, when ``run_time`` expects that size to be no slower than ``n`` itself
        (the caller pads the batch); else ``n``."""
        for size in self.preferred_sizes:
            if n <= size <= self.max_batch_size:
                faster = self.run_time(size) <= self.run_time(n)
                return size if faster or self.always_round_up else n
        return n

    def add(self, item: T) -> None:
        if item.bulk:
            if not self._bulk:
                self._bulk_served_s = max(self._bulk_served_s, item.arrival_s)
            self._bulk.append(item)
        else:
            self._last_interactive_s = max(self._last_interactive_s, item.arrival_s)
            self._interactive.append(item)

    def _earliest_deadline(self) -> float | None:
        deadlines = [i.deadline_s for q in (self._interactive, self._bulk) for i in q
                     if i.deadline_s is not None]
        return min(deadlines) if deadlines else None

    def _release_at(self) -> float | None:
        """The moment the current queues must be released (None when empty)."""
        waits = [q[0].arrival_s + wait for q, wait in
                 ((self._interactive, self.max_wait_s), (self._bulk, self.lanes.bulk_max_wait_s))
                 if q]
        if not waits:
            return None
        release = min(waits)
        deadline = self._earliest_deadline()
        if deadline is not None:
            n = min(len(self), self.max_batch_size)
            release = min(release, deadline - self.run_time(self.run_size(n)))
        return release

    def _bulk_cap(self, now: float) -> int:
        """Largest batch that may hold bulk requests now (at least 1)."""
        budget = self.lanes.bulk_batch_budget_s
        if budget is None or now - self._last_interactive_s > self.lanes.interactive_recent_s:
            return self.max_batch_size
        n = 1
        while n < self.max_batch_size and self.run_time(n + 1) <= budget:
            n += 1
        return n

    def _composition(self, now: float) -> tuple[int, int]:
        """How many interactive and bulk requests the next batch takes."""
        starving = bool(self._bulk) and now - self._bulk_served_s >= self.lanes.bulk_starve_s
        owed = min(len(self._bulk), self._reserve) if starving else 0
        take_i = min(len(self._interactive), self.max_batch_size - owed)
        room = max(0, self._bulk_cap(now) - take_i - owed)
        # Never empty: with no interactive request taken, room is at least one.
        take_b = owed + min(len(self._bulk) - owed, room)
        return take_i, take_b

    def pop_ready(self, now: float) -> list[T]:
        """The next batch if one is due at ``now``, else an empty list.

        Call it only when the model is free. A returned batch always holds at
        least one and at most ``max_batch_size`` requests.
        """
        release = self._release_at()
        if release is None:
            return []
        if len(self) < self.max_batch_size and now < release:
            return []
        take_i, take_b = self._composition(now)
        if take_b:
            self._bulk_served_s = now
        return [self._interactive.popleft() for _ in range(take_i)] + \
               [self._bulk.popleft() for _ in range(take_b)]

    def pop_expired(self, now: float) -> list[T]:
        """Requests whose deadline is already past; they must be answered, not run."""
        expired: list[T] = []
        for queue in (self._interactive, self._bulk):
            late = [i for i in queue if i.deadline_s is not None and i.deadline_s <= now]
            if late:
                expired += late
                keep = [i for i in queue if i.deadline_s is None or i.deadline_s > now]
                queue.clear()
                queue.extend(keep)
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
