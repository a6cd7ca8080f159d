"""The one Redis connection factory (blocking and asyncio, always with timeouts) and the
few stream calls whose reply shapes need normalising.

Redis errors are translated here into :class:`RedisUnavailable` so callers
handle one exception type at the boundary.
"""

from __future__ import annotations

import random
from typing import Any, cast

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
import redis.cluster
from redbatch.common.config import RedisSettings, cluster_nodes, is_cluster_url
from redis._parsers.commands import AsyncCommandsParser, CommandsParser
from redis.connection import SSLConnection, parse_url

StreamEntry = tuple[bytes, dict[bytes, bytes]]
"""(entry id, fields) as read from a stream."""


class RedisUnavailable(ConnectionError):
    """Redis could not be reached or dropped the connection."""


class RedisRefused(Exception):
    """Redis answered but refused a whole transaction, so none of it was applied: it is
    out of memory under ``noeviction`` (OOM), a replica (READONLY), still loading, denied
    by an ACL (NOPERM), or failing over. Retry with back-off; nothing is lost meanwhile."""


#: Redis is out of reach: a connection dropped or timed out, or a cluster whose slot map
#: cannot be read (no node answers, a slot no master serves, redirections without end).
REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterError,
                redis.exceptions.SlotNotCoveredError)

#: Error codes with which Redis refuses writes whatever the key: out of memory, a replica,
#: an ACL, a failed background save (MISCONF), a failover or a cluster in trouble.
#: MOVED and ASK: a cluster slot moved (a failover); the cluster client reads the slot map
#: again on its next call.
REFUSALS = frozenset({"OOM", "READONLY", "NOPERM", "MISCONF", "MASTERDOWN", "NOREPLICAS",
                      "CLUSTERDOWN", "TRYAGAIN", "BUSY", "EXECABORT", "MOVED", "ASK"})


#: The error classes redis-py strips the code word from, and that word.
_CODES_BY_CLASS: tuple[tuple[type[BaseException], str], ...] = (
    (redis.exceptions.OutOfMemoryError, "OOM"),
    (redis.exceptions.ReadOnlyError, "READONLY"),
    (redis.exceptions.NoPermissionError, "NOPERM"),
    (redis.exceptions.MovedError, "MOVED"),
    (redis.exceptions.AskError, "ASK"),
    (redis.exceptions.ClusterDownError, "CLUSTERDOWN"),
    (redis.exceptions.TryAgainError, "TRYAGAIN"),
)


def error_code(e: BaseException) -> str:
    """The first word of a Redis error reply (``OOM``, ``READONLY``, ``WRONGTYPE``,
    ``NOGROUP``...), as redis-py keeps it; ``ERR`` for a reply it stripped to text."""
    for cls, code in _CODES_BY_CLASS:
        if isinstance(e, cls):
            return code
    words = str(e).split(maxsplit=1)
    first = words[0] if words else ""
    return first if first.isupper() else "ERR"


def connect(url_or_settings: str | RedisSettings, *, blocking: bool = False) -> redis.Redis:
    """A blocking client for a Redis URL or :class:`RedisSettings`; bytes in, bytes out.

    The one place a Redis client is built. Connecting is bounded by the socket timeout
    (``RedisSettings.socket_timeout_s``, 10 s for a plain URL), and so is every reply,
    except on a ``blocking=True`` client: one that issues BLOCK/BLPOP calls, whose
    socket timeout is left unset so a long block is not cut off mid-wait. A URL is taken
    as it is; :meth:`RedisSettings.from_dsn` is the one that validates it.

    A cluster URL (``redis+cluster://host:port,host:port``) gives a
    ``redis.cluster.RedisCluster`` started from those nodes, with the same timeouts. It
    answers the same commands (all keys of a model share one slot), so it is typed as
    ``redis.Redis``; the few callers that reach for a connection pool of their own ask
    :func:`is_cluster` first.
    """
    settings = _settings(url_or_settings)
    if is_cluster_url(settings.url):
        nodes, options = _cluster_options(settings, blocking)
        try:  # this client reads the slot map at once, from the first node that answers
            client = redis.cluster.RedisCluster(
                startup_nodes=[redis.cluster.ClusterNode(h, p)  # type: ignore[no-untyped-call]
                               for h, p in nodes], **options)
        except redis.exceptions.RedisClusterException as e:
            raise redis.ConnectionError(str(e)) from None
        _unreachable_as_connection_error(client.nodes_manager)
        client.commands_parser.__class__ = _KeysParser
        return cast(redis.Redis, client)
    return redis.Redis.from_url(settings.url, **_options(settings, blocking))


def connect_async(url_or_settings: str | RedisSettings, *,
                  blocking: bool = False) -> aioredis.Redis:
    """The asyncio twin of :func:`connect`, with the same timeouts (a
    ``redis.asyncio.cluster.RedisCluster`` for a cluster URL)."""
    settings = _settings(url_or_settings)
    if is_cluster_url(settings.url):
        nodes, options = _cluster_options(settings, blocking)
        aclient = aiocluster.RedisCluster(
            startup_nodes=[aiocluster.ClusterNode(h, p) for h, p in nodes], **options)
        _unreachable_as_connection_error(aclient.nodes_manager)
        aclient.commands_parser.__class__ = _AsyncKeysParser
        return cast(aioredis.Redis, aclient)
    return aioredis.Redis.from_url(settings.url, **_options(settings, blocking))


def is_cluster(client: Any) -> bool:
    """True for a client :func:`connect` or :func:`connect_async` built for a cluster."""
    return isinstance(client, (redis.cluster.RedisCluster, aiocluster.RedisCluster))


def node_client(client: redis.Redis, *args: Any) -> redis.Redis:
    """The plain client that serves the command ``args``: ``client`` itself, or on a
    cluster the client of the master owning the command's slot (by the slot map the
    cluster client last read: :func:`refresh_slots` after a failure)."""
    if not isinstance(client, redis.cluster.RedisCluster):
        return client
    node = client.nodes_manager.get_node_from_slot(client.determine_slot(*args))
    return cast(redis.Redis, client.get_redis_connection(node))


def refresh_slots(client: redis.Redis) -> None:
    """On a cluster client, read the slot map again (after a node failed or answered
    MOVED: a failover); best effort, nothing on a plain client."""
    if isinstance(client, redis.cluster.RedisCluster):
        try:
            client.nodes_manager.initialize()
        except (redis.RedisError, redis.exceptions.RedisClusterException):
            pass  # no node answers now: the next failure tries again


class _NodesManager(redis.cluster.NodesManager):
    """The cluster client's slot-map reader, raising ConnectionError where redis-py's
    raises RedisClusterException, which is no RedisError: no node answers, the nodes
    disagree, a slot is not served. Every caller handles a ConnectionError as Redis being
    away (retry with back-off); the other RedisClusterExceptions are errors in the code
    (cross-slot calls) and stay as they are."""

    def initialize(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().initialize(*args, **kwargs)
        except redis.exceptions.RedisClusterException as e:
            raise redis.ConnectionError(str(e)) from None

    # redis-py 8 remembers that the last slot-map read reached no node and then raises a
    # command's, pipeline's or transaction's ConnectionError as RedisClusterUnreachableError
    # (no RedisError) in its stead. Never remembering it keeps those a ConnectionError.
    @property
    def _last_refresh_unreachable_args(self) -> None:
        return None

    @_last_refresh_unreachable_args.setter
    def _last_refresh_unreachable_args(self, value: object) -> None:
        pass


class _AsyncNodesManager(aiocluster.NodesManager):
    """:class:`_NodesManager` of the asyncio client."""

    __slots__ = ()

    async def initialize(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().initialize(*args, **kwargs)
        except redis.exceptions.RedisClusterException as e:
            raise redis.ConnectionError(str(e)) from None

    @property
    def _last_refresh_unreachable_args(self) -> None:
        return None

    @_last_refresh_unreachable_args.setter
    def _last_refresh_unreachable_args(self, value: object) -> None:
        pass


def _unreachable_as_connection_error(nodes_manager: Any) -> None:
    """Give a cluster client's slot-map reader the class that raises ConnectionError
    (:class:`_NodesManager`): redis-py builds it inside the client, so its class is set
    here, with nothing else of it changed."""
    if isinstance(nodes_manager, aiocluster.NodesManager):
        nodes_manager.__class__ = _AsyncNodesManager
    else:
        nodes_manager.__class__ = _NodesManager


def movable_keys(args: tuple[Any, ...]) -> list[Any] | None:
    """The keys of a command whose keys move (XREADGROUP, XREAD, BLMPOP, LMPOP, EVALSHA,
    EVAL, FCALL, FCALL_RO), found in its arguments; None for any other command. A cluster
    client asks a node for them (``COMMAND GETKEYS``, one more round trip to one node)
    before every such command (a script in a pipeline too): measured, two of every three
    commands a worker sent on a cluster (BENCHMARKS.md, the scale curve)."""
    name = str(args[0]).upper() if args else ""
    if name in ("XREADGROUP", "XREAD"):  # past GROUP <group> <consumer>: a name is no word
        for i in range(4 if name == "XREADGROUP" else 1, len(args)):
            if isinstance(args[i], (str, bytes)) and args[i].upper() in ("STREAMS", b"STREAMS"):
                rest = args[i + 1:]
                return list(rest[:len(rest) // 2])
        return None
    first = {"BLMPOP": 2, "LMPOP": 1, "EVALSHA": 2, "EVAL": 2, "FCALL": 2,
             "FCALL_RO": 2}.get(name)
    if first is None or len(args) <= first:
        return None
    return list(args[first + 1:first + 1 + int(args[first])])


class _KeysParser(CommandsParser):
    """The cluster client's key finder, finding the keys of :func:`movable_keys`'s commands
    without a round trip (redis-py's own sends ``COMMAND GETKEYS`` for each)."""

    def get_keys(self, redis_conn: Any, *args: Any) -> Any:
        keys = movable_keys(args)
        return keys if keys is not None else super().get_keys(  # type: ignore[no-untyped-call]
            redis_conn, *args)


class _AsyncKeysParser(AsyncCommandsParser):
    """:class:`_KeysParser` of the asyncio client."""

    __slots__ = ()

    async def get_keys(self, *args: Any) -> Any:
        keys = movable_keys(args)
        return keys if keys is not None else await super().get_keys(*args)


def _cluster_options(settings: RedisSettings,
                     blocking: bool) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """The startup nodes of a cluster URL, and the keywords of its client: the first
    node's URL options (credentials, TLS files) with the timeouts of :func:`_options`."""
    first, nodes = cluster_nodes(settings.url)
    options = parse_url(first)  # type: ignore[no-untyped-call]
    for name in ("host", "port", "db"):
        options.pop(name, None)
    if options.pop("connection_class", None) is SSLConnection:
        options["ssl"] = True
    options.update(_options(settings, blocking))
    del options["health_check_interval"]  # not a cluster client's option
    return nodes, options


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
