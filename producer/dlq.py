"""The dead-letter stream, for people: list, retry and purge (the ``redbatch dlq`` command)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import redis
from redbatch.common.protocol import (
    DLQ_AT_MS,
    DLQ_DELIVERIES,
    DLQ_ENTRY,
    DLQ_REASON,
    DLQ_SOURCE,
    FIELD_JOB,
    FIELD_REQUEST_ID,
    OWNER_TTL_PAD_MS,
    Keys,
    parse_queue_bound,
)

Entry = tuple[bytes, dict[bytes, bytes]]


def _text(value: bytes | None) -> str:
    return (value or b"").decode(errors="replace")


def _xrange(r: redis.Redis, key: str, **kw: Any) -> list[Entry]:
    # redis-py types replies loosely; a client without decode_responses returns bytes.
    return cast(list[Entry], r.xrange(key, **kw) or [])


def entries(r: redis.Redis, keys: Keys, count: int | None = None) -> Iterator[dict[str, Any]]:
    """Dead letters, oldest first, as JSON-friendly dicts (the job body is summarised)."""
    for entry_id, fields in _xrange(r, keys.dlq(), count=count):
        job = fields.get(FIELD_JOB.encode(), b"")
        yield {
            "dlq_id": _text(entry_id),
            "request_id": _text(fields.get(FIELD_REQUEST_ID.encode())),
            "reason": _text(fields.get(DLQ_REASON.encode())),
            "deliveries": int(fields.get(DLQ_DELIVERIES.encode(), b"0") or 0),
            "source": _text(fields.get(DLQ_SOURCE.encode())),
            "entry": _text(fields.get(DLQ_ENTRY.encode())),
            "at_ms": int(fields.get(DLQ_AT_MS.encode(), b"0") or 0),
            "job_bytes": len(job),
        }


def _selected(r: redis.Redis, keys: Keys, ids: list[str]) -> list[Entry]:
    if not ids:
        return _xrange(r, keys.dlq())
    found: list[Entry] = []
    for dlq_id in ids:
        found += _xrange(r, keys.dlq(), min=dlq_id, max=dlq_id)
    return found


class RetryQueueFull(Exception):
    """A lane reached its admission bound while retrying; the rest stay dead letters."""

    def __init__(self, requeued: int, lane_stream: str, bound: int) -> None:
        super().__init__(f"{lane_stream} is at its bound of {bound} jobs; requeued "
                         f"{requeued}, the rest stay in the dead-letter stream")
        self.requeued = requeued


def retry(r: redis.Redis, keys: Keys, ids: list[str]) -> int:
    """Put dead letters back on their lane streams (all when ``ids`` is empty).

    The ``dead_lettered`` result of each, and its claim on the request id, are deleted
    in the same transaction, so its client can wait for the new one. Lane bounds are
    respected (raises RetryQueueFull when one is reached). Returns how many were requeued.
    """
    done = 0
    for dlq_id, fields in _selected(r, keys, ids):
        rid = _text(fields.get(FIELD_REQUEST_ID.encode()))
        source = _text(fields.get(DLQ_SOURCE.encode()))
        if not rid or source not in keys.streams():
            continue  # nothing to answer, or not a stream of this model: only purge helps
        lane = source.rsplit(":", 1)[-1]
        bound = parse_queue_bound(r.hget(keys.limits(), lane))
        # Not atomic with the XADD below, unlike the admission script: an operator's
        # replay may overshoot a bound by the jobs producers add meanwhile.
        if bound is not None and int(r.xlen(source)) >= bound:
            raise RetryQueueFull(done, source, bound)
        pipe = r.pipeline(transaction=True)
        pipe.delete(keys.result(rid), keys.done(rid), keys.owner(rid))
        pipe.xadd(source, {FIELD_REQUEST_ID: rid,
                           FIELD_JOB: fields.get(FIELD_JOB.encode(), b"")})
        pipe.xdel(keys.dlq(), dlq_id)
        entry_id = pipe.execute()[1]
        # The new entry owns the id (a worker that read it first has claimed it the same).
        r.set(keys.owner(rid), entry_id, nx=True, px=OWNER_TTL_PAD_MS)
        done += 1
    return done


def purge(r: redis.Redis, keys: Keys, ids: list[str]) -> int:
    """Delete dead letters (all when ``ids`` is empty); returns how many."""
    selected = [dlq_id for dlq_id, _ in _selected(r, keys, ids)]
    return int(r.xdel(keys.dlq(), *selected)) if selected else 0
