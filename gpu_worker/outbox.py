"""The answers waiting to be written, and the clocks of their retries.

The main loop adds answers as jobs finish and ships what is pending to the writer thread
(threads.py ``write_answers``) whenever no write is in flight, so that answers finished
while a write runs go together in the next one: one transaction for several batches when
the model is quick (results.py writes them with their acknowledgements). The write's
outcome comes back as a ``Written`` event. A write Redis refuses or that breaks off is
retried with back-off, and /readyz says why meanwhile. Each partition of the model has its
own retry clock: the writer writes each partition's answers in a transaction of its own,
and the answers of a partition whose write failed (its master away, or refusing) wait out
their back-off while the other partitions' answers are shipped as ever (issue 28). Dead
letters the writer held back (NOTE [ Write failures ] in results.py) are retried on a clock
of their own, so that they never delay the other answers. The main loop owns it (not
thread-safe).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from redbatch.common.protocol import stream_partition
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
        #: Partitions whose last write failed: when their answers may be sent again, and
        #: the back-off of each (kept until a write of it goes through).
        self._retry_at: dict[int, float] = {}
        self._backoff: dict[int, Backoff] = {}
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
        wakes = [min(self._retry_at.values(), default=0.0)] if self._answers else []
        return wakes + ([self._held_retry_at] if self._held else [])

    def ship(self, now: float) -> None:
        """Hand everything due to the writer, unless a write is in flight; the answers of a
        partition backing off stay."""
        if self._in_flight:
            return
        if self._held and now >= self._held_retry_at:
            self._answers += self._held
            self._held = []
        answers = self._due(now)
        if answers:
            self._in_flight = True
            self._send(answers)

    def _due(self, now: float) -> list[Answer]:
        """Take the answers whose partition is not backing off."""
        for part in [p for p, at in self._retry_at.items() if at <= now]:
            del self._retry_at[part]
        if not self._retry_at:
            answers, self._answers = self._answers, []
            return answers
        due: list[Answer] = []
        wait: list[Answer] = []
        for answer in self._answers:
            waits = stream_partition(answer.stream)[0] in self._retry_at
            (wait if waits else due).append(answer)
        self._answers = wait
        return due

    def settle(self, done: Written, now: float) -> tuple[list[Answer], int]:
        """Take a write's outcome; returns the answers written and acknowledged (their slots
        and leases may go) and how many of them were undeliverable (dead-lettered)."""
        self._in_flight = False
        if done.flushed is None:
            self._failed(done.answers, done.error, now)
            return [], 0
        flushed = done.flushed
        if flushed.failed:
            self._failed(flushed.failed, flushed.error, now, partial=True)
            gone = {id(a) for a in flushed.failed}
            answers = [a for a in done.answers if id(a) not in gone]
        else:
            answers = done.answers
            self._health.accepted("writes")
        if self._backoff:
            for part in {stream_partition(a.stream)[0] for a in answers}:
                self._backoff.pop(part, None)
        return self._keep_held(answers, flushed, now), flushed.undeliverable

    def _failed(self, answers: list[Answer], error: Exception | None, now: float,
                partial: bool = False) -> None:
        """Put back answers whose write failed, their partitions on back-off."""
        parts = {stream_partition(a.stream)[0] for a in answers}
        wait = max(self._backoff.setdefault(part, Backoff()).next_wait_s() for part in parts)
        for part in parts:
            self._retry_at[part] = now + wait
        if isinstance(error, RedisRefused):
            self._health.refused("writes", str(error))
        logger.warning("%s; retrying in %.1fs%s", error, wait,
                       f" (partitions {sorted(parts)} alone: the other partitions' answers "
                       "were written)" if partial else "")
        self._answers = answers + self._answers

    def _keep_held(self, answers: list[Answer], flushed: Flushed, now: float) -> list[Answer]:
        """Keep what the writer held back, on its own clock; the rest was written."""
        if flushed.held:
            self._held = flushed.held
            self._held_retry_at = now + self._held_backoff.next_wait_s()
        else:
            self._held_backoff.reset()
        held = {id(a) for a in flushed.held}
        return [a for a in answers if id(a) not in held]
