"""The client's wait: it honours its timeout whatever Redis does, and planted keys of
another type neither crash it nor hang it. Against real redis-server processes: one that
is killed, one that is stopped (SIGSTOP), and keys planted as a hostile producer would."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis
from conftest import TEST_MODEL
from redbatch.cli.redis_server import RedisServer
from redbatch.common.protocol import ErrorCode, Keys, ResultEnvelope, Status
from redbatch.producer.client import AsyncClient, Client, ResultTimeout, ResultUnreadable

#: What a wait may overrun its timeout by on this (loaded, 2-core) machine: the client
#: promises about 0.2 s; the rest is scheduling noise.
SLACK_S = 1.5


@pytest.fixture
def server() -> Iterator[RedisServer]:
    """A private redis-server for one test, which the test may kill or stop."""
    with RedisServer() as srv:
        try:
            yield srv
        finally:
            if srv.pid is not None:
                os.kill(srv.pid, signal.SIGCONT)  # a stopped one must still die on stop()


def _timed_out(wait: Callable[[], object]) -> float:
    """Run the wait; assert it raised ResultTimeout; return how long it took, s."""
    started = time.monotonic()
    with pytest.raises(ResultTimeout):
        wait()
    return time.monotonic() - started


@pytest.mark.parametrize("fault", ["killed", "stopped"])
def test_the_wait_honours_its_timeout_when_redis_is_gone_or_hung(
        server: RedisServer, fault: str) -> None:
    """Killed: every call is refused at once (the old wait retried every 0.2 s forever).
    Stopped: the connection is open but nothing answers (the old wait blocked for its
    10 s socket timeout, then retried forever)."""
    with Client(server.url, model=TEST_MODEL) as client:
        rid = client.submit(b"x")  # connected, and the job is queued
        assert server.pid is not None
        if fault == "killed":
            server.kill()
        else:
            os.kill(server.pid, signal.SIGSTOP)
        took = _timed_out(lambda: client.result(rid, timeout_s=1.0))
        assert 1.0 <= took < 1.0 + SLACK_S, took


@pytest.mark.parametrize("fault", ["killed", "stopped"])
def test_the_async_wait_honours_its_timeout_when_redis_is_gone_or_hung(
        server: RedisServer, fault: str) -> None:
    async def run() -> float:
        async with AsyncClient(server.url, model=TEST_MODEL) as client:
            rid = await client.submit(b"x")
            assert server.pid is not None
            if fault == "killed":
                server.kill()
            else:
                os.kill(server.pid, signal.SIGSTOP)
            started = time.monotonic()
            with pytest.raises(ResultTimeout):
                await client.result(rid, timeout_s=1.0)
            return time.monotonic() - started

    took = asyncio.run(run())
    assert 1.0 <= took < 1.0 + SLACK_S, took


def _result(rid: str) -> bytes:
    return ResultEnvelope(rid, Status.OK, output={"label": "x"}, model=TEST_MODEL).encode()


def test_a_planted_done_key_makes_the_wait_poll_the_result_key(
        client: Client, r: redis.Redis, keys: Keys) -> None:
    r.set(keys.done("p1"), "planted")  # BLPOP on it answers WRONGTYPE
    timer = threading.Timer(0.6, lambda: r.set(keys.result("p1"), _result("p1")))
    timer.start()
    try:
        started = time.monotonic()
        result = client.result("p1", timeout_s=10)
    finally:
        timer.cancel()
    assert result.ok and result.output == {"label": "x"}
    assert time.monotonic() - started < 0.6 + SLACK_S, "polled, not stuck until the timeout"
    r.set(keys.done("p2"), "planted")
    took = _timed_out(lambda: client.result("p2", timeout_s=0.8))
    assert 0.8 <= took < 0.8 + SLACK_S


@pytest.mark.parametrize("plant", ["hash", "garbage"])
def test_a_planted_result_key_raises_a_clear_error(
        client: Client, r: redis.Redis, keys: Keys, plant: str) -> None:
    if plant == "hash":
        r.hset(keys.result("p3"), "x", 1)
    else:
        r.set(keys.result("p3"), b"\xc1 not msgpack")
    with pytest.raises(ResultUnreadable) as info:
        client.result("p3", timeout_s=5)
    e = info.value
    assert (e.key, e.request_id, e.code) == (keys.result("p3"), "p3", ErrorCode.BAD_ENVELOPE)
    assert str(e).startswith(f"bad_envelope: {keys.result('p3')} holds no result envelope: ")
    assert ("WRONGTYPE" in str(e)) is (plant == "hash")


def test_the_async_wait_survives_planted_keys(redis_url: str, r: redis.Redis,
                                              keys: Keys) -> None:
    r.set(keys.done("p4"), "planted")
    r.hset(keys.result("p5"), "x", 1)

    async def run() -> None:
        async with AsyncClient(redis_url, model=TEST_MODEL) as client:
            later = asyncio.get_running_loop().call_later(
                0.6, lambda: r.set(keys.result("p4"), _result("p4")))
            try:
                assert (await client.result("p4", timeout_s=10)).ok
            finally:
                later.cancel()
            with pytest.raises(ResultUnreadable):
                await client.result("p5", timeout_s=5)

    asyncio.run(run())
