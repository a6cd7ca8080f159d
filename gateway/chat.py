"""The generation routes: OpenAI chat and completions, streamed or not, and a job's token
stream for any reader.

    POST /v1/chat/completions    messages to a chat model (gateway/chat_api.py)
    POST /v1/completions         a prompt to it, as raw text
    GET  /v1/jobs/{id}/events    the job's chunks as server-sent events, for any reader
                                 (a browser's EventSource), from Last-Event-ID or ?after=N

Each request is one generation job, submitted as every job is (the tenant's hold, the
admission function, lanes, the deadline ``timeout``). Not streamed, the answer is the job's
result. Streamed, the events come from the job's token stream (PROTOCOL.md "Token
stream"), each named ``<job id>/<chunk index>``; the first chunk is awaited before the
response starts, for ``sse_keepalive_s`` at most, so a job refused as it is read
(``bad_input``, ``expired``) is still an HTTP error. A job still queued by then gets its
response started with a comment line (``: keep-alive``), and one every
``sse_keepalive_s`` while no chunk comes, so that no proxy or load balancer closes a quiet
stream; a failure after that is an ``error`` event. A client that reconnects with
``Last-Event-ID`` reads on after that chunk and submits nothing. A client that disconnects
before the answer ends stops the job (it is cancelled where it is queued and ends at its
next step where it runs) unless it sent ``X-Redbatch-On-Disconnect: keep``; the events
route only reads.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from redbatch.common.protocol import RedbatchError
from redbatch.common.protocol.generation import CONTENT_TYPE, Chunk
from redbatch.gateway.chat_api import (
    CHAT,
    TEXT,
    GenerationAsk,
    events,
    parse_event_id,
    parse_generation,
    usage,
)
from redbatch.gateway.chat_api import answer as answer_json
from redbatch.gateway.errors import ApiError, bad_request, from_error, from_result
from redbatch.gateway.http_io import (
    ClientGone,
    lane_of,
    parse_job_id,
    public_id,
    read_json,
    tenant_of,
    until_disconnect,
)
from redbatch.gateway.openai_api import parse_timeout
from redbatch.gateway.service import Gateway, Submission
from redbatch.gateway.tenants import Tenant
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

#: HTTP status of a request whose client left before its answer (nginx's; never seen).
CLIENT_GONE = 499
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
#: What a stream sends while no chunk comes (an SSE comment: every reader skips it).
KEEP_ALIVE = b": keep-alive\n\n"


async def chat_completions(request: Request, gateway: Gateway) -> Response:
    return await _generate(request, gateway, CHAT)


async def completions(request: Request, gateway: Gateway) -> Response:
    return await _generate(request, gateway, TEXT)


def _keep_on_disconnect(request: Request) -> bool:
    value = request.headers.get("x-redbatch-on-disconnect", "cancel").lower()
    if value not in ("cancel", "keep"):
        raise bad_request("X-Redbatch-On-Disconnect must be cancel or keep",
                          "X-Redbatch-On-Disconnect")
    return value == "keep"


async def _generate(request: Request, gateway: Gateway, kind: str) -> Response:
    tenant = tenant_of(request, gateway)
    s = gateway.settings
    ask = parse_generation(await read_json(request, s.max_body_bytes), kind, s.max_timeout_s,
                           s.default_max_tokens)
    gateway.check_model(tenant, ask.model)
    keep = _keep_on_disconnect(request)
    timeout_s = ask.timeout_s or s.generation_timeout_s
    rid, after = await _job_of(request, gateway, tenant, ask, timeout_s)
    job = Job(gateway, tenant, ask.model, rid, keep)
    if not ask.stream:
        return await _answer(request, job, ask, timeout_s)
    chunks = _Paced(gateway.chunks(tenant, ask.model, rid, after or 0, timeout_s),
                    s.sse_keepalive_s)
    try:
        first = await until_disconnect(request, chunks.within())
    except ClientGone:
        await chunks.aclose()
        await job.left()
        return Response(status_code=CLIENT_GONE)
    except RedbatchError as e:
        await job.release()
        raise from_error(e, s.retry_after_s) from None
    stream = _events(request, job, ask, first, chunks, after is None)
    return StreamingResponse(stream, media_type="text/event-stream",
                             headers={**SSE_HEADERS, "X-Request-Id": job.public})


class _Paced:
    """A job's chunks with the silences marked: ``within()`` waits ``every_s`` at most for
    the next chunk and returns None when none came, leaving the read going (no chunk is
    lost to a timeout)."""

    def __init__(self, chunks: AsyncIterator[Chunk], every_s: float) -> None:
        self._chunks, self._every_s = chunks, every_s
        self._next: asyncio.Future[Chunk] | None = None

    async def within(self) -> Chunk | None:
        """The next chunk, or None after ``every_s`` without one; raises what the read
        raises (RedbatchError; StopAsyncIteration past the last chunk)."""
        if self._next is None:
            self._next = asyncio.ensure_future(anext(self._chunks))
        done, _ = await asyncio.wait({self._next}, timeout=self._every_s)
        if not done:
            return None
        got, self._next = self._next, None
        return got.result()

    async def aclose(self) -> None:
        """Stop the read in progress, if any."""
        if self._next is not None:
            self._next.cancel()
            self._next = None


async def _job_of(request: Request, gateway: Gateway, tenant: Tenant, ask: GenerationAsk,
                  timeout_s: float) -> tuple[str, int | None]:
    """(request id, last chunk read) of the request's job: the one ``Last-Event-ID`` names
    (a reconnect: nothing submitted), or a new one (None: nothing read yet)."""
    resumed = parse_event_id(request.headers.get("last-event-id"))
    if resumed is not None:
        model, rid = parse_job_id(resumed[0], tenant)
        if model != ask.model:
            raise bad_request("Last-Event-ID names a job of another model", "Last-Event-ID")
        return rid, resumed[1]
    base = request.headers.get("x-request-id")
    rids = await gateway.submit(tenant, Submission(
        ask.model, [ask.payload()], timeout_s, lane_of(request), CONTENT_TYPE,
        [base] if base else []))
    return rids[0], None


class Job:
    """One generation job a request made or read, and what its client leaving does."""

    def __init__(self, gateway: Gateway, tenant: Tenant, model: str, rid: str,
                 keep: bool) -> None:
        self.gateway, self.tenant, self.model, self.rid, self.keep = (
            gateway, tenant, model, rid, keep)
        self.public = public_id(model, tenant, rid)

    async def left(self) -> None:
        """The client left before the answer ended: stop the job unless it asked to keep
        it (its place is given back either way once it ends)."""
        if not self.keep:
            await self.gateway.stop(self.tenant, self.model, self.rid)

    async def release(self) -> None:
        await self.gateway.release(self.tenant, self.model, [self.rid])


async def _answer(request: Request, job: Job, ask: GenerationAsk, timeout_s: float) -> Response:
    try:
        results = await until_disconnect(request, job.gateway.wait(
            job.tenant, job.model, [job.rid], timeout_s))
    except ClientGone:
        await job.left()
        return Response(status_code=CLIENT_GONE)
    if not results[0].ok:
        raise from_result(results[0])
    return JSONResponse(answer_json(ask, job.public, results[0].output, int(time.time())),
                        headers={"X-Request-Id": job.public})


async def _events(request: Request, job: Job, ask: GenerationAsk, first: Chunk | None,
                  rest: _Paced, from_start: bool) -> AsyncIterator[bytes]:
    """The response's events: ``first`` (None: none came in time, so a keep-alive), then
    the rest as they come, a keep-alive in each silence. A stream cut by the client
    (Starlette cancels this generator) stops the job, in the background, since nothing
    here may await once cancelled."""
    metrics = request.app.state.metrics
    metrics.streams.inc()
    created, ended, chunk = int(time.time()), False, first
    try:
        while True:
            if chunk is None:
                yield KEEP_ALIVE
            else:
                yield events(ask, job.public, [chunk], created, from_start)
                from_start = False
                if chunk.finish is not None:
                    ended = True
                    return
            chunk = await rest.within()
    except StopAsyncIteration:  # the stream stopped without a last chunk: nothing to add
        ended = True
    except RedbatchError as e:  # the deadline passed, Redis away for longer than it
        ended = True
        yield _error_event(job.public, from_error(e, job.gateway.settings.retry_after_s))
    finally:
        metrics.streams.dec()
        job.gateway.in_background(job.release() if ended else job.left())
        job.gateway.in_background(rest.aclose())


def _error_event(job_id: str, error: ApiError) -> bytes:
    return f"event: error\ndata: {json.dumps(error.body())}\n\n".encode()


async def job_events(request: Request, gateway: Gateway) -> Response:
    """``GET /v1/jobs/{id}/events``: the job's chunks as native events, each
    ``{index, text, token_ids, finish_reason}`` (the last with ``usage``), named
    ``<job id>/<index>``, after ``Last-Event-ID`` or ``?after=N``; a reader only."""
    tenant = tenant_of(request, gateway)
    model, rid = parse_job_id(request.path_params["job_id"], tenant)
    gateway.check_model(tenant, model)
    public = public_id(model, tenant, rid)
    resumed = parse_event_id(request.headers.get("last-event-id"))
    if resumed is not None and resumed[0] != public:
        raise bad_request("Last-Event-ID names another job", "Last-Event-ID")
    after = resumed[1] if resumed else _after(request.query_params.get("after"))
    s = gateway.settings
    timeout_s = (parse_timeout(request.query_params.get("timeout"), s.max_timeout_s)
                 or s.generation_timeout_s)
    chunks = _Paced(gateway.chunks(tenant, model, rid, after, timeout_s), s.sse_keepalive_s)
    try:
        first = await until_disconnect(request, chunks.within())
    except ClientGone:
        await chunks.aclose()
        return Response(status_code=CLIENT_GONE)
    except RedbatchError as e:
        raise from_error(e, gateway.settings.retry_after_s) from None

    async def stream() -> AsyncIterator[bytes]:
        chunk = first
        try:
            while chunk is None or chunk.finish is None:
                yield KEEP_ALIVE if chunk is None else _native_event(public, chunk)
                chunk = await chunks.within()
            yield _native_event(public, chunk)
        except StopAsyncIteration:
            return
        except RedbatchError as e:
            yield _error_event(public, from_error(e, gateway.settings.retry_after_s))
        finally:
            gateway.in_background(chunks.aclose())

    return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)


def _after(value: str | None) -> int:
    if value is None:
        return 0
    if not value.isdigit() or len(value) > 9:
        raise bad_request("after must be a chunk index", "after")
    return int(value)


def _native_event(job_id: str, c: Chunk) -> bytes:
    body: dict[str, Any] = {"index": c.index, "text": c.text, "token_ids": c.token_ids,
                            "finish_reason": c.finish}
    if c.finish is not None:
        body["usage"] = usage(c.prompt_tokens, c.completion_tokens, c.cached_tokens)
        if c.error:
            body["error"] = c.error
    return f"id: {job_id}/{c.index}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n".encode()
