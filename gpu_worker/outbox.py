"""The answers waiting to be written, and the clocks of their retries.

The main loop adds answers as jobs finish and ships what is pending to the writer thread
(threads.py ``write_answers``) whenever no write is in flight, so that answers finished
while a write runs go together in the next one: one transaction for several batches when
the model is quick (results.py writes them with their acknowledgements). The write's
outcome comes back as a ``Written`` event. A write Redis refuses or that breaks off is
retried whole with back-off, and /readyz says why meanwhile; dead letters the writer held
back (NOTE [ Write failures ] in results.py) are retried on a clock of their own, so that
they never delay the other answers. The main loop owns it (not thread-safe).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from redbatch.common.redis_io import Backoff, RedisRefused
from redbatch.gpu_worker.events import Written
from redbatch.gpu_worker.metrics import Health
from redbatch.gpu_worker.streams.results import Answer, Flushed

logger = logging.getLogger(__name__)


class Outbox:
    """Answers not written yet, and the one write in flight."""

    def __init__(self, health: Health, send: Callable[[list[Answer]], None]) -> None:
        self._health = health
        self._send = send
        self._answers: list[Answer] = []
        self._in_flight = False
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
        """Monotonic times at which :meth:`ship` has something to send."""
        if self._in_flight:
            return []
        wakes = [self._retry_at] if self._answers else []
        return wakes + ([self._held_retry_at] if self._held else [])

    def ship(self, now: float) -> None:
        """Hand everything due to the writer, unless a write is in flight or backing off."""
        if self._in_flight or now < self._retry_at:
            return
        if self._held and now >= self._held_retry_at:
            self._answers += self._held
            self._held = []
        if self._answers:
            self._in_flight = True
            answers, self._answers = self._answers, []
            self._send(answers)

    def settle(self, done: Written, now: float) -> tuple[list[Answer], int]:
        """Take a write's outcome; returns the answers written and acknowledged (their slots
        and leases may go) and how many of them were undeliverable (dead-lettered)."""
        self._in_flight = False
        if done.flushed is None:
            wait = self._backoff.next_wait_s()
            if isinstance(done.error, RedisRefused):
                self._health.refused("writes", str(done.error))
            logger.warning("%s; retrying in %.1fs", done.error, wait)
            self._retry_at = now + wait
            self._answers = done.answers + self._answers
            return [], 0
        self._backoff.reset()
        self._health.accepted("writes")
        return self._keep_held(done.answers, done.flushed, now), done.flushed.undeliverable

    def _keep_held(self, answers: list[Answer], flushed: Flushed, now: float) -> list[Answer]:
        """Keep what the writer held back, on its own clock; the rest was written."""
        if flushed.held:
            self._held = flushed.held
            self._held_retry_at = now + self._held_backoff.next_wait_s()
        else:
            self._held_backoff.reset()
        held = {id(a) for a in flushed.held}
        return [a for a in answers if id(a) not in held]
