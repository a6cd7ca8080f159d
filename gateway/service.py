"""The gateway's calls onto the protocol, without HTTP: hold a tenant's places, submit,
wait, read a status, cancel, and which models have a live worker.

Each tenant has its own :class:`AsyncClient`, on its own Redis URL (its ACL user: request
ids ``<tenant>:...`` only, ``redbatch acl --role tenant``), so one tenant's calls cannot
read or take another's ids even if the gateway asked. Nothing here is kept between requests
but those clients and a one-second cache of which models have a worker: the queue, the
bounds and the holds are in Redis (NOTE [ Tenant holds ] in common/protocol/tenants.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redbatch.common.config import GatewaySettings, redact_url
from redbatch.common.protocol import (
    JobStatus,
    Keys,
    Lane,
    RedbatchError,
    ResultEnvelope,
    new_request_id,
    valid_request_id,
)
from redbatch.common.protocol.functions import is_missing
from redbatch.common.protocol.generation import Chunk
from redbatch.common.protocol.tenants import (
    HOLD_FUNCTION,
    TENANT_FULL_REPLY,
    hold_args,
    load_tenants_library_async,
    tenant_request_id,
)
from redbatch.common.redis_io import connect_async
from redbatch.gateway.coalesce import Coalescer
from redbatch.gateway.errors import (
    NO_WORKER,
    NOT_FOUND,
    TENANT_FULL,
    ApiError,
    bad_request,
    from_error,
)
from redbatch.gateway.tenants import Tenant, Tenants
from redbatch.producer.client import AsyncClient
from redbatch.producer.errors import FUNCTIONS_MISSING, REDIS_UNAVAILABLE

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Submission:
    """What to queue: payloads of one model, each with the caller's id (or None)."""

    model: str
    payloads: Sequence[Any]
    timeout_s: float
    lane: Lane = Lane.INTERACTIVE
    content_type: str | None = None
    ids: Sequence[str | None] = ()


class Gateway:
    """The calls a request makes; one per process, shared by every request."""

    def __init__(self, settings: GatewaySettings, redis_url: str, tenants: Tenants,
                 models: Sequence[str], prefix: str) -> None:
        self.settings = settings
        self.redis_url = redis_url
        self.tenants = tenants
        self.models = tuple(dict.fromkeys(models))
        self.prefix = prefix
        self._clients: dict[str, AsyncClient] = {}
        self._submits: dict[str, Coalescer] = {}
        self._live: dict[str, tuple[float, int]] = {}
        self._admin = connect_async(redis_url)
        self._background: set[asyncio.Future[None]] = set()

    async def start(self) -> None:
        """Open each tenant's client and load the holds library (where --redis may)."""
        for tenant in self.tenants.all:
            client = AsyncClient(tenant.redis_url or self.redis_url, model=self.models[0],
                                 prefix=self.prefix)
            # redis-py's asyncio pool refuses the 101st call in flight by default: "Too many
            # connections", under a load the gateway should only queue behind.
            pool = getattr(client.redis, "connection_pool", None)
            if pool is not None:
                pool.max_connections = self.settings.redis_connections
            self._clients[tenant.name] = client
            self._submits[tenant.name] = Coalescer(client, self.settings.submit_calls_in_flight)
        try:
            await load_tenants_library_async(self._admin)
        except redis.RedisError as e:
            log.warning("could not load the tenant holds library with %s (%s): tenants with "
                        "max_jobs need it loaded (redbatch acl --apply --role tenant)",
                        redact_url(self.redis_url), str(e).splitlines()[0][:200])

    async def close(self) -> None:
        if self._background:
            await asyncio.wait(self._background, timeout=self.settings.close_wait_s)
        for client in self._clients.values():
            await client.close()
        await self._admin.aclose()

    async def ready(self) -> bool:
        """Whether the gateway's Redis answers (/readyz)."""
        try:
            return bool(await self._admin.ping())
        except redis.RedisError:
            return False

    def check_model(self, tenant: Tenant, model: str) -> None:
        if model not in self.models or not tenant.may_use(model):
            raise ApiError(NOT_FOUND, f"the model {model[:80]!r} is not served here", 404,
                           param="model")

    async def live_workers(self, tenant: Tenant, model: str) -> int:
        """How many live workers serve ``model`` (their heartbeats), cached a second."""
        now = time.monotonic()
        checked = self._live.get(model)
        if checked and now - checked[0] < self.settings.ready_cache_s:
            return checked[1]
        try:
            count = len(await self._clients[tenant.name].workers(model=model))
        except RedbatchError as e:
            raise from_error(e, self.settings.retry_after_s) from None
        self._live[model] = (now, count)
        return count

    async def live_models(self, tenant: Tenant) -> dict[str, int]:
        found = {m: await self.live_workers(tenant, m) for m in self.models if tenant.may_use(m)}
        return {m: n for m, n in found.items() if n}

    async def submit(self, tenant: Tenant, job: Submission) -> list[str]:
        """Queue the payloads; their request ids (``<tenant>:<id>``). ApiError 503 with no
        worker alive, 429 when the tenant or the lane is full, 409 for an id taken."""
        self.check_model(tenant, job.model)
        if not await self.live_workers(tenant, job.model):
            raise ApiError(NO_WORKER, f"no worker of {job.model} is alive", 503,
                           headers={"Retry-After": str(self.settings.retry_after_s)})
        ids = list(job.ids) or [None] * len(job.payloads)
        rids = [tenant_request_id(tenant.name, i or new_request_id()) for i in ids]
        if not all(valid_request_id(r) for r in rids):
            raise bad_request("a request id is 1-100 of A-Z a-z 0-9 _ . : -", "X-Request-Id")
        client = self._clients[tenant.name]
        await self._hold(tenant, job, rids)
        try:
            envelopes = client.jobs(job.payloads, request_ids=rids, model=job.model,
                                    timeout_s=job.timeout_s, lane=job.lane,
                                    content_type=job.content_type)
            await self._submits[tenant.name].submit(envelopes)
        except (TypeError, ValueError) as e:
            await self.release(tenant, job.model, rids)
            raise bad_request(str(e)[:300]) from None
        except RedbatchError as e:
            await self.release(tenant, job.model, rids)
            raise from_error(e, self.settings.retry_after_s) from None
        return rids

    async def _hold(self, tenant: Tenant, job: Submission, rids: list[str]) -> None:
        """Take the tenant's places for ``rids`` until their deadline, or ApiError 429."""
        if tenant.max_jobs is None:
            return
        ms = math.ceil(job.timeout_s * 1000)
        key = Keys(job.model, self.prefix).tenant(tenant.name)
        try:
            await self._clients[tenant.name].redis.fcall(
                HOLD_FUNCTION, 1, key, *hold_args(tenant.max_jobs, [(r, ms) for r in rids]))
        except redis.ResponseError as e:
            if str(e).startswith(TENANT_FULL_REPLY):
                raise ApiError(TENANT_FULL, f"{tenant.name} has {tenant.max_jobs} jobs in "
                               "flight already", 429,
                               headers={"Retry-After": str(self.settings.retry_after_s)}) from None
            code = FUNCTIONS_MISSING if is_missing(e) else REDIS_UNAVAILABLE
            raise ApiError(code, f"the tenant holds call failed: {str(e)[:200]}", 503) from None
        except redis.RedisError as e:
            raise ApiError(REDIS_UNAVAILABLE, f"Redis: {str(e)[:200]}", 503) from None

    async def release(self, tenant: Tenant, model: str, rids: Sequence[str]) -> None:
        """Give back the tenant's places of ``rids`` (best effort: a hold lapses anyway)."""
        if tenant.max_jobs is None or not rids:
            return
        try:
            await self._clients[tenant.name].redis.zrem(
                Keys(model, self.prefix).tenant(tenant.name), *rids)
        except redis.RedisError as e:
            log.debug("releasing %d holds of %s: %s", len(rids), tenant.name, e)

    async def wait(self, tenant: Tenant, model: str, rids: Sequence[str],
                   timeout_s: float) -> list[ResultEnvelope]:
        """The results of ``rids``, in order; ApiError 504 past ``timeout_s``."""
        try:
            return await self._clients[tenant.name].results(rids, timeout_s, model=model)
        except RedbatchError as e:
            raise from_error(e, self.settings.retry_after_s) from None
        finally:
            await self.release(tenant, model, rids)

    async def status(self, tenant: Tenant, model: str, rid: str, wait_s: float) -> JobStatus:
        """Where the job is; with ``wait_s``, its result once there within that time."""
        self.check_model(tenant, model)
        client = self._clients[tenant.name]
        try:
            if wait_s > 0:
                try:
                    await client.result(rid, wait_s, model=model)
                except RedbatchError as e:
                    if e.code != "timeout":
                        raise
            found = await client.status(rid, model=model)
        except RedbatchError as e:
            raise from_error(e, self.settings.retry_after_s) from None
        if found.finished:
            await self.release(tenant, model, [rid])
        return found

    def chunks(self, tenant: Tenant, model: str, rid: str, after: int,
               timeout_s: float) -> AsyncIterator[Chunk]:
        """The job's token stream after chunk ``after``, until its last chunk; raises
        RedbatchError (JobFailed for a job refused as it was read, ResultTimeout)."""
        return self._clients[tenant.name].chunks(rid, after=after, timeout_s=timeout_s,
                                                 model=model)

    async def stop(self, tenant: Tenant, model: str, rid: str) -> None:
        """Stop a generation job wherever it is (queued: cancelled; running: it ends at
        its next step) and give back its place; best effort, logged when Redis fails."""
        try:
            await self._clients[tenant.name].stop(rid, model=model)
        except RedbatchError as e:
            log.warning("could not stop %s: %s", rid, str(e).splitlines()[0][:200])
        await self.release(tenant, model, [rid])

    def in_background(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` on its own (a stop or a release after a client left, from code that
        is being cancelled and may not await), keeping it referenced until it ends."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def cancel(self, tenant: Tenant, model: str, rid: str) -> bool:
        """Cancel the job while it is queued: whether it was (it will never run)."""
        self.check_model(tenant, model)
        try:
            cancelled = await self._clients[tenant.name].cancel(rid, model=model)
        except RedbatchError as e:
            raise from_error(e, self.settings.retry_after_s) from None
        if cancelled:
            await self.release(tenant, model, [rid])
        return cancelled
