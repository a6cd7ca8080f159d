"""The result writer: write results and acknowledge their jobs, atomically.

For each answered entry one MULTI/EXEC sets the result key (with its TTL),
pushes the wake-up token for waiting clients, and only then acknowledges and
deletes the stream entry. If the transaction fails nothing is acknowledged,
so a job never leaves its stream without its result written.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import redis
from redbatch.common.protocol import (
    DLQ_AT_MS,
    DLQ_DELIVERIES,
    DLQ_ENTRY,
    DLQ_MAX_LEN,
    DLQ_REASON,
    DLQ_SOURCE,
    DONE_TOKEN,
    FIELD_JOB,
    FIELD_REQUEST_ID,
    GROUP,
    RECENT_MAX,
    RECENT_TTL_MS,
    ErrorCode,
    Keys,
    Lane,
    RecentResult,
    ResultEnvelope,
    Status,
)
from redbatch.common.redis_io import REDIS_ERRORS, RedisUnavailable
from redbatch.gpu_worker.intake import BadEntry, Job


@dataclass(frozen=True, slots=True)
class Answer:
    """One stream entry to acknowledge, with the encoded result to write first (if answerable)."""

    stream: str
    entry_id: bytes
    request_id: str | None
    encoded: bytes = b""
    slot: int = -1
    reply_to: str | None = None
    lane: Lane = Lane.INTERACTIVE
    dead_letter: dict[str, bytes | str] | None = None
    """Fields of a dead-letter entry to add to the DLQ in the same transaction."""
    outcome: str = ""
    """``ok`` or the error code, for the fleet's recent-results list (Keys.recent) and the
    worker's metrics."""
    total_ms: float | None = None
    """The result's end-to-end time, ms; None when the entry was rejected unread."""
    timings: Mapping[str, float] | None = None
    """The result's stage timings, ms, for the worker's latency metrics."""


def _answer(entry: Job | BadEntry, result: ResultEnvelope, slot: int = -1) -> Answer:
    reply_to = entry.envelope.reply_to if isinstance(entry, Job) else None
    lane = entry.envelope.lane if isinstance(entry, Job) else Lane.INTERACTIVE
    return Answer(entry.stream, entry.entry_id, result.request_id, result.encode(), slot,
                  reply_to, lane, outcome=_outcome(result),
                  total_ms=result.timings.get("total_ms"), timings=result.timings)


def _outcome(result: ResultEnvelope) -> str:
    return result.error_code.value if result.error_code is not None else result.status.value


class ResultWriter:
    """Builds result envelopes and writes them with their acknowledgements."""

    def __init__(self, r: redis.Redis, keys: Keys, worker: str, ttl_s: int) -> None:
        self._redis = r
        self.keys = keys
        self.worker = worker
        self._ttl_ms = ttl_s * 1000

    # ------------------------------------------------------------------ envelopes

    def _timings(self, job: Job, inference_ms: float = 0.0, batch_wait_ms: float = 0.0) -> dict[
            str, float]:
        total = job.queue_ms + (time.monotonic() - job.arrival_s) * 1000
        return {"queue_ms": round(job.queue_ms, 3), "preprocess_ms": round(job.preprocess_ms, 3),
                "batch_wait_ms": round(batch_wait_ms, 3), "inference_ms": round(inference_ms, 3),
                "total_ms": round(total, 3)}

    def ok(self, job: Job, output: Any, batch_size: int, inference_ms: float,
           batch_wait_ms: float) -> Answer:
        """An ok result; an output msgpack cannot carry becomes an ``internal`` error result."""
        result = ResultEnvelope(job.request_id, Status.OK, output=output,
                                timings=self._timings(job, inference_ms, batch_wait_ms),
                                batch_size=batch_size, worker=self.worker, model=self.keys.model,
                                finished_ms=int(time.time() * 1000))
        try:
            return _answer(job, result, job.slot)
        except (TypeError, ValueError, OverflowError) as e:
            return self.failed(job, ErrorCode.INTERNAL,
                               f"model output cannot be encoded as msgpack: {e}", batch_size)

    def failed(self, job: Job, code: ErrorCode, message: str, batch_size: int = 0) -> Answer:
        result = ResultEnvelope.error(job.request_id, code, message, timings=self._timings(job),
                                      batch_size=batch_size, worker=self.worker,
                                      model=self.keys.model, finished_ms=int(time.time() * 1000))
        return _answer(job, result, job.slot)

    def rejected(self, entry: BadEntry) -> Answer:
        """An entry that cannot run: answered if it has an id, dead-lettered if it is
        marked so, acknowledged either way."""
        dead = _dead_letter_fields(entry) if entry.dead_letter else None
        if entry.request_id is None:
            return Answer(entry.stream, entry.entry_id, None, dead_letter=dead,
                          outcome=entry.code.value)
        result = ResultEnvelope.error(entry.request_id, entry.code, entry.message,
                                      worker=self.worker, model=self.keys.model,
                                      finished_ms=int(time.time() * 1000))
        answer = _answer(entry, result)
        return replace(answer, dead_letter=dead)

    # ------------------------------------------------------------------ writing

    def write_and_ack(self, answers: Sequence[Answer]) -> None:
        """Write every result, then XACK and XDEL every entry, in one transaction.

        Raises RedisUnavailable; then nothing was acknowledged and the caller
        may retry the same answers.
        """
        if not answers:
            return
        pipe = self._redis.pipeline(transaction=True)
        for answer in answers:
            if answer.dead_letter is not None:
                pipe.xadd(self.keys.dlq(), answer.dead_letter,  # type: ignore[arg-type]
                          maxlen=DLQ_MAX_LEN, approximate=True)
            if answer.request_id is not None:
                rid = answer.request_id
                # NX: a job run twice (taken over from a stuck worker) keeps its first result,
                # so a late write can never change what a client already read.
                pipe.set(self.keys.result(rid), answer.encoded, px=self._ttl_ms, nx=True)
                pipe.rpush(self.keys.done(rid), DONE_TOKEN)
                pipe.pexpire(self.keys.done(rid), self._ttl_ms)
                # The id stays taken while its result can be read (NOTE [ Request id owners ]).
                pipe.pexpire(self.keys.owner(rid), self._ttl_ms)
                if answer.reply_to is not None:
                    pipe.rpush(answer.reply_to, rid)
                    pipe.pexpire(answer.reply_to, self._ttl_ms)
        self._push_recent(pipe, answers)
        for stream, ids in _by_stream(answers).items():
            pipe.xack(stream, GROUP, *ids)
            pipe.xdel(stream, *ids)
        try:
            pipe.execute()
        except REDIS_ERRORS as e:
            raise RedisUnavailable(f"writing {len(answers)} results failed: {e}") from e

    def _push_recent(self, pipe: Any, answers: Sequence[Answer]) -> None:
        """Queue the answered results onto the capped recent list `redbatch status` reads."""
        now = int(time.time() * 1000)
        bulk = self.keys.stream(Lane.BULK)
        # The lane from the stream, not the envelope: rejected entries have no envelope.
        records = [RecentResult(now, Lane.BULK if a.stream == bulk else Lane.INTERACTIVE,
                                a.outcome, a.total_ms).encode()
                   for a in answers if a.request_id is not None]
        if records:
            pipe.lpush(self.keys.recent(), *records)
            pipe.ltrim(self.keys.recent(), 0, RECENT_MAX - 1)
            pipe.pexpire(self.keys.recent(), RECENT_TTL_MS)


def _dead_letter_fields(entry: BadEntry) -> dict[str, bytes | str]:
    fields = dict(entry.fields or {})
    return {
        FIELD_REQUEST_ID: fields.get(FIELD_REQUEST_ID.encode(), b""),
        FIELD_JOB: fields.get(FIELD_JOB.encode(), b""),
        DLQ_SOURCE: entry.stream,
        DLQ_ENTRY: entry.entry_id,
        DLQ_REASON: f"{entry.code.value}: {entry.message}",
        DLQ_DELIVERIES: str(entry.deliveries),
        DLQ_AT_MS: str(int(time.time() * 1000)),
    }


def _by_stream(answers: Sequence[Answer]) -> dict[str, list[bytes]]:
    grouped: dict[str, list[bytes]] = {}
    for answer in answers:
        grouped.setdefault(answer.stream, []).append(answer.entry_id)
    return grouped
