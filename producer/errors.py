"""What the client raises: refusals at submit (QueueFull, DuplicateRequestId), the two
ways a wait ends without a result (ResultTimeout, ResultUnreadable), and a call Redis did
not answer (RedisUnreachable) or refused (RedisRefusedCall); with JobFailed (an error
result, raised on request), ProtocolError and FunctionsMissing (no function library
on Redis), all are RedbatchError, and each carries its
``code``, a ``str``. No redis-py exception leaves the client (:func:`client_error`
translates them where the faces run the calls, ``runners.py``).

Import them from ``redbatch`` (or ``redbatch.producer.client``), which re-export them.
"""

from __future__ import annotations

import redis
from redbatch.common.protocol import ErrorCode, Lane, ProtocolError, RedbatchError
from redbatch.common.redis_io import RedisRefused, RedisUnavailable, error_code

#: The code of a wait that ended without a result: ResultTimeout's, and what `redbatch
#: submit` and `redbatch score` write for such a job. A client's code, never a worker's.
RESULT_TIMEOUT = "timeout"
#: The code of a call Redis did not answer (RedisUnreachable's), and what `redbatch score`
#: writes for an input it gave up on when Redis stayed away. A client's code.
REDIS_UNAVAILABLE = "redis_unavailable"
#: The code of a call Redis answered with an error (RedisRefusedCall's). A client's code.
REDIS_REFUSED = "redis_refused"
#: What redis-py raises when Redis is out of reach: a refused, dropped or late connection,
#: or a cluster whose slot map cannot be read.
_UNREACHABLE = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterError,
                redis.exceptions.SlotNotCoveredError)
#: Everything redis-py raises (its cluster errors are no RedisError).
REDIS_PY_ERRORS = (redis.RedisError, redis.exceptions.RedisClusterException)


class RedisUnreachable(RedbatchError, RedisUnavailable):
    """Redis did not answer a call: the connection was refused or dropped, or no reply
    came within the client's ``redis_timeout_s`` (a hung Redis). What the call did is
    unknown: a submit may have queued its jobs (submitting the same envelopes again is
    safe, see DuplicateRequestId). Waits never raise it: they retry until their timeout
    and raise ResultTimeout."""

    code = REDIS_UNAVAILABLE

    def __init__(self, why: str) -> None:
        super().__init__(f"{REDIS_UNAVAILABLE}: Redis did not answer: {why}")


class RedisRefusedCall(RedbatchError, RedisRefused):
    """Redis answered a call with an error: out of memory (OOM), a replica (READONLY), a
    user's ACL (NOPERM), ... ``reply_code`` is the first word of its reply."""

    code = REDIS_REFUSED

    def __init__(self, reply_code: str, why: str) -> None:
        super().__init__(f"{REDIS_REFUSED}: Redis refused the call: {why}")
        self.reply_code = reply_code


def client_error(e: BaseException) -> RedbatchError:
    """The client's error for an exception redis-py raised (raise it ``from e``)."""
    if isinstance(e, redis.AuthenticationError):  # a ConnectionError, but an answer
        return RedisRefusedCall("AUTH", str(e))
    if isinstance(e, _UNREACHABLE):
        return RedisUnreachable(str(e) or type(e).__name__)
    return RedisRefusedCall(error_code(e), str(e) or type(e).__name__)


class ResultTimeout(RedbatchError, TimeoutError):
    """No result arrived within the time the caller was willing to wait."""

    code = RESULT_TIMEOUT

    def __init__(self, request_id: str, timeout_s: float) -> None:
        super().__init__(f"{RESULT_TIMEOUT}: no result for {request_id} within {timeout_s:g}s")
        self.request_id = request_id


class ResultUnreadable(ProtocolError):
    """The result key of ``request_id`` holds something that is not a result envelope:
    a key of another type (WRONGTYPE), or bytes that do not decode. Someone wrote it by
    hand; the job's own answer cannot be read there. ``key`` names it."""

    def __init__(self, request_id: str, key: str, why: str) -> None:
        super().__init__(ErrorCode.BAD_ENVELOPE, f"{key} holds no result envelope: {why}",
                         request_id)
        self.key = key


class QueueFull(RedbatchError):
    """Admission control refused jobs: their lane's queue is at its bound, in jobs, or
    (``tokens`` true) a generation job's charge does not fit under its token bound.

    Refused jobs were not queued (nothing was dropped silently); submit them again
    later. ``refused`` holds their request ids in submission order; ``accepted``
    the ids of the jobs of the same call that were queued (always empty for
    ``submit``). ``lane``, ``model``, ``bound`` and ``tokens`` describe the first
    refusal.
    """

    code = ErrorCode.QUEUE_FULL

    def __init__(self, model: str, lane: Lane, bound: int, refused: list[str],
                 accepted: list[str] | None = None, *, tokens: bool = False) -> None:
        self.model = model
        self.lane = lane
        self.bound = bound
        self.tokens = tokens
        self.refused = refused
        self.accepted = accepted or []
        #: Ids of the same call refused because they were in use (see DuplicateRequestId).
        self.duplicates: list[str] = []
        self.message = (f"the {lane.value} queue of model {model!r} is at its bound of "
                        f"{bound} {'tokens' if tokens else 'jobs'}; submit again later")
        if self.accepted:
            self.message += (f" ({len(refused)} of {len(refused) + len(self.accepted)} jobs "
                             f"refused, {len(self.accepted)} queued)")
        elif len(refused) > 1:
            self.message += f" ({len(refused)} jobs refused)"
        super().__init__(f"{self.code.value}: {self.message}")


class DuplicateRequestId(RedbatchError):
    """Refused at submit: these request ids belong to jobs already queued, running, or
    with a result that has not expired. Nothing was queued for them. ``accepted`` holds
    the ids of the jobs of the same call that were queued."""

    code = ErrorCode.DUPLICATE_REQUEST_ID

    def __init__(self, duplicates: list[str], accepted: list[str] | None = None) -> None:
        self.duplicates = duplicates
        self.accepted = accepted or []
        self.message = (f"request id {duplicates[0]!r} is already in use"
                        + (f" (and {len(duplicates) - 1} more)" if len(duplicates) > 1 else ""))
        super().__init__(f"{self.code.value}: {self.message}")


#: The code of FunctionsMissing: a client's code, never a worker's.
FUNCTIONS_MISSING = "functions_missing"


class FunctionsMissing(RedbatchError):
    """Redis has no redbatch function library of this client's version (PROTOCOL.md "The
    function library"), and this user may not load it: no worker has started on this
    Redis yet, or the workers are of another version. Nothing was sent to any queue. Start
    a worker, or load it with ``redbatch acl --apply`` (an admin's connection)."""

    code = FUNCTIONS_MISSING

    def __init__(self, function: str, why: str) -> None:
        super().__init__(f"{FUNCTIONS_MISSING}: Redis has no function {function} and this "
                         f"user may not load it ({why[:120]}); start a worker or run "
                         "`redbatch acl --apply`")
        self.function = function
