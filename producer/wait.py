"""Waiting for one result, written once for both clients as a generator of steps.

The worker writes the result key and, for a job that names no reply list, pushes a copy
of the result envelope onto the request's "done" list (a ``done_only`` job's answer is in
that list alone). The wait GETs the result key (these are ids the client did not submit
itself, so their job may have named a reply list and have no done list); while it is absent
it waits on the done list for a slice (FIRST_SLICE_S, doubling up to WAIT_SLICE_S) with a
BLMOVE of the list onto itself, which returns its first element and leaves it there: the
job's own waiter may be another client, and a done-only answer has no other copy. An
envelope is the result; a slice that ends empty means GET again, and anything else (the
token ``1`` of older workers, a planted element) means polling GET from then on. A job that named
a reply list has no done list: the GET after the slice finds its result, so the slices
start short. The result key is durable (until its TTL), so a
connection that drops loses nothing: the wait pauses, reconnects and GETs again.

The wait honours its timeout whatever Redis does: every call has a due time (see
:meth:`_Wait.reply_by`), so a Redis that is gone, restarting or hung ends it with
ResultTimeout, about 0.2 s late at worst. A done key of another type (BLMOVE answers
WRONGTYPE), or a user who may not BLMOVE (a producer made by ``redbatch acl``: a move onto
another id's done list would plant an answer) does not end it either: from then on it
polls the result key and the done list's first element (LINDEX).

This is the per-request path: a client waits this way for ids it did not submit naming
its reply list; its own are awaited together on that list (see ``replies.py``), which
shares the clock rules and constants below.
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

#: Longest single block on the done key; short enough that a dead connection is noticed
#: and retried, and under the client's socket timeout (RedisSettings.socket_timeout_s, 10 s).
WAIT_SLICE_S = 5.0
#: First block of a per-request wait, s; each next one is twice as long, to WAIT_SLICE_S.
FIRST_SLICE_S = 0.25
#: Pause after a lost or late connection before the next call.
RECONNECT_PAUSE_S = 0.2
#: GET interval while the done key cannot be waited on (it holds another type).
POLL_S = 0.25
#: Shortest block sent (BLMOVE, BLMPOP): Redis reads a timeout under 1 ms as 0, which
#: blocks forever.
MIN_BLOCK_S = 0.01
#: A reply is always allowed this long, even at the deadline (one GET at timeout_s=0).
MIN_REPLY_S = 0.2


@dataclass(slots=True)
class DoneMoves:
    """Whether this client's user may BLMOVE a done list onto itself; one per client, so
    that after the first refusal (NOPERM) its waits poll without asking again."""

    allowed: bool = True


def wait_for_result(request_id: str, keys: Keys, timeout_s: float,
                    deadline: float | None = None,
                    moves: DoneMoves | None = None) -> Steps[ResultEnvelope]:
    """The steps of waiting ``timeout_s`` at most for the result of ``request_id``, or
    until ``deadline`` (monotonic s) when given (a wait that began earlier).

    Returns the result (not consumed: it can be read again until it expires). Raises
    ResultTimeout by the deadline, ResultUnreadable when the result key holds no result
    envelope, and Redis errors other than a lost or late connection as they come.
    """
    due = time.monotonic() + timeout_s if deadline is None else deadline
    moves = moves or DoneMoves()
    wait = _Wait(request_id, keys, timeout_s, due, moves, moves.allowed)
    while True:
        try:
            data = yield from _get(wait)
            if data is not None:
                return wait.decode(data)
            if wait.blocks:
                first = yield from _block(wait)
                if first is not None:
                    if (result := wait.token(first)) is not None:
                        return result
                    # Not this id's envelope (an older worker's token ``1``, a planted
                    # element): it stays first in the list, so the next BLMOVE would not
                    # block. Poll the result key from now on.
                    wait.blocks = False
            else:
                first = yield from _peek(wait)
                if first is not None and (result := wait.token(first)) is not None:
                    return result
                yield Pause(wait.pause_s(POLL_S))
        except (redis.ConnectionError, redis.TimeoutError):
            # redis-py reconnects on the next call; pause_s raises ResultTimeout when due.
            yield Pause(wait.pause_s(RECONNECT_PAUSE_S))


def _get(wait: _Wait) -> Steps[object]:
    """GET the result key; a key of another type raises ResultUnreadable."""
    try:
        data: object = yield Command(("GET", wait.result_key), wait.reply_by())
    except redis.ResponseError as e:
        if (unreadable := wait.unreadable(e)) is None:
            raise
        raise unreadable from e
    return data


def _block(wait: _Wait) -> Steps[object]:
    """Wait on the done key until the next slice ends, without popping (BLMOVE of the list
    onto itself, LEFT to LEFT: its first element, which stays): the element, or None (the
    slice ended empty, or the call failed and the wait polls from now on). Not popping
    keeps a ``done_only`` job's answer, whose only copy the list holds, for other readers."""
    seconds = wait.pause_s(wait.next_slice_s())
    done = wait.done_key
    try:
        reply = yield Command(("BLMOVE", done, done, "LEFT", "LEFT", round(seconds, 3)),
                              wait.reply_by(seconds))
    except redis.ResponseError as e:
        wait.no_block(e)
        return None
    return reply


def _peek(wait: _Wait) -> Steps[object]:
    """The done list's first element, read without popping (LINDEX), while the wait polls:
    a ``done_only`` answer has no result key. None when absent or unreadable."""
    try:
        return (yield Command(("LINDEX", wait.done_key, 0), wait.reply_by()))
    except redis.ResponseError:
        return None


def reply_by(deadline: float, blocking_s: float = 0.0) -> float:
    """Monotonic time by which a call that blocks ``blocking_s`` must be answered, for a
    wait that ends at ``deadline``: the deadline, or MIN_REPLY_S after the call would
    return if that is later."""
    return max(deadline, time.monotonic() + blocking_s + MIN_REPLY_S)


def decode_result(request_id: str, key: str, data: object) -> ResultEnvelope:
    """The result envelope read from ``key`` (the result key of ``request_id``); raises
    ResultUnreadable for anything else."""
    if not isinstance(data, bytes):
        raise ResultUnreadable(request_id, key, repr(data)[:80])
    try:
        return ResultEnvelope.decode(data)
    except ProtocolError as e:
        raise ResultUnreadable(request_id, key, e.message) from e


def unreadable(request_id: str, key: str, e: redis.ResponseError) -> ResultUnreadable | None:
    """ResultUnreadable when a GET's error reply says ``key``, the result key of
    ``request_id``, holds another type; None for other errors (NOPERM, ...), which the
    caller raises as they are."""
    if str(e).startswith("WRONGTYPE"):
        return ResultUnreadable(request_id, key, str(e))
    return None


@dataclass(slots=True)
class _Wait:
    """The clock and keys of one result wait."""

    request_id: str
    keys: Keys
    timeout_s: float
    deadline: float
    """Monotonic time the wait ends."""
    moves: DoneMoves
    blocks: bool = True
    """False once BLMOVE on the done key failed (it holds another type): poll GET instead."""
    slice_s: float = FIRST_SLICE_S
    """How long the next block may last, s."""

    @property
    def result_key(self) -> str:
        return self.keys.result(self.request_id)

    @property
    def done_key(self) -> str:
        return self.keys.done(self.request_id)

    def reply_by(self, blocking_s: float = 0.0) -> float:
        """When a call that blocks ``blocking_s`` must be answered (see :func:`reply_by`)."""
        return reply_by(self.deadline, blocking_s)

    def pause_s(self, longest: float) -> float:
        """Seconds to block or sleep before the next GET, ``longest`` at most; raises
        ResultTimeout once the deadline has passed."""
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise ResultTimeout(self.request_id, self.timeout_s)
        return max(MIN_BLOCK_S, min(remaining, longest))

    def next_slice_s(self) -> float:
        """The next block's longest, s: FIRST_SLICE_S, doubling to WAIT_SLICE_S."""
        seconds, self.slice_s = self.slice_s, min(WAIT_SLICE_S, self.slice_s * 2)
        return seconds

    def decode(self, data: object) -> ResultEnvelope:
        """The result envelope a GET returned; raises ResultUnreadable."""
        return decode_result(self.request_id, self.result_key, data)

    def token(self, popped: object) -> ResultEnvelope | None:
        """The result a popped done token carries; None for anything else (the token ``1``
        of older workers, a planted element), which sends the wait back to the result key."""
        if not isinstance(popped, bytes) or len(popped) < 2:
            return None
        try:
            result = ResultEnvelope.decode(popped)
        except ProtocolError:
            return None
        return result if result.request_id == self.request_id else None

    def unreadable(self, e: redis.ResponseError) -> ResultUnreadable | None:
        """ResultUnreadable when a GET's error reply says the result key holds another
        type (see :func:`unreadable`)."""
        return unreadable(self.request_id, self.result_key, e)

    def no_block(self, e: redis.ResponseError) -> None:
        """BLMOVE on the done key failed with ``e``: poll the result key from now on."""
        log = logger.warning
        if isinstance(e, redis.exceptions.NoPermissionError):
            log, self.moves.allowed = logger.info, False
        log("cannot wait on %s (%s); polling %s every %g s instead", self.done_key,
                       str(e)[:100], self.result_key, POLL_S)
        self.blocks = False
