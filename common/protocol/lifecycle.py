"""A job's life as Redis holds it (PROTOCOL.md "Job status" and "Cancelling a job"): the
owner key's value, the state read from what Redis already holds, and the cancel script.

NOTE [ Status and cancel ]
  Nothing new is stored to know where a job is. Its owner key (``Keys.owner``) names its
  stream entry and lane (``<entry id> <lane>``, :func:`owner_value`), the consumer group
  says how far workers have read each lane (``last-delivered-id``) and which entries they
  hold (XPENDING), and the result key (or, for a ``done_only`` job, the done list) holds
  the answer. STATUS_SCRIPT reads them in one
  round trip, as one snapshot (a worker writes a result and acknowledges its entry in one
  MULTI, so no read falls between the two); :func:`job_status` decides. It writes nothing
  and costs the workers nothing.

  Cancelling is one script (CANCEL_SCRIPT), atomic with the workers' reads: a job whose
  entry lies past the group's ``last-delivered-id`` has not been taken by any worker, and
  the script takes it out (XDEL) and adds a cancel entry (field ``cancel``) to the
  interactive lane in its place, which a worker answers ``cancelled`` as soon as it reads
  it (interactive is served first), running nothing. A producer may not write results
  (PROTOCOL.md "Trust model"), so the answer comes from a worker like any other, and every
  waiter, in any language, sees it where it already looks. A job already taken cannot be
  called back in protocol 1: the script says ``taken`` and the job runs to its answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import cast

from redbatch.common.protocol.envelopes import ResultEnvelope
from redbatch.common.protocol.errors import ErrorCode
from redbatch.common.protocol.keys import MAX_NAME_CHARS, MAX_REQUEST_ID_CHARS, Lane

OWNER_CANCEL_FLAG = "cancel"
"""Third word of an owner value whose entry is a cancel entry (the job was cancelled)."""


@dataclass(frozen=True, slots=True)
class Owner:
    """An owner key's value read: the entry that owns the request id, its lane (None when
    an older writer left the bare entry id), and whether that entry is a cancel entry."""

    entry_id: str
    lane: Lane | None = None
    cancelled: bool = False


def owner_value(entry_id: bytes | str, lane: Lane | str, cancelled: bool = False) -> str:
    """What an owner key holds: ``<entry id> <lane>``, with `` cancel`` for a cancel entry."""
    entry = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    flag = f" {OWNER_CANCEL_FLAG}" if cancelled else ""
    return f"{entry} {Lane(lane).value}{flag}"


def parse_owner(raw: bytes | str | None) -> Owner | None:
    """The owner a value names, or None for no value or one that names no entry. A bare
    entry id (written by admission revisions before 4 and by older workers) has no lane."""
    if raw is None:
        return None
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    words = text.split(" ")
    if not _entry_id(words[0]) or len(words) > 3:
        return None
    try:
        lane = Lane(words[1]) if len(words) > 1 else None
    except ValueError:
        return None
    return Owner(words[0], lane, len(words) == 3 and words[2] == OWNER_CANCEL_FLAG)


def owner_entry(raw: bytes | str) -> bytes:
    """The entry id an owner value names (its first word), as bytes, for comparing with an
    entry id as XREADGROUP returns it."""
    data = raw.encode() if isinstance(raw, str) else raw
    return data.split(b" ", 1)[0]


def _entry_id(text: str) -> bool:
    ms, dash, seq = text.partition("-")
    return bool(dash) and ms.isdigit() and seq.isdigit() and ms.isascii() and seq.isascii()


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq)


def _entry_after(entry_id: str, other: str) -> bool:
    """Whether stream entry ``entry_id`` comes after ``other`` (``ms-seq``, compared as
    numbers, as Redis orders them)."""
    return _id_key(entry_id) > _id_key(other)


class JobState(StrEnum):
    """Where a job is, as :func:`job_status` reads it from what Redis holds."""

    QUEUED = "queued"
    """In its lane's stream, not yet read by any worker."""
    RUNNING = "running"
    """Taken by a worker (read from the stream: preprocessing, batching or running)."""
    DONE = "done"
    """Answered ok: the result is there."""
    FAILED = "failed"
    """Answered with an error result (``expired``, ``bad_image``, ``dead_lettered``, ...)."""
    CANCELLED = "cancelled"
    """Cancelled before a worker took it; never run. Its ``cancelled`` answer is there, or
    will be once a worker reads the cancel entry."""
    UNKNOWN = "unknown"
    """Redis holds nothing of it: never submitted, refused, answered and the result expired
    or deleted, or submitted with a plain XADD and not yet read."""


@dataclass(frozen=True, slots=True)
class JobStatus:
    """A job's state, and what Redis said about it."""

    request_id: str
    state: JobState
    result: ResultEnvelope | None = None
    """The answer, once there (DONE, FAILED, and CANCELLED once answered)."""
    lane: Lane | None = None
    entry_id: str | None = None
    """The stream entry that holds it (its cancel entry, when cancelled)."""
    worker: str | None = None
    """RUNNING: the consumer that holds it."""
    deliveries: int | None = None
    """RUNNING: how many times Redis has delivered it (above 1: a worker died holding it)."""

    @property
    def finished(self) -> bool:
        """Whether the job has its answer (DONE, FAILED, or an answered CANCELLED)."""
        return self.result is not None


def answered_state(result: ResultEnvelope) -> JobState:
    """The state of a job whose result is ``result``."""
    if result.ok:
        return JobState.DONE
    return JobState.CANCELLED if result.error_code is ErrorCode.CANCELLED else JobState.FAILED


def job_status(request_id: str, reply: list[object]) -> JobStatus:
    """The status of ``request_id`` from STATUS_SCRIPT's reply (see there). Raises
    ProtocolError when the result key holds something that is not a result envelope."""
    if reply and reply[0] is not None:
        result = ResultEnvelope.decode(_bytes(reply[0]))
        return JobStatus(request_id, answered_state(result), result)
    owner = parse_owner(_bytes(reply[1])) if len(reply) > 1 and reply[1] is not None else None
    if owner is None:
        return JobStatus(request_id, JobState.UNKNOWN)
    last, holder, deliveries = (list(reply[2:5]) + [None] * 3)[:3]
    lane, entry = owner.lane or Lane.INTERACTIVE, owner.entry_id
    if holder is not None:
        return JobStatus(request_id, JobState.RUNNING, None, lane, entry,
                         _bytes(holder).decode(errors="replace"), int(cast(int, deliveries)))
    if last is None or _entry_after(entry, _bytes(last).decode()):
        state = JobState.CANCELLED if owner.cancelled else JobState.QUEUED
        return JobStatus(request_id, state, None, lane, entry)
    # Read and no longer pending, with no result: answered and the result expired or was
    # deleted, dead-lettered as a duplicate, or deleted from the stream by someone.
    return JobStatus(request_id, JobState.UNKNOWN, None, lane, entry)


def _bytes(value: object) -> bytes:
    return value.encode() if isinstance(value, str) else cast(bytes, value)


STATUS_SCRIPT = f"""\
-- redbatch status script, protocol 1 (revision 4: entry ids checked)
-- KEYS: P:{{M}}:result:<request id>  P:{{M}}:owner:<request id>
--       P:{{M}}:jobs:interactive  P:{{M}}:jobs:bulk  [P:{{M}}:done:<request id>]
-- reply: result, owner, last-delivered-id, consumer, deliveries (nil when absent)
if (#KEYS ~= 4 and #KEYS ~= 5) or #ARGV ~= 0 then
  return redis.error_reply('BAD_CALL expected 4 or 5 keys and no arguments')
end
local name = '[A-Za-z0-9][A-Za-z0-9_.%-]*'
local base = KEYS[3]:match('^(.+):jobs:interactive$') or ''
local prefix, model, part = base:match('^(' .. name .. '):{{(' .. name .. ')(#?%d*)}}$')
if part and part ~= '' and not part:find('^#[1-9]%d*$') then prefix = nil end
local rid = KEYS[1]:sub(#base + 9)
if not prefix or #prefix > {MAX_NAME_CHARS} or #model > {MAX_NAME_CHARS}
   or KEYS[4] ~= base .. ':jobs:bulk' or KEYS[1] ~= base .. ':result:' .. rid
   or KEYS[2] ~= base .. ':owner:' .. rid
   or (KEYS[5] and KEYS[5] ~= base .. ':done:' .. rid) then
  return redis.error_reply('BAD_CALL the keys are not one request id of one model')
end
local result = redis.call('GET', KEYS[1])
if result then return {{result}} end
if KEYS[5] then
  local first = redis.pcall('LINDEX', KEYS[5], 0)
  if type(first) == 'string' then return {{first}} end
end
local owner = redis.pcall('GET', KEYS[2])
if type(owner) ~= 'string' then return {{false}} end
local entry, lane = owner:match('^(%d+%-%d+) ?(%l*)')
local function fits(n) return #n < 20 or (#n == 20 and n <= '18446744073709551615') end
if not entry or not (fits(entry:match('^%d+')) and fits(entry:match('%d+$'))) then
  return {{false}}
end
local stream = lane == 'bulk' and KEYS[4] or KEYS[3]
local last, holder, deliveries = false, false, false
local groups = redis.pcall('XINFO', 'GROUPS', stream)
if type(groups) == 'table' and not groups.err then
  for _, group in ipairs(groups) do
    local fields = {{}}
    for i = 1, #group, 2 do fields[group[i]] = group[i + 1] end
    if fields['name'] == 'workers' then last = fields['last-delivered-id'] end
  end
end
if last then
  local pending = redis.call('XPENDING', stream, 'workers', entry, entry, 1)
  if pending[1] then holder, deliveries = pending[1][2], pending[1][4] end
end
return {{false, owner, last, holder, deliveries}}
"""
"""Read where one job is, in one atomic call that writes nothing (see NOTE [ Status and
cancel ]): replies an array of five, nil where absent: the answer (then nothing else
follows: the result key's value, else, when the fifth key is given, the first element of
the done list, where a ``done_only`` job's answer lives), the owner key's value, the
consumer group's ``last-delivered-id`` on the owner's lane (interactive when the owner
names none; nil: no group yet), and, when the owner's entry is pending, the consumer that
holds it and how many times it was delivered.
A result key of another type is an error reply (WRONGTYPE): the answer cannot be read."""


CANCELLED_REPLY = "cancelled"
"""The cancel script's reply ``cancelled <entry id>``: the job was queued; it is out of its
stream, and the cancel entry ``<entry id>`` (interactive lane) will be answered ``cancelled``."""
TAKEN_REPLY = "taken"
"""The cancel script's reply ``taken``: a worker has read the job (it is running, or
answered); it runs to its own answer."""
UNKNOWN_REPLY = "unknown"
"""The cancel script's reply ``unknown``: no queued job owns the id that the script can
find (never submitted, answered and expired, or an owner without a lane). Cancelling a
job again replies ``cancelled`` with the same cancel entry, so a lost reply can be retried."""

CANCEL_SCRIPT = f"""\
-- redbatch cancel script, protocol 1 (revision 3: entry ids checked)
-- KEYS: P:{{M}}:jobs:interactive  P:{{M}}:jobs:bulk  P:{{M}}:owner:<request id>
-- ARGV: <request id>  <msgpack job envelope of the cancel entry>
local function bad(why) return redis.error_reply('BAD_CALL ' .. why) end
if #KEYS ~= 3 or #ARGV ~= 2 then return bad('expected 3 keys and 2 arguments') end
local name = '[A-Za-z0-9][A-Za-z0-9_.%-]*'
local base = KEYS[1]:match('^(.+):jobs:interactive$') or ''
local prefix, model, part = base:match('^(' .. name .. '):{{(' .. name .. ')(#?%d*)}}$')
if part and part ~= '' and not part:find('^#[1-9]%d*$') then prefix = nil end
if not prefix or #prefix > {MAX_NAME_CHARS} or #model > {MAX_NAME_CHARS} then
  return bad('KEYS[1] is not an interactive stream')
end
if KEYS[2] ~= base .. ':jobs:bulk' then return bad('KEYS[2] is not the bulk stream') end
local rid = ARGV[1]
if #rid > {MAX_REQUEST_ID_CHARS} or not rid:find('^[A-Za-z0-9_.:%-]+$') then
  return bad('unusable request id')
end
if KEYS[3] ~= base .. ':owner:' .. rid then return bad('KEYS[3] is not the owner key') end
local acl = redis.acl_check_cmd
if acl and not (acl('XADD', KEYS[1], '*', 'a', 'b') and acl('XDEL', KEYS[1], '0-1')
                and acl('XDEL', KEYS[2], '0-1') and acl('XINFO', 'GROUPS', KEYS[1])
                and acl('XINFO', 'GROUPS', KEYS[2])
                and acl('SET', KEYS[3], '0-1', 'XX', 'KEEPTTL')) then
  return redis.error_reply('NOPERM this user may not cancel on ' .. base)
end
local owner = redis.pcall('GET', KEYS[3])
if type(owner) ~= 'string' then return 'unknown' end
local done = owner:match('^(%d+%-%d+) interactive cancel$')
if done then return 'cancelled ' .. done end
local entry, lane = owner:match('^(%d+%-%d+) (%l+)$')
local stream = ({{interactive = KEYS[1], bulk = KEYS[2]}})[lane or '']
local function fits(n) return #n < 20 or (#n == 20 and n <= '18446744073709551615') end
if not stream or not (fits(entry:match('^%d+')) and fits(entry:match('%d+$'))) then
  return 'unknown'
end
local function id(text)
  local ms, seq = text:match('^(%d+)%-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local groups = redis.pcall('XINFO', 'GROUPS', stream)
if type(groups) ~= 'table' or groups.err then return 'unknown' end
local ems, eseq = id(entry)
for _, group in ipairs(groups) do
  local fields = {{}}
  for i = 1, #group, 2 do fields[group[i]] = group[i + 1] end
  if fields['name'] == 'workers' then
    local lms, lseq = id(fields['last-delivered-id'])
    if ems < lms or (ems == lms and eseq <= lseq) then return 'taken' end
  end
end
local cancel = redis.call('XADD', KEYS[1], '*', 'rid', rid, 'job', ARGV[2], 'adm', '1',
                          'cancel', owner)
if redis.call('XDEL', stream, entry) == 0 then
  redis.call('XDEL', KEYS[1], cancel)
  return 'unknown'
end
redis.call('SET', KEYS[3], cancel .. ' interactive cancel', 'XX', 'KEEPTTL')
return 'cancelled ' .. cancel
"""
"""Cancel one queued job (see NOTE [ Status and cancel ]). Atomic with the workers' reads,
so a job it takes out was never read and never runs. Its first write is the XADD of the
cancel entry (Redis refuses a script's first write under OOM, and never a later one), then
the XDEL of the job (none: the cancel entry is taken back out, ``unknown``), then the owner
key names the cancel entry (``<id> interactive cancel``, TTL kept). Replies a status
string: CANCELLED_REPLY with the cancel entry's id, TAKEN_REPLY or UNKNOWN_REPLY; or an
error ``BAD_CALL <what>`` / ``NOPERM <what>`` having written nothing."""
