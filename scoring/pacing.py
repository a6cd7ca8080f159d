"""Pacing the bulk scorer against a bounded queue: the items admission control refused, in
order, and when to offer them again; and how long it waits out Redis being away.

NOTE [ A bounded queue ]
  When the lane has a bound (admission control) the scorer is just one more
  producer that can be refused. Refused items are kept, in order, at the head
  of the line (only the item: the file is read again when it is resubmitted,
  so memory stays bounded) and count towards the window. The scorer then backs
  off, exponentially with jitter from BACKOFF_START_S up to BACKOFF_MAX_S,
  while it keeps collecting results; a retry that gets jobs admitted resets the
  delay, and results of its own jobs (room was freed) end the wait at once,
  without resetting the delay should the room be gone again. Once refused,
  the scorer asks for the room left before each submission and sends no more
  than fits, so refused payloads are not sent over and over; the script still
  decides, atomically, so other producers racing for the same room only cause
  more retries. New items that find no room wait in the same line. An item
  that waits longer than ``timeout_s`` to be admitted is written as a
  ``timeout``, so a run against a queue that never drains still ends.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from redbatch.common.redis_io import Backoff
from redbatch.scoring.inputs import Item

#: Back-off after a queue_full refusal: first delay and cap, seconds (see the NOTE).
BACKOFF_START_S = 0.05
BACKOFF_MAX_S = 2.0
#: Shortest wait for results while refused items wait for their retry, seconds.
MIN_WAIT_S = 0.01


@dataclass(slots=True)
class Waiting:
    """An item to submit; ``since``: when admission control first refused it (monotonic),
    for its timeout, or None when it was not refused yet."""

    item: Item
    since: float | None = None


class RetryClock:
    """When refused items may be sent again: the shared exponential back-off with jitter
    (``redis_io.Backoff``), kept as a moment rather than slept through, because the scorer
    goes on collecting results meanwhile."""

    def __init__(self, start: float = BACKOFF_START_S, cap: float = BACKOFF_MAX_S) -> None:
        self._delays = Backoff(first_s=start, cap_s=cap)
        #: Monotonic time before which no retry is made.
        self.until = 0.0

    def failed(self, now: float) -> None:
        self.until = now + self._delays.next_wait_s()

    def progressed(self, now: float) -> None:
        """Jobs were admitted: keep polling at the start rate while any wait."""
        self._delays.reset()
        self.failed(now)

    def reset(self) -> None:
        self._delays.reset()
        self.until = 0.0

    def wake(self) -> None:
        """Retry now (room was freed), keeping the delay for the next failure."""
        self.until = 0.0


class WaitingLine:
    """Items waiting for room in the queue, oldest first, to be submitted before any new
    one, and the clock that says when to try (see the NOTE). Its length is the items in it."""

    def __init__(self) -> None:
        self._items: deque[Waiting] = deque()
        self.clock = RetryClock()
        #: The lane refused us once: size every submission to the room its queue has left.
        self.bounded = False

    def __len__(self) -> int:
        return len(self._items)

    def ready(self, now: float) -> bool:
        """True when the back-off allows a submission (or a retry after a broken one)."""
        return now >= self.clock.until

    def take(self, n: int) -> list[Waiting]:
        """The ``n`` oldest waiting items, out of the line."""
        return [self._items.popleft() for _ in range(n)]

    def refused(self, entries: Iterable[Waiting], now: float) -> None:
        """Put refused items back at the head, in order; each keeps the time it was first
        refused (``now`` if it was new)."""
        for entry in reversed(list(entries)):
            self._items.appendleft(Waiting(entry.item, now if entry.since is None
                                           else entry.since))

    def no_room(self, fresh: Iterable[Waiting], now: float) -> None:
        """New items that found the queue full wait at the end of the line from ``now``."""
        self._items.extend(Waiting(w.item, now) for w in fresh)

    def pace(self, admitted: int, refused: int, now: float) -> None:
        """Set the next try after a submission that had ``admitted`` and ``refused`` jobs."""
        if not refused:
            self.clock.reset()
        elif admitted:
            self.clock.progressed(now)
        else:
            self.clock.failed(now)

    def wait_s(self, longest: float, now: float) -> float:
        """How long to wait for results: ``longest``, or less so as to end with the back-off."""
        if self.clock.until > 0:
            return min(longest, max(MIN_WAIT_S, self.clock.until - now))
        return longest

    def expired(self, limit: float) -> list[Item]:
        """The items refused before ``limit`` (monotonic), out of the line, oldest first."""
        late: list[Item] = []
        while self._items and (self._items[0].since or limit) < limit:
            late.append(self._items.popleft().item)
        return late


class Outage:
    """Since when Redis is out of reach, and why (NOTE [ Redis going away ] in bulk.py); a
    run starts as if it were, so that a Redis unreachable from the start is bounded too."""

    def __init__(self, limit_s: float, now: float) -> None:
        self.limit_s = limit_s
        #: Monotonic time of the first failed call since the last that got through, or
        #: None while Redis answers.
        self.since: float | None = now
        self.why = "no call got through yet"

    def failed(self, e: BaseException, now: float) -> None:
        """A call failed with Redis out of reach."""
        if self.since is None:
            self.since = now
        self.why = str(e) or type(e).__name__

    def answered(self) -> None:
        """A call got through: an outage, if any, is over."""
        self.since = None

    def over(self, now: float) -> bool:
        """True once Redis has been away for longer than ``limit_s``."""
        return self.since is not None and now - self.since > self.limit_s
