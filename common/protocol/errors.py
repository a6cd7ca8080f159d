"""The stable error codes (PROTOCOL.md "Error codes") and the errors raised about a job,
under one base, RedbatchError: ProtocolError (a job or result that does not decode) and
JobFailed (an error result, raised on request). The client's own (QueueFull,
ResultTimeout, ...) subclass it in producer/errors.py.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from redbatch.common.protocol.envelopes import ResultEnvelope


class ErrorCode(StrEnum):
    """Stable error codes written into error results (see PROTOCOL.md). A ``str``: printed,
    formatted or compared, a code is its value (``bad_image``), never ``ErrorCode.X``."""

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
    """A recognised format that is not accepted (handlers/decode.py lists them by
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
    TOO_MANY_TOKENS = "too_many_tokens"
    """A generation job whose prompt tokens plus max_new_tokens pass the model's context
    or the worker's KV cache; refused as it was read, never run."""
    QUEUE_FULL = "queue_full"
    """Refused at submit: the lane's queue is at its bound (see ADMIT_SCRIPT). Never
    written by workers into a result; the client raises it to its caller."""
    DUPLICATE_REQUEST_ID = "duplicate_request_id"
    """The request id belongs to another job still queued, running, or with a live result.
    Refused at submit by ADMIT_SCRIPT; an entry added past it (plain XADD) is not run and
    goes to the dead-letter stream with this reason, and the first job keeps the id."""
    CANCELLED = "cancelled"
    """Cancelled before a worker took it (the cancel script, PROTOCOL.md "Cancelling a
    job"); it was never run. A worker writes it when it reads the cancel entry."""
    UNDELIVERABLE = "undeliverable"
    """Never written into a result, a dead-letter reason only: the answer's own keys (its
    done list, result key or reply list) hold another type, planted by someone, so the
    answer could not be written; the job is dead-lettered with its decoded envelope."""


class RedbatchError(Exception):
    """The base of every error redbatch raises about a job: ``code`` says what kind (an
    ErrorCode, which is a str, or a client-side code such as ``timeout``), ``request_id``
    which job, when known. Catch it to catch them all."""

    code: str | None = None
    request_id: str | None = None


class ProtocolError(RedbatchError):
    """A job or result could not be decoded or is invalid.

    ``request_id`` is set when the request could still be identified, so the
    caller can answer it with an error result.
    """

    code: ErrorCode

    def __init__(self, code: ErrorCode, message: str, request_id: str | None = None) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


class JobFailed(RedbatchError):
    """A job was answered with an error result (``ResultEnvelope.raise_for_error``, or
    ``predict(..., raise_on_error=True)``): ``code`` is its ErrorCode (``bad_image``,
    ``expired``, ...), ``message`` the worker's words, ``result`` the whole envelope."""

    code: ErrorCode | None

    def __init__(self, result: ResultEnvelope) -> None:
        self.result = result
        self.request_id = result.request_id
        self.code = result.error_code
        self.message = result.error_message
        code = result.error_code.value if result.error_code is not None else "error"
        super().__init__(f"{code}: {result.error_message} (request {result.request_id})")


class JobCancelled(JobFailed):
    """The job's answer is ``cancelled``: it was cancelled before a worker took it, and
    never ran (a JobFailed, so one ``except JobFailed`` catches both)."""
