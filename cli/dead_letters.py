"""The dead-letter streams, for people: list, retry and purge (the ``redbatch dlq`` command).

The streams' commands and record fields belong to ``DeadLetters``, and a request id's keys
to ``OwnerKeys`` (common/protocol): this module decides what to list, requeue or delete.

A model of several partitions has a dead-letter stream in each (PROTOCOL.md "Partitions"):
every command covers them all, or the one ``partition`` names. Letters are read in one
pipelined round trip, and written in groups: one transaction per partition and group of
letters, not one per letter. A replayed job goes to the partition its request id maps to
under the model's partition count now (where a client with only the id looks first), which
after the count rose may not be the partition it was dead-lettered in; it then names the
same reply list in its new partition (``DeadLetterEntry.job_in``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redbatch.common.protocol import (
    DeadLetterEntry,
    DeadLetters,
    Keys,
    Lane,
    OwnerKeys,
    parse_queue_bound,
    read_partitions,
    select_in,
    valid_request_id,
)

#: Letters requeued per transaction.
RETRY_CHUNK = 256


class NoSuchPartition(ValueError):
    """A partition the model does not have was named."""


@dataclass(frozen=True, slots=True)
class Found:
    """A dead letter and the partition whose stream holds it."""

    partition: int
    letter: DeadLetterEntry


def find(r: redis.Redis, keys: Keys, ids: Sequence[str], partition: int | None = None,
         count: int | None = None) -> tuple[int, list[Found]]:
    """The model's partition count now, and its dead letters in every partition or the one
    ``partition`` names (NoSuchPartition for one the model lacks): those of ``ids``,
    partition by partition in the order of ``ids`` (each letter once), or all of them,
    oldest first across partitions (at most ``count``)."""
    total = read_partitions(r, keys)[-1]
    if partition is not None and not 0 <= partition < total:
        raise NoSuchPartition(f"model {keys.model} has {total} partition{'s' * (total > 1)}: "
                         f"there is no partition {partition}")
    chosen = list(range(total)) if partition is None else [partition]
    per_part = select_in(r, [DeadLetters(keys.part(p)) for p in chosen], ids, count)
    found = list({(p, letter.dlq_id): Found(p, letter)
                  for p, letters in zip(chosen, per_part, strict=True)
                  for letter in letters}.values())
    if not ids:
        found.sort(key=lambda f: (_stream_order(f.letter.dlq_id), f.partition))
    return total, found[:count]


def _stream_order(dlq_id: bytes) -> tuple[int, int]:
    """A stream entry id ``ms-seq`` as numbers, to merge several streams oldest first."""
    ms, _, seq = dlq_id.partition(b"-")
    return int(ms or 0), int(seq or 0)


def entries(r: redis.Redis, keys: Keys, count: int | None = None,
            partition: int | None = None) -> Iterator[dict[str, Any]]:
    """Dead letters of every partition (or ``partition``), oldest first, as JSON-friendly
    dicts (the job body is summarised)."""
    for found in find(r, keys, [], partition, count)[1]:
        letter = found.letter
        yield {
            "dlq_id": letter.dlq_id.decode(errors="replace"),
            "partition": found.partition,
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


@dataclass(frozen=True, slots=True)
class _Replay:
    """A letter to requeue: where it is (``source``: its partition's keys) and where its
    job goes (``target``, on ``lane``)."""

    letter: DeadLetterEntry
    source: Keys
    target: Keys
    lane: Lane


def retry(r: redis.Redis, keys: Keys, ids: list[str], partition: int | None = None) -> int:
    """Put dead letters back on their lanes (all when ``ids`` is empty), in the partition
    each request id maps to now (module docstring).

    The ``dead_lettered`` result of each, and its claim on the request id, are deleted
    with the requeue, so its client can wait for the new one. Lane bounds are respected:
    the letters up to the first that finds its lane full are requeued, then
    RetryQueueFull is raised. Returns how many were requeued.
    """
    count, found = find(r, keys, ids, partition)
    replays = _replays(keys, count, found)
    chosen, full = _fitting(r, replays)
    done = 0
    for group in _groups(chosen):
        _requeue(r, group)
        done += len(group)
    if full is not None:
        raise RetryQueueFull(done, *full)
    return done


def _replays(keys: Keys, count: int, found: list[Found]) -> list[_Replay]:
    """What to requeue, and where: letters with a request id and a job stream of this model
    as their source (a letter without either is for purge only)."""
    lanes = {part.stream(lane): lane for part in keys.parts(count) for lane in Lane}
    out = []
    for f in found:
        rid, lane = f.letter.request_id, lanes.get(f.letter.source)
        if not rid or lane is None:
            continue
        source = keys.part(f.partition)
        # An id that is none maps to no partition: it goes back where it was (and is
        # dead-lettered again, bad_request_id).
        target = keys.of(rid, count) if valid_request_id(rid) else source
        out.append(_Replay(f.letter, source, target, lane))
    return out


def _fitting(r: redis.Redis, replays: list[_Replay]) -> tuple[list[_Replay],
                                                                tuple[str, int] | None]:
    """The replays up to the first whose lane is at its bound, and that lane's stream and
    bound (None when all fit); each target lane's bound and length read in one pipeline.
    Not atomic with the requeue, unlike the admission script: an operator's replay may
    overshoot a bound by the jobs producers add meanwhile."""
    lanes = list(dict.fromkeys((x.target, x.lane) for x in replays))
    pipe = r.pipeline(transaction=False)
    for target, lane in lanes:
        pipe.hget(target.limits(), lane.value)
        pipe.xlen(target.stream(lane))
    replies = pipe.execute() if lanes else []
    room = {lane_of: (parse_queue_bound(replies[2 * i]), int(replies[2 * i + 1]))
            for i, lane_of in enumerate(lanes)}
    for n, replay in enumerate(replays):
        bound, queued = room[(replay.target, replay.lane)]
        if bound is not None and queued >= bound:
            return replays[:n], (replay.target.stream(replay.lane), bound)
        room[(replay.target, replay.lane)] = (bound, queued + 1)
    return replays, None


def _groups(replays: list[_Replay]) -> list[list[_Replay]]:
    """The replays by source and target partition, in order, RETRY_CHUNK at most each."""
    by_pair: dict[tuple[Keys, Keys], list[_Replay]] = {}
    for replay in replays:
        by_pair.setdefault((replay.source, replay.target), []).append(replay)
    return [group[i:i + RETRY_CHUNK] for group in by_pair.values()
            for i in range(0, len(group), RETRY_CHUNK)]


def _requeue(r: redis.Redis, group: list[_Replay]) -> None:
    """Requeue one group (one source and one target partition): in one transaction in the
    target, the ids' old answers and owners deleted and the jobs added (with the letters
    deleted when the source is the same partition); then each new entry made its id's owner
    (NX: a worker that read it first has claimed the id for it the same way). A source in
    another partition (another slot) loses its letters, and the ids' old answers there,
    after the jobs are queued: a failure between leaves a letter that can be retried again,
    never a job lost."""
    source, target = group[0].source, group[0].target
    rids = [x.letter.request_id for x in group]
    letters = [x.letter.dlq_id for x in group]
    moved = source != target
    pipe = r.pipeline(transaction=True)
    OwnerKeys(target).free(pipe, rids)
    first = len(pipe)
    for x in group:
        DeadLetters.readd(pipe, x.letter, target.stream(x.lane),
                          x.letter.job_in(target) if moved else x.letter.job)
    if not moved:
        DeadLetters(source).remove(pipe, letters)
    entry_ids = pipe.execute()[first:first + len(group)]
    owners, pipe = OwnerKeys(target), r.pipeline(transaction=False)
    for x, entry_id in zip(group, entry_ids, strict=True):
        owners.retake(pipe, x.letter.request_id, entry_id, x.lane)
    pipe.execute()
    if moved:
        pipe = r.pipeline(transaction=True)
        OwnerKeys(source).free(pipe, rids)
        DeadLetters(source).remove(pipe, letters)
        pipe.execute()


def purge(r: redis.Redis, keys: Keys, ids: list[str], partition: int | None = None) -> int:
    """Delete dead letters (all when ``ids`` is empty) of every partition (or
    ``partition``), one XDEL per partition in one pipeline; returns how many."""
    by_part: dict[int, list[bytes]] = {}
    for found in find(r, keys, ids, partition)[1]:
        by_part.setdefault(found.partition, []).append(found.letter.dlq_id)
    if not by_part:
        return 0
    pipe = r.pipeline(transaction=False)
    for p, dlq_ids in by_part.items():
        DeadLetters(keys.part(p)).remove(pipe, dlq_ids)
    return sum(int(n) for n in pipe.execute())
