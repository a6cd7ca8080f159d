"""Submit jobs and wait for their results: the client API (sync and asyncio).

A job is one XADD to the model's lane stream. Its result is a msgpack string
key that the worker writes together with one token pushed onto a per-request
"done" list; the client waits with BLPOP on that list and then reads the key.
Because the result key is durable (until its TTL), a waiting connection that
drops loses nothing: the client reconnects and reads the key again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from typing import Any

import redis
import redis.asyncio as aioredis
from redbatch.common.config import DEFAULT_MAX_PAYLOAD_BYTES, DEFAULT_MODEL, DEFAULT_REDIS_URL
from redbatch.common.protocol import (
    DEFAULT_PREFIX,
    JobEnvelope,
    Keys,
    Lane,
    ResultEnvelope,
    new_request_id,
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

    def submit(self, payload: bytes, *, model: str | None = None, timeout_s: float | None = None,
               lane: Lane | str = Lane.INTERACTIVE, params: Mapping[str, Any] | None = None,
               content_type: str = "application/octet-stream",
               request_id: str | None = None) -> str:
        """Queue one job and return its request id.

        ``timeout_s`` sets the job's deadline: a worker that reaches it later
        answers ``expired`` instead of computing it.
        """
        job = self.job(payload, model=model, timeout_s=timeout_s, lane=lane, params=params,
                       content_type=content_type, request_id=request_id)
        self.redis.xadd(self.keys(model).stream(job.lane), job.encode())  # type: ignore[arg-type]
        return job.request_id

    def submit_many(self, payloads: Iterable[bytes], **kw: Any) -> list[str]:
        """Queue many jobs in one pipelined round trip; same keywords as submit."""
        return self.submit_jobs(self._jobs(payloads, kw))

    def submit_jobs(self, jobs: list[JobEnvelope]) -> list[str]:
        """Queue envelopes made by :meth:`job` in one pipelined round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for job in jobs:
            pipe.xadd(self.keys(job.model).stream(job.lane), job.encode())  # type: ignore[arg-type]
        pipe.execute()
        return [job.request_id for job in jobs]

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

    async def submit(self, payload: bytes, *, model: str | None = None,
                     timeout_s: float | None = None, lane: Lane | str = Lane.INTERACTIVE,
                     params: Mapping[str, Any] | None = None,
                     content_type: str = "application/octet-stream",
                     request_id: str | None = None) -> str:
        job = self.job(payload, model=model, timeout_s=timeout_s, lane=lane, params=params,
                       content_type=content_type, request_id=request_id)
        await self.redis.xadd(self.keys(model).stream(job.lane), job.encode())  # type: ignore[arg-type]
        return job.request_id

    async def submit_many(self, payloads: Iterable[bytes], **kw: Any) -> list[str]:
        jobs = self._jobs(payloads, kw)
        async with self.redis.pipeline(transaction=False) as pipe:
            for job in jobs:
                pipe.xadd(self.keys(kw.get("model")).stream(job.lane), job.encode())  # type: ignore[arg-type]
            await pipe.execute()
        return [job.request_id for job in jobs]

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
