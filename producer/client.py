"""Submit jobs and wait for their results: the client API, blocking and asyncio.

A job is one XADD to the model's lane stream. Its result is a msgpack string
key that the worker writes; the jobs a client submits name its reply list, where
the worker then pushes their request ids, and one reader per client and model
pops them in groups and hands every waiting call its result: many waits in one
process share one connection (NOTE [ Waiting in groups ] in ``replies.py``). Any
other id is awaited per request (``wait.py``). Because the result key is durable
(until its TTL), a connection that drops loses nothing: the client reconnects
and reads the key again.

Admission control: every submit runs the protocol's admission script (an atomic
check-and-XADD), so a lane with a bound in the model's limits hash refuses jobs
once its stream holds that many; the caller gets :class:`QueueFull` at once and
nothing is queued for the refused jobs. The same script refuses a request id that
another job still owns (:class:`DuplicateRequestId`), so submitting the same envelope
again after a lost reply is safe: the job is queued at most once.

``submit`` returns a handle (``handles.py``): the request id, as a ``str``, with its
``result``, ``status`` and ``cancel``. Status and cancel are one protocol script each
(NOTE [ Status and cancel ] in common/protocol/lifecycle.py).

Waiting honours its timeout whatever Redis does (see ``wait.py`` and ``replies.py``):
a Redis that is gone, restarting or hung ends it with ResultTimeout.

The logic is written once, without I/O, in ``core.py``, ``wait.py`` and ``replies.py``:
each operation is a generator of Redis calls (``calls.py``). :class:`Client` runs those
calls blocking and :class:`AsyncClient` awaits them (``runners.py``), each with its own
reply reader (``readers.py``); this module holds only the two faces. The errors live in
``errors.py`` and are re-exported here, where users import them from.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from typing import Any

from redbatch.common.config import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    DEFAULT_MODEL,
    DEFAULT_REDIS_URL,
    RedisSettings,
    default_of,
)
from redbatch.common.protocol import (
    DEFAULT_PREFIX,
    IDEMPOTENCY_WINDOW_MS,
    ErrorCode,
    JobCancelled,
    JobEnvelope,
    JobFailed,
    JobState,
    JobStatus,
    Lane,
    ProtocolError,
    RedbatchError,
    ResultEnvelope,
    WorkerRecord,
)
from redbatch.common.protocol.generation import CONTENT_TYPE, Chunk
from redbatch.common.redis_io import connect, connect_async, is_cluster
from redbatch.producer.core import ClientCore, QueueState, admitted_jobs
from redbatch.producer.errors import (
    DuplicateRequestId,
    FunctionsMissing,
    QueueFull,
    RedisRefusedCall,
    RedisUnreachable,
    ResultTimeout,
    ResultUnreadable,
)
from redbatch.producer.handles import AsyncJobHandle, JobHandle
from redbatch.producer.readers import ReaderTasks, ReaderThreads
from redbatch.producer.runners import AsyncInbox, AsyncRunner, BlockingRunner, SyncInbox, connected
from redbatch.producer.streaming import TokenReader, generation_payload

__all__ = ["AsyncClient", "AsyncJobHandle", "Client", "DuplicateRequestId", "FunctionsMissing",
           "JobCancelled", "JobFailed", "JobHandle", "JobState", "JobStatus", "ProtocolError",
           "QueueFull", "QueueState", "RedbatchError", "RedisRefusedCall", "RedisUnreachable",
           "Result", "ResultTimeout", "ResultUnreadable", "WorkerRecord"]

Result = ResultEnvelope
#: How long a call that is no wait (submit, status, cancel, workers, ...) may go unanswered
#: before it raises RedisUnreachable, s: the socket timeout (RedisSettings), for opening a
#: connection and for each reply. Waits end by their own timeout.
REDIS_TIMEOUT_S: float = default_of(RedisSettings, "socket_timeout_s")


class Client(ClientCore):
    """Blocking client.

    >>> c = Client("redis://localhost:6379/0")
    >>> job = c.submit(open("cat.jpg", "rb").read())
    >>> job.result(timeout_s=10).raise_for_error().output["label"]

    Every error a call raises is a RedbatchError. A wait (``result``, ``results``,
    ``as_completed``, ``predict``'s) ends by its ``timeout_s`` whatever Redis does, with
    ResultTimeout. Any other call raises RedisUnreachable when Redis refuses the connection
    or sends no reply within ``redis_timeout_s`` (twice that at worst when a connection
    must be opened too), and RedisRefusedCall when it answers with an error.
    """

    def __init__(self, redis_url: str = DEFAULT_REDIS_URL, *, model: str = DEFAULT_MODEL,
                 prefix: str = DEFAULT_PREFIX,
                 max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
                 redis_timeout_s: float = REDIS_TIMEOUT_S,
                 idempotency_window_s: float = IDEMPOTENCY_WINDOW_MS / 1000) -> None:
        super().__init__(redis_url, model, prefix, max_payload_bytes, idempotency_window_s)
        settings = RedisSettings(url=redis_url, socket_timeout_s=redis_timeout_s)
        self.redis = connected(connect, settings)
        self.one_slot_per_call = is_cluster(self.redis)
        self._run = BlockingRunner(self.redis).run
        self._readers = ReaderThreads(settings)

    def submit(self, payload: Any, *, model: str | None = None, timeout_s: float | None = None,
               lane: Lane | str = Lane.INTERACTIVE, params: Mapping[str, Any] | None = None,
               content_type: str | None = None, request_id: str | None = None) -> JobHandle:
        """Queue one job; returns its handle, which is its request id (a ``str``) with
        ``result()``, ``status()`` and ``cancel()``.

        ``payload``: bytes (sent as they are), a str (UTF-8), a numpy array (``.npy``) or
        a JSON value (dict, list, number, bool, None), each with its content type
        (``common/protocol/payloads.py``); ``content_type`` overrides the type.
        ``timeout_s`` sets the job's deadline: a worker that reaches it later
        answers ``expired`` instead of computing it. Raises :class:`QueueFull`, with
        nothing queued, when the lane is at its bound (see :meth:`set_queue_limit`), and
        :class:`DuplicateRequestId` when ``request_id`` belongs to another job.
        """
        job = self.job(payload, model=model, timeout_s=timeout_s, lane=lane, params=params,
                       content_type=content_type, request_id=request_id,
                       reply_to=self._reply_to(model))
        try:
            self._run(self._submit(job))
            return self._handle(job)
        finally:
            self._start_readers()

    def submit_many(self, payloads: Iterable[Any], **kw: Any) -> list[JobHandle]:
        """Queue many jobs in one pipelined round trip; same keywords as submit. Wait for
        them with :meth:`results` or :meth:`as_completed`.

        Raises :class:`QueueFull` if any job was refused; its ``accepted`` and
        ``refused`` say which were queued and which were not.
        """
        return self.submit_jobs(self._jobs(payloads, kw))

    def submit_jobs(self, jobs: Sequence[JobEnvelope]) -> list[JobHandle]:
        """Queue envelopes made by :meth:`job` in one pipelined round trip; returns their
        handles. Raises :class:`QueueFull` as :meth:`submit_many` does; the refused
        envelopes can be submitted again as they are. Envelopes keep their ``reply_to``:
        those naming none are awaited per request."""
        try:
            admitted = self._run(self._submit_jobs(jobs))
        finally:
            self._start_readers()
        return [self._handle(job) for job in admitted_jobs(jobs, admitted)]

    def partitions(self, model: str | None = None) -> tuple[int, ...]:
        """The model's partition history, oldest count first; the last is its count now
        (PROTOCOL.md "Partitions"; read again when older than 5 s)."""
        return self._run(self._history(model))

    def status(self, request_id: str, *, model: str | None = None) -> JobStatus:
        """Where the job is: ``state`` is queued, running (taken by a worker: ``worker``
        and ``deliveries`` say which and how often), done, failed, cancelled or unknown,
        with ``result`` once answered. Read from what Redis holds, in one call, writing
        nothing (PROTOCOL.md "Job status"). Raises ResultUnreadable when the result key
        holds something that is not a result."""
        return self._run(self._status(request_id, model))

    def cancel(self, request_id: str, *, model: str | None = None) -> bool:
        """Cancel the job unless a worker has taken it. True: it was queued, it will never
        run, and a worker answers it ``cancelled`` (interactive lane, served first): its
        waiters get that result, and ``raise_for_error()`` raises JobCancelled. False: a
        worker has taken it and it runs to its own answer (a taken job cannot be called
        back), or Redis knows no queued job of that id. Cancelling twice is True twice."""
        return self._run(self._cancel(request_id, model))

    def _handle(self, job: JobEnvelope) -> JobHandle:
        return JobHandle(job.request_id, self, job.model, Lane(job.lane))

    def set_queue_limit(self, lane: Lane | str, max_jobs: int | None, *,
                        model: str | None = None) -> None:
        """Bound the lane's queue to ``max_jobs`` entries (queued or in progress) for every
        client that submits through the admission script; None removes the bound."""
        self._run(self._set_queue_limit(lane, max_jobs, model))

    def set_token_limit(self, lane: Lane | str, max_tokens: int | None, *,
                        model: str | None = None) -> None:
        """Bound what the lane's queued generation jobs may be charged, in tokens (each
        job: its payload's bytes plus its max_new_tokens; PROTOCOL.md "Admission control")
        for every client that submits through the admission function; None removes it."""
        self._run(self._set_queue_limit(lane, max_tokens, model, tokens=True))

    def queue_state(self, lane: Lane | str, *, model: str | None = None) -> QueueState:
        """The lane's current backlog and bounds."""
        return self._run(self._queue_state(lane, model))

    def workers(self, *, model: str | None = None) -> list[WorkerRecord]:
        """The model's live workers, from their heartbeats (each record: consumer, host,
        pid, device, largest batch, jobs in flight, ...); one missed for about 6 s is gone."""
        return self._run(self._workers(model))

    def is_ready(self, *, model: str | None = None) -> bool:
        """Whether a live worker serves the model, so that a job submitted now is run."""
        return bool(self.workers(model=model))

    def result(self, request_id: str, timeout_s: float = 30.0, *,
               model: str | None = None) -> ResultEnvelope:
        """Wait for the result of ``request_id``, ``timeout_s`` seconds at most.

        An id this client submitted is awaited on its reply list, with every other wait
        of the process (see ``replies.py``); any other id per request (``wait.py``).
        Raises ResultTimeout by then (about 0.2 s later at worst) whatever Redis does:
        an unreachable, restarting or hung Redis is retried until the deadline. (One
        exception, per request only: opening a new connection to a Redis that accepts it
        but never answers, a stopped process, takes up to the socket timeout, 10 s:
        redis-py's handshake knows no deadline. The asyncio client has none.) A done
        key or reply list of another type does not end the wait: the result key is
        polled instead. Raises ResultUnreadable when the result key holds no result
        envelope. Results are not consumed: reading again returns the same result until
        it expires.
        """
        return self.results([request_id], timeout_s, model=model)[0]

    def results(self, request_ids: Sequence[str], timeout_s: float = 30.0, *,
                model: str | None = None) -> list[ResultEnvelope]:
        """Wait for the results of ``request_ids`` (of one model), ``timeout_s`` seconds at
        most for all of them; returns them in the order of ``request_ids``. Raises as
        :meth:`result` does; ResultTimeout names one of the ids still missing (use
        :meth:`as_completed` to keep the results that came)."""
        got = dict(self._gather(request_ids, timeout_s, model))
        return [got[rid] for rid in request_ids]

    def as_completed(self, request_ids: Sequence[str], timeout_s: float = 30.0, *,
                     model: str | None = None) -> Iterator[ResultEnvelope]:
        """Yield the results of ``request_ids`` (of one model), each id once, in the order
        they finish; ``timeout_s`` seconds at most for all. Results already there come
        first; ids this client did not submit come last, one by one. Raises as
        :meth:`result` does, at the result concerned."""
        for _, result in self._gather(request_ids, timeout_s, model):
            yield result

    def predict(self, payload: Any, *, timeout_s: float = 30.0, raise_on_error: bool = False,
                **kw: Any) -> ResultEnvelope:
        """Submit and wait; the job's deadline is the same ``timeout_s``. An error result
        comes back as a value, or with ``raise_on_error`` raises JobFailed (as
        ``raise_for_error()`` on the result does)."""
        request_id = self.submit(payload, timeout_s=timeout_s, **kw)
        result = self.result(request_id, timeout_s, model=kw.get("model"))
        return result.raise_for_error() if raise_on_error else result

    def generate(self, prompt: str | None = None, *, timeout_s: float = 120.0,
                 model: str | None = None, **options: Any) -> str:
        """Submit a generation job and wait for its whole answer; returns the text.
        ``prompt`` (raw text) or ``messages=[{"role": ..., "content": ...}]`` (a chat);
        ``options``: ``max_new_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``,
        ``lane`` (PROTOCOL.md "Generation"). An error result raises JobFailed."""
        rid = self.submit(_generation(prompt, options), content_type=CONTENT_TYPE,
                          model=model, timeout_s=timeout_s, **_lane(options))
        return str(self.result(rid, timeout_s, model=model).raise_for_error().output["text"])

    def stream(self, prompt: str | None = None, *, timeout_s: float = 120.0,
               model: str | None = None, **options: Any) -> Iterator[str]:
        """As :meth:`generate`, yielding the answer's text as it comes (never half a
        character). Reads the job's token stream on from the last chunk it saw, so a
        dropped connection loses and repeats nothing (``producer/streaming.py``)."""
        rid = self.submit(_generation(prompt, options), content_type=CONTENT_TYPE,
                          model=model, timeout_s=timeout_s, **_lane(options))
        reader = TokenReader(self.placed_keys(rid, model), rid, timeout_s)
        last = None
        while not reader.done:
            for last in self._run(reader.next()):
                if last.text:
                    yield last.text
        if last is not None and last.finish == "error":
            self.result(rid, timeout_s, model=model).raise_for_error()

    def stop(self, request_id: str, *, model: str | None = None) -> bool:
        """Stop a generation job wherever it is, from any process: a running one ends at
        its worker's next step, its result ``ok`` with the text so far and
        ``finish_reason`` ``cancelled``; a queued one is cancelled as by :meth:`cancel`
        (True: it will never run)."""
        return self._run(self._stop(request_id, model))

    def chunks(self, request_id: str, *, after: int = 0, timeout_s: float = 120.0,
               model: str | None = None) -> Iterator[Chunk]:
        """The token stream of a generation job, whoever submitted it, from the chunk
        after index ``after`` (0: the first): each chunk once, in order, until the one
        with ``finish``. To resume what another process read, pass the last index it saw."""
        keys = self._run(self._token_keys(request_id, model))
        reader = TokenReader(keys, request_id, timeout_s, after=f"0-{after}")
        while not reader.done:
            yield from self._run(reader.next())

    def close(self) -> None:
        """Stop the reply readers and close the client's connections."""
        self._readers.stop()
        self.redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start_readers(self) -> None:
        """Start the reader of each reply list the client named that has none yet."""
        if len(self._readers) == len(self.reply_waits):
            return
        for tag, waits in list(self.reply_waits.items()):
            self._readers.start(tag, waits)

    def _gather(self, request_ids: Sequence[str], timeout_s: float,
                model: str | None) -> Iterator[tuple[str, ResultEnvelope]]:
        """``(request_id, result)`` pairs as they come (see replies.Gathering)."""
        deadline = time.monotonic() + timeout_s
        self._run(self._wait_history(model, request_ids, timeout_s, deadline))
        gathering = self._gathering(request_ids, timeout_s, model, SyncInbox(), deadline)
        try:
            while (got := self._run(gathering.next())) is not None:
                yield got
        finally:
            gathering.close()


class AsyncClient(ClientCore):
    """The asyncio twin of :class:`Client`, with the same methods as coroutines."""

    def __init__(self, redis_url: str = DEFAULT_REDIS_URL, *, model: str = DEFAULT_MODEL,
                 prefix: str = DEFAULT_PREFIX,
                 max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
                 redis_timeout_s: float = REDIS_TIMEOUT_S,
                 idempotency_window_s: float = IDEMPOTENCY_WINDOW_MS / 1000) -> None:
        super().__init__(redis_url, model, prefix, max_payload_bytes, idempotency_window_s)
        settings = RedisSettings(url=redis_url, socket_timeout_s=redis_timeout_s)
        self.redis = connected(connect_async, settings)
        self.one_slot_per_call = is_cluster(self.redis)
        self._run = AsyncRunner(self.redis).run
        self._readers = ReaderTasks(settings)

    async def submit(self, payload: Any, *, model: str | None = None,
                     timeout_s: float | None = None, lane: Lane | str = Lane.INTERACTIVE,
                     params: Mapping[str, Any] | None = None, content_type: str | None = None,
                     request_id: str | None = None) -> AsyncJobHandle:
        """As :meth:`Client.submit`; the handle's methods are coroutines, and
        ``await handle`` is its result."""
        job = self.job(payload, model=model, timeout_s=timeout_s, lane=lane, params=params,
                       content_type=content_type, request_id=request_id,
                       reply_to=self._reply_to(model))
        try:
            await self._run(self._submit(job))
            return self._handle(job)
        finally:
            self._start_readers()

    async def submit_many(self, payloads: Iterable[Any], **kw: Any) -> list[AsyncJobHandle]:
        """As :meth:`Client.submit_many`."""
        return await self.submit_jobs(self._jobs(payloads, kw))

    async def submit_jobs(self, jobs: Sequence[JobEnvelope]) -> list[AsyncJobHandle]:
        """As :meth:`Client.submit_jobs`."""
        try:
            admitted = await self._run(self._submit_jobs(jobs))
        finally:
            self._start_readers()
        return [self._handle(job) for job in admitted_jobs(jobs, admitted)]

    async def partitions(self, model: str | None = None) -> tuple[int, ...]:
        """As :meth:`Client.partitions`."""
        return await self._run(self._history(model))

    async def status(self, request_id: str, *, model: str | None = None) -> JobStatus:
        """As :meth:`Client.status`."""
        return await self._run(self._status(request_id, model))

    async def cancel(self, request_id: str, *, model: str | None = None) -> bool:
        """As :meth:`Client.cancel`."""
        return await self._run(self._cancel(request_id, model))

    def _handle(self, job: JobEnvelope) -> AsyncJobHandle:
        return AsyncJobHandle(job.request_id, self, job.model, Lane(job.lane))

    async def set_queue_limit(self, lane: Lane | str, max_jobs: int | None, *,
                              model: str | None = None) -> None:
        """As :meth:`Client.set_queue_limit`."""
        await self._run(self._set_queue_limit(lane, max_jobs, model))

    async def set_token_limit(self, lane: Lane | str, max_tokens: int | None, *,
                              model: str | None = None) -> None:
        """As :meth:`Client.set_token_limit`."""
        await self._run(self._set_queue_limit(lane, max_tokens, model, tokens=True))

    async def queue_state(self, lane: Lane | str, *, model: str | None = None) -> QueueState:
        """As :meth:`Client.queue_state`."""
        return await self._run(self._queue_state(lane, model))

    async def workers(self, *, model: str | None = None) -> list[WorkerRecord]:
        """As :meth:`Client.workers`."""
        return await self._run(self._workers(model))

    async def is_ready(self, *, model: str | None = None) -> bool:
        """As :meth:`Client.is_ready`."""
        return bool(await self.workers(model=model))

    async def result(self, request_id: str, timeout_s: float = 30.0, *,
                     model: str | None = None) -> ResultEnvelope:
        """As :meth:`Client.result`: the result, ResultTimeout by ``timeout_s`` whatever
        Redis does, or ResultUnreadable."""
        return (await self.results([request_id], timeout_s, model=model))[0]

    async def results(self, request_ids: Sequence[str], timeout_s: float = 30.0, *,
                      model: str | None = None) -> list[ResultEnvelope]:
        """As :meth:`Client.results`."""
        got = {rid: result async for rid, result in self._gather(request_ids, timeout_s, model)}
        return [got[rid] for rid in request_ids]

    async def as_completed(self, request_ids: Sequence[str], timeout_s: float = 30.0, *,
                           model: str | None = None) -> AsyncIterator[ResultEnvelope]:
        """As :meth:`Client.as_completed`, an async iterator."""
        async for _, result in self._gather(request_ids, timeout_s, model):
            yield result

    async def predict(self, payload: Any, *, timeout_s: float = 30.0,
                      raise_on_error: bool = False, **kw: Any) -> ResultEnvelope:
        """As :meth:`Client.predict`."""
        request_id = await self.submit(payload, timeout_s=timeout_s, **kw)
        result = await self.result(request_id, timeout_s, model=kw.get("model"))
        return result.raise_for_error() if raise_on_error else result

    async def generate(self, prompt: str | None = None, *, timeout_s: float = 120.0,
                       model: str | None = None, **options: Any) -> str:
        """As :meth:`Client.generate`."""
        rid = await self.submit(_generation(prompt, options), content_type=CONTENT_TYPE,
                                model=model, timeout_s=timeout_s, **_lane(options))
        result = await self.result(rid, timeout_s, model=model)
        return str(result.raise_for_error().output["text"])

    async def stream(self, prompt: str | None = None, *, timeout_s: float = 120.0,
                     model: str | None = None, **options: Any) -> AsyncIterator[str]:
        """As :meth:`Client.stream`."""
        rid = await self.submit(_generation(prompt, options), content_type=CONTENT_TYPE,
                                model=model, timeout_s=timeout_s, **_lane(options))
        reader = TokenReader(self.placed_keys(rid, model), rid, timeout_s)
        last = None
        while not reader.done:
            for last in await self._run(reader.next()):
                if last.text:
                    yield last.text
        if last is not None and last.finish == "error":
            (await self.result(rid, timeout_s, model=model)).raise_for_error()

    async def stop(self, request_id: str, *, model: str | None = None) -> bool:
        """As :meth:`Client.stop`."""
        return await self._run(self._stop(request_id, model))

    async def chunks(self, request_id: str, *, after: int = 0, timeout_s: float = 120.0,
                     model: str | None = None) -> AsyncIterator[Chunk]:
        """As :meth:`Client.chunks`."""
        keys = await self._run(self._token_keys(request_id, model))
        reader = TokenReader(keys, request_id, timeout_s, after=f"0-{after}")
        while not reader.done:
            for chunk in await self._run(reader.next()):
                yield chunk

    async def close(self) -> None:
        """Cancel the reply readers and close the client's connections."""
        await self._readers.stop()
        await self.redis.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _start_readers(self) -> None:
        """Start the reader task of each reply list the client named that has none on this
        event loop (a task of a loop that ended is replaced)."""
        for tag, waits in list(self.reply_waits.items()):
            self._readers.start(tag, waits)

    async def _gather(self, request_ids: Sequence[str], timeout_s: float,
                      model: str | None) -> AsyncIterator[tuple[str, ResultEnvelope]]:
        """As :meth:`Client._gather`."""
        deadline = time.monotonic() + timeout_s
        await self._run(self._wait_history(model, request_ids, timeout_s, deadline))
        gathering = self._gathering(request_ids, timeout_s, model, AsyncInbox(), deadline)
        try:
            while (got := await self._run(gathering.next())) is not None:
                yield got
        finally:
            gathering.close()


def _lane(options: dict[str, Any]) -> dict[str, Any]:
    """The ``lane`` of a generation call's options, taken out of them."""
    return {"lane": options.pop("lane")} if "lane" in options else {}


def _generation(prompt: str | None, options: dict[str, Any]) -> bytes:
    """The payload of a generation job, for ``submit`` (its content type is JSON)."""
    messages = options.pop("messages", None)
    known = {"max_new_tokens", "temperature", "top_p", "seed", "stop"}
    if set(options) - known - {"lane"}:
        raise ProtocolError(ErrorCode.BAD_INPUT,
                            f"unknown options {sorted(set(options) - known - {'lane'})}")
    return generation_payload(prompt, messages, options.get("max_new_tokens", 128),
                              options.get("temperature", 0.0), options.get("top_p", 1.0),
                              options.get("seed"), options.get("stop", ()))
