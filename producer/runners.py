"""How each face runs the steps of the client's logic (``calls.py``): blocking for
:class:`~redbatch.producer.client.Client`, awaited for
:class:`~redbatch.producer.client.AsyncClient`. A runner owns no logic: it sends each
step's calls through its Redis client, and throws the Redis errors they raise back into
the steps, which decide what they mean; one the steps do not handle leaves as the
client's own error (``errors.client_error``), never as redis-py's. The inboxes here are
where a face's waits receive what the reply reader hands them (the replies of ``Receive``
steps).
"""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import redis
import redis.asyncio as aioredis
from redbatch.common.config import RedisSettings
from redbatch.common.protocol.functions import is_missing, load_library, load_library_async
from redbatch.common.redis_io import node_client, refresh_slots
from redbatch.producer.calls import Command, Outcome, Pause, Pipelined, Receive, Script, Step, Steps
from redbatch.producer.errors import REDIS_PY_ERRORS, FunctionsMissing, client_error

T = TypeVar("T")

Received = tuple[str, Outcome] | None


class SyncInbox:
    """The inbox of one blocking wait; the reader thread delivers, the waiter receives."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[str, Outcome]] = queue.SimpleQueue()

    def deliver(self, request_id: str, outcome: Outcome) -> None:
        self._queue.put((request_id, outcome))

    def receive(self, due: float) -> Received:
        """The next outcome, or None once ``due`` (monotonic s) has passed."""
        try:
            return self._queue.get(timeout=max(0.0, due - time.monotonic()))
        except queue.Empty:
            return None


class AsyncInbox:
    """The inbox of one asyncio wait; the reader task (same loop) delivers."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[tuple[str, Outcome]] = asyncio.Queue()

    def deliver(self, request_id: str, outcome: Outcome) -> None:
        self._queue.put_nowait((request_id, outcome))

    async def receive(self, due: float) -> Received:
        """The next outcome, or None once ``due`` (monotonic s) has passed."""
        try:
            return await asyncio.wait_for(self._queue.get(), max(0.0, due - time.monotonic()))
        except TimeoutError:
            return None



def connected(make: Callable[[RedisSettings], T], settings: RedisSettings) -> T:
    """``make(settings)``, a Redis client (a cluster client reads its slot map at once),
    with a Redis error raised as the client's own."""
    try:
        return make(settings)
    except REDIS_PY_ERRORS as e:
        raise client_error(e) from e


def _advance(steps: Steps[Any], reply: Any, error: Exception | None) -> tuple[bool, Any]:
    """Hand ``steps`` the last step's reply, or throw its error into them: ``(True, value)``
    when they ended, else ``(False, next step)``. The drive of both runners. A Redis error
    the steps let out (or raise: a reply reader hands its waits them) is translated."""
    try:
        return False, steps.send(reply) if error is None else steps.throw(error)
    except StopIteration as done:
        return True, done.value
    except REDIS_PY_ERRORS as e:
        raise client_error(e) from e


class BlockingRunner:
    """Runs steps blocking, through ``client`` (its pool serves every thread)."""

    def __init__(self, client: redis.Redis) -> None:
        self.redis = client

    def run(self, steps: Steps[T]) -> T:
        """Drive ``steps`` to their end, running each step blocking; returns their value.
        A Redis error a step raises is thrown into ``steps``, which may handle it."""
        reply: Any = None
        error: Exception | None = None
        while True:
            finished, item = _advance(steps, reply, error)
            if finished:
                return cast(T, item)
            try:
                reply, error = self._step(item), None
            except REDIS_PY_ERRORS as e:
                reply, error = None, e

    def _step(self, step: Step) -> Any:
        """Run one step; returns its reply."""
        if isinstance(step, Pause):
            time.sleep(step.seconds)
            return None
        if isinstance(step, Receive):
            assert isinstance(step.inbox, SyncInbox)
            return step.inbox.receive(step.due)
        if isinstance(step, Pipelined):
            replies = self._pipeline(step.calls)
            if missing := _missing(replies):
                self._load(step.calls[missing[0]])
                _retried(step.calls, replies, missing, self._pipeline)
            return _raised(replies, step.errors_as_replies)
        if isinstance(step, Command) and step.due is not None:
            return self._call_by(step.due, *step.args)
        return self._alone(step)

    def _alone(self, call: Command | Script) -> Any:
        """Send one call, not in a pipeline (a function's library loaded when missing)."""
        try:
            return self.redis.execute_command(*_args(call))  # type: ignore[no-untyped-call]
        except redis.ResponseError as e:
            if not (isinstance(call, Script) and is_missing(e)):
                raise
        self._load(call)
        return self.redis.execute_command(*_args(call))  # type: ignore[no-untyped-call]

    def _pipeline(self, calls: Sequence[Command | Script]) -> list[Any]:
        """The replies of ``calls`` sent in one pipeline, errors as replies; on a cluster
        one pipeline too: redis-py's sends each node its calls, all nodes before reading.
        A single call goes alone: a pipeline of one costs more, on a cluster most."""
        if len(calls) == 1:
            try:
                return [self._alone(calls[0])]
            except redis.ResponseError as e:
                return [e]
        pipe = self.redis.pipeline(transaction=False)
        for call in calls:
            pipe.execute_command(*_args(call))  # type: ignore[no-untyped-call]
        return pipe.execute(raise_on_error=False)

    def _load(self, call: Command | Script) -> None:
        """Load the function library (on a cluster, into every master); FunctionsMissing
        when this user may not."""
        try:
            load_library(self.redis)
        except redis.ResponseError as e:  # NOPERM included
            raise _no_library(call, e) from None

    def _call_by(self, by: float, *args: Any) -> Any:
        """Run one command on a pooled connection; its reply is due by ``by`` (monotonic s).

        Raises redis.TimeoutError when it is late, after dropping the connection so that a
        late reply never meets another command; other Redis errors as they come."""
        try:
            # On a cluster, the master of the command's slot.
            pool = node_client(self.redis, *args).connection_pool
            conn = pool.get_connection()
        except redis.RedisError:
            refresh_slots(self.redis)
            raise
        try:
            # No health check: its PING would wait the socket timeout, past ``by``, on a
            # hung Redis; a dead connection fails this command, which the caller retries.
            conn.send_command(*args, check_health=False)  # type: ignore[no-untyped-call]
            if not conn.can_read(timeout=max(0.0, by - time.monotonic())):
                conn.disconnect()  # type: ignore[no-untyped-call]
                raise redis.TimeoutError(f"no reply to {args[0]} in time")
            return conn.read_response()
        except (redis.ConnectionError, redis.exceptions.AskError):  # MOVED: a failover
            refresh_slots(self.redis)
            raise
        finally:
            pool.release(conn)


class AsyncRunner:
    """Runs steps awaited, through ``client``."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.redis = client

    async def run(self, steps: Steps[T]) -> T:
        """As :meth:`BlockingRunner.run`, awaiting each step."""
        reply: Any = None
        error: Exception | None = None
        while True:
            finished, item = _advance(steps, reply, error)
            if finished:
                return cast(T, item)
            try:
                reply, error = await self._step(item), None
            except REDIS_PY_ERRORS as e:
                reply, error = None, e

    async def _step(self, step: Step) -> Any:
        """Run one step; returns its reply."""
        if isinstance(step, Pause):
            await asyncio.sleep(step.seconds)
            return None
        if isinstance(step, Receive):
            assert isinstance(step.inbox, AsyncInbox)
            return await step.inbox.receive(step.due)
        if isinstance(step, Pipelined):
            replies = await self._pipeline(step.calls)
            if missing := _missing(replies):  # as _retried, awaited
                await self._load(step.calls[missing[0]])
                again = await self._pipeline([step.calls[i] for i in missing])
                for i, reply in zip(missing, again, strict=True):
                    replies[i] = reply
            return _raised(replies, step.errors_as_replies)
        if isinstance(step, Script):
            return await self._alone(step)
        return await self._call_by(step.due, *step.args)

    async def _alone(self, call: Script) -> Any:
        """Call one function, not in a pipeline (its library loaded when missing)."""
        try:
            return await self.redis.execute_command(*_args(call))  # type: ignore[no-untyped-call]
        except redis.ResponseError as e:
            if not is_missing(e):
                raise
        await self._load(call)
        return await self.redis.execute_command(*_args(call))  # type: ignore[no-untyped-call]

    async def _load(self, call: Command | Script) -> None:
        """As :meth:`BlockingRunner._load`, awaited."""
        try:
            await load_library_async(self.redis)
        except redis.ResponseError as e:
            raise _no_library(call, e) from None

    async def _pipeline(self, calls: Sequence[Command | Script]) -> list[Any]:
        """As :meth:`BlockingRunner._pipeline`; on a cluster the nodes are sent their calls
        concurrently."""
        if len(calls) == 1:
            try:
                return [await self.redis.execute_command(*_args(calls[0]))]  # type: ignore[no-untyped-call]
            except redis.ResponseError as e:
                return [e]
        async with self.redis.pipeline(transaction=False) as pipe:
            for call in calls:
                pipe.execute_command(*_args(call))
            return await pipe.execute(raise_on_error=False)

    async def _call_by(self, by: float | None, *args: Any) -> Any:
        """One command whose reply is due by ``by`` (monotonic s; None: the socket timeout
        bounds it); raises redis.TimeoutError when it is late (redis-py drops a connection
        whose command was cancelled)."""
        timeout = None if by is None else max(0.0, by - time.monotonic())
        try:
            return await asyncio.wait_for(
                self.redis.execute_command(*args),  # type: ignore[no-untyped-call]
                timeout)
        except TimeoutError as e:
            raise redis.TimeoutError(f"no reply to {args[0]} in time") from e


def _args(call: Command | Script) -> tuple[Any, ...]:
    """The command of ``call`` as sent: a function by its name (``FCALL`` or ``FCALL_RO``)."""
    if isinstance(call, Command):
        return call.args
    return ("FCALL_RO" if call.read_only else "FCALL", call.function, len(call.keys),
            *call.keys, *call.args)


def _retried(calls: Sequence[Command | Script], replies: list[Any], missing: list[int],
             pipeline: Callable[[Sequence[Command | Script]], list[Any]]) -> None:
    """Send the ``missing`` calls (their function was not loaded: Redis ran nothing of
    them) again in one pipeline, once the library is loaded; their replies replace the
    error ones."""
    for i, reply in zip(missing, pipeline([calls[i] for i in missing]), strict=True):
        replies[i] = reply


def _missing(replies: list[Any]) -> list[int]:
    """Indexes of the replies saying the function called is not loaded (it ran nothing)."""
    return [i for i, reply in enumerate(replies) if is_missing(reply)]


def _no_library(call: Command | Script, e: redis.ResponseError) -> FunctionsMissing:
    """The error for a library this user could not load (``e``: Redis's refusal)."""
    return FunctionsMissing(call.function if isinstance(call, Script) else "?", str(e))


def _raised(replies: list[Any], errors_as_replies: bool) -> list[Any]:
    """``replies``, or the first error among them raised unless errors are replies."""
    if not errors_as_replies:
        for reply in replies:
            if isinstance(reply, redis.ResponseError):
                raise reply
    return replies
