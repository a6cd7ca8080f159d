"""Admission (PROTOCOL.md "Admission control", "Request ids are unique"): the Lua script
every producer submits with, its replies, and the owner key's TTL."""

from __future__ import annotations

import math
import re

from redbatch.common.protocol.keys import MAX_NAME_CHARS, MAX_REQUEST_ID_CHARS

# --------------------------------------------------------------------------- admission

MAX_OWNER_TTL_DIGITS = 15
"""Longest owner TTL the admission script takes, decimal digits (about 31,000 years in ms)."""

MAX_ADMIT_JOBS = 1000
"""Most jobs one call of the admission script takes."""

MAX_CHARGE_DIGITS = 15
"""Longest charge the admission script takes, decimal digits."""

# NOTE [ Token charges ]
#   While a lane has a token bound, P:{M}:charges:<lane> holds each admitted job's charge
#   by entry id, and two fields of the function's own, whose values are no numbers (so no
#   sum counts them): ``total`` (``=<n>``), the charges as the last admission left them,
#   and ``recounted`` (``@<ms>``). Workers delete an entry's charge with the entry and
#   leave ``total`` alone (a transaction cannot lower it only if the field was there), so
#   ``total`` is never below what the fields hold. An admission trusts it while the job
#   fits; one that would not fit sums the fields (HVALS) first, and one that still would
#   not, recounts them (at most once a RECOUNT_EVERY_MS). So a lane far from its bound
#   costs one HGET a call, and only a lane at it pays for the sum.

RECOUNT_EVERY_MS = 1000
"""Least time between two recounts of a lane's charges, ms: a recount reads every charge and
every pending entry of the lane, so refusals in a burst share one (the charges hash's field
``recounted`` holds ``@<Redis time, ms>`` of the last)."""

ADMIT_SCRIPT = f"""\
-- redbatch admission script, protocol 1 (revision 7: token bounds)
-- KEYS: P:{{M}}:jobs:<lane>  P:{{M}}:limits  P:{{M}}:charges:<lane>
--       then P:{{M}}:owner:<request id> per job
--       then any owner keys of the jobs' ids in other partitions (P:{{M#q}}:owner:<id>)
-- ARGV: <lane>  then per job: <owner TTL ms>  <request id>  <charge>  <msgpack job envelope>
local function bad(why) return redis.error_reply('BAD_CALL ' .. why) end
local n = (#ARGV - 1) / 4
if n < 1 or n > {MAX_ADMIT_JOBS} or n % 1 ~= 0 or #KEYS < 3 + n then
  return bad('expected 3 + N keys and 1 + 4N arguments, N from 1 to {MAX_ADMIT_JOBS}')
end
local lane = ARGV[1]
if lane ~= 'interactive' and lane ~= 'bulk' then return bad('unknown lane') end
local name = '[A-Za-z0-9][A-Za-z0-9_.%-]*'
local base = KEYS[1]:match('^(.+):jobs:' .. lane .. '$') or ''
local prefix, model, part = base:match('^(' .. name .. '):{{(' .. name .. ')(#?%d*)}}$')
if part and part ~= '' and not part:find('^#[1-9]%d*$') then prefix = nil end
if not prefix or #prefix > {MAX_NAME_CHARS} or #model > {MAX_NAME_CHARS} then
  return bad('KEYS[1] is not the stream of the lane')
end
if KEYS[2] ~= base .. ':limits' then return bad('KEYS[2] is not the limits hash') end
if KEYS[3] ~= base .. ':charges:' .. lane then
  return bad('KEYS[3] is not the charges hash of the lane')
end
local acl = redis.acl_check_cmd
if acl and not (acl('XADD', KEYS[1], '*', 'a', 'b') and acl('XDEL', KEYS[1], '0-1')) then
  return redis.error_reply('NOPERM this user may not XADD and XDEL ' .. KEYS[1])
end
for i = 1, n do
  local ttl, rid, owner = ARGV[4 * i - 2], ARGV[4 * i - 1], KEYS[3 + i]
  if #rid > {MAX_REQUEST_ID_CHARS} or not rid:find('^[A-Za-z0-9_.:%-]+$') then
    return bad('unusable request id of job ' .. i)
  end
  if #ttl > {MAX_OWNER_TTL_DIGITS} or not ttl:find('^[1-9][0-9]*$') then
    return bad('owner TTL of job ' .. i .. ' must be a positive integer')
  end
  if #ARGV[4 * i] > {MAX_CHARGE_DIGITS} or not ARGV[4 * i]:find('^[0-9]+$') then
    return bad('charge of job ' .. i .. ' must be a non-negative integer')
  end
  if owner ~= base .. ':owner:' .. rid then
    return bad('KEYS[' .. (3 + i) .. '] is not the owner key of job ' .. i)
  end
  if acl and not acl('SET', owner, '0-1', 'NX', 'PX', ttl) then
    return redis.error_reply('NOPERM this user may not SET ' .. owner)
  end
end
local ids, earlier, head = {{}}, {{}}, prefix .. ':{{' .. model
for i = 1, n do ids[ARGV[4 * i - 1]] = true end
for k = 4 + n, #KEYS do
  local tail = KEYS[k]:sub(1, #head) == head and KEYS[k]:sub(#head + 1) or ''
  local q, rid = tail:match('^#([1-9]%d*)}}:owner:(.+)$')
  if not q then rid = tail:match('^}}:owner:(.+)$') end
  if not (rid and ids[rid]) then
    return bad('KEYS[' .. k .. '] is not an owner key of a job of the call')
  end
  local found = redis.pcall('GET', KEYS[k])
  if found then earlier[rid] = type(found) == 'string' and found:match('^(%d+%-%d+)') or '?' end
end
local function bound_of(raw)
  return raw and raw:find('^%-?%d+%.?%d*$') and tonumber(raw)
end
local raw = redis.call('HMGET', KEYS[2], lane, lane .. ':tokens')
local room, bound, tokens = n, bound_of(raw[1]), bound_of(raw[2])
if bound then room = math.max(0, math.ceil(bound - redis.call('XLEN', KEYS[1]))) end
local left, recounted, exact, changed = nil, false, false, false
local function sum()
  exact, left = true, tokens
  for _, v in ipairs(redis.call('HVALS', KEYS[3])) do left = left - (tonumber(v) or 0) end
end
if tokens then
  if acl and not (acl('HSET', KEYS[3], '0-1', '1') and acl('HDEL', KEYS[3], '0-1')
                  and acl('HGET', KEYS[3], '0-1') and acl('HGETALL', KEYS[3])
                  and acl('XINFO', 'GROUPS', KEYS[1]) and acl('TIME')
                  and acl('XPENDING', KEYS[1], 'workers', '-', '+', '1')) then
    return redis.error_reply('NOPERM this user may not charge ' .. KEYS[3])
  end
  local total = (redis.call('HGET', KEYS[3], 'total') or ''):match('^=(%d+)$')
  if total then left = tokens - tonumber(total) else sum() end
end
local function entry(text)
  local ms, seq = text:match('^(%d+)%-(%d+)$')
  if ms and #ms < 16 and #seq < 16 then return tonumber(ms), tonumber(seq) end
end
local function recount()
  recounted = true
  local now = redis.call('TIME')
  now = now[1] * 1000 + math.floor(now[2] / 1000)
  local last = tonumber((redis.call('HGET', KEYS[3], 'recounted') or ''):match('^@(%d+)$'))
  if last and last <= now and now - last < {RECOUNT_EVERY_MS} then return end
  redis.call('HSET', KEYS[3], 'recounted', '@' .. now)
  exact, left = true, tokens
  local rms, rseq, running = 0, 0, {{}}
  local groups = redis.pcall('XINFO', 'GROUPS', KEYS[1])
  for _, group in ipairs(type(groups) == 'table' and not groups.err and groups or {{}}) do
    local fields = {{}}
    for g = 1, #group, 2 do fields[group[g]] = group[g + 1] end
    if fields['name'] == 'workers' then
      rms, rseq = entry(fields['last-delivered-id'])
      local count = tonumber(fields['pending']) or 0
      if count > 0 then
        for _, p in ipairs(redis.call('XPENDING', KEYS[1], 'workers', '-', '+', count)) do
          running[p[1]] = true
        end
      end
    end
  end
  rms, rseq = rms or 0, rseq or 0
  local held = redis.call('HGETALL', KEYS[3])
  for j = 1, #held, 2 do
    local ms, seq = entry(held[j])
    if held[j] == 'recounted' or held[j] == 'total' then
    elseif not ms or ((ms < rms or (ms == rms and seq <= rseq)) and not running[held[j]]) then
      redis.call('HDEL', KEYS[3], held[j])
    else
      left = left - (tonumber(held[j + 1]) or 0)
    end
  end
end
local replies = {{}}
for i = 1, n do
  local owner, rid, charge = KEYS[3 + i], ARGV[4 * i - 1], tonumber(ARGV[4 * i])
  local over = room >= 1 and left ~= nil and charge > 0 and charge > left
  if over and not exact then
    sum()
    over = charge > left
  end
  if over and not recounted then
    recount()
    over = charge > left
  end
  if room < 1 then
    replies[i] = {{err = 'QUEUE_FULL ' .. bound}}
  elseif over then
    replies[i] = {{err = 'TOKENS_FULL ' .. tokens}}
  elseif earlier[rid] then
    replies[i] = {{err = 'DUPLICATE_REQUEST_ID ' .. earlier[rid]}}
  else
    local id = redis.call('XADD', KEYS[1], '*', 'rid', rid, 'job', ARGV[4 * i + 1], 'adm', '1')
    if redis.call('SET', owner, id .. ' ' .. lane, 'NX', 'PX', ARGV[4 * i - 2]) then
      room = room - 1
      if left ~= nil and charge > 0 then
        redis.call('HSET', KEYS[3], id, charge)
        left, changed = left - charge, true
      end
      replies[i] = id
    else
      redis.call('XDEL', KEYS[1], id)
      local first = redis.pcall('GET', owner)
      first = type(first) == 'string' and first:match('^(%d+%-%d+)') or '?'
      replies[i] = {{err = 'DUPLICATE_REQUEST_ID ' .. first}}
    end
  end
end
if left ~= nil and (changed or exact) then
  redis.call('HSET', KEYS[3], 'total', '=' .. (tokens - left))
end
return replies
"""
"""Admission: for each of N jobs of one lane, XADD it (with the field FIELD_ADMITTED) while
the lane's stream holds fewer entries than its bound in :meth:`Keys.limits` and, when the
lane has a token bound (field ``<lane>:tokens``), while the job's charge fits in what the
charges of its queued jobs leave (:meth:`Keys.charges`: an admitted job's charge is
recorded there, and workers delete it with the entry; before a job is refused, the
charges are summed, and at most once a RECOUNT_EVERY_MS the fields of entries the
workers' group has read and holds no longer pending are deleted: NOTE [ Token charges ]);
and make
the new entry its request id's owner (SET NX PX); an id that has an owner already takes
its entry back out at once (XDEL), so only duplicates cost a third command. One Lua
script, so it is atomic; every check of the call (its shape, the keys, the TTLs and
charges, the ACL of the commands) comes before the first write, so an error reply to the
call means nothing was written (Redis refuses a script's first write under OOM, and never
a later one). Replies an array with one element per job, in order: the entry id, or an
error element whose first word is its code (QUEUE_FULL, TOKENS_FULL, DUPLICATE_REQUEST_ID).
Workers XDEL each entry when they answer it, so XLEN is exactly the jobs queued or in
progress. PROTOCOL.md holds the same text; it is the body of the library's admission
function (functions.py)."""

OWNER_TTL_PAD_MS = 600_000
"""Added to a job's own time budget for its owner key's TTL at submit; a job with no
deadline gets the idempotency window instead. As long as the default result TTL (600 s),
so the id stays taken at least as long as a result written within the budget can be read;
its reader may free it sooner (OwnerKeys.free)."""

IDEMPOTENCY_WINDOW_MS = 3600 * 1000
"""How long the request id of a job without a deadline stays taken, ms: the idempotency
window (PROTOCOL.md "Request ids are unique"). A resubmit within it is refused
DUPLICATE_REQUEST_ID; after it the id is free again. One hour: twelve times SQS FIFO's
five-minute de-duplication window, room for a client's retries after a lost reply and
for a bulk backlog to drain, and each key it holds (about 250 bytes) lives an hour, not a
day: at 1,000 such jobs/s, 3.6 M keys (about 0.9 GiB) instead of 86 M. A client may pick
another within the bounds below (``Client(idempotency_window_s=...)``)."""
MIN_IDEMPOTENCY_WINDOW_MS = 60 * 1000
"""Shortest idempotency window a client may choose: one minute."""
MAX_IDEMPOTENCY_WINDOW_MS = 7 * 24 * 3600 * 1000
"""Longest idempotency window a client may choose: a week."""
NO_DEADLINE_OWNER_TTL_MS = IDEMPOTENCY_WINDOW_MS
"""The owner TTL of a job without a deadline, ms (the default idempotency window)."""

# NOTE [ Request id owners ]
#   A request id names exactly one job: its result key is the only place a client looks.
#   ``Keys.owner(id)`` holds the stream entry id of the job that owns the id. The admission
#   script refuses an id that has an owner, and sets it. Producers that XADD directly skip
#   that check, so a worker also claims the id when it reads an entry (SET NX GET): an entry
#   whose id is owned by a different entry is a duplicate and is dead-lettered without being
#   run or answered, so it cannot overwrite or pre-empt the first job's result. A job taken
#   over from a dead worker is the same entry, so it is not a duplicate.


def owner_ttl_ms(budget_ms: int | None, window_ms: int = IDEMPOTENCY_WINDOW_MS) -> int:
    """TTL of a request id's owner key at submit, ms: ``max(0, budget_ms) + 600,000``, or
    the idempotency window ``window_ms`` without a deadline; always a positive integer, as
    the script requires."""
    return window_ms if budget_ms is None else max(0, budget_ms) + OWNER_TTL_PAD_MS


def idempotency_window_ms(seconds: float) -> int:
    """An idempotency window of ``seconds``, in ms; ValueError outside one minute to a
    week (MIN_/MAX_IDEMPOTENCY_WINDOW_MS)."""
    if not MIN_IDEMPOTENCY_WINDOW_MS <= seconds * 1000 <= MAX_IDEMPOTENCY_WINDOW_MS:
        raise ValueError(f"idempotency window of {seconds!r} s: choose "
                         f"{MIN_IDEMPOTENCY_WINDOW_MS // 1000} s to "
                         f"{MAX_IDEMPOTENCY_WINDOW_MS // 1000} s")
    return int(seconds * 1000)


QUEUE_FULL_REPLY = "QUEUE_FULL"
"""Code of the admission script's error reply ``QUEUE_FULL <bound>``: the lane is at its
bound (the number as Lua prints it)."""
TOKENS_FULL_REPLY = "TOKENS_FULL"
"""Code of the admission script's error reply ``TOKENS_FULL <bound>``: the job's charge
does not fit under the lane's token bound (the number as Lua prints it)."""
DUPLICATE_REPLY = "DUPLICATE_REQUEST_ID"
"""Code of the admission script's error reply ``DUPLICATE_REQUEST_ID <owner>``: the request
id already has an owner, the stream entry id it names (``?`` if the key holds no entry id)."""
BAD_CALL_REPLY = "BAD_CALL"
"""Code of the admission script's error reply ``BAD_CALL <what>``: the call itself is
malformed (argument count, lane, fields, request id, TTL, or keys of another model/id)."""
NOPERM_REPLY = "NOPERM"
"""Code of the admission script's error reply ``NOPERM <what>`` (Redis 7 ACLs): the user may
add to the stream but not SET the owner key, so the script refuses before adding."""
ADMIT_ERROR_CODES = (QUEUE_FULL_REPLY, TOKENS_FULL_REPLY, DUPLICATE_REPLY, BAD_CALL_REPLY,
                     NOPERM_REPLY)
"""Every error code the admission script itself replies; each reply is ``CODE text``."""


def error_reply_code(message: str) -> str:
    """The code of a Redis error reply: its first word (``QUEUE_FULL 5`` -> ``QUEUE_FULL``).

    Give it the reply as it arrived, without the leading ``-``. redis-py's message of a
    plain ResponseError qualifies (it strips a leading ``ERR ``, which no admission reply
    carries); codes it knows (NOPERM, WRONGTYPE, OOM, ...) become their own exception
    classes, whose message lacks the code."""
    return message.split(" ", 1)[0]


#: A limits-hash field that is a bound: a decimal number, digits with an optional minus and
#: fraction (the admission script matches the same pattern, as a Lua pattern).
_BOUND = re.compile(r"-?[0-9]+\.?[0-9]*")


def parse_queue_bound(raw: bytes | str | None) -> int | None:
    """A limits-hash field read as the admission script reads it: the most entries the
    lane may hold (a fraction rounds up, below 0 is 0), or None (unbounded) when the field
    is absent or not a decimal number (hex, exponents, nan and inf included)."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    if text is None or not _BOUND.fullmatch(text):
        return None
    return max(0, math.ceil(float(text)))


