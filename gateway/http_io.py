"""What every route reads from a request: the tenant of its key, its lane, its body
within a bound, a model name, a public job id."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from typing import Any, TypeVar

from redbatch.common.protocol import Lane, validate_name
from redbatch.common.protocol.tenants import tenant_request_id
from redbatch.gateway.errors import NOT_FOUND, UNAUTHORIZED, ApiError, bad_request
from redbatch.gateway.service import Gateway
from redbatch.gateway.tenants import Tenant
from starlette.requests import Request

T = TypeVar("T")


class ClientGone(Exception):
    """The client closed its connection before its answer was ready."""


def tenant_of(request: Request, gateway: Gateway) -> Tenant:
    found = gateway.tenants.authenticate(request.headers.get("authorization"))
    if found is None:
        raise ApiError(UNAUTHORIZED, "a valid API key is needed: Authorization: Bearer <key>",
                       401, headers={"WWW-Authenticate": "Bearer"})
    return found


def lane_of(request: Request) -> Lane:
    try:
        return Lane(request.headers.get("x-redbatch-lane", Lane.INTERACTIVE.value))
    except ValueError:
        raise bad_request("X-Redbatch-Lane must be interactive or bulk",
                          "X-Redbatch-Lane") from None


async def read_body(request: Request, limit: int) -> bytes:
    """The body, at most ``limit`` bytes (ApiError 413 past it, without reading on)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError("payload_too_large", f"the body is over {limit} bytes", 413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError("payload_too_large", f"the body is over {limit} bytes", 413)
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request: Request, limit: int) -> Any:
    try:
        return json.loads(await read_body(request, limit))
    except (ValueError, UnicodeDecodeError):
        raise bad_request("the body is not JSON") from None


def model_name(name: str) -> str:
    try:
        return validate_name(name)
    except ValueError:
        raise ApiError(NOT_FOUND, "not a model name", 404, param="model") from None


def parse_job_id(job_id: str, tenant: Tenant) -> tuple[str, str]:
    """(model, request id in Redis) of a public id ``<model>:<id>``."""
    model, _, rest = job_id.partition(":")
    if not rest:
        raise ApiError(NOT_FOUND, "a job id is <model>:<id>", 404)
    return model_name(model), tenant_request_id(tenant.name, rest)


def public_id(model: str, tenant: Tenant, rid: str) -> str:
    """The public id ``<model>:<id>`` of request id ``rid`` (``<tenant>:<id>``)."""
    return f"{model}:{rid[len(tenant.name) + 1:]}"


async def until_disconnect(request: Request, awaitable: Awaitable[T]) -> T:
    """What ``awaitable`` returns, or ClientGone once the client disconnects first (its
    body is read: the next ASGI message is ``http.disconnect``)."""
    work = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        raise ClientGone
    finally:
        for task in (work, gone):
            task.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
