"""Waiting for one result, written once for both clients as a generator of steps.

The worker writes the result key and pushes one token onto the request's "done" list.
The wait GETs the result key; while it is absent it BLPOPs the done list for a slice of
at most 5 s, then GETs again. The result key is durable (until its TTL), so a connection
that drops loses nothing: the wait pauses, reconnects and GETs again.

The wait honours its timeout whatever Redis does: every call has a due time (see
:meth:`_Wait.reply_by`), so a Redis that is gone, restarting or hung ends it with
ResultTimeout, about 0.2 s late at worst. A done key of another type (BLPOP answers
WRONGTYPE) does not end it either: from then on it polls the result key.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import redis
from redbatch.common.protocol import Keys, ProtocolError, ResultEnvelope
from redbatch.producer.calls import Command, Pause, Steps
from redbatch.producer.errors import ResultTimeout, ResultUnreadable

logger = logging.getLogger(__name__)

#: Longest single BLPOP; short enough that a dead connection is noticed and retried, and
#: under the client's socket timeout (RedisSettings.socket_timeout_s, 10 s).
_WAIT_SLICE_S = 5.0
_RECONNECT_PAUSE_S = 0.2
#: GET interval while the done key cannot be BLPOPped (it holds another type).
_POLL_S = 0.25
#: Shortest BLPOP sent: Redis reads a timeout under 1 ms as 0, which blocks forever.
_MIN_BLPOP_S = 0.01
#: A reply is always allowed this long, even at the deadline (one GET at timeout_s=0).
_MIN_REPLY_S = 0.2


def wait_for_result(request_id: str, keys: Keys, timeout_s: float) -> Steps[ResultEnvelope]:
    """The steps of waiting ``timeout_s`` at most for the result of ``request_id``.

    Returns the result (not consumed: it can be read again until it expires). Raises
    ResultTimeout by the deadline, ResultUnreadable when the result key holds no result
    envelope, and Redis errors other than a lost or late connection as they come.
    """
    wait = _Wait(request_id, keys, timeout_s)
    while True:
        try:
            data = yield from _get(wait)
            if data is not None:
                return wait.decode(data)
            if wait.blpop:
                yield from _block(wait)
            else:
                yield Pause(wait.pause_s(_POLL_S))
        except (redis.ConnectionError, redis.TimeoutError):
            # redis-py reconnects on the next call; pause_s raises ResultTimeout when due.
            yield Pause(wait.pause_s(_RECONNECT_PAUSE_S))


def _get(wait: _Wait) -> Steps[object]:
    """GET the result key; a key of another type raises ResultUnreadable."""
    try:
        data: object = yield Command(("GET", wait.result_key), wait.reply_by())
    except redis.ResponseError as e:
        if (unreadable := wait.unreadable(e)) is None:
            raise
        raise unreadable from e
    return data


def _block(wait: _Wait) -> Steps[None]:
    """BLPOP the done key until the next slice ends; polling from now on if it fails."""
    seconds = wait.pause_s(_WAIT_SLICE_S)
    try:
        yield Command(("BLPOP", wait.done_key, round(seconds, 3)), wait.reply_by(seconds))
    except redis.ResponseError as e:
        wait.no_blpop(e)


@dataclass(slots=True)
class _Wait:
    """The clock and keys of one result wait."""

    request_id: str
    keys: Keys
    timeout_s: float
    deadline: float = 0.0
    """Monotonic time the wait ends."""
    blpop: bool = True
    """False once BLPOP on the done key failed (it holds another type): poll GET instead."""

    def __post_init__(self) -> None:
        self.deadline = time.monotonic() + self.timeout_s

    @property
    def result_key(self) -> str:
        return self.keys.result(self.request_id)

    @property
    def done_key(self) -> str:
        return self.keys.done(self.request_id)

    def reply_by(self, blocking_s: float = 0.0) -> float:
        """Monotonic time by which a call that blocks ``blocking_s`` must be answered: the
        deadline, or _MIN_REPLY_S after the call would return if that is later."""
        return max(self.deadline, time.monotonic() + blocking_s + _MIN_REPLY_S)

    def pause_s(self, longest: float) -> float:
        """Seconds to block or sleep before the next GET, ``longest`` at most; raises
        ResultTimeout once the deadline has passed."""
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise ResultTimeout(self.request_id, self.timeout_s)
        return max(_MIN_BLPOP_S, min(remaining, longest))

    def decode(self, data: object) -> ResultEnvelope:
        """The result envelope a GET returned; raises ResultUnreadable."""
        if not isinstance(data, bytes):
            raise ResultUnreadable(self.request_id, self.result_key, repr(data)[:80])
        try:
            return ResultEnvelope.decode(data)
        except ProtocolError as e:
            raise ResultUnreadable(self.request_id, self.result_key, e.message) from e

    def unreadable(self, e: redis.ResponseError) -> ResultUnreadable | None:
        """ResultUnreadable when a GET's error reply says the result key holds another
        type; None for other errors (NOPERM, ...), which the caller raises as they are."""
        if str(e).startswith("WRONGTYPE"):
            return ResultUnreadable(self.request_id, self.result_key, str(e))
        return None

    def no_blpop(self, e: redis.ResponseError) -> None:
        """BLPOP on the done key failed with ``e``: poll the result key from now on."""
        logger.warning("cannot BLPOP %s (%s); polling %s every %g s instead", self.done_key,
                       str(e)[:100], self.result_key, _POLL_S)
        self.blpop = False
