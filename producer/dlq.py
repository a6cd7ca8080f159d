"""The dead-letter stream, for people: list, retry and purge (the ``redbatch dlq`` command).

The stream's commands and record fields belong to ``DeadLetters``, and a request id's keys
to ``OwnerKeys`` (common/protocol): this module decides what to list, requeue or delete."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import redis
from redbatch.common.protocol import DeadLetters, Keys, Lane, OwnerKeys, parse_queue_bound


def entries(r: redis.Redis, keys: Keys, count: int | None = None) -> Iterator[dict[str, Any]]:
    """Dead letters, oldest first, as JSON-friendly dicts (the job body is summarised)."""
    for letter in DeadLetters(keys).range(r, count):
        yield {
            "dlq_id": letter.dlq_id.decode(errors="replace"),
            "request_id": letter.request_id,
            "reason": letter.reason,
            "deliveries": letter.deliveries,
            "source": letter.source,
            "entry": letter.entry,
            "at_ms": letter.at_ms,
            "job_bytes": len(letter.job),
        }


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
    dead, owners = DeadLetters(keys), OwnerKeys(keys)
    done = 0
    for letter in dead.select(r, ids):
        rid, source = letter.request_id, letter.source
        if not rid or source not in keys.streams():
            continue  # nothing to answer, or not a stream of this model: only purge helps
        lane = source.rsplit(":", 1)[-1]
        bound = parse_queue_bound(r.hget(keys.limits(), lane))
        # Not atomic with the XADD below, unlike the admission script: an operator's
        # replay may overshoot a bound by the jobs producers add meanwhile.
        if bound is not None and int(r.xlen(source)) >= bound:
            raise RetryQueueFull(done, source, bound)
        pipe = r.pipeline(transaction=True)
        owners.free(pipe, [rid])
        requeued_at = len(pipe)
        dead.requeue(pipe, letter)
        entry_id = pipe.execute()[requeued_at]
        # The new entry owns the id (a worker that read it first has claimed it the same).
        owners.retake(r, rid, entry_id, Lane(lane))
        done += 1
    return done


def purge(r: redis.Redis, keys: Keys, ids: list[str]) -> int:
    """Delete dead letters (all when ``ids`` is empty); returns how many."""
    dead = DeadLetters(keys)
    return dead.delete(r, [letter.dlq_id for letter in dead.select(r, ids)])
