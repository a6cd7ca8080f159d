"""Bulk scoring: stream many inputs through the workers with a bounded window of jobs in flight.

Every job names the run's reply list in ``reply_to``, so collecting is one
BLMPOP (up to COLLECT_CHUNK ids) on one key however many jobs are in flight;
results are deleted from Redis once written to the output, so neither Redis
nor this process grows with the number of inputs.

NOTE [ Scoring a partitioned model ]
  Each job goes to the partition its request id maps to (PROTOCOL.md "Partitions"), as
  any client's does, so its result's keys follow from its id alone. The run has a reply
  list of the same name in each partition its jobs went to (the client points each job at
  its own partition's: ``ClientCore._place``), and keeps each job's partition
  (``run_parts.py``). Collecting is one BLMPOP of every list on one Redis; on a cluster,
  where the lists lie in different slots, one list per round, in turn, each for its share
  of the wait. Reading results and freeing their keys take one MGET and one DEL per
  partition, pipelined.

NOTE [ Interrupting a scoring run ]
  The first SIGINT/SIGTERM stops submitting; jobs in flight are collected
  for ``grace_s`` and written; the rest are left out of the output, so
  ``--resume`` scores them again. A second signal stops collecting at once.
  The output never holds half a record from this process, and a half line
  left by a crash (SIGKILL) is dropped when the run resumes.

Pacing against a bounded lane (the items admission control refuses, and when to
offer them again) is in pacing.py, with its NOTE [ A bounded queue ].

NOTE [ Redis going away ]
  A submission whose connection breaks may have queued some of its jobs, or
  none. The scorer keeps those envelopes and, after the same back-off, sends
  them again unchanged: request ids are unique (PROTOCOL.md), so the ones
  queued the first time come back as duplicates and count as queued. No job
  is lost and none runs twice. Collecting waits out the outage the same way.
  A BLMPOP whose reply is cut off by a broken connection has still popped its
  ids from the reply list, so the reply list alone can lose a finished job:
  every SWEEP_EVERY_S the scorer also looks up the result keys of jobs in
  flight for longer than that, and collects the ones that are there.
  An outage is waited out for ``redis_wait_s`` at most, counted from the first
  failed call since the last one that got through (a Redis unreachable from
  the start counts from the start): then every input left (in flight, waiting,
  not yet read) is written as a ``redis_unavailable`` error, so the run ends
  with a record for each input and says so in its exit code.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from redbatch.common.protocol import JobEnvelope, Lane, ResultEnvelope
from redbatch.common.redis_io import REDIS_ERRORS, RedisUnavailable
from redbatch.producer.client import Client, DuplicateRequestId, QueueFull
from redbatch.producer.errors import REDIS_UNAVAILABLE, RESULT_TIMEOUT
from redbatch.scoring.inputs import Item, Unsendable, read_payload
from redbatch.scoring.output import DoneIndex, OutputWriter, record, result_record
from redbatch.scoring.pacing import Outage, Waiting, WaitingLine
from redbatch.scoring.progress import Progress, RunStats
from redbatch.scoring.run_parts import Part, RunParts

#: Jobs sent per pipelined round trip while filling the window.
SUBMIT_CHUNK = 64
#: Ids taken from the reply list per round trip.
COLLECT_CHUNK = 256
#: Longest single wait for a reply, seconds (bounds how late a signal is noticed).
WAIT_SLICE_S = 0.5
#: How often, and past what age, jobs in flight are looked up by their result key, s.
SWEEP_EVERY_S = 5.0
#: What a Redis out of reach raises: redis-py's errors (the scorer's own calls) and the
#: client's (``RedisUnavailable`` subclasses).
AWAY = (*REDIS_ERRORS, RedisUnavailable)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ScoreSettings:
    #: Jobs in flight at most; memory is bounded by this, not by the number of inputs.
    window: int = 256
    lane: Lane = Lane.BULK
    #: Per-job deadline and how long the scorer waits for it, seconds.
    timeout_s: float = 3600.0
    #: After a stop signal, how long jobs in flight are still collected, seconds.
    grace_s: float = 10.0
    max_payload_bytes: int = 20 * 1024 * 1024
    #: How long Redis may stay out of reach before the inputs left are written as
    #: ``redis_unavailable`` errors, seconds (see NOTE [ Redis going away ]).
    redis_wait_s: float = 60.0
    #: The share of inputs (0-1) that may end in an error record with the run still a
    #: success (exit code 0), as Ray Data's ``max_errored_blocks`` but as a share.
    max_error_rate: float = 0.1


@dataclass(slots=True)
class _InFlight:
    item: Item
    sent: float
    #: The partition its job went to.
    part: Part


class BulkScorer:
    """Scores items from an iterator into an output writer; see the module NOTE."""

    def __init__(self, client: Client, writer: OutputWriter, settings: ScoreSettings,
                 done: DoneIndex | None = None, progress: Progress | None = None) -> None:
        self.client = client
        self.writer = writer
        self.settings = settings
        self.done = done or DoneIndex.empty()
        self.stats = RunStats()
        self.progress = progress
        self.stopping = threading.Event()
        self.aborting = threading.Event()
        self._parts = RunParts(client.redis, client.keys(), f"run-{uuid.uuid4().hex[:12]}")
        #: What every job names: partition 0's list (the client re-points it).
        self._reply = self._parts.first.reply
        self._inflight: dict[str, _InFlight] = {}
        #: Items refused by admission control, submitted before any new one (see pacing.py).
        self._line = WaitingLine()
        #: A submission whose connection broke, to send again as it was (see the NOTE).
        self._unsent: tuple[list[JobEnvelope], dict[str, Waiting]] | None = None
        self._next_sweep = time.monotonic() + SWEEP_EVERY_S
        self._exhausted = False
        self._outage = Outage(settings.redis_wait_s, time.monotonic())

    def stop(self) -> None:
        """First call: stop submitting and drain; second call: stop draining too."""
        if self.stopping.is_set():
            self.aborting.set()
        self.stopping.set()

    # ------------------------------------------------------------------ main loop

    def run(self, items: Iterator[Item]) -> bool:
        """Score every item; True when all were written (as results, or as errors once
        Redis stayed away past ``redis_wait_s``), False when stopped early."""
        pending = self._unseen(items)
        drain_until: float | None = None
        while not self.aborting.is_set():
            if not self.stopping.is_set():
                self._fill(pending)
            elif drain_until is None:
                drain_until = time.monotonic() + self.settings.grace_s
            if not self._inflight and (self.stopping.is_set() or self._all_sent()):
                break
            if drain_until is not None and time.monotonic() > drain_until:
                break
            self._collect()
            self._sweep()
            self._expire()
            self._tick()
            if self._outage.over(time.monotonic()):
                self._give_up(pending)
                break
        self.writer.flush()
        if self.progress:
            self.progress.finish()
        try:
            self._parts.delete()
        except AWAY:
            pass  # the lists expire on their own
        return self._all_sent() and not self._inflight

    def _all_sent(self) -> bool:
        """Every item was read and submitted: none waits for room or for Redis."""
        return self._exhausted and not self._line and self._unsent is None

    # ------------------------------------------------------------------ outages

    def _give_up(self, pending: Iterator[Item]) -> None:
        """Write every input left as ``redis_unavailable``: in flight, waiting, unread."""
        message = (f"Redis stayed out of reach for over {self.settings.redis_wait_s:g}s "
                   f"({self._outage.why})")
        logger.error("%s: every input left is written as %s", message, REDIS_UNAVAILABLE)
        left: list[Item] = [f.item for f in self._inflight.values()]
        self._inflight.clear()
        if self._unsent is not None:
            left += [w.item for w in self._unsent[1].values()]
            self._unsent = None
        left += [w.item for w in self._line.take(len(self._line))]
        for item in itertools.chain(left, pending):
            self._write_error(item, REDIS_UNAVAILABLE, message)
        self._exhausted = True

    def _unseen(self, items: Iterator[Item]) -> Iterator[Item]:
        for item in items:
            if item.id in self.done:
                self.stats.skipped += 1
            else:
                yield item

    def _tick(self) -> None:
        if self.progress:
            self.progress.update()

    # ------------------------------------------------------------------ submit

    def _fill(self, pending: Iterator[Item]) -> None:
        """Top the window up, in pipelined chunks; refused items go first, once the
        back-off allows (see NOTE [ A bounded queue ] in pacing.py)."""
        line = self._line
        while True:
            if self._unsent is not None:
                if not line.ready(time.monotonic()) or not self._send(*self._unsent):
                    return
            if line:
                room = min(SUBMIT_CHUNK, len(line))
            else:
                room = min(SUBMIT_CHUNK, self.settings.window - len(self._inflight))
                if room <= 0 or self._exhausted:
                    return
            if not line.ready(time.monotonic()):
                return
            if line.bounded:
                room = self._room_in_queue(pending, room)
                if room == 0:
                    return
            chunk = line.take(room) if line else self._take(pending, room)
            admitted, refused = self._submit(chunk)
            if self._unsent is not None:
                return
            line.pace(admitted, refused, time.monotonic())

    def _room_in_queue(self, pending: Iterator[Item], room: int) -> int:
        """How many of ``room`` jobs fit the lane's bound now; 0 means back off."""
        try:
            free = self.client.queue_state(self.settings.lane).room
        except AWAY as e:
            self._outage.failed(e, time.monotonic())
            self._line.clock.failed(time.monotonic())
            return 0
        self._outage.answered()
        if free is None:
            self._line.bounded = False  # the bound was removed
            return room
        if free == 0:
            if not self._line:  # new items wait for room (and time out) too
                self._line.no_room(self._take(pending, room), time.monotonic())
            self._line.clock.failed(time.monotonic())
        return min(room, free)

    def _take(self, pending: Iterator[Item], n: int) -> list[Waiting]:
        fresh = list(itertools.islice(pending, n))
        self._exhausted = len(fresh) < n
        return [Waiting(item) for item in fresh]

    def _read(self, item: Item) -> bytes | str | Mapping[str, Any] | None:
        """The item's payload; None (its error record written) when it cannot be sent."""
        data = read_payload(item, self.settings.max_payload_bytes)
        if isinstance(data, Unsendable):
            self._write_error(item, data.code, data.message)
            return None
        return data

    def _submit(self, chunk: list[Waiting]) -> tuple[int, int]:
        """Submit items; the refused ones go back to the head of the line, in order.
        Returns how many were admitted and how many refused."""
        jobs: list[JobEnvelope] = []
        entries: dict[str, Waiting] = {}
        for entry in chunk:
            data = self._read(entry.item)
            if data is None:
                continue
            job = self.client.job(data, timeout_s=self.settings.timeout_s,
                                  lane=self.settings.lane, reply_to=self._reply.key)
            jobs.append(job)
            entries[job.request_id] = entry
        if not jobs:
            return 0, 0
        return self._admit(jobs, entries)

    def _send(self, jobs: list[JobEnvelope], entries: dict[str, Waiting]) -> bool:
        """Send a submission again after a broken connection; True once it got through."""
        self._unsent = None
        _, refused = self._admit(jobs, entries)
        if self._unsent is not None:
            return False
        logger.info("Redis is back: submitting again")
        self._line.pace(len(jobs) - refused, refused, time.monotonic())
        return True

    def _admit(self, jobs: list[JobEnvelope], entries: dict[str, Waiting]) -> tuple[int, int]:
        refused: list[str] = []
        admitted: list[str]
        try:
            admitted = list(self.client.submit_jobs(jobs))
        except QueueFull as e:
            admitted, refused = e.accepted + e.duplicates, e.refused
            if not self._line.bounded:
                logger.info("the %s queue of model %r is full (bound %d): backing off "
                            "and retrying", e.lane.value, e.model, e.bound)
            self._line.bounded = True
        except DuplicateRequestId as e:
            # Only after a broken connection: these were queued by the lost submission.
            admitted = e.accepted + e.duplicates
        except AWAY as e:
            if self._unsent is None:
                logger.warning("submitting failed (%s); retrying with back-off for %gs at "
                               "most", e, self.settings.redis_wait_s)
            self._outage.failed(e, time.monotonic())
            self._unsent = (jobs, entries)
            self._line.clock.failed(time.monotonic())
            return 0, 0
        self._outage.answered()
        now = time.monotonic()
        for rid in admitted:
            part = self._parts.of(self.client.placed_keys(rid))
            self._inflight[rid] = _InFlight(entries[rid].item, now, part)
        self._line.refused((entries[rid] for rid in refused), now)
        return len(admitted), len(refused)

    # ------------------------------------------------------------------ collect

    def _collect(self) -> None:
        """Wait briefly for finished ids on the reply list, then read and write their results.

        While refused items wait, the wait ends when their back-off does."""
        wait = WAIT_SLICE_S
        if not self.stopping.is_set():
            wait = self._line.wait_s(wait, time.monotonic())
        try:
            ids = self._parts.pop(wait, COLLECT_CHUNK)
        except AWAY as e:
            self._outage.failed(e, time.monotonic())
            time.sleep(WAIT_SLICE_S)  # results are durable; the sweep finds any lost id
            return
        self._outage.answered()
        self._write_results([i for i in ids if i in self._inflight])

    def _sweep(self) -> None:
        """Collect jobs whose result exists but whose reply-list id was lost (see the NOTE)."""
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_EVERY_S
        old = [rid for rid, f in self._inflight.items() if now - f.sent > SWEEP_EVERY_S]
        for start in range(0, len(old), COLLECT_CHUNK):
            chunk = old[start:start + COLLECT_CHUNK]
            pipe = self.client.redis.pipeline(transaction=False)
            for rid in chunk:
                self._inflight[rid].part.answers.exists(pipe, rid)
            try:
                found = pipe.execute()
            except AWAY:
                return
            self._write_results([rid for rid, n in zip(chunk, found, strict=True) if n])

    def _write_results(self, ids: list[str]) -> None:
        if not ids:
            return
        groups: dict[int, list[str]] = {}
        for rid in ids:
            groups.setdefault(self._inflight[rid].part.keys.partition, []).append(rid)
        ids = [rid for group in groups.values() for rid in group]
        try:
            raw = self._parts.read(groups)
        except AWAY:
            return  # still in flight: the next sweep finds their results
        try:  # read once: free Redis now (or they expire), the id's claim with them
            self._parts.free(groups)
        except AWAY:
            pass
        now = time.monotonic()
        for rid, data in zip(ids, raw, strict=True):
            flight = self._inflight.pop(rid)
            if data is None:
                self._write_error(flight.item, "result_expired", "result expired before it "
                                  "was read")
                continue
            self._write_result(flight, ResultEnvelope.decode(data), (now - flight.sent) * 1000)
        self.writer.flush()
        self._line.clock.wake()  # our jobs left the queue: room for refused ones, if any

    def _write_result(self, flight: _InFlight, result: ResultEnvelope, latency_ms: float) -> None:
        item = flight.item
        rec = result_record(item.id, item.path, result, latency_ms)
        outcome = "ok" if result.ok else rec["error"]["code"]
        self.writer.write(rec)
        self.stats.add(outcome, latency_ms, result.batch_size)

    def _write_error(self, item: Item, code: str, message: str) -> None:
        self.writer.write(record(item.id, item.path, "error", error=(code, message)))
        self.stats.add(code, None, 0)

    def _expire(self) -> None:
        """Jobs past their deadline with no result: written as client-side timeouts."""
        limit = time.monotonic() - self.settings.timeout_s
        late = [rid for rid, f in self._inflight.items() if f.sent < limit]
        for rid in late:
            item = self._inflight.pop(rid).item
            self._write_error(item, RESULT_TIMEOUT,
                              f"no result within {self.settings.timeout_s:g}s")
        for item in self._line.expired(limit):
            self._write_error(item, RESULT_TIMEOUT, f"not admitted within "
                              f"{self.settings.timeout_s:g}s: the queue stayed full")
