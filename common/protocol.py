"""The wire protocol: Redis key names, the job and result envelopes, error codes.

This module mirrors PROTOCOL.md, which is the single source of truth for
clients in any language. It is the only module that spells a Redis key,
stream, group or field name; everything else asks it.

Envelopes are msgpack maps with string keys. ``decode`` functions validate
types and sizes and raise :class:`ProtocolError` carrying a stable
:class:`ErrorCode`; they never evaluate, import or unpickle anything.

It is longer than our modules usually are (about 700 lines) because it follows the page
section by section (names, keys, admission script, limits, envelopes, fleet records), and
keeping every spelling of the protocol in one module is the point of it.
"""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import msgpack

PROTOCOL_VERSION = 1
"""Version written into every envelope; workers reject versions they don't know."""

DEFAULT_PREFIX = "redbatch"
GROUP = "workers"
"""The consumer group every worker of a model joins, on each lane's stream."""

FIELD_REQUEST_ID = "rid"
"""Stream field holding the request id, kept apart from the body so that a
body that fails to decode can still be answered."""
FIELD_JOB = "job"
"""Stream field holding the msgpack job envelope."""

DONE_TOKEN = b"1"

#: Fields of a dead-letter entry (besides FIELD_REQUEST_ID and FIELD_JOB, copied as they were).
DLQ_SOURCE = "source"
DLQ_ENTRY = "entry"
DLQ_REASON = "reason"
DLQ_DELIVERIES = "deliveries"
DLQ_AT_MS = "at_ms"
#: Dead-letter entries kept at most (approximate trim), so the DLQ cannot grow without bound.
DLQ_MAX_LEN = 100_000

# Limits on what a worker parses (PROTOCOL.md "Limits" lists each; a test compares them).
MAX_ENVELOPE_OVERHEAD_BYTES = 64 * 1024
"""A ``job`` field may be this many bytes longer than the payload limit (the envelope's
other fields); a longer one is answered ``payload_too_large`` unread."""
MAX_PARAMS = 32
"""Entries of an envelope's ``params`` map."""
MAX_NAME_CHARS = 64
"""Longest model, prefix or reply-list name."""
MAX_REQUEST_ID_CHARS = 128
"""Longest request id."""
MAX_CONTENT_TYPE_BYTES = 4096
"""Longest ``content_type``, UTF-8 bytes; a longer one is ``bad_envelope``."""
MAX_STR_BYTES = 64 * 1024
"""Longest msgpack str anywhere in an envelope, UTF-8 bytes."""
MAX_ARRAY_LEN = 4096
"""Most items of any msgpack array in an envelope."""
MAX_MAP_LEN = 256
"""Most entries of any msgpack map in an envelope."""
MAX_DEPTH = 1024
"""Deepest nesting of msgpack arrays and maps: the msgpack extension's own fixed stack,
which it enforces with an empty StackError (stated here so the page can name it)."""
MAX_RESULT_BYTES = 64 * 1024 * 1024
"""Largest result envelope the Python client decodes."""

# fullmatch only: "$" in re.match also matches before a trailing newline.
_NAME_RE = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.\-]{{0,{MAX_NAME_CHARS - 1}}}")
_REQUEST_ID_RE = re.compile(rf"[A-Za-z0-9_.:\-]{{1,{MAX_REQUEST_ID_CHARS}}}")


class Lane(str, Enum):
    """Which stream of a model a job goes to; workers serve interactive first."""

    INTERACTIVE = "interactive"
    BULK = "bulk"


class Status(str, Enum):
    OK = "ok"
    ERROR = "error"


class ErrorCode(str, Enum):
    """Stable error codes written into error results (see PROTOCOL.md)."""

    BAD_ENVELOPE = "bad_envelope"
    """The job body is not a msgpack map of the documented shape."""
    UNSUPPORTED_VERSION = "unsupported_version"
    BAD_REQUEST_ID = "bad_request_id"
    WRONG_MODEL = "wrong_model"
    """The envelope names another model than the stream it was put on."""
    WRONG_LANE = "wrong_lane"
    """The envelope's ``lane`` is not the lane of the stream it was put on (a bulk job
    labelled interactive would be scheduled ahead of the interactive queue)."""
    PAYLOAD_TOO_LARGE = "payload_too_large"
    BAD_IMAGE = "bad_image"
    """Not an image, truncated, or corrupt."""
    UNSUPPORTED_FORMAT = "unsupported_format"
    """A recognised format that is not accepted (preproc_worker/decode.py lists them by
    signature), or an accepted one in a variant with no decoder (a TIFF compression)."""
    IMAGE_TOO_LARGE = "image_too_large"
    """Declared dimensions exceed the pixel or side limits (decompression bomb)."""
    BAD_INPUT = "bad_input"
    """The model's preprocessing rejected the payload for another reason."""
    EXPIRED = "expired"
    """The deadline passed before the job could be computed; it was not run."""
    DEAD_LETTERED = "dead_lettered"
    """Delivered too many times (it kept killing workers), or unanswerable; see the DLQ."""
    PREPROCESS_CRASHED = "preprocess_crashed"
    """A preprocessing process died on this input more than once."""
    INFERENCE_FAILED = "inference_failed"
    """The model raised an error on this request (alone, after the batch was split)."""
    NON_FINITE_OUTPUT = "non_finite_output"
    """The model's output for this request holds NaN or infinity."""
    INTERNAL = "internal"
    QUEUE_FULL = "queue_full"
    """Refused at submit: the lane's queue is at its bound (see ADMIT_SCRIPT). Never
    written by workers into a result; the client raises it to its caller."""
    DUPLICATE_REQUEST_ID = "duplicate_request_id"
    """The request id belongs to another job still queued, running, or with a live result.
    Refused at submit by ADMIT_SCRIPT; an entry added past it (plain XADD) is not run and
    goes to the dead-letter stream with this reason, and the first job keeps the id."""
    UNDELIVERABLE = "undeliverable"
    """Never written into a result, a dead-letter reason only: the answer's own keys (its
    done list, result key or reply list) hold another type, planted by someone, so the
    answer could not be written; the job is dead-lettered with its decoded envelope."""


class ProtocolError(Exception):
    """A job or result could not be decoded or is invalid.

    ``request_id`` is set when the request could still be identified, so the
    caller can answer it with an error result.
    """

    def __init__(self, code: ErrorCode, message: str, request_id: str | None = None) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


# --------------------------------------------------------------------------- names


def validate_name(name: str, what: str = "model") -> str:
    """Return ``name`` if it is a safe model or prefix name, else raise ValueError.

    Names end up inside Redis keys and are never resolved to files or code, but
    keeping them to a small alphabet stops slashes, braces (hash tags) and
    whitespace from making keys ambiguous.
    """
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(f"invalid {what} name {name!r:.100}: use 1-{MAX_NAME_CHARS} of "
                         "[A-Za-z0-9_.-], starting with a letter or digit")
    return name


def valid_request_id(request_id: object) -> bool:
    """True for a str of 1-MAX_REQUEST_ID_CHARS characters of ``A-Z a-z 0-9 _ . : -``."""
    return isinstance(request_id, str) and bool(_REQUEST_ID_RE.fullmatch(request_id))


def new_request_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True, slots=True)
class Keys:
    """Every Redis key of one model.

    All keys carry the model name as a Redis Cluster hash tag (``{model}``) so
    one model's streams and results live in one slot, which lets the worker
    write a result and acknowledge its job in one MULTI/EXEC.
    """

    model: str
    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        validate_name(self.model, "model")
        validate_name(self.prefix, "prefix")

    @property
    def _base(self) -> str:
        return f"{self.prefix}:{{{self.model}}}"

    def stream(self, lane: Lane) -> str:
        """The job stream of one lane."""
        return f"{self._base}:jobs:{Lane(lane).value}"

    def streams(self) -> list[str]:
        """All job streams, highest priority first."""
        return [self.stream(lane) for lane in Lane]

    def result(self, request_id: str) -> str:
        """String key holding the msgpack result envelope (expires)."""
        return f"{self._base}:result:{request_id}"

    def done(self, request_id: str) -> str:
        """List key that receives one token when the result is written (BLPOP it)."""
        return f"{self._base}:done:{request_id}"

    def dlq(self) -> str:
        """The dead-letter stream: jobs that will not be run again, with the reason."""
        return f"{self._base}:dlq"

    def reply(self, name: str) -> str:
        """A client's reply list: workers push the request id of each finished job whose
        envelope names it, so a client with many jobs in flight waits on one key."""
        return f"{self._base}:reply:{validate_name(name, 'reply')}"

    def is_reply(self, key: str) -> bool:
        """True for a key :meth:`reply` can produce; workers write no other list a job names."""
        prefix = f"{self._base}:reply:"
        return key.startswith(prefix) and bool(_NAME_RE.fullmatch(key[len(prefix):]))

    def owner(self, request_id: str) -> str:
        """String key naming the stream entry id of the job that owns ``request_id``, for
        as long as that job is queued or its result lives (see NOTE [ Request id owners ])."""
        return f"{self._base}:owner:{request_id}"

    def limits(self) -> str:
        """Hash of queue bounds: field = lane name, value = most entries its stream may
        hold for a new job to be admitted (absent: unbounded). See ADMIT_SCRIPT."""
        return f"{self._base}:limits"

    def workers(self) -> str:
        """Sorted set of the model's workers: member = consumer name, score = its last
        heartbeat, Unix ms. Expires with the fleet (see WORKERS_TTL_MS)."""
        return f"{self._base}:workers"

    def worker(self, consumer: str) -> str:
        """String key holding one worker's msgpack WorkerRecord; it lives WORKER_RECORD_TTL_MS
        past the last heartbeat, so it exists only while the worker is alive."""
        return f"{self._base}:worker:{consumer}"

    def recent(self) -> str:
        """List of the newest RECENT_MAX results' msgpack RecentResult records, newest first."""
        return f"{self._base}:recent"


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


# --------------------------------------------------------------------------- msgpack


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not allowed")


def packb(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


def unpackb(data: bytes, max_bytes: int) -> Any:
    """Decode msgpack within the limits above (str, array, map, nesting; bin and the whole
    body at most ``max_bytes``). Raises ProtocolError: PAYLOAD_TOO_LARGE for a body over
    ``max_bytes``, BAD_ENVELOPE (saying what is wrong) for anything else."""
    if len(data) > max_bytes:
        raise ProtocolError(ErrorCode.PAYLOAD_TOO_LARGE, f"envelope of {len(data)} bytes")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            ext_hook=_refuse_ext,
            max_str_len=MAX_STR_BYTES,
            max_bin_len=max_bytes,
            max_array_len=MAX_ARRAY_LEN,
            max_map_len=MAX_MAP_LEN,
        )
    except msgpack.StackError as e:  # its message is empty
        raise ProtocolError(ErrorCode.BAD_ENVELOPE, "body nests arrays or maps deeper than "
                            f"{MAX_DEPTH} levels") from e
    except Exception as e:  # msgpack raises many types; all mean "not our envelope"
        detail = str(e) or type(e).__name__
        raise ProtocolError(ErrorCode.BAD_ENVELOPE, f"body is not valid msgpack: {detail}") from e


# --------------------------------------------------------------------------- job


@dataclass(frozen=True, slots=True)
class JobEnvelope:
    """One inference request as it travels on a job stream."""

    request_id: str
    model: str
    payload: bytes
    content_type: str = "application/octet-stream"
    submitted_ms: int = 0
    """Client's wall clock at submit, Unix milliseconds."""
    deadline_ms: int | None = None
    """Client's wall clock after which the result is useless, or None."""
    lane: Lane = Lane.INTERACTIVE
    params: Mapping[str, Any] = field(default_factory=dict)
    reply_to: str | None = None
    """Optional reply list (see Keys.reply) that receives the request id when done."""
    version: int = PROTOCOL_VERSION

    def encode(self) -> dict[str, bytes]:
        """The stream entry fields for XADD."""
        body = {
            "v": self.version,
            "model": self.model,
            "payload": self.payload,
            "content_type": self.content_type,
            "submitted_ms": self.submitted_ms,
            "deadline_ms": self.deadline_ms,
            "lane": Lane(self.lane).value,
            "params": dict(self.params),
        }
        if self.reply_to is not None:
            body["reply_to"] = self.reply_to
        return {FIELD_REQUEST_ID: self.request_id.encode(), FIELD_JOB: packb(body)}

    @property
    def budget_ms(self) -> int | None:
        """The time the client allowed, independent of its clock's offset."""
        if self.deadline_ms is None:
            return None
        return self.deadline_ms - self.submitted_ms

    @classmethod
    def decode(cls, fields: Mapping[bytes, bytes], max_payload_bytes: int) -> JobEnvelope:
        """Validate a stream entry and build the envelope.

        Raises ProtocolError; its ``request_id`` is set whenever the entry had a
        usable request id, so the caller can answer it.
        """
        request_id = _decode_request_id(fields)
        raw = fields.get(FIELD_JOB.encode())
        if raw is None:
            raise ProtocolError(ErrorCode.BAD_ENVELOPE, "entry has no 'job' field", request_id)
        try:
            body = unpackb(raw, max_payload_bytes + MAX_ENVELOPE_OVERHEAD_BYTES)
            return _job_from_body(request_id, body, max_payload_bytes)
        except ProtocolError as e:
            raise ProtocolError(e.code, e.message, request_id) from e


def _decode_request_id(fields: Mapping[bytes, bytes]) -> str:
    raw = fields.get(FIELD_REQUEST_ID.encode())
    try:
        request_id = raw.decode() if isinstance(raw, bytes) else None
    except UnicodeDecodeError:
        request_id = None
    if request_id is None or not valid_request_id(request_id):
        raise ProtocolError(ErrorCode.BAD_REQUEST_ID, f"unusable request id {raw!r:.80}")
    return request_id


_JOB_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "v": (int,),
    "model": (str,),
    "payload": (bytes,),
    "content_type": (str,),
    "submitted_ms": (int,),
    "deadline_ms": (int, type(None)),
    "lane": (str,),
    "params": (dict,),
}


def _check_fields(body: Any, types: Mapping[str, tuple[type, ...]]) -> None:
    if not isinstance(body, dict):
        raise ProtocolError(ErrorCode.BAD_ENVELOPE, f"body is a {type(body).__name__}, not a map")
    for name, allowed in types.items():
        if name not in body:
            raise ProtocolError(ErrorCode.BAD_ENVELOPE, f"missing field {name!r}")
        value = body[name]
        # bool is an int subclass; a version or timestamp of True is a type error.
        if isinstance(value, bool) or not isinstance(value, allowed):
            kind = type(value).__name__
            raise ProtocolError(ErrorCode.BAD_ENVELOPE, f"field {name!r} has type {kind}")


def _job_from_body(request_id: str, body: Any, max_payload_bytes: int) -> JobEnvelope:
    _check_fields(body, _JOB_FIELD_TYPES)
    if body["v"] != PROTOCOL_VERSION:
        raise ProtocolError(ErrorCode.UNSUPPORTED_VERSION, f"protocol version {body['v']}")
    if len(body["payload"]) > max_payload_bytes:
        size = len(body["payload"])
        raise ProtocolError(ErrorCode.PAYLOAD_TOO_LARGE, f"{size} > {max_payload_bytes} bytes")
    try:
        lane = Lane(body["lane"])
        validate_name(body["model"])
    except ValueError as e:
        raise ProtocolError(ErrorCode.BAD_ENVELOPE, str(e)) from e
    reply_to = body.get("reply_to")
    if reply_to is not None and not isinstance(reply_to, str):
        raise ProtocolError(ErrorCode.BAD_ENVELOPE, "field 'reply_to' must be a string or nil")
    if len(body["content_type"].encode(errors="surrogatepass")) > MAX_CONTENT_TYPE_BYTES:
        raise ProtocolError(ErrorCode.BAD_ENVELOPE,
                            f"content_type longer than {MAX_CONTENT_TYPE_BYTES} bytes")
    return JobEnvelope(
        request_id=request_id,
        model=body["model"],
        payload=body["payload"],
        content_type=body["content_type"],
        submitted_ms=body["submitted_ms"],
        deadline_ms=body["deadline_ms"],
        lane=lane,
        params=_check_params(body["params"]),
        reply_to=reply_to,
    )


def _check_params(params: dict[Any, Any]) -> dict[str, Any]:
    """``params`` as the page allows it: at most MAX_PARAMS str keys to scalars."""
    if len(params) > MAX_PARAMS:
        raise ProtocolError(ErrorCode.BAD_ENVELOPE, f"more than {MAX_PARAMS} params")
    for key, value in params.items():
        if not isinstance(key, str):  # a msgpack bin key decodes as bytes
            kind = type(key).__name__
            raise ProtocolError(ErrorCode.BAD_ENVELOPE, f"param key {key!r:.80} is a {kind}")
        if not isinstance(value, str | int | float | bool | type(None)):
            kind = type(value).__name__
            raise ProtocolError(ErrorCode.BAD_ENVELOPE, f"param {key!r} has type {kind}")
    return params


# --------------------------------------------------------------------------- result


TIMING_NAMES = ("queue_ms", "preprocess_ms", "batch_wait_ms", "inference_ms", "total_ms")


@dataclass(frozen=True, slots=True)
class ResultEnvelope:
    """The answer to one request: ok with an output, or error with a code."""

    request_id: str
    status: Status
    output: Any = None
    error_code: ErrorCode | None = None
    error_message: str = ""
    timings: Mapping[str, float] = field(default_factory=dict)
    """Milliseconds per stage; see TIMING_NAMES."""
    batch_size: int = 0
    worker: str = ""
    model: str = ""
    finished_ms: int = 0
    version: int = PROTOCOL_VERSION

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    @classmethod
    def error(cls, request_id: str, code: ErrorCode, message: str, **kw: Any) -> ResultEnvelope:
        return cls(request_id, Status.ERROR, error_code=code, error_message=message, **kw)

    def encode(self) -> bytes:
        error = None
        if self.error_code is not None:
            error = {"code": self.error_code.value, "message": self.error_message}
        return packb(
            {
                "v": self.version,
                "id": self.request_id,
                "status": self.status.value,
                "output": self.output,
                "error": error,
                "timings": dict(self.timings),
                "batch_size": self.batch_size,
                "worker": self.worker,
                "model": self.model,
                "finished_ms": self.finished_ms,
            }
        )

    @classmethod
    def decode(cls, data: bytes, max_bytes: int = MAX_RESULT_BYTES) -> ResultEnvelope:
        body = unpackb(data, max_bytes)
        _check_fields(body, {"v": (int,), "id": (str,), "status": (str,)})
        error = body.get("error") or {}
        try:
            status = Status(body["status"])
            code = ErrorCode(error["code"]) if error else None
        except (ValueError, KeyError, TypeError) as e:
            raise ProtocolError(ErrorCode.BAD_ENVELOPE, f"bad result status: {e}") from e
        return cls(
            request_id=body["id"],
            status=status,
            output=body.get("output"),
            error_code=code,
            error_message=str(error.get("message", "")),
            timings=body.get("timings") or {},
            batch_size=int(body.get("batch_size") or 0),
            worker=str(body.get("worker") or ""),
            model=str(body.get("model") or ""),
            finished_ms=int(body.get("finished_ms") or 0),
            version=body["v"],
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly view, as the CLI prints it."""
        out: dict[str, Any] = {"id": self.request_id, "status": self.status.value}
        if self.ok:
            out["output"] = self.output
        else:
            out["error"] = {"code": self.error_code.value if self.error_code else None,
                            "message": self.error_message}
        out.update(timings=dict(self.timings), batch_size=self.batch_size,
                   worker=self.worker, model=self.model)
        return out


# --------------------------------------------------------------------------- fleet status
# Written by workers for `redbatch status` / `top`; clients need none of it. Every key expires.

HEARTBEAT_INTERVAL_S = 2.0
"""How often a worker writes its WorkerRecord and its score in Keys.workers()."""
WORKER_RECORD_TTL_MS = 3 * 2000
"""A worker record outlives three missed heartbeats, then the worker counts as gone."""
WORKERS_TTL_MS = 3600 * 1000
"""Members of Keys.workers() not seen for this long are removed; the set itself expires
this long after the last heartbeat of any worker."""
RECENT_MAX = 4096
"""Result records kept in Keys.recent() (LTRIM), enough for p99 over a minute of load."""
RECENT_TTL_MS = 3600 * 1000
"""Keys.recent() expires this long after the last result was written."""


def job_stream_pattern(prefix: str) -> str:
    """SCAN MATCH pattern for the job streams of every model under ``prefix``."""
    return f"{validate_name(prefix, 'prefix')}:{{*}}:jobs:*"


def parse_job_stream(prefix: str, key: str) -> tuple[str, Lane] | None:
    """``(model, lane)`` of a job stream key, or None for any other key."""
    m = re.fullmatch(rf"{re.escape(prefix)}:\{{([^{{}}]+)\}}:jobs:([a-z]+)", key)
    if m is None or not _NAME_RE.fullmatch(m.group(1)):
        return None
    try:
        return m.group(1), Lane(m.group(2))
    except ValueError:
        return None


_WORKER_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "consumer": (str,), "host": (str,), "pid": (int,), "version": (str,), "device": (str,),
    "max_batch_size": (int,), "started_ms": (int,), "last_seen_ms": (int,), "inflight": (int,),
    "metrics_port": (int, type(None)),
}


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """What a live worker says about itself in its heartbeat (Keys.worker)."""

    consumer: str
    host: str
    pid: int
    version: str
    device: str
    max_batch_size: int
    started_ms: int
    """Worker's wall clock when it started serving, Unix ms."""
    last_seen_ms: int
    """Worker's wall clock at this heartbeat, Unix ms."""
    inflight: int
    """Jobs read and not yet answered."""
    metrics_port: int | None = None
    """Port of its /metrics endpoint, or None when it serves none."""

    def encode(self) -> bytes:
        return packb({name: getattr(self, name) for name in _WORKER_FIELD_TYPES})

    @classmethod
    def decode(cls, data: bytes) -> WorkerRecord:
        body = unpackb(data, MAX_ENVELOPE_OVERHEAD_BYTES)
        _check_fields(body, _WORKER_FIELD_TYPES)
        return cls(**{name: body[name] for name in _WORKER_FIELD_TYPES})


_RECENT_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "finished_ms": (int,), "lane": (str,), "outcome": (str,), "total_ms": (float, int, type(None)),
}


@dataclass(frozen=True, slots=True)
class RecentResult:
    """One written result, as Keys.recent() keeps it for throughput and latency figures."""

    finished_ms: int
    """Worker's wall clock when the result was written, Unix ms."""
    lane: Lane
    outcome: str
    """``ok`` or the ErrorCode value."""
    total_ms: float | None
    """End-to-end time (the result's ``total_ms``); None for entries rejected unread."""

    def encode(self) -> bytes:
        return packb({"finished_ms": self.finished_ms, "lane": Lane(self.lane).value,
                      "outcome": self.outcome, "total_ms": self.total_ms})

    @classmethod
    def decode(cls, data: bytes) -> RecentResult:
        body = unpackb(data, MAX_ENVELOPE_OVERHEAD_BYTES)
        _check_fields(body, _RECENT_FIELD_TYPES)
        try:
            lane = Lane(body["lane"])
        except ValueError as e:
            raise ProtocolError(ErrorCode.BAD_ENVELOPE, str(e)) from e
        total = body["total_ms"]
        return cls(body["finished_ms"], lane, body["outcome"],
                   None if total is None else float(total))
