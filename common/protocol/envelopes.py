"""The job and result envelopes (PROTOCOL.md "Job envelope", "Result envelope", "Limits"):
msgpack maps with string keys, and their limits. The stable error codes and the errors
raised about jobs live in errors.py.

``decode`` functions validate types and sizes and raise :class:`ProtocolError` carrying a
stable :class:`ErrorCode`; they never evaluate, import or unpickle anything.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import msgpack
from redbatch.common.protocol.errors import ErrorCode, JobCancelled, JobFailed, ProtocolError
from redbatch.common.protocol.keys import (
    FIELD_JOB,
    FIELD_REQUEST_ID,
    Lane,
    valid_request_id,
    validate_name,
)

PROTOCOL_VERSION = 1
"""Version written into every envelope; workers reject versions they don't know."""

# Limits on what a worker parses (PROTOCOL.md "Limits" lists each; a test compares them).
MAX_ENVELOPE_OVERHEAD_BYTES = 64 * 1024
"""A ``job`` field may be this many bytes longer than the payload limit (the envelope's
other fields); a longer one is answered ``payload_too_large`` unread."""
MAX_PARAMS = 32
"""Entries of an envelope's ``params`` map."""
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

class Status(StrEnum):
    OK = "ok"
    ERROR = "error"


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
    done_only: bool = False
    """Keep the answer in the done list only, with no result key (PROTOCOL.md "Waiting
    for the result"): one command per job less for a per-request waiter, and one copy of
    the envelope in Redis instead of two. Ignored with ``reply_to`` (whose client reads
    result keys)."""
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
        if self.done_only:
            body["done_only"] = True
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


def _job_fields_exact(body: Any) -> bool:
    """The common case of ``_check_fields(body, _JOB_FIELD_TYPES)``, decided in one
    expression: every field there with exactly the type msgpack decodes it to (``type is``
    also keeps a bool out of the int fields)."""
    get = body.get if type(body) is dict else None
    return get is not None and (
        type(get("v")) is int and type(get("model")) is str and type(get("payload")) is bytes
        and type(get("content_type")) is str and type(get("submitted_ms")) is int
        and "deadline_ms" in body
        and (type(body["deadline_ms"]) is int or body["deadline_ms"] is None)
        and type(get("lane")) is str and type(get("params")) is dict)


#: Lanes by their wire value: a dict lookup per job rather than an Enum call.
_LANES = {lane.value: lane for lane in Lane}
#: Model names already validated (a worker sees one, a client a few), so that the name's
#: pattern is matched once, not per job; at most _VALID_MODELS_KEPT are kept.
_VALID_MODELS: set[str] = set()
_VALID_MODELS_KEPT = 64


def _job_from_body(request_id: str, body: Any, max_payload_bytes: int) -> JobEnvelope:
    if not _job_fields_exact(body):
        _check_fields(body, _JOB_FIELD_TYPES)  # says what is wrong (or passes subclasses)
    if body["v"] != PROTOCOL_VERSION:
        raise ProtocolError(ErrorCode.UNSUPPORTED_VERSION, f"protocol version {body['v']}")
    if len(body["payload"]) > max_payload_bytes:
        size = len(body["payload"])
        raise ProtocolError(ErrorCode.PAYLOAD_TOO_LARGE, f"{size} > {max_payload_bytes} bytes")
    lane = _LANES.get(body["lane"])
    if lane is None:
        raise ProtocolError(ErrorCode.BAD_ENVELOPE, f"{body['lane']!r:.100} is not a valid Lane")
    if body["model"] not in _VALID_MODELS:
        try:
            validate_name(body["model"])
        except ValueError as e:
            raise ProtocolError(ErrorCode.BAD_ENVELOPE, str(e)) from e
        if len(_VALID_MODELS) < _VALID_MODELS_KEPT:
            _VALID_MODELS.add(body["model"])
    reply_to = body.get("reply_to")
    if reply_to is not None and not isinstance(reply_to, str):
        raise ProtocolError(ErrorCode.BAD_ENVELOPE, "field 'reply_to' must be a string or nil")
    done_only = body.get("done_only", False)
    if type(done_only) is not bool:
        raise ProtocolError(ErrorCode.BAD_ENVELOPE, "field 'done_only' must be a boolean")
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
        done_only=done_only,
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


# NOTE [ Ok results of a batch ]
# The answers to one batch share all but three of their ten fields (version, status, no
# error, batch size, worker, model, finish time), so ResultEnvelope.ok_encoder packs those
# once and each answer packs only its id, output and timings, joined between them: the
# bytes _pack_result makes (a map of the same ten keys in the same order; a test holds
# them equal), at about a third of the CPU of packing each whole map. Its Packer belongs
# to the one batch (a Packer is not shared between threads); one that raises on an output
# msgpack cannot carry starts empty again on the next call.


def _pack_result(version: int, request_id: str, status: str, output: Any,
                 error: dict[str, str] | None, timings: dict[str, float], batch_size: int,
                 worker: str, model: str, finished_ms: int) -> bytes:
    """The msgpack result envelope (PROTOCOL.md "Result envelope"): its one layout."""
    return packb({"v": version, "id": request_id, "status": status, "output": output,
                  "error": error, "timings": timings, "batch_size": batch_size,
                  "worker": worker, "model": model, "finished_ms": finished_ms})


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

    def raise_for_error(self) -> ResultEnvelope:
        """This result if it is ok; else raise JobFailed with its code and message
        (JobCancelled, a JobFailed, for ``cancelled``), so
        ``client.predict(x).raise_for_error().output`` is the output or an exception."""
        if not self.ok:
            raise (JobCancelled if self.error_code is ErrorCode.CANCELLED else JobFailed)(self)
        return self

    @classmethod
    def error(cls, request_id: str, code: ErrorCode, message: str, **kw: Any) -> ResultEnvelope:
        return cls(request_id, Status.ERROR, error_code=code, error_message=message, **kw)

    def encode(self) -> bytes:
        error = None
        if self.error_code is not None:
            error = {"code": self.error_code.value, "message": self.error_message}
        return _pack_result(self.version, self.request_id, self.status.value, self.output,
                            error, dict(self.timings), self.batch_size, self.worker, self.model,
                            self.finished_ms)

    @staticmethod
    def encode_ok(request_id: str, output: Any, timings: dict[str, float], batch_size: int,
                  worker: str, model: str, finished_ms: int) -> bytes:
        """What ``ResultEnvelope(request_id, Status.OK, output, ...).encode()`` returns,
        without the object: a worker encodes every ok answer this way."""
        return _pack_result(PROTOCOL_VERSION, request_id, Status.OK.value, output, None, timings,
                            batch_size, worker, model, finished_ms)

    @staticmethod
    def ok_encoder(batch_size: int, worker: str, model: str,
                   finished_ms: int) -> Callable[[str, Any, dict[str, float]], bytes]:
        """``encode_ok`` for one batch's answers: ``encode(request_id, output, timings)``
        returns the same bytes (NOTE [ Ok results of a batch ])."""
        packer = msgpack.Packer(use_bin_type=True)
        pack = packer.pack
        head = b"\x8a" + pack("v") + pack(PROTOCOL_VERSION) + pack("id")
        middle = pack("status") + pack(Status.OK.value) + pack("output")
        before_timings = pack("error") + pack(None) + pack("timings")
        tail = (pack("batch_size") + pack(batch_size) + pack("worker") + pack(worker)
                + pack("model") + pack(model) + pack("finished_ms") + pack(finished_ms))

        def encode(request_id: str, output: Any, timings: dict[str, float]) -> bytes:
            return b"".join((head, pack(request_id), middle, pack(output), before_timings,
                             pack(timings), tail))

        return encode

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


