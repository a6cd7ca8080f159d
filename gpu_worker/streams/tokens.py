"""Token streams of generation jobs (PROTOCOL.md "Token stream"): what another worker
already streamed (read at takeover), and each step's writes in one round trip.

One step's pipeline holds ``XADD P:{M}:tokens:ID 0-n ...`` for every chunk; ``PEXPIRE`` of
a stream at its first chunk, its last, and when a quarter of its TTL has passed since the
last renewal (not at every chunk: most steps then add one command per running request, not
two); one ``MGET`` of the running requests' stop keys per partition (their keys share the
partition's hash tag, so this holds on a cluster); and the ``XCLAIM ... JUSTID`` of the
leases due. A chunk index written before (a retried write, or a takeover racing the old
worker) is refused by Redis itself, and that refusal is expected, not an error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redbatch.common.protocol import GROUP
from redbatch.common.protocol.generation import Chunk, chunk_id

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepWrite:
    """What one round trip found."""

    stopped: set[str]
    """The stop keys found set."""
    refused: int = 0
    """Chunks Redis refused as already there (index written before)."""


class TokenStreams:
    """Reads and writes the token streams and stop keys of one model's generation jobs."""

    def __init__(self, r: redis.Redis, consumer: str, ttl_ms: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._redis, self.consumer, self._ttl_ms, self._clock = r, consumer, ttl_ms, clock
        #: Token stream key -> when its TTL was last set (monotonic s), while it is open.
        self._expires: dict[str, float] = {}

    def streamed(self, token_keys: Sequence[str]) -> dict[str, list[Chunk]]:
        """The chunks already in each token stream key, in order (one round trip)."""
        if not token_keys:
            return {}
        pipe = self._redis.pipeline(transaction=False)
        for key in token_keys:
            pipe.xrange(key, "-", "+")
        out: dict[str, list[Chunk]] = {}
        for rid, rows in zip(token_keys, pipe.execute(), strict=True):
            chunks = []
            for entry_id, fields in rows:
                try:
                    chunks.append(Chunk.read(entry_id, fields))
                except (ValueError, UnicodeDecodeError):
                    logger.warning("token stream of %s holds a foreign entry; ignored", rid)
            out[rid] = chunks
        return out

    def write_step(self, chunks: Iterable[tuple[str, Chunk]], stop_keys: Sequence[str],
                   leases: dict[str, list[bytes]]) -> StepWrite:
        """One round trip: every chunk (token stream key, chunk) and its stream's TTL when
        due, the ``stop_keys`` of the running requests, the leases due; the stop keys that
        are set. Raises redis errors of the connection (the caller retries)."""
        pipe = self._redis.pipeline(transaction=False)
        now = self._clock()
        chunks = list(chunks)
        for key, chunk in chunks:
            fields: Any = chunk.fields()
            pipe.xadd(key, fields, id=chunk_id(chunk.index))
        renew = self._due(chunks, now)
        for key in renew:
            pipe.pexpire(key, self._ttl_ms)
        groups = _by_partition(stop_keys)
        for group in groups:
            pipe.mget(group)
        for stream, ids in leases.items():
            message_ids: list[Any] = list(ids)
            pipe.xclaim(stream, GROUP, self.consumer, 0, message_ids, justid=True)
        replies = pipe.execute(raise_on_error=False)
        for key, ended in renew.items():  # only once Redis has them
            if ended:
                self._expires.pop(key, None)
            else:
                self._expires[key] = now
        at = len(chunks) + len(renew)
        return StepWrite(_stopped(groups, replies[at:at + len(groups)]),
                         _refused(replies[:len(chunks)]))

    def _due(self, chunks: Sequence[tuple[str, Chunk]], now: float) -> dict[str, bool]:
        """Streams whose TTL to set now (first chunk, last chunk, or a quarter of the TTL
        since), each with whether its last chunk is among ``chunks``."""
        renew_s = self._ttl_ms / 4000
        renew: dict[str, bool] = {}
        for key, chunk in chunks:
            last = self._expires.get(key)
            if chunk.finish is not None or last is None or now - last >= renew_s:
                renew[key] = renew.get(key, False) or chunk.finish is not None
        return renew

    def forget(self, token_keys: Iterable[str]) -> None:
        """Streams that will get no more chunks here (their job ended without a last one)."""
        for key in token_keys:
            self._expires.pop(key, None)


def _refused(replies: Sequence[Any]) -> int:
    """Chunks refused: already written (expected after a retry or a takeover), or other."""
    refused = 0
    for reply in replies:
        if isinstance(reply, redis.ResponseError):
            if "equal or smaller" not in str(reply):
                logger.warning("a token chunk was refused: %s", reply)
            refused += 1
    return refused


def _stopped(groups: Sequence[list[str]], replies: Sequence[Any]) -> set[str]:
    """The stop keys set, from each group's MGET (an error, e.g. a key of another type,
    reads as none set)."""
    stopped: set[str] = set()
    for group, values in zip(groups, replies, strict=True):
        if isinstance(values, list):
            stopped.update(k for k, v in zip(group, values, strict=True) if v is not None)
    return stopped


def _by_partition(keys: Sequence[str]) -> list[list[str]]:
    """``keys`` grouped by their hash tag (the text up to the first ``}``), in order."""
    groups: dict[str, list[str]] = {}
    for key in keys:
        groups.setdefault(key[:key.find("}") + 1], []).append(key)
    return list(groups.values())
