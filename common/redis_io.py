"""The one Redis connection factory (blocking and asyncio, always with timeouts) and the
few stream calls whose reply shapes need normalising.

Redis errors are translated here into :class:`RedisUnavailable` so callers
handle one exception type at the boundary.
"""

from __future__ import annotations

import random
from typing import Any

import redis
import redis.asyncio as aioredis
from redbatch.common.config import RedisSettings

StreamEntry = tuple[bytes, dict[bytes, bytes]]
"""(entry id, fields) as read from a stream."""


class RedisUnavailable(ConnectionError):
    """Redis could not be reached or dropped the connection."""


class RedisRefused(Exception):
    """Redis answered but refused a whole transaction, so none of it was applied: it is
    out of memory under ``noeviction`` (OOM), a replica (READONLY), still loading, denied
    by an ACL (NOPERM), or failing over. Retry with back-off; nothing is lost meanwhile."""


REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError)

#: Error codes with which Redis refuses writes whatever the key: out of memory, a replica,
#: an ACL, a failed background save (MISCONF), a failover or a cluster in trouble.
REFUSALS = frozenset({"OOM", "READONLY", "NOPERM", "MISCONF", "MASTERDOWN", "NOREPLICAS",
                      "CLUSTERDOWN", "TRYAGAIN", "BUSY", "EXECABORT"})


def error_code(e: BaseException) -> str:
    """The first word of a Redis error reply (``OOM``, ``READONLY``, ``WRONGTYPE``,
    ``NOGROUP``...), as redis-py keeps it; ``ERR`` for a reply it stripped to text."""
    words = str(e).split(maxsplit=1)
    first = words[0] if words else ""
    if isinstance(e, redis.exceptions.OutOfMemoryError):
        return "OOM"
    if isinstance(e, redis.exceptions.ReadOnlyError):
        return "READONLY"
    if isinstance(e, redis.exceptions.NoPermissionError):
        return "NOPERM"
    return first if first.isupper() else "ERR"


def connect(url_or_settings: str | RedisSettings, *, blocking: bool = False) -> redis.Redis:
    """A blocking client for a Redis URL or :class:`RedisSettings`; bytes in, bytes out.

    The one place a Redis client is built. Connecting is bounded by the socket timeout
    (``RedisSettings.socket_timeout_s``, 10 s for a plain URL), and so is every reply,
    except on a ``blocking=True`` client: one that issues BLOCK/BLPOP calls, whose
    socket timeout is left unset so a long block is not cut off mid-wait. A URL is taken
    as it is; :meth:`RedisSettings.from_dsn` is the one that validates it.
    """
    settings = _settings(url_or_settings)
    return redis.Redis.from_url(settings.url, **_options(settings, blocking))


def connect_async(url_or_settings: str | RedisSettings, *,
                  blocking: bool = False) -> aioredis.Redis:
    """The asyncio twin of :func:`connect`, with the same timeouts."""
    settings = _settings(url_or_settings)
    return aioredis.Redis.from_url(settings.url, **_options(settings, blocking))


def _settings(url_or_settings: str | RedisSettings) -> RedisSettings:
    if isinstance(url_or_settings, RedisSettings):
        return url_or_settings
    return RedisSettings(url=url_or_settings)


def _options(settings: RedisSettings, blocking: bool) -> dict[str, Any]:
    """Keywords of ``from_url`` shared by both clients."""
    return {
        "socket_timeout": None if blocking else settings.socket_timeout_s,
        "socket_connect_timeout": settings.socket_timeout_s,
        "health_check_interval": 30,
        "decode_responses": False,
    }


class Backoff:
    """Exponential backoff with jitter for reconnecting: 0.1 s doubling to 5 s, each wait
    drawn from 50-150% so a fleet that lost Redis together does not return in step."""

    def __init__(self, first_s: float = 0.1, cap_s: float = 5.0) -> None:
        self.first_s = first_s
        self.cap_s = cap_s
        self.failures = 0

    def next_wait_s(self) -> float:
        wait: float = min(self.cap_s, self.first_s * 2.0 ** self.failures)
        self.failures += 1
        return wait * random.uniform(0.5, 1.5)

    def reset(self) -> None:
        self.failures = 0
