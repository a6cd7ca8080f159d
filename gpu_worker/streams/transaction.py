"""One MULTI/EXEC sent as one packed write and read back raw: the result writer's
transaction without redis-py's Pipeline.

A flush of answers is hundreds of commands. redis-py's Pipeline spends, per command, a
look-up of its reply callback, a pack of the command on its own, and a parse of its
``QUEUED`` reply; the worker's GIL pays for all of it, while the writer needs none of it:
it reads each reply only for errors and one integer. :class:`Commands` records the commands
through redis-py's own command methods (so their arguments are built as redis-py builds
them), and :func:`exec_transaction` packs ``MULTI``, the commands and ``EXEC`` into one
buffer (each command by hiredis, in C, or in Python where hiredis is not installed: redis-py
works without it), sends it in one write, and returns EXEC's replies as the parser gives
them: bytes, integers, lists, and the error replies of single commands as ResponseError
values.

Errors follow the Pipeline's so that the caller's NOTE [ Write failures ] holds: a dropped
connection or a timeout raises ConnectionError / TimeoutError, and a transaction Redis
refuses whole (OOM, READONLY, NOPERM at queue time: EXECABORT) raises ResponseError. In
both cases nothing was applied. The connection goes back to the pool only when its replies
were all read; otherwise it is dropped, so that no late reply meets another command.

NOTE [ WAIT after the write ]
  With a :class:`ReplicaWait`, ``WAIT replicas timeout`` follows the EXEC on the very
  connection that ran it, before the connection goes back to its pool: WAIT counts the
  replicas that reached the replication offset Redis noted for *its own connection*
  (Redis 7.0: after that connection's last command; older servers: after its last
  write), so on the writing connection it covers the write on any version, and on a
  cluster it reaches the master that took it. One WAIT per transaction, whatever it
  holds. A WAIT that times out or fails never raises: the transaction was applied on
  the master, and :class:`Replication` says how many replicas confirmed it. redis-py's
  pipelines give their connection back inside ``execute()``, so :func:`run_pipeline` calls
  the parts of ``execute()`` that run the transaction and leaves the reset to the caller.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import redis
import redis.cluster
from redbatch.common.redis_io import REDIS_ERRORS, is_cluster, node_client, refresh_slots
from redis.commands.core import CoreCommands
from redis.crc import key_slot
from redis.exceptions import AskError, ClusterDownError, MovedError, TryAgainError


@dataclass(frozen=True, slots=True)
class Replication:
    """What the WAIT after a write said: how many replicas were asked for and confirmed it."""

    asked: int
    acked: int
    #: Why WAIT itself failed (the write stands, unconfirmed); empty when it answered.
    error: str = ""

    @property
    def short(self) -> bool:
        return self.acked < self.asked


@dataclass(frozen=True, slots=True)
class ReplicaWait:
    """``WAIT replicas timeout_ms`` after each transaction (NOTE [ WAIT after the write ])."""

    replicas: int
    timeout_ms: int

    def after(self, conn: Any) -> Replication:
        """WAIT on ``conn``, the connection that just wrote; never raises a Redis error."""
        try:
            conn.send_command("WAIT", self.replicas, self.timeout_ms, check_health=False)
            return Replication(self.replicas, int(conn.read_response()))
        except redis.RedisError as e:  # the write happened; only its copies are unknown
            conn.disconnect()  # a reply still on its way must meet no other command
            return Replication(self.replicas, 0, f"{type(e).__name__}: {e}")


class Commands(CoreCommands):
    """Records commands instead of sending them: ``commands.rpush(key, *ids)`` appends
    ``("RPUSH", key, *ids)`` to :attr:`args`. Every redis-py command method works."""

    _event_dispatcher: Any = None  # a CoreCommands attribute; nothing is sent: no events

    def __init__(self) -> None:
        self.args: list[tuple[Any, ...]] = []

    def execute_command(self, *args: Any, **options: Any) -> None:
        """Record one command (the options are for redis-py's reply parsing: unused)."""
        self.args.append(args)

    def __len__(self) -> int:
        return len(self.args)


def pack_in_python(args: Sequence[Any]) -> bytes:
    """One command as a RESP array of bulk strings, byte for byte what hiredis's
    ``pack_command`` makes: bytes as they are, str as UTF-8, int and float as their
    decimal text (repr, as redis-py's encoder writes a float). TypeError for anything else."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, bytes):
            data = arg
        elif isinstance(arg, str):
            data = arg.encode()
        elif isinstance(arg, (int, float)) and not isinstance(arg, bool):
            data = repr(arg).encode()
        else:
            raise TypeError(f"cannot pack a {type(arg).__name__} into a Redis command")
        parts.append(b"$%d\r\n%b\r\n" % (len(data), data))
    return b"".join(parts)


def _packer() -> Callable[[Sequence[Any]], bytes]:
    """hiredis's pack_command, or pack_in_python in an install without hiredis."""
    try:
        from hiredis import pack_command as packer
    except ImportError:
        return pack_in_python
    return cast(Callable[[Sequence[Any]], bytes], packer)


pack_command = _packer()


_MULTI, _EXEC = pack_command(("MULTI",)), pack_command(("EXEC",))


def _packed(commands: list[tuple[Any, ...]]) -> bytes:
    """MULTI, ``commands`` and EXEC as one RESP buffer: hiredis packs each command in C,
    a third of what redis-py's ``pack_commands`` costs around the same call."""
    return b"".join([_MULTI, *[pack_command(args) for args in commands], _EXEC])


def exec_transaction(client: redis.Redis, commands: Commands,
                     wait: ReplicaWait | None = None) -> tuple[list[Any], Replication | None]:
    """Run ``commands`` in one MULTI/EXEC on a connection of ``client``'s pool; returns
    EXEC's replies, in order, and what the WAIT after it said (None without ``wait``).
    Raises as the module docstring says.

    On a cluster (all the keys in one slot) the same packed transaction runs on a
    connection of the master of that slot, by the slot map the client last read. A slot
    that moved (a failover: every queued command answers MOVED, EXEC aborts, nothing is
    applied) or a node that fails makes the client read the slot map again, and raises
    as above: the caller's retry reaches the new master."""
    if not is_cluster(client):
        return _exec_on(client, commands, wait)
    try:
        return _exec_on(node_client(client, *commands.args[0]), commands, wait)
    except (*REDIS_ERRORS, MovedError, AskError, ClusterDownError, TryAgainError):
        refresh_slots(client)
        raise


def _exec_on(client: redis.Redis, commands: Commands,
             wait: ReplicaWait | None) -> tuple[list[Any], Replication | None]:
    """exec_transaction on a plain client (one Redis, or one master of a cluster)."""
    pool = client.connection_pool
    conn: Any = pool.get_connection()  # redis-py leaves the connection's methods untyped
    complete = False
    try:
        conn.send_packed_command([_packed(commands.args)], check_health=False)
        replies = _read_exec(conn, len(commands.args))
        complete = True
        return replies, wait.after(conn) if wait is not None else None
    except redis.ResponseError:  # refused whole; every reply was read
        complete = True
        raise
    finally:
        if not complete:
            conn.disconnect()
        pool.release(conn)


def _read_exec(conn: Any, n: int) -> list[Any]:
    """The replies of MULTI, ``n`` queued commands and EXEC: EXEC's replies, or the
    ResponseError of a transaction refused whole (after every reply was read)."""
    conn.read_response()  # +OK of MULTI
    refused: redis.ResponseError | None = None
    for _ in range(n):
        try:
            conn.read_response()  # +QUEUED
        except redis.ResponseError as e:  # refused at queue time: EXEC aborts it all
            refused = refused or e
    try:
        replies = conn.read_response()
    except redis.ResponseError as e:  # EXECABORT (or a refusal of EXEC itself)
        raise (refused or e) from None
    if refused is not None:  # cannot happen: Redis aborts a transaction with a refusal
        raise refused
    return list(replies) if replies is not None else []


def pipelined(client: redis.Redis, commands: Sequence[tuple[str, tuple[Any, ...]]],
              node_errors: bool = False) -> list[Any]:
    """The reply of each ``(key, command)``, in order, the commands sent as a plain
    pipeline (no transaction) packed as exec_transaction packs one; on a cluster each is
    sent to the master of its key's slot, every master its commands in one write before
    any reply is read: one round trip, however many masters they reach. Replies are raw
    (RESP as the parser gives it), an error reply a ResponseError value. A dropped
    connection or a timeout raises (the connection is dropped); on a cluster that, or a
    slot that moved, also makes the client read the slot map again (a MOVED reply is
    raised, once the other replies are read).

    ``node_errors``: a master that cannot be reached, or a slot that moved, fails only its
    own commands: their replies are the error (a ConnectionError, TimeoutError or MOVED
    value), and the other masters' replies come as ever (issue 28: partitions that fail
    alone)."""
    by_node: dict[int, tuple[redis.Redis, list[int]]] = {}
    for i, (key, _) in enumerate(commands):
        node = node_of(client, key)
        by_node.setdefault(id(node), (node, []))[1].append(i)
    replies: list[Any] = [None] * len(commands)
    taken: list[tuple[Any, Any, list[int]]] = []
    failed = False
    try:
        for node, indexes in by_node.values():
            try:
                _send(node, commands, indexes, taken)
            except REDIS_ERRORS as e:
                failed = _node_failed(e, indexes, replies, node_errors)
        for _, conn, indexes in taken:
            if failed and replies[indexes[0]] is not None:
                continue  # its send failed: nothing to read (dropped below)
            failed = _read_node(conn, indexes, replies, node_errors) or failed
    except REDIS_ERRORS:
        refresh_slots(client)
        raise
    finally:
        for pool, conn, indexes in taken:
            if indexes:
                conn.disconnect()
            pool.release(conn)
    moved = [r for r in replies if isinstance(r, (MovedError, AskError))]
    if failed or moved:
        refresh_slots(client)
    if moved and not node_errors:
        raise moved[0]
    return replies


def _send(node: redis.Redis, commands: Sequence[tuple[str, tuple[Any, ...]]],
          indexes: list[int], taken: list[tuple[Any, Any, list[int]]]) -> None:
    """Send one master its commands in one write; its connection joins ``taken``."""
    pool = node.connection_pool
    conn: Any = pool.get_connection()
    taken.append((pool, conn, indexes))
    conn.send_packed_command([b"".join(pack_command(commands[i][1]) for i in indexes)],
                             check_health=False)


def _read_node(conn: Any, indexes: list[int], replies: list[Any], node_errors: bool) -> bool:
    """Read one master's replies into ``replies``; True when it failed (its connection is
    then left dirty, ``indexes`` not cleared, to be dropped)."""
    try:
        for i in indexes:
            try:
                replies[i] = conn.read_response()
            except redis.ResponseError as e:
                replies[i] = e
    except REDIS_ERRORS as e:
        return _node_failed(e, [i for i in indexes if replies[i] is None], replies,
                            node_errors)
    indexes.clear()  # every reply read: the connection is clean
    return False


def _node_failed(error: Exception, indexes: list[int], replies: list[Any],
                 node_errors: bool) -> bool:
    """A master failed: its commands' replies are the error, or it raises."""
    if not node_errors:
        raise error
    for i in indexes:
        replies[i] = error
    return True


def node_of(client: redis.Redis, key: str) -> redis.Redis:
    """The plain client of the master serving ``key``: ``client`` itself on one Redis; on a
    cluster by the slot map the client last read (the key's slot is remembered)."""
    if not isinstance(client, redis.cluster.RedisCluster):
        return client
    node = client.nodes_manager.get_node_from_slot(_slot(key))
    return cast(redis.Redis, client.get_redis_connection(node))


@functools.lru_cache(maxsize=4096)
def _slot(key: str) -> int:
    return int(key_slot(key.encode()))


def run_pipeline(pipe: Any, wait: ReplicaWait | None) -> tuple[list[Any], Replication | None]:
    """``pipe.execute(raise_on_error=False)`` of a transaction pipeline, plain or cluster,
    then the WAIT on the connection that ran it (NOTE [ WAIT after the write ]). The caller
    resets ``pipe`` afterwards, which gives the connection back."""
    if wait is None:
        return list(pipe.execute(raise_on_error=False)), None
    if isinstance(pipe, redis.cluster.ClusterPipeline):
        strategy: Any = pipe._execution_strategy  # redis-py 8's transaction strategy
        replies = strategy.execute(raise_on_error=False)
        conn = strategy._transaction_connection  # held until pipe.reset()
    else:
        if pipe.connection is None:  # no WATCH took one: take it as execute() would
            pipe.connection = pipe.connection_pool.get_connection()
        conn = pipe.connection
        try:
            replies = pipe._execute_transaction(conn, pipe.command_stack, False)
        except REDIS_ERRORS:
            conn.disconnect()  # as execute() does: no late reply meets another command
            raise
    return list(replies), wait.after(conn) if conn is not None else None
