"""One MULTI/EXEC sent as one packed write and read back raw: the result writer's
transaction without redis-py's Pipeline.

A flush of answers is hundreds of commands. redis-py's Pipeline spends, per command, a
look-up of its reply callback, a pack of the command on its own, and a parse of its
``QUEUED`` reply; the worker's GIL pays for all of it, while the writer needs none of it:
it reads each reply only for errors and one integer. :class:`Commands` records the commands
through redis-py's own command methods (so their arguments are built as redis-py builds
them), and :func:`exec_transaction` packs ``MULTI``, the commands and ``EXEC`` into one
buffer (each command by hiredis, in C), sends it in one write, and returns EXEC's replies
as the parser gives them: bytes, integers, lists, and the error replies of single commands
as ResponseError values.

Errors follow the Pipeline's so that the caller's NOTE [ Write failures ] holds: a dropped
connection or a timeout raises ConnectionError / TimeoutError, and a transaction Redis
refuses whole (OOM, READONLY, NOPERM at queue time: EXECABORT) raises ResponseError. In
both cases nothing was applied. The connection goes back to the pool only when its replies
were all read; otherwise it is dropped, so that no late reply meets another command.
"""

from __future__ import annotations

from typing import Any

import redis
from hiredis import pack_command
from redbatch.common.redis_io import is_cluster
from redis.commands.core import CoreCommands


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


_MULTI, _EXEC = pack_command(("MULTI",)), pack_command(("EXEC",))


def _packed(commands: list[tuple[Any, ...]]) -> bytes:
    """MULTI, ``commands`` and EXEC as one RESP buffer: hiredis packs each command in C,
    a third of what redis-py's ``pack_commands`` costs around the same call."""
    return b"".join([_MULTI, *[pack_command(args) for args in commands], _EXEC])


def exec_transaction(client: redis.Redis, commands: Commands) -> list[Any]:
    """Run ``commands`` in one MULTI/EXEC on a connection of ``client``'s pool; returns
    EXEC's replies, in order. Raises as the module docstring says.

    On a cluster (all the keys in one slot) the cluster client's own transaction runs them
    on the master of that slot, following a slot that moved."""
    if is_cluster(client):
        return _cluster_transaction(client, commands)
    pool = client.connection_pool
    conn: Any = pool.get_connection()  # redis-py leaves the connection's methods untyped
    complete = False
    try:
        conn.send_packed_command([_packed(commands.args)], check_health=False)
        conn.read_response()  # +OK of MULTI
        refused: redis.ResponseError | None = None
        for _ in commands.args:
            try:
                conn.read_response()  # +QUEUED
            except redis.ResponseError as e:  # refused at queue time: EXEC aborts it all
                refused = refused or e
        try:
            replies = conn.read_response()
        except redis.ResponseError as e:  # EXECABORT (or a refusal of EXEC itself)
            complete = True
            raise (refused or e) from None
        complete = True
        if refused is not None:  # cannot happen: Redis aborts a transaction with a refusal
            raise refused
        return list(replies) if replies is not None else []
    finally:
        if not complete:
            conn.disconnect()
        pool.release(conn)


def _cluster_transaction(client: redis.Redis, commands: Commands) -> list[Any]:
    """exec_transaction on a cluster client: the same replies and errors (a refusal at
    queue time raises its ResponseError; single commands' errors are replies)."""
    pipe = client.pipeline(transaction=True)
    try:
        for args in commands.args:
            pipe.execute_command(*args)  # type: ignore[no-untyped-call]  # redis-py
        return list(pipe.execute(raise_on_error=False))
    finally:
        pipe.reset()
