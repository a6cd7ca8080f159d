"""The HTTP routes (Starlette), each a thin shell over :class:`Gateway`'s calls.

    POST   /v1/chat/completions      OpenAI chat and completions: one generation job each,
    POST   /v1/completions           streamed as server-sent events (gateway/chat.py)
    GET    /v1/jobs/{id}/events      a generation job's token stream, for any reader
    POST   /v1/embeddings            OpenAI embeddings: texts to the text model
    POST   /v1/models/{model}/jobs   native: the raw body, or each part of a multipart
                                     body, as one job (an image, any bytes); 202 and ids,
                                     or the results with ?wait=S
    GET    /v1/jobs/{id}             where the job is, and its result (?wait=S)
    DELETE /v1/jobs/{id}             cancel it while it is queued
    GET    /v1/models                the models with a live worker
    GET    /metrics /healthz /readyz

Every /v1 route takes ``Authorization: Bearer <key>`` (401 otherwise, unless the gateway
has no tenants file), ``X-Request-Id`` (the job's id; echoed) and ``X-Redbatch-Lane``
(``interactive``, the default, or ``bulk``). A public job id is ``<model>:<id>``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from redbatch.common.protocol import JobStatus, ResultEnvelope
from redbatch.gateway.chat import chat_completions, completions, job_events
from redbatch.gateway.errors import (
    INTERNAL,
    METHOD_NOT_ALLOWED,
    NOT_FOUND,
    ApiError,
    bad_request,
    from_result,
)
from redbatch.gateway.http_io import (
    lane_of,
    model_name,
    parse_job_id,
    public_id,
    read_body,
    read_json,
    tenant_of,
)
from redbatch.gateway.openai_api import (
    embeddings_response,
    models_response,
    parse_embeddings,
    parse_timeout,
    vectors_of,
)
from redbatch.gateway.service import Gateway, Submission
from redbatch.gateway.tenants import Tenant
from starlette.applications import Starlette
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

log = logging.getLogger(__name__)
Handler = Callable[[Request], Awaitable[Response]]
MAX_PARTS = 64
"""Most files one multipart request may carry (each one job)."""


class Metrics:
    """The gateway's own registry: requests, their latency, open streams."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("redbatch_gateway_requests_total", "HTTP requests answered",
                                ["route", "status"], registry=self.registry)
        self.seconds = Histogram("redbatch_gateway_request_seconds",
                                 "Time to answer a request, s", ["route"],
                                 buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1,
                                          2.5, 5, 10, 30), registry=self.registry)
        self.streams = Gauge("redbatch_gateway_open_streams", "Server-sent event streams open",
                             registry=self.registry)


def create_app(gateway: Gateway) -> Starlette:
    """The ASGI app of ``gateway``; its clients open and close with the app's lifespan."""
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.close()

    def endpoint(name: str, handler: Callable[[Request, Gateway], Awaitable[Response]]) -> Handler:
        async def run(request: Request) -> Response:
            started = time.perf_counter()
            try:
                response = await handler(request, gateway)
            except ApiError as e:
                response = JSONResponse(e.body(), e.status, headers=e.headers)
            rid = request.headers.get("x-request-id")
            if rid and "x-request-id" not in response.headers:
                response.headers["X-Request-Id"] = rid[:128]
            metrics.requests.labels(name, str(response.status_code)).inc()
            metrics.seconds.labels(name).observe(time.perf_counter() - started)
            return response
        return run

    async def metrics_page(_: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def healthz(_: Request) -> Response:
        return PlainTextResponse("ok\n")

    async def readyz(_: Request) -> Response:
        ok = await gateway.ready()
        return PlainTextResponse("ready\n" if ok else "redis unreachable\n", 200 if ok else 503)

    routes = [
        Route("/v1/chat/completions", endpoint("chat", chat_completions), methods=["POST"]),
        Route("/v1/completions", endpoint("completions", completions), methods=["POST"]),
        Route("/v1/jobs/{job_id}/events", endpoint("events", job_events), methods=["GET"]),
        Route("/v1/embeddings", endpoint("embeddings", embeddings), methods=["POST"]),
        Route("/v1/models/{model}/jobs", endpoint("jobs", submit_jobs), methods=["POST"]),
        Route("/v1/jobs/{job_id}", endpoint("job", job_status), methods=["GET"]),
        Route("/v1/jobs/{job_id}", endpoint("cancel", cancel_job), methods=["DELETE"]),
        Route("/v1/models", endpoint("models", list_models), methods=["GET"]),
        Route("/metrics", metrics_page), Route("/healthz", healthz), Route("/readyz", readyz),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={
        HTTPException: http_error, Exception: internal_error})
    app.state.metrics = metrics
    return app


async def http_error(_: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no such route, a method the route lacks) in the OpenAI
    error shape, each with a stable code."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    code = {404: NOT_FOUND, 405: METHOD_NOT_ALLOWED}.get(status, "http_error")
    e = ApiError(code, str(getattr(exc, "detail", "")) or code, status)
    return JSONResponse(e.body(), status, headers=getattr(exc, "headers", None))


async def internal_error(_: Request, exc: Exception) -> Response:
    """A bug of the gateway's: one log line and a 500 in the OpenAI shape, not a page."""
    log.error("unhandled %s: %s", type(exc).__name__, str(exc)[:300])
    e = ApiError(INTERNAL, "the gateway failed on this request", 500)
    return JSONResponse(e.body(), 500)


async def embeddings(request: Request, gateway: Gateway) -> Response:
    tenant = tenant_of(request, gateway)
    s = gateway.settings
    asked = parse_embeddings(await read_json(request, s.max_body_bytes), s.max_texts,
                             s.max_timeout_s)
    chunks = asked.chunks()
    base = request.headers.get("x-request-id")
    ids = [base if i == 0 else f"{base}.{i}" for i in range(len(chunks))] if base else []
    timeout_s = asked.timeout_s or s.default_timeout_s
    rids = await gateway.submit(tenant, Submission(
        asked.model, chunks, timeout_s, lane_of(request), ids=ids))
    results = await gateway.wait(tenant, asked.model, rids, timeout_s)
    for result in results:
        if not result.ok:
            raise from_result(result)
    try:
        vectors = vectors_of([r.output for r in results])
    except ValueError as e:
        raise bad_request(str(e), "model") from None
    return JSONResponse(embeddings_response(asked.model, vectors, asked.encoding))


async def submit_jobs(request: Request, gateway: Gateway) -> Response:
    tenant = tenant_of(request, gateway)
    s = gateway.settings
    model = model_name(request.path_params["model"])
    timeout_s = parse_timeout(request.query_params.get("timeout"), s.max_timeout_s)
    wait_s = parse_timeout(request.query_params.get("wait"), s.max_poll_s) or 0.0
    payloads, types = await _payloads(request, s.max_body_bytes)
    base = request.headers.get("x-request-id")
    ids = [base if i == 0 else f"{base}.{i}" for i in range(len(payloads))] if base else []
    # One content type per submit: parts of differing types go as raw bytes (the image
    # models sniff the bytes and ignore it).
    rids = await gateway.submit(tenant, Submission(
        model, payloads, timeout_s or s.default_timeout_s, lane_of(request),
        types[0] if len(set(types)) == 1 else None, ids))
    results = await gateway.wait(tenant, model, rids, wait_s) if wait_s else []
    if len(results) == 1 and not results[0].ok:  # one input, refused: the HTTP error
        raise from_result(results[0])
    jobs = [_job_json(model, tenant, rid, results[i] if results else None)
            for i, rid in enumerate(rids)]
    return JSONResponse(jobs[0] if len(jobs) == 1 else {"object": "list", "data": jobs},
                        200 if results else 202)


async def _payloads(request: Request, limit: int) -> tuple[list[bytes], list[str]]:
    """The jobs' payloads and content types: each file of a multipart body, or the body."""
    kind = request.headers.get("content-type", "application/octet-stream")
    if not kind.lower().startswith("multipart/form-data"):
        body = await read_body(request, limit)
        if not body:
            raise bad_request("the body is empty: send the input's bytes")
        return [body], [kind.split(";")[0].strip() or "application/octet-stream"]
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError("payload_too_large", f"the body is over {limit} bytes", 413)
    payloads, types = [], []
    try:
        async with request.form(max_files=MAX_PARTS, max_fields=MAX_PARTS,
                                max_part_size=limit) as form:
            for _, value in form.multi_items():
                if isinstance(value, UploadFile):
                    payloads.append(await value.read(limit + 1))
                    types.append(value.content_type or "application/octet-stream")
    except ApiError:
        raise
    except Exception as e:  # starlette's MultiPartException and its kin: a malformed body
        raise bad_request(f"unreadable multipart body: {str(e)[:200]}") from None
    if not payloads or any(len(p) > limit or not p for p in payloads):
        raise bad_request("send one or more non-empty files, each within the size limit")
    return payloads, types


def _job_json(model: str, tenant: Tenant, rid: str, result: ResultEnvelope | None,
              state: str | None = None) -> dict[str, Any]:
    found: dict[str, Any] = {"id": public_id(model, tenant, rid), "object": "job", "model": model,
                             "status": state or ("queued" if result is None else
                                                 "done" if result.ok else "failed")}
    if result is not None:
        found.update(output=result.output, batch_size=result.batch_size,
                     worker=result.worker, timings=dict(result.timings),
                     error=None if result.ok else {
                         "code": result.error_code.value if result.error_code else "internal",
                         "message": result.error_message})
    return found


async def job_status(request: Request, gateway: Gateway) -> Response:
    tenant = tenant_of(request, gateway)
    model, rid = parse_job_id(request.path_params["job_id"], tenant)
    wait_s = parse_timeout(request.query_params.get("wait"), gateway.settings.max_poll_s) or 0.0
    found: JobStatus = await gateway.status(tenant, model, rid, wait_s)
    if found.state.value == "unknown":
        raise ApiError(NOT_FOUND, "no such job (never submitted, or its result expired)", 404)
    body = _job_json(model, tenant, rid, found.result, found.state.value)
    if found.worker:
        body["worker"] = found.worker
    return JSONResponse(body)


async def cancel_job(request: Request, gateway: Gateway) -> Response:
    tenant = tenant_of(request, gateway)
    model, rid = parse_job_id(request.path_params["job_id"], tenant)
    cancelled = await gateway.cancel(tenant, model, rid)
    public = request.path_params["job_id"]
    if not cancelled:
        found = await gateway.status(tenant, model, rid, 0.0)
        if found.state.value == "unknown":
            raise ApiError(NOT_FOUND, "no such job", 404)
        return JSONResponse({"id": public, "object": "job", "cancelled": False,
                             "status": found.state.value}, 409)
    return JSONResponse({"id": public, "object": "job", "cancelled": True,
                         "status": "cancelled"})


async def list_models(request: Request, gateway: Gateway) -> Response:
    tenant = tenant_of(request, gateway)
    return JSONResponse(models_response(await gateway.live_models(tenant), int(time.time())))
