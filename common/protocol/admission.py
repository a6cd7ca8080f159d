"""Admission (PROTOCOL.md "Admission control", "Request ids are unique"): the Lua script
every producer submits with, its replies, and the owner key's TTL."""

from __future__ import annotations

import math

from redbatch.common.protocol.keys import MAX_NAME_CHARS, MAX_REQUEST_ID_CHARS

# --------------------------------------------------------------------------- admission

MAX_OWNER_TTL_DIGITS = 15
"""Longest owner TTL the admission script takes, decimal digits (about 31,000 years in ms)."""

ADMIT_SCRIPT = f"""\
-- redbatch admission script, protocol 1 (revision 2: every check before the first write)
-- KEYS: P:{{M}}:jobs:<lane>  P:{{M}}:limits  P:{{M}}:owner:<request id>
-- ARGV: <lane>  <owner TTL ms>  rid  <request id>  job  <msgpack job envelope>
local function bad(why) return redis.error_reply('BAD_CALL ' .. why) end
if #KEYS ~= 3 or #ARGV ~= 6 then return bad('expected 3 keys and 6 arguments') end
local lane, ttl, rid = ARGV[1], ARGV[2], ARGV[4]
if lane ~= 'interactive' and lane ~= 'bulk' then return bad('unknown lane') end
if ARGV[3] ~= 'rid' or ARGV[5] ~= 'job' then return bad('fields must be rid and job') end
if #rid > {MAX_REQUEST_ID_CHARS} or not rid:find('^[A-Za-z0-9_.:%-]+$') then
  return bad('unusable request id')
end
if #ttl > {MAX_OWNER_TTL_DIGITS} or not ttl:find('^[1-9][0-9]*$') then
  return bad('owner TTL must be a positive integer')
end
local name = '[A-Za-z0-9][A-Za-z0-9_.%-]*'
local base = KEYS[1]:match('^(.+):jobs:' .. lane .. '$') or ''
local prefix, model = base:match('^(' .. name .. '):{{(' .. name .. ')}}$')
if not prefix or #prefix > {MAX_NAME_CHARS} or #model > {MAX_NAME_CHARS} then
  return bad('KEYS[1] is not the stream of the lane')
end
if KEYS[2] ~= base .. ':limits' then return bad('KEYS[2] is not the limits hash') end
if KEYS[3] ~= base .. ':owner:' .. rid then return bad('KEYS[3] is not the owner key') end
if redis.acl_check_cmd and not redis.acl_check_cmd('SET', KEYS[3], '0-1', 'PX', ttl) then
  return redis.error_reply('NOPERM this user may not SET ' .. KEYS[3])
end
local bound = tonumber(redis.call('HGET', KEYS[2], lane))
if bound and redis.call('XLEN', KEYS[1]) >= bound then
  return redis.error_reply('QUEUE_FULL ' .. bound)
end
if redis.call('EXISTS', KEYS[3]) == 1 then
  local owner = redis.pcall('GET', KEYS[3])
  if type(owner) ~= 'string' or not owner:find('^%d+%-%d+$') then owner = '?' end
  return redis.error_reply('DUPLICATE_REQUEST_ID ' .. owner)
end
local id = redis.call('XADD', KEYS[1], '*', 'rid', rid, 'job', ARGV[6])
redis.call('SET', KEYS[3], id, 'PX', ttl)
return id
"""
"""Admission: XADD a job only while its lane's stream holds fewer entries than the
lane's bound in :meth:`Keys.limits`, and only if its request id is free; then record the
new entry as the id's owner. One Lua script, so it is atomic; and every check (the call's
shape, the keys, the TTL, the ACL of the SET) comes before its first write, so an error
reply means nothing was written (Redis refuses a script's first write under OOM, and
never a later one). Workers XDEL each entry when they answer it, so XLEN is exactly the
jobs queued or in progress. Returns the entry id, or an error reply whose first word is
its code (ADMIT_ERROR_CODES). Run it with EVALSHA; PROTOCOL.md holds the same text.
Each client sends its own copy, so a new revision never breaks an older client."""

OWNER_TTL_PAD_MS = 600_000
"""Added to a job's own time budget for its owner key's TTL at submit; a job with no
deadline gets NO_DEADLINE_OWNER_TTL_MS. Workers set the TTL to the result's when they
answer, so the id stays taken exactly as long as its result can be read."""
NO_DEADLINE_OWNER_TTL_MS = 24 * 3600 * 1000

# NOTE [ Request id owners ]
#   A request id names exactly one job: its result key is the only place a client looks.
#   ``Keys.owner(id)`` holds the stream entry id of the job that owns the id. The admission
#   script refuses an id that has an owner, and sets it. Producers that XADD directly skip
#   that check, so a worker also claims the id when it reads an entry (SET NX GET): an entry
#   whose id is owned by a different entry is a duplicate and is dead-lettered without being
#   run or answered, so it cannot overwrite or pre-empt the first job's result. A job taken
#   over from a dead worker is the same entry, so it is not a duplicate.


def owner_ttl_ms(budget_ms: int | None) -> int:
    """TTL of a request id's owner key at submit, ms: ``max(0, budget_ms) + 600,000``, or
    86,400,000 without a deadline; always a positive integer, as the script requires."""
    return NO_DEADLINE_OWNER_TTL_MS if budget_ms is None else max(0, budget_ms) + OWNER_TTL_PAD_MS


QUEUE_FULL_REPLY = "QUEUE_FULL"
"""Code of the admission script's error reply ``QUEUE_FULL <bound>``: the lane is at its
bound (the number as Lua prints it)."""
DUPLICATE_REPLY = "DUPLICATE_REQUEST_ID"
"""Code of the admission script's error reply ``DUPLICATE_REQUEST_ID <owner>``: the request
id already has an owner, the stream entry id it names (``?`` if the key holds no entry id)."""
BAD_CALL_REPLY = "BAD_CALL"
"""Code of the admission script's error reply ``BAD_CALL <what>``: the call itself is
malformed (argument count, lane, fields, request id, TTL, or keys of another model/id)."""
NOPERM_REPLY = "NOPERM"
"""Code of the admission script's error reply ``NOPERM <what>`` (Redis 7 ACLs): the user may
add to the stream but not SET the owner key, so the script refuses before adding."""
ADMIT_ERROR_CODES = (QUEUE_FULL_REPLY, DUPLICATE_REPLY, BAD_CALL_REPLY, NOPERM_REPLY)
"""Every error code the admission script itself replies; each reply is ``CODE text``."""


def error_reply_code(message: str) -> str:
    """The code of a Redis error reply: its first word (``QUEUE_FULL 5`` -> ``QUEUE_FULL``).

    Give it the reply as it arrived, without the leading ``-``. redis-py's message of a
    plain ResponseError qualifies (it strips a leading ``ERR ``, which no admission reply
    carries); codes it knows (NOPERM, WRONGTYPE, OOM, ...) become their own exception
    classes, whose message lacks the code."""
    return message.split(" ", 1)[0]


def parse_queue_bound(raw: bytes | str | None) -> int | None:
    """A limits-hash field read as the admission script reads it: the most entries the
    lane may hold, or None (unbounded) when the field is absent or not a number."""
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    if math.isnan(value) or math.isinf(value):
        return None
    return max(0, math.ceil(value))


