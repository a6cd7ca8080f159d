"""Tenant holds (PROTOCOL.md "Tenant holds"): a per-tenant bound on jobs in flight, kept in
Redis by the gateway's own function library, so any number of gateways share one count.

NOTE [ Tenant holds ]
  The lane bound (the admission function) is per model and lane; a gateway serving many
  tenants also bounds each tenant. Each tenant has a sorted set ``P:{M}:tenant:T`` of the
  request ids it holds, scored by the Unix ms at which the hold lapses. The hold function
  drops lapsed holds, refuses the whole call when the set would pass the bound, else adds
  the ids, in one atomic step; the gateway then admits the jobs with the protocol's
  admission function and releases (ZREM) the holds of what that refused, and of every job
  whose result it has read or that it cancelled. A hold lapses at the job's deadline, so a
  gateway that dies between the two calls, or a result nobody collects, holds the place
  only until then: the count is bounded in Redis, never in a gateway's memory.
  The set lives in partition 0's slot of the model, beside nothing it must be atomic with.
"""

from __future__ import annotations

import re
from typing import Any

import redis
import redis.asyncio as aioredis
from redbatch.common.protocol.admission import MAX_ADMIT_JOBS

TENANT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-]{0,31}")
"""A tenant's name: 1-32 of ``A-Z a-z 0-9 _ -`` (no ``.`` or ``:``, so ``name:`` begins its
request ids unambiguously)."""
MAX_HOLD_DIGITS = 12
"""Longest hold time the hold function takes, decimal ms digits (about 31 years)."""
TENANT_FULL_REPLY = "TENANT_FULL"
"""First word of the hold function's refusal: the tenant holds its bound already."""

HOLD_SCRIPT = f"""\
-- redbatch tenant hold script (revision 1)
-- KEYS: P:{{M}}:tenant:<tenant>
-- ARGV: <bound>  then per job: <request id>  <hold ms>
local function bad(why) return redis.error_reply('BAD_CALL ' .. why) end
local n = (#ARGV - 1) / 2
if #KEYS ~= 1 or n < 1 or n > {MAX_ADMIT_JOBS} or n % 1 ~= 0 then
  return bad('expected 1 key and 1 + 2N arguments, N from 1 to {MAX_ADMIT_JOBS}')
end
local name = '[A-Za-z0-9][A-Za-z0-9_.%-]*'
if not KEYS[1]:find('^' .. name .. ':{{' .. name .. '}}:tenant:[A-Za-z0-9][A-Za-z0-9_%-]*$') then
  return bad('KEYS[1] is not a tenant key')
end
if #ARGV[1] > {MAX_HOLD_DIGITS} or not ARGV[1]:find('^%d+$') then
  return bad('the bound must be a whole number')
end
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local held = redis.call('ZCARD', KEYS[1])
if held + n > tonumber(ARGV[1]) then
  return redis.error_reply('{TENANT_FULL_REPLY} ' .. held)
end
local last = 0
for i = 1, n do
  local rid, ms = ARGV[2 * i], ARGV[2 * i + 1]
  if #rid > 128 or not rid:find('^[A-Za-z0-9_.:%-]+$') then
    return bad('unusable request id of job ' .. i)
  end
  if #ms > {MAX_HOLD_DIGITS} or not ms:find('^[1-9][0-9]*$') then
    return bad('hold ms of job ' .. i .. ' must be a positive integer')
  end
  last = math.max(last, tonumber(ms))
end
for i = 1, n do redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2 * i + 1]), ARGV[2 * i]) end
if redis.call('PTTL', KEYS[1]) < last then redis.call('PEXPIRE', KEYS[1], last) end
return held + n
"""
"""The hold function's body: see NOTE [ Tenant holds ]. Replies the tenant's holds after
the call, or ``TENANT_FULL <held>`` having added nothing."""

TENANTS_LIBRARY_NAME = "redbatch_tenants_v1"
HOLD_FUNCTION = f"{TENANTS_LIBRARY_NAME}_hold"
TENANTS_LIBRARY = (
    f"#!lua name={TENANTS_LIBRARY_NAME}\n"
    "local function hold(KEYS, ARGV)\n" + HOLD_SCRIPT + "end\n"
    f"redis.register_function('{HOLD_FUNCTION}', hold)\n"
)
"""The gateway's function library, as ``FUNCTION LOAD REPLACE`` takes it."""


def tenant_name(name: str) -> str:
    """``name`` if it is a usable tenant name, else ValueError."""
    if not isinstance(name, str) or not TENANT_RE.fullmatch(name):
        raise ValueError(f"invalid tenant name {name!r:.80}: use 1-32 of [A-Za-z0-9_-]")
    return name


def tenant_request_id(tenant: str, request_id: str) -> str:
    """The request id a tenant's job has in Redis: ``<tenant>:<id>``. Every key of the job
    then begins with the tenant's pattern, which its ACL user is bound to."""
    return f"{tenant}:{request_id}"


def hold_args(bound: int, holds: list[tuple[str, int]]) -> list[str]:
    """ARGV of the hold function: the bound, then each (request id, hold ms)."""
    return [str(max(0, bound)), *(str(v) for rid, ms in holds for v in (rid, max(1, ms)))]


def load_tenants_library(r: redis.Redis | Any) -> None:
    """Load (or replace with the same text) the gateway's library; on a cluster, on every
    master. Raises redis-py's errors: NoPermissionError for a user without FUNCTION LOAD."""
    r.function_load(TENANTS_LIBRARY, replace=True)


async def load_tenants_library_async(r: aioredis.Redis | Any) -> None:
    """:func:`load_tenants_library`, awaited."""
    await r.function_load(TENANTS_LIBRARY, replace=True)
