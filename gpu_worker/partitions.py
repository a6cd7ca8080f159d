"""The partitions of one model a worker reads (PROTOCOL.md "Partitions"): the count is
read from Redis at start and again every REFRESH_S, and only ever grows here."""

from __future__ import annotations

import time

import redis
from redbatch.common.protocol import Keys, Lane, parse_partition_history

REFRESH_S = 5.0
"""How often a worker reads the model's partition count again."""


class PartitionSet:
    """Keys of every partition of one model, and a rotating order to read them in."""

    def __init__(self, r: redis.Redis, keys: Keys) -> None:
        self._redis = r
        self.model_keys = keys.part(0)
        #: Partition p's keys at index p.
        self.parts: list[Keys] = [self.model_keys]
        self._checked = float("-inf")
        self._turn = 0

    @property
    def count(self) -> int:
        return len(self.parts)

    def refresh(self, force: bool = False) -> list[Keys]:
        """Read the count if due (or ``force``); returns the keys of partitions it added."""
        now = time.monotonic()
        if not force and now - self._checked < REFRESH_S:
            return []
        raw = self._redis.lrange(self.model_keys.partitions(), 0, -1)
        self._checked = now
        count = parse_partition_history(raw)[-1]
        added = [self.model_keys.part(p) for p in range(self.count, count)]
        self.parts += added
        return added

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
