"""Submit jobs and wait for their results: the client API (sync and asyncio).

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

Waiting honours its timeout whatever Redis does: every call of a wait has a due time
(see ``_Wait``), so a Redis that is gone, restarting or hung ends it with ResultTimeout.

The module holds the blocking client and its asyncio twin side by side (about 550 lines)
so that the two stay alike method for method; what they share lives in ``_Base``/``_Wait``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis
from redbatch.common.config import DEFAULT_MAX_PAYLOAD_BYTES, DEFAULT_MODEL, DEFAULT_REDIS_URL
from redbatch.common.protocol import (
    ADMIT_SCRIPT,
    DEFAULT_PREFIX,
    DUPLICATE_REPLY,
    MAX_CONTENT_TYPE_BYTES,
    QUEUE_FULL_REPLY,
    ErrorCode,
    JobEnvelope,
    Keys,
    Lane,
    ProtocolError,
    ResultEnvelope,
    error_reply_code,
    new_request_id,
    owner_ttl_ms,
    parse_queue_bound,
    valid_request_id,
)

Result = ResultEnvelope
logger = logging.getLogger(__name__)

#: Longest single BLPOP; short enough that a dead connection is noticed and retried.
_WAIT_SLICE_S = 5.0
_RECONNECT_PAUSE_S = 0.2
#: GET interval while the done key cannot be BLPOPped (it holds another type).
_POLL_S = 0.25
#: Shortest BLPOP sent: Redis reads a timeout under 1 ms as 0, which blocks forever.
_MIN_BLPOP_S = 0.01
#: A reply is always allowed this long, even at the deadline (one GET at timeout_s=0).
_MIN_REPLY_S = 0.2


class ResultTimeout(TimeoutError):
    """No result arrived within the time the caller was willing to wait."""

    def __init__(self, request_id: str, timeout_s: float) -> None:
        super().__init__(f"no result for {request_id} within {timeout_s:g}s")
        self.request_id = request_id


class ResultUnreadable(ProtocolError):
    """The result key of ``request_id`` holds something that is not a result envelope:
    a key of another type (WRONGTYPE), or bytes that do not decode. Someone wrote it by
    hand; the job's own answer cannot be read there. ``key`` names it."""

    def __init__(self, request_id: str, key: str, why: str) -> None:
        super().__init__(ErrorCode.BAD_ENVELOPE, f"{key} holds no result envelope: {why}",
                         request_id)
        self.key = key


class QueueFull(Exception):
    """Admission control refused jobs: their lane's queue is at its bound.

    Refused jobs were not queued (nothing was dropped silently); submit them again
    later. ``refused`` holds their request ids in submission order; ``accepted``
    the ids of the jobs of the same call that were queued (always empty for
    ``submit``). ``lane``, ``model`` and ``bound`` describe the first refusal.
    """

    code = ErrorCode.QUEUE_FULL

    def __init__(self, model: str, lane: Lane, bound: int, refused: list[str],
                 accepted: list[str] | None = None) -> None:
        self.model = model
        self.lane = lane
        self.bound = bound
        self.refused = refused
        self.accepted = accepted or []
        #: Ids of the same call refused because they were in use (see DuplicateRequestId).
        self.duplicates: list[str] = []
        self.message = (f"the {lane.value} queue of model {model!r} is at its bound of "
                        f"{bound} jobs; submit again later")
        if self.accepted:
            self.message += (f" ({len(refused)} of {len(refused) + len(self.accepted)} jobs "
                             f"refused, {len(self.accepted)} queued)")
        elif len(refused) > 1:
            self.message += f" ({len(refused)} jobs refused)"
        super().__init__(f"{self.code.value}: {self.message}")


class DuplicateRequestId(Exception):
    """Refused at submit: these request ids belong to jobs already queued, running, or
    with a result that has not expired. Nothing was queued for them. ``accepted`` holds
    the ids of the jobs of the same call that were queued."""

    code = ErrorCode.DUPLICATE_REQUEST_ID

    def __init__(self, duplicates: list[str], accepted: list[str] | None = None) -> None:
        self.duplicates = duplicates
        self.accepted = accepted or []
        self.message = (f"request id {duplicates[0]!r} is already in use"
                        + (f" (and {len(duplicates) - 1} more)" if len(duplicates) > 1 else ""))
        super().__init__(f"{self.code.value}: {self.message}")


@dataclass(frozen=True, slots=True)
class QueueState:
    """One lane's queue: entries in its stream (queued or in progress) and its bound."""

    lane: Lane
    queued: int
    #: Most entries admitted; None: unbounded.
    bound: int | None

    @property
    def room(self) -> int | None:
        """Jobs that would be admitted now (absent other producers); None: unbounded."""
        return None if self.bound is None else max(0, self.bound - self.queued)


def _reply_code(reply: object) -> str | None:
    """The code (first word) of an admission error reply, None for any other reply."""
    return error_reply_code(str(reply)) if isinstance(reply, redis.ResponseError) else None


def _refused_bound(reply: object) -> int | None:
    """The bound named by the admission script's ``QUEUE_FULL <bound>`` reply, else None."""
    if _reply_code(reply) != QUEUE_FULL_REPLY:
        return None
    words = str(reply).split()
    return (parse_queue_bound(words[1]) if len(words) > 1 else None) or 0


@dataclass(slots=True)
class _Wait:
    """The clock and keys of one result wait, shared by both clients' ``result``."""

    request_id: str
    keys: Keys
    timeout_s: float
    deadline: float = 0.0
    """Monotonic time the wait ends."""
    blpop: bool = True
    """False once BLPOP on the done key failed (it holds another type): poll GET instead."""

    def __post_init__(self) -> None:
        self.deadline = time.monotonic() + self.timeout_s

    @property
    def result_key(self) -> str:
        return self.keys.result(self.request_id)

    @property
    def done_key(self) -> str:
        return self.keys.done(self.request_id)

    def reply_by(self, blocking_s: float = 0.0) -> float:
        """Monotonic time by which a call that blocks ``blocking_s`` must be answered: the
        deadline, or _MIN_REPLY_S after the call would return if that is later."""
        return max(self.deadline, time.monotonic() + blocking_s + _MIN_REPLY_S)

    def pause_s(self, longest: float) -> float:
        """Seconds to block or sleep before the next GET, ``longest`` at most; raises
        ResultTimeout once the deadline has passed."""
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise ResultTimeout(self.request_id, self.timeout_s)
        return max(_MIN_BLPOP_S, min(remaining, longest))

    def decode(self, data: object) -> ResultEnvelope:
        """The result envelope a GET returned; raises ResultUnreadable."""
        if not isinstance(data, bytes):
            raise ResultUnreadable(self.request_id, self.result_key, repr(data)[:80])
        try:
            return ResultEnvelope.decode(data)
        except ProtocolError as e:
            raise ResultUnreadable(self.request_id, self.result_key, e.message) from e

    def unreadable(self, e: redis.ResponseError) -> ResultUnreadable | None:
        """ResultUnreadable when a GET's error reply says the result key holds another
        type; None for other errors (NOPERM, ...), which the caller raises as they are."""
        if str(e).startswith("WRONGTYPE"):
            return ResultUnreadable(self.request_id, self.result_key, str(e))
        return None

    def no_blpop(self, e: redis.ResponseError) -> None:
        """BLPOP on the done key failed with ``e``: poll the result key from now on."""
        logger.warning("cannot BLPOP %s (%s); polling %s every %g s instead", self.done_key,
                       str(e)[:100], self.result_key, _POLL_S)
        self.blpop = False


class _Base:
    """What the sync and async clients share: settings, keys and envelopes."""

    def __init__(self, redis_url: str, model: str, prefix: str, max_payload_bytes: int) -> None:
        self.redis_url = redis_url
        self.model = model
        self.prefix = prefix
        self.max_payload_bytes = max_payload_bytes

    def keys(self, model: str | None = None) -> Keys:
        return Keys(model or self.model, self.prefix)

    def job(self, payload: bytes, *, model: str | None = None, timeout_s: float | None = None,
            lane: Lane | str = Lane.INTERACTIVE, params: Mapping[str, Any] | None = None,
            content_type: str = "application/octet-stream", request_id: str | None = None,
            reply_to: str | None = None) -> JobEnvelope:
        """A validated job envelope (not yet sent); ``submit`` takes the same keywords.
        Raises TypeError or ValueError for what a worker would refuse unread."""
        if not isinstance(payload, bytes | bytearray | memoryview):
            raise TypeError("payload must be bytes")
        if len(payload) > self.max_payload_bytes:
            raise ValueError(f"payload of {len(payload)} bytes exceeds {self.max_payload_bytes}")
        if len(content_type.encode()) > MAX_CONTENT_TYPE_BYTES:
            raise ValueError(f"content_type longer than {MAX_CONTENT_TYPE_BYTES} bytes")
        if any(not isinstance(key, str) for key in params or {}):
            raise TypeError("params keys must be str")
        request_id = request_id or new_request_id()
        if not valid_request_id(request_id):
            raise ValueError(f"invalid request id {request_id!r}")
        now_ms = int(time.time() * 1000)
        deadline = None if timeout_s is None else now_ms + int(timeout_s * 1000)
        return JobEnvelope(request_id=request_id, model=self.keys(model).model,
                           payload=bytes(payload), content_type=content_type,
                           submitted_ms=now_ms, deadline_ms=deadline, lane=Lane(lane),
                           params=dict(params or {}), reply_to=reply_to)


    def _admit_args(self, job: JobEnvelope) -> tuple[list[str], list[bytes | str | int]]:
        """KEYS and ARGV of the admission script for one job."""
        keys = self.keys(job.model)
        fields = [x for name, value in job.encode().items() for x in (name, value)]
        return ([keys.stream(job.lane), keys.limits(), keys.owner(job.request_id)],
                [Lane(job.lane).value, owner_ttl_ms(job.budget_ms), *fields])

    def _admitted(self, jobs: Sequence[JobEnvelope], replies: Sequence[object]) -> list[str]:
        """Request ids of the admitted jobs; raises QueueFull naming the refused ones (its
        ``duplicates`` lists ids refused as in use), DuplicateRequestId when only ids in
        use were refused, or the first other error a reply holds."""
        accepted, refused, duplicates = [], [], []
        first: tuple[JobEnvelope, int] | None = None
        for job, reply in zip(jobs, replies, strict=True):
            bound = _refused_bound(reply)
            if bound is not None:
                refused.append(job.request_id)
                first = first or (job, bound)
            elif _reply_code(reply) == DUPLICATE_REPLY:
                duplicates.append(job.request_id)
            elif isinstance(reply, BaseException):
                raise reply
            else:
                accepted.append(job.request_id)
        if first is not None:
            job, bound = first
            full = QueueFull(job.model, Lane(job.lane), bound, refused, accepted)
            full.duplicates = duplicates
            raise full
        if duplicates:
            raise DuplicateRequestId(duplicates, accepted)
        return accepted

    def _limit_value(self, lane: Lane | str, max_jobs: int | None) -> tuple[str, int | None]:
        if max_jobs is not None and (isinstance(max_jobs, bool) or max_jobs < 0):
            raise ValueError(f"max_jobs must be a non-negative int or None, not {max_jobs!r}")
        return Lane(lane).value, max_jobs

    def _jobs(self, payloads: Iterable[bytes], kw: Mapping[str, Any]) -> list[JobEnvelope]:
        """Envelopes for submit_many: the keywords of submit, shared by every payload."""
        return [self.job(p, model=kw.get("model"), timeout_s=kw.get("timeout_s"),
                          lane=kw.get("lane", Lane.INTERACTIVE), params=kw.get("params"),
                          content_type=kw.get("content_type", "application/octet-stream"),
                          request_id=None) for p in payloads]


class Client(_Base):
    """Blocking client.

    >>> c = Client("redis://localhost:6379/0")
    >>> rid = c.submit(open("cat.jpg", "rb").read())
    >>> c.result(rid, timeout_s=10).output["label"]
    """

    def __init__(self, redis_url: str = DEFAULT_REDIS_URL, *, model: str = DEFAULT_MODEL,
                 prefix: str = DEFAULT_PREFIX,
                 max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> None:
        super().__init__(redis_url, model, prefix, max_payload_bytes)
        self.redis = redis.Redis.from_url(redis_url, socket_timeout=_WAIT_SLICE_S + 5)
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
        keys, args = self._admit_args(job)
        try:
            self._admit(keys, args)
        except redis.ResponseError as e:
            self._admitted([job], [e])
            raise
        return job.request_id

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
        if not jobs:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for job in jobs:
            keys, args = self._admit_args(job)
            self._admit(keys, args, client=pipe)
        return self._admitted(jobs, pipe.execute(raise_on_error=False))

    def set_queue_limit(self, lane: Lane | str, max_jobs: int | None, *,
                        model: str | None = None) -> None:
        """Bound the lane's queue to ``max_jobs`` entries (queued or in progress) for every
        client that submits through the admission script; None removes the bound."""
        field, value = self._limit_value(lane, max_jobs)
        if value is None:
            self.redis.hdel(self.keys(model).limits(), field)
        else:
            self.redis.hset(self.keys(model).limits(), field, value)

    def queue_state(self, lane: Lane | str, *, model: str | None = None) -> QueueState:
        """The lane's current backlog and bound."""
        keys = self.keys(model)
        pipe = self.redis.pipeline(transaction=False)
        pipe.xlen(keys.stream(Lane(lane)))
        pipe.hget(keys.limits(), Lane(lane).value)
        queued, raw = pipe.execute()
        return QueueState(Lane(lane), int(queued), parse_queue_bound(raw))

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
        wait = _Wait(request_id, self.keys(model), timeout_s)
        while True:
            try:
                data = self._get_result(wait)
                if data is not None:
                    return wait.decode(data)
                if wait.blpop:
                    self._block(wait)
                else:
                    time.sleep(wait.pause_s(_POLL_S))
            except (redis.ConnectionError, redis.TimeoutError):
                # redis-py reconnects on the next call; raises ResultTimeout when due.
                time.sleep(wait.pause_s(_RECONNECT_PAUSE_S))

    def _get_result(self, wait: _Wait) -> object:
        try:
            return self._call_by(wait.reply_by(), "GET", wait.result_key)
        except redis.ResponseError as e:
            if (unreadable := wait.unreadable(e)) is None:
                raise
            raise unreadable from e

    def _block(self, wait: _Wait) -> None:
        """BLPOP the done key until the next slice ends; polling from now on if it fails."""
        seconds = wait.pause_s(_WAIT_SLICE_S)
        try:
            self._call_by(wait.reply_by(seconds), "BLPOP", wait.done_key, round(seconds, 3))
        except redis.ResponseError as e:
            wait.no_blpop(e)

    def _call_by(self, by: float, *args: Any) -> Any:
        """Run one command on a pooled connection; its reply is due by ``by`` (monotonic s).

        Raises redis.TimeoutError when it is late, after dropping the connection so that a
        late reply never meets another command; other Redis errors as they come."""
        pool = self.redis.connection_pool
        conn = pool.get_connection()
        try:
            conn.send_command(*args)  # type: ignore[no-untyped-call]  # untyped in redis-py
            if not conn.can_read(timeout=max(0.0, by - time.monotonic())):
                conn.disconnect()  # type: ignore[no-untyped-call]
                raise redis.TimeoutError(f"no reply to {args[0]} in time")
            return conn.read_response()
        finally:
            pool.release(conn)

    def predict(self, payload: bytes, *, timeout_s: float = 30.0, **kw: Any) -> ResultEnvelope:
        """Submit and wait; the job's deadline is the same ``timeout_s``."""
        request_id = self.submit(payload, timeout_s=timeout_s, **kw)
        return self.result(request_id, timeout_s, model=kw.get("model"))

    def close(self) -> None:
        self.redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_Base):
    """The asyncio twin of :class:`Client`, with the same methods as coroutines."""

    def __init__(self, redis_url: str = DEFAULT_REDIS_URL, *, model: str = DEFAULT_MODEL,
                 prefix: str = DEFAULT_PREFIX,
                 max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> None:
        super().__init__(redis_url, model, prefix, max_payload_bytes)
        self.redis = aioredis.Redis.from_url(redis_url, socket_timeout=_WAIT_SLICE_S + 5)
        self._admit = self.redis.register_script(ADMIT_SCRIPT)

    async def submit(self, payload: bytes, *, model: str | None = None,
                     timeout_s: float | None = None, lane: Lane | str = Lane.INTERACTIVE,
                     params: Mapping[str, Any] | None = None,
                     content_type: str = "application/octet-stream",
                     request_id: str | None = None) -> str:
        job = self.job(payload, model=model, timeout_s=timeout_s, lane=lane, params=params,
                       content_type=content_type, request_id=request_id)
        keys, args = self._admit_args(job)
        try:
            await self._admit(keys, args)
        except redis.ResponseError as e:
            self._admitted([job], [e])
            raise
        return job.request_id

    async def submit_many(self, payloads: Iterable[bytes], **kw: Any) -> list[str]:
        return await self.submit_jobs(self._jobs(payloads, kw))

    async def submit_jobs(self, jobs: Sequence[JobEnvelope]) -> list[str]:
        if not jobs:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for job in jobs:
                keys, args = self._admit_args(job)
                await self._admit(keys, args, client=pipe)
            replies = await pipe.execute(raise_on_error=False)
        return self._admitted(jobs, replies)

    async def set_queue_limit(self, lane: Lane | str, max_jobs: int | None, *,
                              model: str | None = None) -> None:
        field, value = self._limit_value(lane, max_jobs)
        if value is None:
            await self.redis.hdel(self.keys(model).limits(), field)
        else:
            await self.redis.hset(self.keys(model).limits(), field, value)

    async def queue_state(self, lane: Lane | str, *, model: str | None = None) -> QueueState:
        keys = self.keys(model)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xlen(keys.stream(Lane(lane)))
            pipe.hget(keys.limits(), Lane(lane).value)
            queued, raw = await pipe.execute()
        return QueueState(Lane(lane), int(queued), parse_queue_bound(raw))

    async def result(self, request_id: str, timeout_s: float = 30.0, *,
                     model: str | None = None) -> ResultEnvelope:
        """As :meth:`Client.result`: the result, ResultTimeout by ``timeout_s`` whatever
        Redis does, or ResultUnreadable."""
        wait = _Wait(request_id, self.keys(model), timeout_s)
        while True:
            try:
                data = await self._get_result(wait)
                if data is not None:
                    return wait.decode(data)
                if wait.blpop:
                    await self._block(wait)
                else:
                    await asyncio.sleep(wait.pause_s(_POLL_S))
            except (redis.ConnectionError, redis.TimeoutError):
                await asyncio.sleep(wait.pause_s(_RECONNECT_PAUSE_S))

    async def _get_result(self, wait: _Wait) -> object:
        try:
            return await self._call_by(wait.reply_by(), "GET", wait.result_key)
        except redis.ResponseError as e:
            if (unreadable := wait.unreadable(e)) is None:
                raise
            raise unreadable from e

    async def _block(self, wait: _Wait) -> None:
        seconds = wait.pause_s(_WAIT_SLICE_S)
        try:
            await self._call_by(wait.reply_by(seconds), "BLPOP", wait.done_key,
                                round(seconds, 3))
        except redis.ResponseError as e:
            wait.no_blpop(e)

    async def _call_by(self, by: float, *args: Any) -> Any:
        """One command whose reply is due by ``by`` (monotonic s); raises redis.TimeoutError
        when it is late (redis-py drops a connection whose command was cancelled)."""
        try:
            return await asyncio.wait_for(
                self.redis.execute_command(*args),  # type: ignore[no-untyped-call]
                max(0.0, by - time.monotonic()))
        except TimeoutError as e:
            raise redis.TimeoutError(f"no reply to {args[0]} in time") from e

    async def predict(self, payload: bytes, *, timeout_s: float = 30.0,
                      **kw: Any) -> ResultEnvelope:
        request_id = await self.submit(payload, timeout_s=timeout_s, **kw)
        return await self.result(request_id, timeout_s, model=kw.get("model"))

    async def close(self) -> None:
        await self.redis.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
