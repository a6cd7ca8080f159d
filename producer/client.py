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
"""

from __future__ import annotations

import asyncio
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
    QUEUE_FULL_REPLY,
    ErrorCode,
    JobEnvelope,
    Keys,
    Lane,
    ResultEnvelope,
    new_request_id,
    owner_ttl_ms,
    parse_queue_bound,
    valid_request_id,
)

Result = ResultEnvelope

#: Longest single BLPOP; short enough that a dead connection is noticed and retried.
_WAIT_SLICE_S = 5.0
_RECONNECT_PAUSE_S = 0.2


class ResultTimeout(TimeoutError):
    """No result arrived within the time the caller was willing to wait."""

    def __init__(self, request_id: str, timeout_s: float) -> None:
        super().__init__(f"no result for {request_id} within {timeout_s:g}s")
        self.request_id = request_id


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


def _refused_bound(reply: object) -> int | None:
    """The bound named by the admission script's QUEUE_FULL error reply, else None."""
    if not isinstance(reply, redis.ResponseError):
        return None
    words = str(reply).split()
    if len(words) < 2 or words[0] != QUEUE_FULL_REPLY:
        return None
    return parse_queue_bound(words[1]) or 0


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
        """A validated job envelope (not yet sent); ``submit`` takes the same keywords."""
        if not isinstance(payload, bytes | bytearray | memoryview):
            raise TypeError("payload must be bytes")
        if len(payload) > self.max_payload_bytes:
            raise ValueError(f"payload of {len(payload)} bytes exceeds {self.max_payload_bytes}")
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
            elif isinstance(reply, redis.ResponseError) and str(reply) == DUPLICATE_REPLY:
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
        """Wait for the result of ``request_id``; raises ResultTimeout.

        Results are not consumed: reading again returns the same result until
        it expires.
        """
        keys = self.keys(model)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                data = self.redis.get(keys.result(request_id))
                if data is not None:
                    return ResultEnvelope.decode(data)  # type: ignore[arg-type]
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ResultTimeout(request_id, timeout_s)
                self.redis.blpop([keys.done(request_id)], timeout=min(remaining, _WAIT_SLICE_S))
            except (redis.ConnectionError, redis.TimeoutError):
                time.sleep(_RECONNECT_PAUSE_S)  # redis-py reconnects on the next call

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
        keys = self.keys(model)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                data = await self.redis.get(keys.result(request_id))
                if data is not None:
                    assert isinstance(data, bytes), "the client never decodes responses"
                    return ResultEnvelope.decode(data)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ResultTimeout(request_id, timeout_s)
                await self.redis.blpop([keys.done(request_id)],
                                       timeout=min(remaining, _WAIT_SLICE_S))
            except (redis.ConnectionError, redis.TimeoutError):
                await asyncio.sleep(_RECONNECT_PAUSE_S)

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
