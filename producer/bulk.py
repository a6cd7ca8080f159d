"""Bulk scoring: stream many inputs through the workers with a bounded window of jobs in flight.

Every job names the run's reply list in ``reply_to``, so collecting is one
BLPOP on one key however many jobs are in flight; results are deleted from
Redis once written to the output, so neither Redis nor this process grows
with the number of inputs.

NOTE [ Interrupting a scoring run ]
  The first SIGINT/SIGTERM stops submitting; jobs in flight are collected
  for ``grace_s`` and written; the rest are left out of the output, so
  ``--resume`` scores them again. A second signal stops collecting at once.
  The output never holds half a record from this process, and a half line
  left by a crash (SIGKILL) is dropped when the run resumes.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import redis
from redbatch.common.protocol import Lane, ResultEnvelope
from redbatch.producer.client import Client
from redbatch.producer.inputs import Item
from redbatch.producer.output import DoneIndex, OutputWriter, record
from redbatch.producer.progress import Progress, RunStats

#: Jobs sent per pipelined round trip while filling the window.
SUBMIT_CHUNK = 64
#: Ids taken from the reply list per round trip.
COLLECT_CHUNK = 256
#: Longest single wait for a reply, seconds (bounds how late a signal is noticed).
WAIT_SLICE_S = 0.5


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


@dataclass(slots=True)
class _InFlight:
    item: Item
    sent: float


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
        self._reply = client.keys().reply(f"run-{uuid.uuid4().hex[:12]}")
        self._inflight: dict[str, _InFlight] = {}
        self._exhausted = False

    def stop(self) -> None:
        """First call: stop submitting and drain; second call: stop draining too."""
        if self.stopping.is_set():
            self.aborting.set()
        self.stopping.set()

    # ------------------------------------------------------------------ main loop

    def run(self, items: Iterator[Item]) -> bool:
        """Score every item; True when all were written, False when stopped early."""
        pending = self._unseen(items)
        drain_until: float | None = None
        while not self.aborting.is_set():
            if not self.stopping.is_set():
                self._fill(pending)
            elif drain_until is None:
                drain_until = time.monotonic() + self.settings.grace_s
            if not self._inflight and (self.stopping.is_set() or self._exhausted):
                break
            if drain_until is not None and time.monotonic() > drain_until:
                break
            self._collect()
            self._expire()
            self._tick()
        self.writer.flush()
        if self.progress:
            self.progress.finish()
        try:
            self.client.redis.delete(self._reply)
        except (redis.ConnectionError, redis.TimeoutError):
            pass  # the list expires on its own
        return self._exhausted and not self._inflight

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
        """Top the window up, in pipelined chunks."""
        while len(self._inflight) < self.settings.window:
            room = min(SUBMIT_CHUNK, self.settings.window - len(self._inflight))
            chunk = [item for _, item in zip(range(room), pending, strict=False)]
            if not chunk:
                self._exhausted = True
                return
            self._submit(chunk)

    def _read(self, item: Item) -> bytes | None:
        try:
            with open(item.path, "rb") as f:
                data = f.read(self.settings.max_payload_bytes + 1)
        except OSError as e:
            self._write_error(item, "unreadable_file", f"cannot read file: {e.strerror or e}")
            return None
        if len(data) > self.settings.max_payload_bytes:
            self._write_error(item, "payload_too_large",
                              f"file is larger than {self.settings.max_payload_bytes} bytes")
            return None
        return data

    def _submit(self, chunk: list[Item]) -> None:
        jobs, sent = [], []
        for item in chunk:
            data = self._read(item)
            if data is None:
                continue
            jobs.append(self.client.job(data, timeout_s=self.settings.timeout_s,
                                        lane=self.settings.lane, reply_to=self._reply))
            sent.append(item)
        now = time.monotonic()
        for job, item in zip(jobs, sent, strict=True):
            self._inflight[job.request_id] = _InFlight(item, now)
        if jobs:
            self.client.submit_jobs(jobs)

    # ------------------------------------------------------------------ collect

    def _collect(self) -> None:
        """Wait briefly for finished ids on the reply list, then read and write their results."""
        r = self.client.redis
        try:
            first = r.blpop([self._reply], timeout=WAIT_SLICE_S)
            if first is None:
                return
            more = r.lpop(self._reply, COLLECT_CHUNK) or []
        except (redis.ConnectionError, redis.TimeoutError):
            time.sleep(WAIT_SLICE_S)  # the reply list is durable; nothing is lost meanwhile
            return
        ids = [i.decode() for i in [first[1], *more]]
        self._write_results([i for i in ids if i in self._inflight])

    def _write_results(self, ids: list[str]) -> None:
        if not ids:
            return
        keys = self.client.keys()
        pipe = self.client.redis.pipeline(transaction=False)
        for rid in ids:
            pipe.get(keys.result(rid))
        for rid in ids:
            pipe.delete(keys.result(rid), keys.done(rid))  # read once; free Redis now
        raw = pipe.execute()[: len(ids)]
        now = time.monotonic()
        for rid, data in zip(ids, raw, strict=True):
            flight = self._inflight.pop(rid)
            if data is None:
                self._write_error(flight.item, "result_expired", "result expired before it "
                                  "was read")
                continue
            self._write_result(flight, ResultEnvelope.decode(data), (now - flight.sent) * 1000)
        self.writer.flush()

    def _write_result(self, flight: _InFlight, result: ResultEnvelope, latency_ms: float) -> None:
        item = flight.item
        if result.ok:
            rec = record(item.id, item.path, "ok", output=result.output, latency_ms=latency_ms,
                         batch_size=result.batch_size, worker=result.worker)
            outcome = "ok"
        else:
            code = result.error_code.value if result.error_code else "internal"
            rec = record(item.id, item.path, "error", error=(code, result.error_message),
                         latency_ms=latency_ms, batch_size=result.batch_size,
                         worker=result.worker)
            outcome = code
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
            self._write_error(item, "timeout", f"no result within {self.settings.timeout_s:g}s")
