"""Taking over jobs of dead or stuck workers, keeping our own, and spotting poison jobs.

NOTE [ Leases ]
  A job read by a worker stays pending on that worker's consumer until its
  result is written. Pending entries idle longer than ``reclaim_idle_ms`` are
  taken over by any live worker (XPENDING with IDLE, then XCLAIM, which checks
  the idle time again so only one worker wins): that is how the jobs of a
  worker that was SIGKILLed, OOM-killed or lost its machine get answered.
  A live worker renews the lease of every job it still holds (XCLAIM JUSTID,
  which resets the idle time without counting a delivery) well before that
  limit, so a long batch is never taken from under it. ``reclaim_idle_ms``
  must stay well above the p99 time a job spends in one worker.

NOTE [ Poison jobs ]
  Redis counts deliveries per entry. Jobs are taken over without counting
  (JUSTID), and each taken-over job is run alone, charged one delivery just
  before it runs (``charge``, on the model thread): so a job that kills its worker is charged once
  per death, while the innocent jobs that were waiting in the same worker are
  not charged for that. A job delivered more than ``max_deliveries`` times is
  not run again: it goes to the dead-letter stream with the reason, and its
  client gets a ``dead_lettered`` error result.

NOTE [ Departed consumers ]
  Every worker start adds a consumer to the group (names are unique per process),
  so the group would collect the names of every worker that ever ran. A consumer
  idle for ``DEPARTED_AFTER`` leases and holding nothing pending is deleted. The
  check and the XGROUP DELCONSUMER run in one Lua script: deleting a consumer drops
  its pending entries, and an entry dropped that way would never be delivered
  again, so "nothing pending" must still be true at the moment of deletion. A live
  worker that was deleted by mistake loses nothing: its next XREADGROUP creates
  its consumer again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import Any, cast

import redis
from redbatch.common.protocol import GROUP
from redbatch.common.redis_io import StreamEntry
from redbatch.gpu_worker.streams.faults import StreamFaults

logger = logging.getLogger(__name__)

#: A consumer idle for this many lease periods with nothing pending is deleted.
DEPARTED_AFTER = 3

_FORGET_DEPARTED = """\
-- KEYS[1] = stream; ARGV[1] = group, ARGV[2] = min idle ms, ARGV[3] = caller's consumer
local gone = {}
for _, row in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local c = {}
  for i = 1, #row, 2 do c[row[i]] = row[i + 1] end
  if c['pending'] == 0 and c['idle'] >= tonumber(ARGV[2]) and c['name'] ~= ARGV[3] then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], c['name'])
    table.insert(gone, c['name'])
  end
end
return gone
"""


class Leases:
    """The entries this worker holds, with when their lease was last renewed (thread-safe)."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, bytes], float] = {}
        self._lock = threading.Lock()

    def hold(self, entries: Iterable[tuple[str, bytes]]) -> None:
        """Hold each (stream, entry id), renewed now; one lock for the group."""
        now = time.monotonic()
        with self._lock:
            self._held.update((entry, now) for entry in entries)

    def release(self, entries: Iterable[tuple[str, bytes]]) -> None:
        """Let go of each (stream, entry id); one lock for the group."""
        with self._lock:
            for entry in entries:
                self._held.pop(entry, None)

    def due(self, older_than_s: float) -> dict[str, list[bytes]]:
        """Entries not renewed for ``older_than_s``, by stream; marks them renewed."""
        now = time.monotonic()
        out: dict[str, list[bytes]] = {}
        with self._lock:
            for (stream, entry_id), renewed in self._held.items():
                if now - renewed >= older_than_s:
                    out.setdefault(stream, []).append(entry_id)
                    self._held[(stream, entry_id)] = now
        return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)


class Reclaimer:
    """Takeover of idle entries, lease renewal, and delivery counts."""

    def __init__(self, r: redis.Redis, consumer: str, idle_ms: int,
                 faults: StreamFaults | None = None) -> None:
        self._redis = r
        #: The intake's streams set aside: a stream that fails here fails alone.
        self._faults = faults or StreamFaults()
        self.consumer = consumer
        self.idle_ms = idle_ms
        self.leases = Leases()
        self._last_claim = 0.0
        self._last_renew = time.monotonic()
        self._forget = r.register_script(_FORGET_DEPARTED)

    def renew(self) -> None:
        """Reset the idle time of every held entry not renewed for a third of the limit. A
        stream whose renewal fails is set aside (its entries are renewed next period, or
        taken over once idle if its master stays away past the limit)."""
        period = self.idle_ms / 3000
        if time.monotonic() - self._last_renew < period:
            return
        self._last_renew = time.monotonic()
        for stream, ids in self.leases.due(period).items():
            message_ids: list[Any] = list(ids)
            try:
                self._redis.xclaim(stream, GROUP, self.consumer, 0, message_ids, justid=True)
            except redis.RedisError as e:
                self._faults.failed([stream], e, "renewing leases (XCLAIM)")

    def claim(self, streams: list[str], count: int) -> list[tuple[str, StreamEntry]]:
        """Up to ``count`` entries idle longer than the limit on any stream, now ours.

        Entries deleted while pending come back with empty fields (Redis 7 reports
        them separately; they are acknowledged by the caller like any bad entry).
        """
        if count <= 0 or time.monotonic() - self._last_claim < self.idle_ms / 4000:
            return []
        self._last_claim = time.monotonic()
        got: list[tuple[str, StreamEntry]] = []
        for stream in streams:
            if len(got) >= count:
                break
            try:
                got += self._claim_stream(stream, count - len(got))
            except redis.RedisError as e:
                self._faults.failed([stream], e, "taking over idle jobs")
        if got:
            logger.warning("took over %d jobs idle for over %d ms from other consumers",
                           len(got), self.idle_ms)
        self._forget_departed(streams)
        return got

    def _forget_departed(self, streams: list[str]) -> None:
        """Delete consumers that left holding nothing (see NOTE [ Departed consumers ])."""
        for stream in self._faults.keep_usable(streams):
            try:
                gone = self._forget(keys=[stream],
                                    args=[GROUP, DEPARTED_AFTER * self.idle_ms, self.consumer])
            except redis.RedisError as e:
                self._faults.failed([stream], e, "removing departed consumers")
                continue
            if gone:
                names = ", ".join(n.decode() if isinstance(n, bytes) else str(n) for n in gone)
                logger.info("removed departed consumers with nothing pending from %s: %s",
                            stream, names)

    def _claim_stream(self, stream: str, count: int) -> list[tuple[str, StreamEntry]]:
        idle = self._redis.xpending_range(stream, GROUP, min="-", max="+", count=count,
                                          idle=self.idle_ms)
        if not idle:
            return []
        # JUSTID: taking over is not a delivery (see NOTE [ Poison jobs ]); XCLAIM checks
        # the idle time again, so of two workers racing for an entry only one gets it.
        ids: list[Any] = [row["message_id"] for row in idle]
        claimed = self._redis.xclaim(stream, GROUP, self.consumer, self.idle_ms, ids,
                                     justid=True)
        # An entry deleted while pending has no fields any more; it is acknowledged as bad.
        return [(stream, entry) for entry in self._fetch(stream, cast(list[bytes], claimed))]

    def _fetch(self, stream: str, ids: list[bytes]) -> list[StreamEntry]:
        pipe = self._redis.pipeline(transaction=False)
        for entry_id in ids:
            pipe.xrange(stream, min=entry_id, max=entry_id)
        return [(eid, rows[0][1] if rows else {}) for eid, rows in zip(ids, pipe.execute(),
                                                                      strict=True)]

    def charge(self, stream: str, entry_id: bytes) -> None:
        """Count one delivery of a taken-over job that is about to run."""
        message_ids: list[Any] = [entry_id]
        self._redis.xclaim(stream, GROUP, self.consumer, 0, message_ids)

    def deliveries(self, entries: list[tuple[str, StreamEntry]]) -> list[int]:
        """How many times Redis has delivered each entry (1 when it is not pending)."""
        if not entries:
            return []
        pipe = self._redis.pipeline(transaction=False)
        for stream, (entry_id, _) in entries:
            pipe.xpending_range(stream, GROUP, min=entry_id, max=entry_id, count=1)
        return [int(rows[0]["times_delivered"]) if rows else 1 for rows in pipe.execute()]
