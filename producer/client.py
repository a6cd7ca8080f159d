"""Submit jobs and wait for their results: the client API, blocking and asyncio.

A job is one XADD to the model's lane stream. Its result is a msgpack string
key that the worker writes together with one token pushed onto a per-request
"done" list; the client waits with BLPOP on that list and then reads the key.
Because the result key is durable (until its TTL), a waiting connection that
drops loses nothing: the client reconnects and reads the key again.

Admission control: every submit runs the protocol's admission script (an atomic
check-and-XADD), so a lane with a bound in the model's limits hash refuses jobs
once its stream holds that many; the caller gets :class:`QueueFull` at once and
nothing is queued for the refused jobs. The same script refuses a request id that
another job still owns (:class:`DuplicateRequestId`), so submitting the same envelope
again after a lost reply is safe: the job is queued at most once.

Waiting honours its timeout whatever Redis does (see ``wait.py``): a Redis that is
gone, restarting or hung ends it with ResultTimeout.

The logic is written once, without I/O, in ``core.py`` and ``wait.py``: each operation
is a generator of Redis calls (``calls.py``). :class:`Client` runs those calls blocking
and :class:`AsyncClient` awaits them; this module holds only the two faces. The errors
live in ``errors.py`` and are re-exported here, where users import them from.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

import redis
import redis.asyncio as aioredis
from redbatch.common.config import DEFAULT_MAX_PAYLOAD_BYTES, DEFAULT_MODEL, DEFAULT_REDIS_URL
from redbatch.common.protocol import ADMIT_SCRIPT, DEFAULT_PREFIX, JobEnvelope, Lane, ResultEnvelope
from redbatch.common.redis_io import connect, connect_async
from redbatch.producer.calls import Admit, Command, Pause, Pipelined, Step, Steps
from redbatch.producer.core import ClientCore, QueueState
from redbatch.producer.errors import DuplicateRequestId, QueueFull, ResultTimeout, ResultUnreadable

__all__ = ["AsyncClient", "Client", "DuplicateRequestId", "QueueFull", "QueueState", "Result",
           "ResultTimeout", "ResultUnreadable"]

T = TypeVar("T")
Result = ResultEnvelope


class Client(ClientCore):
    """Blocking client.

    >>> c = Client("redis://localhost:6379/0")
    >>> rid = c.submit(open("cat.jpg", "rb").read())
    >>> c.result(rid, timeout_s=10).output["label"]
    """

    def __init__(self, redis_url: str = DEFAULT_REDIS_URL, *, model: str = DEFAULT_MODEL,
                 prefix: str = DEFAULT_PREFIX,
                 max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> None:
        super().__init__(redis_url, model, prefix, max_payload_bytes)
        self.redis = connect(redis_url)
        self._admit = self.redis.register_script(ADMIT_SCRIPT)

    def submit(self, payload: bytes, *, model: str | None = None, timeout_s: float | None = None,
               lane: Lane | str = Lane.INTERACTIVE, params: Mapping[str, Any] | None = None,
               content_type: str = "application/octet-stream",
               request_id: str | None = None) -> str:
        """Queue one job and return its request id.

        ``timeout_s`` sets the job's deadline: a worker that reaches it later
        answers ``expired`` instead of computing it. Raises :class:`QueueFull`, with
        nothing queued, when the lane is at its bound (see :meth:`set_queue_limit`), and
        :class:`DuplicateRequestId` when ``request_id`` belongs to another job.
        """
        job = self.job(payload, model=model, timeout_s=timeout_s, lane=lane, params=params,
                       content_type=content_type, request_id=request_id)
        return self._run(self._submit(job))

    def submit_many(self, payloads: Iterable[bytes], **kw: Any) -> list[str]:
        """Queue many jobs in one pipelined round trip; same keywords as submit.

        Raises :class:`QueueFull` if any job was refused; its ``accepted`` and
        ``refused`` say which were queued and which were not.
        """
        return self.submit_jobs(self._jobs(payloads, kw))

    def submit_jobs(self, jobs: Sequence[JobEnvelope]) -> list[str]:
        """Queue envelopes made by :meth:`job` in one pipelined round trip; returns their
        request ids. Raises :class:`QueueFull` as :meth:`submit_many` does; the refused
        envelopes can be submitted again as they are."""
        return self._run(self._submit_jobs(jobs))

    def set_queue_limit(self, lane: Lane | str, max_jobs: int | None, *,
                        model: str | None = None) -> None:
        """Bound the lane's queue to ``max_jobs`` entries (queued or in progress) for every
        client that submits through the admission script; None removes the bound."""
        self._run(self._set_queue_limit(lane, max_jobs, model))

    def queue_state(self, lane: Lane | str, *, model: str | None = None) -> QueueState:
        """The lane's current backlog and bound."""
        return self._run(self._queue_state(lane, model))

    def result(self, request_id: str, timeout_s: float = 30.0, *,
               model: str | None = None) -> ResultEnvelope:
        """Wait for the result of ``request_id``, ``timeout_s`` seconds at most.

        Raises ResultTimeout by then (about 0.2 s later at worst) whatever Redis does:
        an unreachable, restarting or hung Redis is retried until the deadline. (One
        exception: opening a new connection to a Redis that accepts it but never answers,
        a stopped process, takes up to the socket timeout, 10 s: redis-py's handshake
        knows no deadline. The asyncio client has none.) A done
        key of another type does not end the wait: the result key is polled instead.
        Raises ResultUnreadable when the result key holds no result envelope. Results
        are not consumed: reading again returns the same result until it expires.
        """
        return self._run(self._result(request_id, timeout_s, model))

    def predict(self, payload: bytes, *, timeout_s: float = 30.0, **kw: Any) -> ResultEnvelope:
        """Submit and wait; the job's deadline is the same ``timeout_s``."""
        request_id = self.submit(payload, timeout_s=timeout_s, **kw)
        return self.result(request_id, timeout_s, model=kw.get("model"))

    def close(self) -> None:
        """Close the client's connections."""
        self.redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, steps: Steps[T]) -> T:
        """Drive ``steps`` to their end, running each step blocking; returns their value.
        A Redis error a step raises is thrown into ``steps``, which may handle it."""
        reply: Any = None
        error: redis.RedisError | None = None
        while True:
            try:
                step = steps.send(reply) if error is None else steps.throw(error)
            except StopIteration as done:
                value: T = done.value
                return value
            try:
                reply, error = self._step(step), None
            except redis.RedisError as e:
                reply, error = None, e

    def _step(self, step: Step) -> Any:
        """Run one step; returns its reply."""
        if isinstance(step, Pause):
            time.sleep(step.seconds)
            return None
        if isinstance(step, Pipelined):
            pipe = self.redis.pipeline(transaction=False)
            for call in step.calls:
                self._send(call, pipe)
            return pipe.execute(raise_on_error=not step.errors_as_replies)
        if isinstance(step, Command) and step.due is not None:
            return self._call_by(step.due, *step.args)
        return self._send(step, self.redis)

    def _send(self, call: Command | Admit, client: redis.Redis) -> Any:
        """Send ``call`` through ``client``, or queue it there when it is a pipeline."""
        if isinstance(call, Admit):
            return self._admit(call.keys, call.args, client=client)
        return client.execute_command(*call.args)  # type: ignore[no-untyped-call]  # redis-py

    def _call_by(self, by: float, *args: Any) -> Any:
        """Run one command on a pooled connection; its reply is due by ``by`` (monotonic s).

        Raises redis.TimeoutError when it is late, after dropping the connection so that a
        late reply never meets another command; other Redis errors as they come."""
        pool = self.redis.connection_pool
        conn = pool.get_connection()
        try:
            # No health check: its PING would wait the socket timeout, past ``by``, on a
            # hung Redis; a dead connection fails this command, which the caller retries.
            conn.send_command(*args, check_health=False)  # type: ignore[no-untyped-call]
            if not conn.can_read(timeout=max(0.0, by - time.monotonic())):
                conn.disconnect()  # type: ignore[no-untyped-call]
                raise redis.TimeoutError(f"no reply to {args[0]} in time")
            return conn.read_response()
        finally:
            pool.release(conn)


class AsyncClient(ClientCore):
    """The asyncio twin of :class:`Client`, with the same methods as coroutines."""

    def __init__(self, redis_url: str = DEFAULT_REDIS_URL, *, model: str = DEFAULT_MODEL,
                 prefix: str = DEFAULT_PREFIX,
                 max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> None:
        super().__init__(redis_url, model, prefix, max_payload_bytes)
        self.redis = connect_async(redis_url)
        self._admit = self.redis.register_script(ADMIT_SCRIPT)

    async def submit(self, payload: bytes, *, model: str | None = None,
                     timeout_s: float | None = None, lane: Lane | str = Lane.INTERACTIVE,
                     params: Mapping[str, Any] | None = None,
                     content_type: str = "application/octet-stream",
                     request_id: str | None = None) -> str:
        """As :meth:`Client.submit`."""
        job = self.job(payload, model=model, timeout_s=timeout_s, lane=lane, params=params,
                       content_type=content_type, request_id=request_id)
        return await self._run(self._submit(job))

    async def submit_many(self, payloads: Iterable[bytes], **kw: Any) -> list[str]:
        """As :meth:`Client.submit_many`."""
        return await self.submit_jobs(self._jobs(payloads, kw))

    async def submit_jobs(self, jobs: Sequence[JobEnvelope]) -> list[str]:
        """As :meth:`Client.submit_jobs`."""
        return await self._run(self._submit_jobs(jobs))

    async def set_queue_limit(self, lane: Lane | str, max_jobs: int | None, *,
                              model: str | None = None) -> None:
        """As :meth:`Client.set_queue_limit`."""
        await self._run(self._set_queue_limit(lane, max_jobs, model))

    async def queue_state(self, lane: Lane | str, *, model: str | None = None) -> QueueState:
        """As :meth:`Client.queue_state`."""
        return await self._run(self._queue_state(lane, model))

    async def result(self, request_id: str, timeout_s: float = 30.0, *,
                     model: str | None = None) -> ResultEnvelope:
        """As :meth:`Client.result`: the result, ResultTimeout by ``timeout_s`` whatever
        Redis does, or ResultUnreadable."""
        return await self._run(self._result(request_id, timeout_s, model))

    async def predict(self, payload: bytes, *, timeout_s: float = 30.0,
                      **kw: Any) -> ResultEnvelope:
        """As :meth:`Client.predict`."""
        request_id = await self.submit(payload, timeout_s=timeout_s, **kw)
        return await self.result(request_id, timeout_s, model=kw.get("model"))

    async def close(self) -> None:
        """Close the client's connections."""
        await self.redis.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _run(self, steps: Steps[T]) -> T:
        """As :meth:`Client._run`, awaiting each step."""
        reply: Any = None
        error: redis.RedisError | None = None
        while True:
            try:
                step = steps.send(reply) if error is None else steps.throw(error)
            except StopIteration as done:
                value: T = done.value
                return value
            try:
                reply, error = await self._step(step), None
            except redis.RedisError as e:
                reply, error = None, e

    async def _step(self, step: Step) -> Any:
        """Run one step; returns its reply."""
        if isinstance(step, Pause):
            await asyncio.sleep(step.seconds)
            return None
        if isinstance(step, Pipelined):
            async with self.redis.pipeline(transaction=False) as pipe:
                for call in step.calls:
                    await self._queue(call, pipe)
                return await pipe.execute(raise_on_error=not step.errors_as_replies)
        if isinstance(step, Admit):
            return await self._admit(step.keys, step.args)
        return await self._call_by(step.due, *step.args)

    async def _queue(self, call: Command | Admit, pipe: aioredis.client.Pipeline) -> None:
        """Queue ``call`` on ``pipe``."""
        if isinstance(call, Admit):
            await self._admit(call.keys, call.args, client=pipe)
        else:
            pipe.execute_command(*call.args)

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
