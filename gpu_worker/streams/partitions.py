"""The partitions of one model a worker reads (PROTOCOL.md "Partitions"): the count is
read from Redis at start and again every REFRESH_S, and only ever grows here."""

from __future__ import annotations

import logging
import time
from collections.abc import Generator, Sequence
from typing import Any, cast

import redis
from redbatch.common.protocol import (
    DEFAULT_PARTITIONS_SCRIPT,
    Keys,
    Lane,
    parse_partition_history,
)
from redbatch.common.redis_io import error_code, is_cluster
from redbatch.gpu_worker.streams.faults import StreamFaults

logger = logging.getLogger(__name__)

REFRESH_S = 5.0
"""How often a worker reads the model's partition count again."""
BULK_RECHECK_S = 0.010
"""With several partitions, a bulk lane a read found empty is not read again for this
long: reads come every few ms under load, and a lane without bulk work would cost a call
each time. A bulk job waits this much longer at most; interactive lanes are read every
time."""


class PartitionSet:
    """Keys of every partition of one model, and a rotating order to read them in."""

    def __init__(self, r: redis.Redis, keys: Keys, faults: StreamFaults | None = None) -> None:
        self._redis = r
        #: Where a failed read of the count sets the partitions key aside (the streams'
        #: own, in the intake).
        self._faults = faults or StreamFaults()
        self.model_keys = keys.part(0)
        #: Partition p's keys at index p.
        self.parts: list[Keys] = [self.model_keys]
        self._checked = float("-inf")
        self._turn = 0
        #: When each bulk stream was last found empty (monotonic s).
        self._bulk_empty: dict[str, float] = {}
        #: The partitions key was found holding another type (warned once).
        self._warned = False

    @property
    def count(self) -> int:
        return len(self.parts)

    def refresh(self, force: bool = False) -> list[Keys]:
        """Read the count if due (or ``force``); returns the keys of partitions it added.
        A key of another type reads as 1 (warned once). Another failure keeps the count
        read last, and the key is read again after a back-off; a forced read raises it."""
        now = time.monotonic()
        key = self.model_keys.partitions()
        if not force and (now - self._checked < REFRESH_S or not self._faults.usable(key)):
            return []
        raw: Sequence[bytes | str] | None
        try:
            raw = cast(list[bytes], self._redis.lrange(key, 0, -1))
        except redis.ResponseError as e:
            if error_code(e) != "WRONGTYPE":
                return self._failed(e, force)
            raw = None  # unreadable: 1 (PROTOCOL.md "Partitions")
            if not self._warned:
                self._warned = True
                logger.warning("%s is not a list (%s): it reads as 1 partition until it "
                               "is deleted", key, e)
        except redis.RedisError as e:
            return self._failed(e, force)
        if force and raw == [] and is_cluster(self._redis):
            raw = self._spread()
        self._faults.served([key])
        self._checked = now
        count = parse_partition_history(raw)[-1]
        added = [self.model_keys.part(p) for p in range(self.count, count)]
        self.parts += added
        return added

    def _spread(self) -> list[bytes]:
        """No count was ever set on this cluster: set P = its masters, once for every
        worker (DEFAULT_PARTITIONS_SCRIPT), so that the model spreads over them; said in
        one line. Refused (an ACL user without the script): P stays 1, said so."""
        key = self.model_keys.partitions()
        masters = len(cast(Any, self._redis).get_primaries())
        if masters < 2:
            return []
        try:
            history = cast(list[bytes], self._redis.eval(DEFAULT_PARTITIONS_SCRIPT, 1, key,
                                                         masters))
        except redis.RedisError as e:
            logger.warning("model %s has no partition count and it could not be set (%s): "
                           "it stays on one of the cluster's %d masters; run redbatch "
                           "partitions --set %d to spread it", self.model_keys.model, e,
                           masters, masters)
            return []
        logger.info("model %s had no partition count: %s now, set for the cluster's %d "
                    "masters (redbatch partitions --set 1 before the first worker starts "
                    "keeps a model on one)", self.model_keys.model,
                    parse_partition_history(history)[-1], masters)
        return history

    def _failed(self, error: redis.RedisError, force: bool) -> list[Keys]:
        self._faults.failed([self.model_keys.partitions()], error,
                            f"reading the partition count ({self.count} read before)")
        if force:
            raise error
        return []

    def streams(self) -> list[str]:
        """Every job stream, partition by partition, interactive first in each."""
        return [stream for keys in self.parts for stream in keys.streams()]

    def next_turn(self) -> int:
        """The partition to start the next read at: each read starts one further on."""
        self._turn = (self._turn + 1) % self.count
        return self._turn

    def rotated(self, lane: Lane, start: int) -> list[str]:
        """The lane's streams of every partition, from partition ``start`` round."""
        order = self.parts[start:] + self.parts[:start]
        return [keys.stream(lane) for keys in order]

    def to_read(self, lane: Lane, start: int) -> list[str]:
        """The lane's streams to read, from partition ``start`` round: every one, but for
        the bulk streams of several partitions found empty in the last BULK_RECHECK_S."""
        order = self.rotated(lane, start)
        if lane is Lane.INTERACTIVE or self.count == 1:
            return order
        since = time.monotonic() - BULK_RECHECK_S
        return [s for s in order if self._bulk_empty.get(s, since) <= since]

    def found_empty(self, lane: Lane, streams: list[str]) -> None:
        """Note the streams a read drained (they gave fewer entries than asked)."""
        if lane is Lane.BULK and streams:
            now = time.monotonic()
            self._bulk_empty.update((s, now) for s in streams)


def read_rounds(streams: list[str],
                room: int) -> Generator[list[tuple[str, int]], list[int], None]:
    """The rounds of a read of up to ``room`` entries over ``streams`` (in the order to
    favour), which never asks for more entries than there is room for.

    Each round is ``[(stream, count)]``: the room left shared evenly among the streams that
    may still hold entries (the first ones get the remainder; with less room than streams,
    the first ``room`` get one). It is sent how many entries each stream gave; a stream
    that gave fewer than asked is drained and left out from then on, one that gave all may
    hold more. Ends (an empty round) when the room is filled or no stream is left: at most
    one round per stream, and one alone when every stream holds enough.
    """
    left = list(streams)
    while left and room > 0:
        base, extra = divmod(room, len(left))
        asks = [(s, base + (i < extra)) for i, s in enumerate(left) if base + (i < extra)]
        gave = yield asks
        room -= sum(gave)
        drained = {s for (s, n), g in zip(asks, gave, strict=True) if g < n}
        left = [s for s in left if s not in drained]
    yield []
