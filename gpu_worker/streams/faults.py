"""Streams that fail alone: a stream Redis refuses or cannot reach is set aside with back-off
while the model's other streams are served (PROTOCOL.md "Partitions", RELIABILITY.md
"One lost master").

A model's streams may sit on several masters (its partitions) and hold anything a person
left there: one master lost, or a key of another type at one lane stream, must not stop the
others. Each failure sets the streams it touched aside, each on a back-off of its own (0.1 s
doubling to 5 s), and is logged once per outage (a line again when the stream serves
again); a stream set aside is tried again when its back-off is over. The reader thread
owns it (not thread-safe).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

import redis
from redbatch.common.redis_io import Backoff, error_code

logger = logging.getLogger(__name__)


class StreamFaults:
    """The streams set aside, each until when (monotonic s), with the error that did it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._until: dict[str, float] = {}
        self._backoff: dict[str, Backoff] = {}
        #: The latest error that set a stream aside: raised when every stream is aside.
        self.last_error: redis.RedisError | None = None

    def usable(self, stream: str) -> bool:
        """Whether ``stream`` may be called now: never failed, or its back-off is over."""
        until = self._until.get(stream)
        return until is None or self._clock() >= until

    def keep_usable(self, streams: Iterable[str]) -> list[str]:
        return [s for s in streams if self.usable(s)]

    def failed(self, streams: Iterable[str], error: redis.RedisError, what: str) -> None:
        """Set ``streams`` aside after ``error`` on ``what`` (a call, for the log line);
        one line for the streams that were serving until now, none for a retry that
        failed again."""
        now = self._clock()
        fresh = []
        for stream in streams:
            backoff = self._backoff.setdefault(stream, Backoff())
            if stream not in self._until:
                fresh.append(stream)
            self._until[stream] = now + backoff.next_wait_s()
        self.last_error = error
        if fresh:
            logger.error("%s failed on %s (%s: %s); skipped, retried with back-off while "
                         "the model's other streams are served", what, ", ".join(fresh),
                         error_code(error), error)

    def served(self, streams: Iterable[str]) -> None:
        """``streams`` answered: those that were set aside serve again (logged)."""
        if not self._until:
            return
        back = [s for s in streams if self._until.pop(s, None) is not None]
        for stream in back:
            self._backoff.pop(stream, None)
        if back:
            logger.warning("%s served again", ", ".join(back))

    @property
    def any(self) -> bool:
        """Whether some stream is set aside now."""
        return bool(self._until)

    def next_retry_s(self) -> float | None:
        """Seconds until the soonest stream set aside may be tried again; None if none."""
        if not self._until:
            return None
        return max(0.0, min(self._until.values()) - self._clock())
