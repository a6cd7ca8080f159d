"""The answers waiting to be written, and the clocks of their retries.

The main loop adds answers as jobs finish and flushes them once per step (results.py writes
them with their acknowledgements in one transaction). A write Redis refuses or that breaks
off is retried whole with back-off, and /readyz says why meanwhile; dead letters the writer
held back (NOTE [ Write failures ] in results.py) are retried on a clock of their own, so
that they never delay the other answers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from redbatch.common.redis_io import Backoff, RedisRefused, RedisUnavailable
from redbatch.gpu_worker.metrics import Health
from redbatch.gpu_worker.results import Answer, Flushed, ResultWriter

logger = logging.getLogger(__name__)


class Outbox:
    """Answers not written yet; owned by the worker's main loop (not thread-safe)."""

    def __init__(self, health: Health) -> None:
        self._health = health
        self._answers: list[Answer] = []
        self._retry_at = 0.0
        self._backoff = Backoff()
        self._held: list[Answer] = []
        self._held_retry_at = 0.0
        self._held_backoff = Backoff()

    def add(self, answer: Answer) -> None:
        self._answers.append(answer)

    def extend(self, answers: Iterable[Answer]) -> None:
        self._answers.extend(answers)

    def wake_times(self) -> list[float]:
        """Monotonic times at which a flush has something to do."""
        wakes = [self._retry_at] if self._answers else []
        return wakes + ([self._held_retry_at] if self._held else [])

    def flush(self, writer: ResultWriter, now: float) -> tuple[list[Answer], int]:
        """Write what is due; returns the answers written and acknowledged (their slots and
        leases may go) and how many of them were undeliverable (dead-lettered)."""
        if self._held and now >= self._held_retry_at:
            self._answers += self._held
            self._held = []
        if not self._answers or now < self._retry_at:
            return [], 0
        try:
            flushed = writer.write_and_ack(self._answers)
        except (RedisUnavailable, RedisRefused) as e:
            wait = self._backoff.next_wait_s()
            if isinstance(e, RedisRefused):
                self._health.refused("writes", str(e))
            logger.warning("%s; retrying in %.1fs", e, wait)
            self._retry_at = now + wait
            return [], 0
        self._backoff.reset()
        self._health.accepted("writes")
        written = self._settle(flushed, now)
        self._answers = []
        return written, flushed.undeliverable

    def _settle(self, flushed: Flushed, now: float) -> list[Answer]:
        """Keep what the writer held back, on its own clock; the rest was written."""
        if flushed.held:
            self._held = flushed.held
            self._held_retry_at = now + self._held_backoff.next_wait_s()
        else:
            self._held_backoff.reset()
        held = {id(a) for a in flushed.held}
        return [a for a in self._answers if id(a) not in held]
