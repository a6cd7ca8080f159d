"""Token streams of generation jobs (PROTOCOL.md "Token stream"): what another worker
already streamed (read at takeover), and each step's writes in one round trip.

One step's pipeline holds, for every request touched, ``XADD P:{M}:tokens:ID 0-n ...`` and
``PEXPIRE``; the ``GET`` of every running request's stop key; and the ``XCLAIM ... JUSTID``
of the leases due. A chunk index written before (a retried write, or a takeover racing the
old worker) is refused by Redis itself, and that refusal is expected, not an error.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
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

    def __init__(self, r: redis.Redis, consumer: str, ttl_ms: int) -> None:
        self._redis, self.consumer, self._ttl_ms = r, consumer, ttl_ms

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
        """One round trip: every chunk (token stream key, chunk) and its stream's TTL, the
        ``stop_keys`` of the running requests, the leases due; the stop keys that are set.
        Raises redis errors of the connection (the caller retries)."""
        pipe = self._redis.pipeline(transaction=False)
        n_chunks = 0
        for key, chunk in chunks:
            fields: Any = chunk.fields()
            pipe.xadd(key, fields, id=chunk_id(chunk.index))
            pipe.pexpire(key, self._ttl_ms)
            n_chunks += 1
        for key in stop_keys:
            pipe.get(key)
        for stream, ids in leases.items():
            message_ids: list[Any] = list(ids)
            pipe.xclaim(stream, GROUP, self.consumer, 0, message_ids, justid=True)
        replies = pipe.execute(raise_on_error=False)
        refused = 0
        for reply in replies[:2 * n_chunks:2]:
            if isinstance(reply, redis.ResponseError):
                if "equal or smaller" not in str(reply):
                    logger.warning("a token chunk was refused: %s", reply)
                refused += 1
        stops = replies[2 * n_chunks:2 * n_chunks + len(stop_keys)]
        stopped = {key for key, v in zip(stop_keys, stops, strict=True)
                   if v is not None and not isinstance(v, Exception)}
        return StepWrite(stopped, refused)
