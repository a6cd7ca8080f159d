"""The dead-letter stream (PROTOCOL.md "Dead letters"): its records, and every command on it.

``Keys.dlq`` holds the jobs that will not be run again, with the reason. Workers add
records (:meth:`DeadLetters.add`); people list, requeue and purge them (``redbatch dlq``);
the status readers count them. As with rq's registries, :class:`DeadLetters` is the one owner
of the stream: the only code that writes it, and the one place that spells its commands
(the MAXLEN trim) and its record's fields. Each verb queues its commands on the pipeline the
caller gives (or runs them at once on a client), so the callers' transactions stay theirs.
Each partition of a model has its own stream (PROTOCOL.md "Partitions"): :func:`select_in`
reads several in one pipeline, and a letter replayed into another partition takes its job
re-pointed there (:meth:`DeadLetterEntry.job_in`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import redis
from redbatch.common.protocol.envelopes import packb, unpackb
from redbatch.common.protocol.errors import ErrorCode, ProtocolError
from redbatch.common.protocol.keys import (
    DLQ_AT_MS,
    DLQ_DELIVERIES,
    DLQ_ENTRY,
    DLQ_MAX_LEN,
    DLQ_REASON,
    DLQ_SOURCE,
    FIELD_JOB,
    FIELD_REQUEST_ID,
    Keys,
)

DeadLetter = dict[str, bytes | str]
"""The fields of one dead-letter record, to add (see :func:`dead_letter`)."""
_Entry = tuple[bytes, dict[bytes, bytes]]


def own_fields(fields: Mapping[bytes, bytes]) -> DeadLetter:
    """A stream entry's own ``rid`` and ``job`` fields, byte for byte and only those it had."""
    return {name: fields[name.encode()] for name in (FIELD_REQUEST_ID, FIELD_JOB)
            if name.encode() in fields}


def dead_letter(own: Mapping[str, bytes | str], source: str, entry_id: bytes, code: ErrorCode,
                message: str, deliveries: int) -> DeadLetter:
    """The record of a job: its ``own`` fields, the stream and entry it came from, the reason
    (``code: message``), how many times it was delivered, and when (now, Unix ms)."""
    return {**own, DLQ_SOURCE: source, DLQ_ENTRY: entry_id, DLQ_REASON: f"{code.value}: {message}",
            DLQ_DELIVERIES: str(deliveries), DLQ_AT_MS: str(int(time.time() * 1000))}


def _text(value: bytes | None) -> str:
    return (value or b"").decode(errors="replace")


@dataclass(frozen=True, slots=True)
class DeadLetterEntry:
    """One entry of the dead-letter stream as read. Its fields are read on use: text is
    decoded leniently and an absent field reads as empty (0 for the numbers)."""

    dlq_id: bytes
    fields: Mapping[bytes, bytes]

    def _field(self, name: str) -> bytes | None:
        return self.fields.get(name.encode())

    @property
    def request_id(self) -> str:
        return _text(self._field(FIELD_REQUEST_ID))

    @property
    def job(self) -> bytes:
        """The job envelope, byte for byte (b"" when the entry had none)."""
        return self._field(FIELD_JOB) or b""

    def job_in(self, keys: Keys) -> bytes:
        """The job envelope to queue in the partition of ``keys``: byte for byte, but for a
        ``reply_to`` naming a reply list of another partition of the model, which becomes
        the same list of this one (a worker answers a job naming a list of another
        partition ``bad_envelope``). An envelope that does not decode is kept as it is."""
        try:
            body = unpackb(self.job, len(self.job))
        except ProtocolError:
            return self.job
        reply_to = body.get("reply_to") if isinstance(body, dict) else None
        name = keys.reply_name(reply_to) if isinstance(reply_to, str) else None
        if name is None or reply_to == keys.reply(name):
            return self.job
        return packb({**body, "reply_to": keys.reply(name)})

    @property
    def source(self) -> str:
        """The lane stream the job was read from."""
        return _text(self._field(DLQ_SOURCE))

    @property
    def entry(self) -> str:
        """The job's entry id in ``source``."""
        return _text(self._field(DLQ_ENTRY))

    @property
    def reason(self) -> str:
        """``code: message``."""
        return _text(self._field(DLQ_REASON))

    @property
    def deliveries(self) -> int:
        """How many times Redis had delivered it; raises ValueError for a non-number."""
        return int(self._field(DLQ_DELIVERIES) or 0)

    @property
    def at_ms(self) -> int:
        """When it was dead-lettered, Unix ms; raises ValueError for a non-number."""
        return int(self._field(DLQ_AT_MS) or 0)


class DeadLetters:
    """The dead-letter stream of one model (``Keys.dlq``): add, count, read, requeue, delete."""

    def __init__(self, keys: Keys) -> None:
        self.keys = keys
        #: The stream's key.
        self.key = keys.dlq()

    def add(self, pipe: redis.Redis, record: DeadLetter) -> str:
        """Queue XADD of ``record``, trimming the stream to about DLQ_MAX_LEN entries so it
        cannot grow without bound. Returns ``"XADD <key>"``, to name it in messages."""
        pipe.xadd(self.key, cast(Any, record), maxlen=DLQ_MAX_LEN, approximate=True)
        return f"XADD {self.key}"

    def guard(self, pipe: redis.Redis) -> bytes | str | None:
        """WATCH the stream, so that an EXEC after this fails if it changes, and return its
        type when the key holds something else (records cannot be added then); None when
        it is a stream or absent. Call it on a transaction pipeline before ``multi()``."""
        pipe.watch(self.key)
        kind: bytes | str = pipe.type(self.key)
        return None if kind in (b"none", b"stream", "none", "stream") else kind

    def length(self, pipe: redis.Redis) -> None:
        """Queue XLEN: how many dead letters there are."""
        pipe.xlen(self.key)

    def range(self, r: redis.Redis, count: int | None = None) -> list[DeadLetterEntry]:
        """Up to ``count`` dead letters (all for None), oldest first (XRANGE)."""
        return self._xrange(r, count=count)

    def select(self, r: redis.Redis, dlq_ids: Sequence[str]) -> list[DeadLetterEntry]:
        """The dead letters of ``dlq_ids`` that exist, in that order (all for no ids);
        one XRANGE per id."""
        if not dlq_ids:
            return self._xrange(r)
        return [found for dlq_id in dlq_ids
                for found in self._xrange(r, min=dlq_id, max=dlq_id)]

    def requeue(self, pipe: redis.Redis, letter: DeadLetterEntry) -> None:
        """Queue XADD of the letter's request id and job to its source stream (the reply is
        the new entry's id), then XDEL of the letter. Its source must be a job stream of
        this model; its result and owner are the caller's (``OwnerKeys.free``/``retake``)."""
        self.readd(pipe, letter, letter.source, letter.job)
        self.remove(pipe, [letter.dlq_id])

    @staticmethod
    def readd(pipe: redis.Redis, letter: DeadLetterEntry, stream: str, job: bytes) -> None:
        """Queue XADD of the letter's request id and ``job`` (its own, or
        :meth:`DeadLetterEntry.job_in` another partition) to the job stream ``stream``; the
        reply is the new entry's id. The letter stays until :meth:`remove`."""
        pipe.xadd(stream, {FIELD_REQUEST_ID: letter.request_id, FIELD_JOB: job})

    def remove(self, pipe: redis.Redis, dlq_ids: Sequence[bytes]) -> None:
        """Queue one XDEL of dead letters (none for no ids)."""
        if dlq_ids:
            pipe.xdel(self.key, *dlq_ids)

    def delete(self, r: redis.Redis, dlq_ids: Sequence[bytes]) -> int:
        """Delete dead letters (XDEL); returns how many there were. No ids, no call."""
        return int(r.xdel(self.key, *dlq_ids)) if dlq_ids else 0

    def _xrange(self, r: redis.Redis, **kw: Any) -> list[DeadLetterEntry]:
        return _entries(r.xrange(self.key, **kw))


def select_in(r: redis.Redis, streams: Sequence[DeadLetters], dlq_ids: Sequence[str],
              count: int | None = None) -> list[list[DeadLetterEntry]]:
    """The dead letters of several streams (a model's partitions), per stream, in one
    pipelined round trip (on a cluster redis-py sends each XRANGE to its stream's master):
    those of ``dlq_ids`` the stream holds, in that order, or without ids its first
    ``count`` (all for None), oldest first."""
    pipe = r.pipeline(transaction=False)
    for dead in streams:
        if not dlq_ids:
            pipe.xrange(dead.key, count=count)
        for dlq_id in dlq_ids:
            pipe.xrange(dead.key, min=dlq_id, max=dlq_id)
    replies = iter(pipe.execute())
    calls = max(1, len(dlq_ids))
    return [[found for _ in range(calls) for found in _entries(next(replies))]
            for _ in streams]


def _entries(raw: Any) -> list[DeadLetterEntry]:
    # redis-py types replies loosely; a client without decode_responses returns bytes.
    return [DeadLetterEntry(dlq_id, fields) for dlq_id, fields in cast(list[_Entry], raw or [])]
