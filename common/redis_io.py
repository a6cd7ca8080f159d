"""Redis connections and the few stream calls whose reply shapes need normalising.

Redis errors are translated here into :class:`RedisUnavailable` so callers
handle one exception type at the boundary.
"""

from __future__ import annotations

from typing import Any

import redis
from redbatch.common.config import RedisSettings

StreamEntry = tuple[bytes, dict[bytes, bytes]]
"""(entry id, fields) as read from a stream."""


class RedisUnavailable(ConnectionError):
    """Redis could not be reached or dropped the connection."""


REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError)


def connect(settings: RedisSettings, *, blocking: bool = False) -> redis.Redis:
    """A client for ``settings.url``; bytes in, bytes out.

    ``blocking=True`` is for connections that issue BLOCK/BLPOP calls: their
    socket timeout is left unset so a long block is not cut off mid-wait.
    """
    return redis.Redis.from_url(
        settings.url,
        socket_timeout=None if blocking else settings.socket_timeout_s,
        socket_connect_timeout=settings.socket_timeout_s,
        health_check_interval=30,
        decode_responses=False,
    )


def normalise_xread(reply: Any) -> list[tuple[bytes, list[StreamEntry]]]:
    """XREAD/XREADGROUP replies as [(stream, [(id, fields)])] under RESP2 and RESP3.

    Entries deleted while pending come back with fields None; they are kept
    with an empty dict so the caller can acknowledge them.
    """
    if not reply:
        return []
    items = reply.items() if isinstance(reply, dict) else reply
    out = []
    for stream, entries in items:
        out.append((stream, [(eid, fields or {}) for eid, fields in entries]))
    return out
