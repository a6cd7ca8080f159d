"""Intake: read jobs from the model's lane streams with XREADGROUP, and validate them.

Reads only as many entries as the worker has room for. On start it first
re-reads this consumer's own pending entries (jobs it had read but not
answered before a restart under the same consumer name), then new ones.

Deadlines: the client's clock and ours may disagree, so a job's deadline is
taken as a *budget* (``deadline_ms - submitted_ms``) counted from the
moment Redis stored the entry (the stream id's milliseconds, Redis's clock),
and Redis's clock is mapped to ours with a measured offset.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import redis
from redbatch.common.config import Settings, default_of
from redbatch.common.protocol import (
    FIELD_ADMITTED,
    FIELD_CANCEL,
    FIELD_REQUEST_ID,
    GROUP,
    ErrorCode,
    JobEnvelope,
    Keys,
    Lane,
    ProtocolError,
    valid_request_id,
)
from redbatch.common.redis_io import StreamEntry, error_code
from redbatch.gpu_worker.streams.claims import Claim, rivals
from redbatch.gpu_worker.streams.faults import StreamFaults
from redbatch.gpu_worker.streams.partitions import PartitionSet, read_rounds
from redbatch.gpu_worker.streams.reclaim import Reclaimer
from redbatch.gpu_worker.streams.transaction import pipelined

logger = logging.getLogger(__name__)

CLOCK_REFRESH_S = 30.0
#: While bulk jobs fill their in-flight places, how long a read waits on the interactive
#: stream alone before looking again whether bulk places came free, ms.
BULK_RECHECK_MS = 10
#: With several partitions an idle worker blocks on one at a time, at most this long, so a
#: job in another waits little (PROTOCOL.md "Partitions"); on one partition it blocks for
#: the whole block time, as ever.
PARTITION_BLOCK_MAX_MS = 50
#: Reply lists whose name was checked, remembered so that each is matched once (a client
#: names one in all its jobs); past this many the memory starts again.
REPLY_LISTS_KEPT = 4096


@dataclass(slots=True, eq=False)
class Job:
    """A valid job on its way through the worker."""

    envelope: JobEnvelope
    stream: str
    entry_id: bytes
    arrival_s: float
    """Our monotonic clock when intake read it; the batcher's wait clock starts here."""
    queue_ms: float
    """Time it spent in Redis before we read it."""
    deadline_s: float | None
    """Monotonic time after which it is answered ``expired``; None for no deadline."""
    taken_over: bool = False
    """Read from a worker that died or stalled holding it: it runs alone (see reclaim.py)."""
    deliveries: int = 1
    """How many times Redis has delivered its entry, this time included."""
    slot: int = -1
    preprocess_ms: float = 0.0
    ready_s: float = 0.0
    """When preprocessing finished and it joined the batcher."""
    cost: int = 0
    """What it costs the model (tokens, for a text model; 0 when its handler says nothing):
    the batcher groups and bounds batches by it."""
    rows: int = 1
    """Rows of the model's batch it fills (a text model's list of texts: one per text)."""
    model: int = 0
    """Which of the worker's models it is for (Served.index), set by its reader."""

    @property
    def request_id(self) -> str:
        return self.envelope.request_id

    @property
    def bulk(self) -> bool:
        return self.envelope.lane is Lane.BULK


@dataclass(frozen=True, slots=True)
class BadEntry:
    """A stream entry that cannot be run; answered when ``request_id`` is known.

    ``dead_letter`` entries are also copied, raw, to the dead-letter stream.
    """

    stream: str
    entry_id: bytes
    request_id: str | None
    code: ErrorCode
    message: str
    dead_letter: bool = False
    fields: Mapping[bytes, bytes] | None = None
    deliveries: int = 0
    reply_to: str | None = None
    """The reply list its answer is announced on (a cancel entry's, checked like a job's)."""


class RedisClock:
    """Offset between Redis's wall clock and ours, refreshed now and then."""

    def __init__(self, r: redis.Redis) -> None:
        self._redis = r
        self._offset_ms = 0.0
        self._refreshed = float("-inf")

    def redis_now_ms(self) -> float:
        """Redis's clock now, ms; while TIME fails (its node away), by the offset measured
        last, measured again a second later."""
        if time.monotonic() - self._refreshed > CLOCK_REFRESH_S:
            before = time.time()
            try:
                seconds, micros = self._redis.time()
            except redis.RedisError as e:
                logger.debug("TIME failed (%s); keeping the clock offset", e)
                self._refreshed = time.monotonic() - CLOCK_REFRESH_S + 1.0
                return time.time() * 1000 + self._offset_ms
            after = time.time()
            self._offset_ms = seconds * 1000 + micros / 1000 - (before + after) * 500
            self._refreshed = time.monotonic()
        return time.time() * 1000 + self._offset_ms


class Intake:
    """Reads and validates entries for one consumer of one model's group."""

    def __init__(self, r: redis.Redis, keys: Keys, consumer: str, max_payload_bytes: int,
                 reclaim_idle_ms: int = default_of(Settings, "reclaim_idle_ms"),
                 max_deliveries: int = default_of(Settings, "max_deliveries")) -> None:
        self._redis = r
        # XREADGROUP's replies parsed in one pass here (_entries), not by redis-py's chain
        # of callbacks per entry: this client is intake's own, and only intake reads.
        r.set_response_callback("XREADGROUP", _entries)
        self.keys = keys
        #: Streams (and the partitions key) set aside after a failure: each fails alone.
        self.faults = StreamFaults()
        self.partitions = PartitionSet(r, keys, self.faults)
        self.consumer = consumer
        self._max_payload = max_payload_bytes
        self._max_deliveries = max_deliveries
        self._clock = RedisClock(r)
        self.reclaimer = Reclaimer(r, consumer, reclaim_idle_ms, self.faults)
        # Pending recovery cursors; a stream leaves the dict once its backlog is read.
        self._pending_from: dict[str, bytes] = {}
        #: Each stream's partition keys and lane, for the partitions read so far.
        self._part_of: dict[str, Keys] = {}
        self._lane_of: dict[str, Lane] = {}
        #: Streams whose consumer group is not there yet (its creation failed, or a read
        #: found it gone): not read until it is made, tried again on their back-off.
        self._no_group: set[str] = set()
        self._add_partitions(self.partitions.parts)
        self._replies_seen: set[tuple[int, str]] = set()

    def _add_partitions(self, added: list[Keys]) -> None:
        """Start reading the streams of ``added`` partitions (own pending entries first)."""
        for keys in added:
            for lane in Lane:
                stream = keys.stream(lane)
                self._pending_from[stream] = b"0"
                self._part_of[stream], self._lane_of[stream] = keys, lane

    def refresh_partitions(self, force: bool = False) -> None:
        """Read the model's partition count if due; create the group on new partitions.
        Raises the Redis error of a forced read (PartitionSet.refresh)."""
        added = self.partitions.refresh(force)
        if added:
            logger.info("reading %d partitions of model %s", self.partitions.count,
                        self.keys.model)
            self._add_partitions(added)
            self._create_groups([s for keys in added for s in keys.streams()])

    def ensure_groups(self) -> None:
        """Create the consumer group on every lane stream (from id 0, so jobs that
        were queued before any worker existed are served). A stream whose group cannot be
        made now (its master away, a key of another type there) is set aside and tried
        again while the others are read; raises the Redis error when the partition count
        cannot be read, or when every stream failed and not all by WRONGTYPE (Redis is
        away or refuses: out of memory, a replica), so that start-up waits."""
        self.refresh_partitions(force=True)
        streams = self.partitions.streams()
        errors = self._create_groups(streams)
        if len(errors) == len(streams) and any(error_code(e) != "WRONGTYPE" for e in errors):
            raise next(e for e in errors if error_code(e) != "WRONGTYPE")

    def _create_groups(self, streams: list[str]) -> list[redis.RedisError]:
        """Create the group on each of ``streams``; returns the errors of those that failed
        (set aside, made on a later read: _retry_groups)."""
        self._no_group.update(streams)
        errors = [self._create_group(stream) for stream in streams]
        return [e for e in errors if e is not None]

    def _create_group(self, stream: str) -> redis.RedisError | None:
        try:
            self._redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                self.faults.failed([stream], e, "XGROUP CREATE")
                return e
        except redis.RedisError as e:
            self.faults.failed([stream], e, "XGROUP CREATE")
            return e
        self._no_group.discard(stream)
        self.faults.served([stream])
        return None

    def _retry_groups(self) -> None:
        """Make the groups still missing whose back-off is over."""
        for stream in [s for s in self._no_group if self.faults.usable(s)]:
            self._create_group(stream)

    def _usable(self, streams: list[str]) -> list[str]:
        """The streams that may be read now: their group made, not set aside."""
        if not self._no_group and not self.faults.any:
            return streams
        return [s for s in streams if s not in self._no_group and self.faults.usable(s)]

    def _failed(self, streams: list[str], error: redis.RedisError, what: str) -> None:
        """Set ``streams`` aside; a group gone (NOGROUP: Redis came back without its data,
        or the stream was deleted) is made again on a later read."""
        if error_code(error) == "NOGROUP":
            logger.error("the consumer group of %s is gone (did Redis restart without "
                         "persistence?); creating it again", ", ".join(streams))
            self._no_group.update(streams)
        self.faults.failed(streams, error, what)

    @property
    def recovering(self) -> bool:
        return bool(self._pending_from)

    def read(self, count: int, bulk_count: int,
             block_ms: int) -> tuple[list[Job], list[BadEntry]]:
        """Up to ``count`` entries, at most ``bulk_count`` of them from the bulk lane (own
        pending entries first, whatever their lane), validated."""
        try:
            return self._read(count, bulk_count, block_ms)
        except redis.ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            # Redis came back without its data (no persistence): the streams and the group
            # are gone, and so is every queued job; serve what producers add from now on.
            logger.error("the consumer group is gone (did Redis restart without "
                         "persistence?); creating it again")
            self.ensure_groups()
            return [], []

    def _read(self, count: int, bulk_count: int,
              block_ms: int) -> tuple[list[Job], list[BadEntry]]:
        self.reclaimer.renew()
        self.refresh_partitions()
        if self._no_group:
            self._retry_groups()
        # Entries delivered before (our own pending ones, or taken over) may be poison.
        entries = self._read_pending(count) if self.recovering else []
        if not entries:
            entries = self.reclaimer.claim(self._usable(self.partitions.streams()), count)
        deliveries = self.reclaimer.deliveries(entries)
        taken_over = bool(entries)
        if not entries:
            entries = self._read_new(count, bulk_count, block_ms)
            deliveries = [1] * len(entries)
        if not entries and self.faults.any and not self._usable(self.partitions.streams()):
            # Every stream set aside: the read failed; the reader backs off and says why.
            assert self.faults.last_error is not None
            raise self.faults.last_error
        now_ms, now_s = self._clock.redis_now_ms(), time.monotonic()
        jobs: list[Job] = []
        bad: list[BadEntry] = []
        for (stream, entry), delivered in zip(entries, deliveries, strict=True):
            item = self._decode(stream, entry, now_ms, now_s, delivered)
            if isinstance(item, Job):
                item.taken_over = taken_over
                item.deliveries = delivered
                jobs.append(item)
            else:
                bad.append(item)
        raw = {entry_id: fields for _, (entry_id, fields) in entries}
        jobs, bad = self._drop_duplicates(jobs, bad, raw)
        # Only now, with nothing left to fail, are the entries ours to renew. Had a call
        # above failed (Redis went away), they would stay pending without a lease and be
        # taken over once idle, by this worker or another, instead of renewed forever.
        self.reclaimer.leases.hold((stream, entry_id) for stream, (entry_id, _) in entries)
        return jobs, bad

    def _drop_duplicates(self, jobs: list[Job], bad: list[BadEntry],
                         raw: Mapping[bytes, Mapping[bytes, bytes]]) -> tuple[
            list[Job], list[BadEntry]]:
        """Entries whose request id another entry owns are dead-lettered unanswered, with
        their fields as read (``raw``, by entry id; see NOTE [ Request id owners ] in
        common/protocol/admission.py, and claims.py: FIELD_ADMITTED is checked against the
        owner key, never trusted)."""
        part_of, lane_of = self._part_of, self._lane_of
        items: list[Job | BadEntry] = []
        claims: list[Claim] = []
        for job in jobs:
            env = job.envelope
            items.append(job)
            claims.append(Claim(env.request_id, job.entry_id, part_of[job.stream],
                                lane_of[job.stream], env.budget_ms,
                                _ADMITTED in raw[job.entry_id]))
        for entry in bad:
            if entry.request_id is not None:
                items.append(entry)
                claims.append(Claim(entry.request_id, entry.entry_id, part_of[entry.stream],
                                    lane_of[entry.stream], 0, _ADMITTED in raw[entry.entry_id]))
        duplicates: set[int] = set()
        for item, owner in zip(items, rivals(self._redis, claims), strict=True):
            if owner is not None:
                duplicates.add(id(item))
                bad.append(_duplicate(item, owner, raw[item.entry_id]))
        if duplicates:
            bad = [b for b in bad if id(b) not in duplicates]
            logger.warning("dead-lettered %d entries whose request id belongs to another job",
                           len(duplicates))
        return [j for j in jobs if id(j) not in duplicates], bad

    def _xreadgroup(self, streams: dict[str, bytes | str], count: int,
                    block_ms: int | None) -> list[tuple[str, StreamEntry]]:
        reply = self._redis.xreadgroup(GROUP, self.consumer, streams,  # type: ignore[arg-type]
                                       count=count, block=block_ms)
        return cast(list[tuple[str, StreamEntry]], reply)

    def _read_pending(self, count: int) -> list[tuple[str, StreamEntry]]:
        for stream, cursor in list(self._pending_from.items()):
            if not self._usable([stream]):
                continue  # read once it serves again
            try:
                got = self._xreadgroup({stream: cursor}, count, None)
            except redis.RedisError as e:
                self._failed([stream], e, "XREADGROUP (own pending entries)")
                continue
            self.faults.served([stream])
            if got:
                self._pending_from[stream] = got[-1][1][0]
                logger.info("re-reading %d pending entries of %s", len(got), stream)
                return got
            del self._pending_from[stream]
        return []

    def _read_new(self, count: int, bulk_count: int,
                  block_ms: int) -> list[tuple[str, StreamEntry]]:
        # Interactive first, without blocking; then bulk into what room is left for it;
        # each lane over every partition, from a starting partition that turns.
        start = self.partitions.next_turn()
        got = self._read_lane(Lane.INTERACTIVE, count, start)
        bulk_count = min(bulk_count, count - len(got))
        if bulk_count > 0:
            got += self._read_lane(Lane.BULK, bulk_count, start)
        if got or block_ms <= 0:
            return got
        return self._block(count, bulk_count, block_ms, self._block_partition(start))

    def _block_partition(self, start: int) -> Keys:
        """Partition ``start``, or the first one on from it with a stream to read."""
        parts = self.partitions.parts
        if not self.faults.any and not self._no_group:
            return parts[start]
        order = parts[start:] + parts[:start]
        return next((keys for keys in order if self._usable(keys.streams())), parts[start])

    def _block(self, count: int, bulk_count: int, block_ms: int,
               keys: Keys) -> list[tuple[str, StreamEntry]]:
        """Idle: block on both lanes of one partition; or, when bulk has no room, on
        interactive alone and only briefly, since bulk places come free without anything
        arriving in Redis. COUNT holds for each stream named, so each lane is asked for
        half the room: never more entries than places. A lane set aside is left out; with
        none to block on, it sleeps as briefly instead (the reader never spins)."""
        if self.partitions.count > 1:  # one partition at a time (one slot per call)
            block_ms = max(1, min(block_ms, PARTITION_BLOCK_MAX_MS))
        both = min(count // 2, bulk_count)
        interactive, bulk = keys.stream(Lane.INTERACTIVE), keys.stream(Lane.BULK)
        asks = {interactive: count, bulk: bulk_count} if both > 0 else {interactive: count}
        streams = self._usable(list(asks))
        if not streams:
            time.sleep(min(block_ms, PARTITION_BLOCK_MAX_MS) / 1000)
            return []
        if len(streams) == 2:
            count = both
        elif both > 0:  # the other lane is set aside: this one alone, for all its room
            count = asks[streams[0]]
        else:
            block_ms = min(block_ms, BULK_RECHECK_MS)
        try:
            return self._xreadgroup(dict.fromkeys(streams, ">"), count, block_ms)
        except redis.RedisError as e:
            self._failed(streams, e, "XREADGROUP")
            return []

    def _read_lane(self, lane: Lane, count: int, start: int) -> list[tuple[str, StreamEntry]]:
        """Up to ``count`` new entries of one lane over every partition (but bulk lanes
        found empty just now: PartitionSet.to_read), without blocking: in rounds
        (``read_rounds``), each one pipeline of one XREADGROUP per partition asked (one
        round trip to each node on a cluster); one call with one partition."""
        got: list[tuple[str, StreamEntry]] = []
        rounds = read_rounds(self._usable(self.partitions.to_read(lane, start)), count)
        asks = next(rounds)
        while asks:
            replies = self._read_each(asks)
            got += [entry for reply in replies for entry in reply]
            self.partitions.found_empty(lane, [stream for (stream, n), reply
                                               in zip(asks, replies, strict=True)
                                               if len(reply) < n])
            asks = rounds.send([len(reply) for reply in replies])
        return got

    def _read_each(self, asks: list[tuple[str, int]]) -> list[list[tuple[str, StreamEntry]]]:
        """The new entries of each (stream, count) asked, in one pipeline when several
        (transaction.pipelined: packed, and one write to each node on a cluster)."""
        if len(asks) == 1:
            try:
                got = self._xreadgroup({asks[0][0]: ">"}, asks[0][1], None)
            except redis.RedisError as e:
                self._failed([asks[0][0]], e, "XREADGROUP")
                return [[]]
            self.faults.served([asks[0][0]])
            return [got]
        replies = pipelined(self._redis, [
            (stream, ("XREADGROUP", "GROUP", GROUP, self.consumer, "COUNT", n, "STREAMS",
                      stream, ">")) for stream, n in asks], node_errors=True)
        out: list[list[tuple[str, StreamEntry]]] = []
        for (stream, _), reply in zip(asks, replies, strict=True):
            if isinstance(reply, redis.RedisError):  # that partition alone (issue 28)
                self._failed([stream], reply, "XREADGROUP")
                out.append([])
            else:
                out.append(_entries(reply))
        if self.faults.any:
            self.faults.served([stream for (stream, _), reply in zip(asks, replies,
                                                                    strict=True)
                                if not isinstance(reply, redis.RedisError)])
        return out

    def _decode(self, stream: str, entry: StreamEntry, now_ms: float, now_s: float,
                deliveries: int) -> Job | BadEntry:
        """The Job of one entry, or why it cannot run; ``now_ms`` is Redis's clock and
        ``now_s`` ours (monotonic), both read once per group."""
        entry_id, fields = entry
        if not fields:
            return BadEntry(stream, entry_id, None, ErrorCode.BAD_ENVELOPE,
                            "entry was deleted while pending")
        if deliveries > self._max_deliveries:
            rid = fields.get(FIELD_REQUEST_ID.encode(), b"").decode(errors="replace")
            return BadEntry(stream, entry_id, rid if valid_request_id(rid) else None,
                            ErrorCode.DEAD_LETTERED,
                            f"delivered {deliveries} times without an answer (the workers "
                            f"that took it died); not run again", True, fields, deliveries)
        try:
            env = JobEnvelope.decode(fields, self._max_payload)
        except ProtocolError as e:
            # With no request id nobody can be told: keep the entry for a person to look at.
            return BadEntry(stream, entry_id, e.request_id, e.code, e.message,
                            dead_letter=e.request_id is None, fields=fields,
                            deliveries=deliveries)
        if env.model != self.keys.model:
            return BadEntry(stream, entry_id, env.request_id, ErrorCode.WRONG_MODEL,
                            f"job for model {env.model!r} on the stream of {self.keys.model!r}")
        if self._lane_of[stream] is not env.lane:
            # The batcher schedules by the envelope's lane: a mislabelled bulk job would
            # jump the interactive queue.
            return BadEntry(stream, entry_id, env.request_id, ErrorCode.WRONG_LANE,
                            f"job for lane {env.lane.value!r} on the stream {stream!r}")
        if env.reply_to is not None and not self._is_reply(env.reply_to, stream):
            # Never let a job make the worker write to an arbitrary key.
            return BadEntry(stream, entry_id, env.request_id, ErrorCode.BAD_ENVELOPE,
                            f"reply_to {env.reply_to[:100]!r} is not a reply key of this model")
        if _CANCEL in fields:
            # The cancel script took the job out before any worker read it: nothing to run.
            return BadEntry(stream, entry_id, env.request_id, ErrorCode.CANCELLED,
                            "cancelled before a worker took it; it was not run",
                            reply_to=env.reply_to)
        return _job(env, stream, entry_id, now_ms, now_s)

    def _is_reply(self, key: str, stream: str) -> bool:
        """``keys.is_reply`` of the stream's partition (a job names a reply list of its own
        partition), remembered for the reply lists seen lately (each client has one per
        partition, named in all its jobs there), so that the pattern is matched once."""
        keys = self._part_of[stream]
        if (keys.partition, key) in self._replies_seen:
            return True
        if not keys.is_reply(key):
            return False
        if len(self._replies_seen) >= REPLY_LISTS_KEPT:
            self._replies_seen.clear()
        self._replies_seen.add((keys.partition, key))
        return True


_CANCEL = FIELD_CANCEL.encode()
_ADMITTED = FIELD_ADMITTED.encode()


def _entries(reply: Any, **options: Any) -> list[tuple[str, StreamEntry]]:
    """An XREADGROUP reply as ``[(stream, (entry id, fields))]``, in order, under RESP2 (a
    list of ``[stream, entries]``) and RESP3 (a map), or as a cluster client's node has
    parsed it already (fields as dicts). An entry deleted while pending comes
    with no fields: an empty dict, so that it can still be acknowledged."""
    if not reply:
        return []
    out: list[tuple[str, StreamEntry]] = []
    for stream, entries in (reply.items() if isinstance(reply, dict) else reply):
        name = stream.decode() if isinstance(stream, bytes) else stream
        # A cluster client applies this after its node's own parsing: fields come as dicts.
        out += [(name, (entry_id, fields if isinstance(fields, dict) else
                        dict(zip(fields[::2], fields[1::2], strict=True)) if fields else {}))
                for entry_id, fields in entries]
    return out


def _duplicate(item: Job | BadEntry, owner: bytes, fields: Mapping[bytes, bytes]) -> BadEntry:
    # No request id on purpose: answering it would write the first job's result key.
    return BadEntry(item.stream, item.entry_id, None, ErrorCode.DUPLICATE_REQUEST_ID,
                    f"request id {item.request_id!r} belongs to entry "
                    f"{owner.decode(errors='replace')} of {item.stream}", dead_letter=True,
                    fields=fields, deliveries=item.deliveries)


def _entry_ms(entry_id: bytes) -> int:
    return int(entry_id.split(b"-", 1)[0])


def _job(env: JobEnvelope, stream: str, entry_id: bytes, redis_now_ms: float,
         now: float) -> Job:
    queue_ms = max(0.0, redis_now_ms - _entry_ms(entry_id))
    budget = env.budget_ms
    deadline = None if budget is None else now + (budget - queue_ms) / 1000
    return Job(env, stream, entry_id, now, queue_ms, deadline)
