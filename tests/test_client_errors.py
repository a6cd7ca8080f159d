"""Every call of ``Client`` and ``AsyncClient`` raises only RedbatchError subclasses, and
every call is bounded, with Redis down (killed: connections refused) and hung (SIGSTOP:
connections accepted, nothing answered). Waits end by their timeout with ResultTimeout;
every other call raises RedisUnreachable within about twice the client's
``redis_timeout_s``. One real redis-server for the module; no worker is needed."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from redbatch.cli.redis_server import RedisServer
from redbatch.common.protocol import ErrorCode, Lane, ProtocolError
from redbatch.producer.client import (
    AsyncClient,
    Client,
    QueueFull,
    RedbatchError,
    RedisUnreachable,
    ResultTimeout,
)

#: The client's bound on a call that is no wait, and every wait's timeout, s.
BOUND_S = 0.3
#: What a call may overrun its bound by on this loaded 2-core machine, s.
SLACK_S = 1.5
#: An id no client of the test submitted.
FOREIGN = "not-submitted-here-0001"

Call = Callable[[Any, str, Any], Any]

#: name -> (call(client, own id, a client that has made no call yet), is it a wait).
CALLS: dict[str, tuple[Call, bool]] = {
    "submit": (lambda c, own, cold: c.submit(b"x"), False),
    "submit_many": (lambda c, own, cold: c.submit_many([b"x", b"y"]), False),
    "submit_jobs": (lambda c, own, cold: c.submit_jobs([c.job(b"x")]), False),
    "submit_cold": (lambda c, own, cold: cold.submit(b"x"), False),
    "predict": (lambda c, own, cold: c.predict(b"x", timeout_s=BOUND_S), False),
    "result_own": (lambda c, own, cold: c.result(own, timeout_s=BOUND_S), True),
    "result_foreign": (lambda c, own, cold: cold.result(FOREIGN, timeout_s=BOUND_S), True),
    "results": (lambda c, own, cold: c.results([own, FOREIGN], timeout_s=BOUND_S), True),
    "handle_result": (lambda c, own, cold: own.result(timeout_s=BOUND_S), True),
    "status": (lambda c, own, cold: c.status(own), False),
    "status_cold": (lambda c, own, cold: cold.status(FOREIGN), False),
    "cancel": (lambda c, own, cold: c.cancel(own), False),
    "workers": (lambda c, own, cold: c.workers(), False),
    "queue_state": (lambda c, own, cold: c.queue_state(Lane.BULK), False),
    "set_queue_limit": (lambda c, own, cold: c.set_queue_limit(Lane.BULK, 5), False),
    "partitions": (lambda c, own, cold: cold.partitions(), False),
}


async def _async_as_completed(c: AsyncClient, ids: list[str]) -> list[Any]:
    return [res async for res in c.as_completed(ids, timeout_s=BOUND_S)]


#: The same calls of the asyncio client, as coroutines (as_completed for both: a generator).
CALLS["as_completed"] = (lambda c, own, cold: (
    _async_as_completed(c, [own, FOREIGN]) if isinstance(c, AsyncClient)
    else list(c.as_completed([own, FOREIGN], timeout_s=BOUND_S))), True)


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


class _Fault:
    """Redis down (killed, started again after) or hung (SIGSTOP, then SIGCONT)."""

    def __init__(self, server: RedisServer, kind: str) -> None:
        self.server, self.kind = server, kind

    def __enter__(self) -> None:
        assert self.server.pid is not None
        if self.kind == "down":
            self.server.kill()
        else:
            os.kill(self.server.pid, signal.SIGSTOP)

    def __exit__(self, *exc: object) -> None:
        if self.kind == "down":
            self.server.start()
        else:
            assert self.server.pid is not None
            os.kill(self.server.pid, signal.SIGCONT)


def _check(e: BaseException | None, took: float, wait: bool) -> None:
    assert e is not None, "the call returned"
    assert isinstance(e, RedbatchError), f"{type(e).__module__}.{type(e).__name__}: {e}"
    if wait:
        assert isinstance(e, ResultTimeout), repr(e)
        assert BOUND_S <= took < BOUND_S + SLACK_S, took
    else:
        assert isinstance(e, RedisUnreachable), repr(e)
        assert took < 2 * BOUND_S + SLACK_S, took
    # The code prints as its value: what a log line or a record shows.
    assert f"{e.code}" == str(e.code) == ("timeout" if wait else "redis_unavailable")


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("fault", ["down", "hung"])
def test_every_call_of_the_client_raises_ours_in_bounded_time(
        server: RedisServer, fault: str, call: str) -> None:
    run, wait = CALLS[call]
    with Client(server.url, model="null", redis_timeout_s=BOUND_S) as c, \
            Client(server.url, model="null", redis_timeout_s=BOUND_S) as cold:
        own = c.submit(b"x")
        error: BaseException | None = None
        with _Fault(server, fault):
            started = time.monotonic()
            try:
                run(c, own, cold)
            except Exception as e:
                error = e
            took = time.monotonic() - started
    _check(error, took, wait)


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("fault", ["down", "hung"])
def test_every_call_of_the_async_client_raises_ours_in_bounded_time(
        server: RedisServer, fault: str, call: str) -> None:
    run, wait = CALLS[call]

    async def case() -> tuple[BaseException | None, float]:
        c = AsyncClient(server.url, model="null", redis_timeout_s=BOUND_S)
        cold = AsyncClient(server.url, model="null", redis_timeout_s=BOUND_S)
        own = await c.submit(b"x")
        error: BaseException | None = None
        with _Fault(server, fault):
            started = time.monotonic()
            try:
                await run(c, own, cold)
            except Exception as e:
                error = e
            took = time.monotonic() - started
        await c.close()
        await cold.close()
        return error, took

    _check(*asyncio.run(case()), wait)


def test_error_codes_print_as_their_values() -> None:
    full = QueueFull("null", Lane.BULK, 4, ["a"])
    assert f"{full.code}" == str(full.code) == "queue_full"
    bad = ProtocolError(ErrorCode.BAD_ENVELOPE, "no")
    assert f"{bad.code}" == str(bad.code) == "bad_envelope"
    assert ErrorCode.BAD_IMAGE == "bad_image"
