"""The steps the client's logic asks its face to run: Redis calls and pauses.

The client's logic (``core.py``, ``wait.py``) does no I/O. Each operation is a generator
that yields one step at a time and is sent the step's reply, or has the Redis error the
step raised thrown into it at that ``yield``; its return value is the operation's.
:class:`~redbatch.producer.client.Client` runs the steps blocking and
:class:`~redbatch.producer.client.AsyncClient` awaits them. Neither face holds logic of
its own, so the two cannot drift apart (the sans-I/O shape of h11 and wsproto).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from redbatch.common.protocol import ResultEnvelope
from redbatch.common.protocol.functions import ADMIT_FUNCTION

T = TypeVar("T")

Outcome = ResultEnvelope | Exception
"""What a wait on the reply list is handed: the result, or the error its caller raises."""

Arg = bytes | str | int | float
"""One argument of a Redis command."""


@dataclass(frozen=True, slots=True)
class Command:
    """One Redis command, ``args`` as sent (``("HGET", key, field)``); the reply comes back
    as redis-py parses it.

    ``due``: the monotonic time by which the reply must have come. A later one is a
    ``redis.TimeoutError``, and the connection is dropped so that the late reply never
    meets another command. None: only the socket timeout bounds the call.
    """

    args: tuple[Arg, ...]
    due: float | None = None


@dataclass(frozen=True, slots=True)
class Script:
    """One call of one of the protocol's functions (FCALL, or FCALL_RO when ``read_only``;
    the library is loaded, where the user may, when Redis lacks it): the admission
    function unless ``function`` names another (status, cancel)."""

    keys: list[str]
    args: list[Arg]
    function: str = ADMIT_FUNCTION
    read_only: bool = False


@dataclass(frozen=True, slots=True)
class Pipelined:
    """Calls sent in one round trip, not as a transaction; the reply is the list of their
    replies. ``errors_as_replies``: an error reply takes its call's place in the list as
    an exception instance; otherwise the first one is raised."""

    calls: tuple[Command | Script, ...]
    errors_as_replies: bool = False


@dataclass(frozen=True, slots=True)
class Pause:
    """Sleep ``seconds``; the reply is None."""

    seconds: float


class Inbox(Protocol):
    """Where the reply reader (``replies.py``) hands a waiting operation its outcomes; each
    face has its own, which it also reads (see :class:`Receive`)."""

    def deliver(self, request_id: str, outcome: Outcome) -> None:
        """Hand over the outcome of ``request_id``; never blocks."""


@dataclass(frozen=True, slots=True)
class Receive:
    """Wait until ``due`` (monotonic s) for the next outcome handed to ``inbox``, an inbox
    of the face's own kind; the reply is ``(request_id, outcome)``, or None once due."""

    inbox: Inbox
    due: float


Step = Command | Script | Pipelined | Pause | Receive

Steps = Generator[Step, Any, T]
"""An operation of the client: yields steps, returns a T."""
