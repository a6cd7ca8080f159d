"""The client's wait: it honours its timeout whatever Redis does, and planted keys of
another type neither crash it nor hang it. Against real redis-server processes: one that
is killed, one that is stopped (SIGSTOP), and keys planted as a hostile producer would.
And waiting in groups (NOTE [ Waiting in groups ] in producer/replies.py): many waits in
one process share one reply list and one reader, with real null-model workers."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from urllib.parse import urlparse

import psutil
import pytest
import redis
from conftest import SAMPLES, TEST_MODEL, WorkerFactory
from redbatch.cli.redis_server import RedisServer
from redbatch.common.protocol import ErrorCode, Keys, ResultEnvelope, Status
from redbatch.producer import replies
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
@pytest.mark.serial
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
@pytest.mark.serial
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


def test_the_done_token_is_the_result_and_any_other_token_sends_the_wait_to_the_result_key(
        client: Client, r: redis.Redis, keys: Keys) -> None:
    """Workers push the result envelope itself as the done token (PROTOCOL.md "Waiting for
    the result"): the wait on the done list (BLMOVE onto itself, which leaves the token
    there) is the answer, no second GET. The token ``1`` of older workers, or an envelope
    of another id, only says "read the result key"."""
    r.rpush(keys.done("t1"), _result("t1"))
    r.config_resetstat()
    assert client.result("t1", timeout_s=5).output == {"label": "x"}
    calls = {name.removeprefix("cmdstat_"): stat["calls"]
             for name, stat in r.info("commandstats").items()}
    # The first GET: an id this client did not submit may have named a reply list.
    assert (calls.get("get"), calls.get("blmove")) == (1, 1), calls
    assert r.lrange(keys.done("t1"), 0, -1) == [_result("t1")], "not consumed"
    for rid, token in (("t2", b"1"), ("t3", _result("someone-else"))):
        r.rpush(keys.done(rid), token)
        timer = threading.Timer(0.3, lambda rid=rid: r.set(keys.result(rid), _result(rid)))
        timer.start()
        try:
            result = client.result(rid, timeout_s=10)
        finally:
            timer.cancel()
        assert result.request_id == rid and result.output == {"label": "x"}


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


# ---------------------------------------------------------------- waiting in groups

NULL = "null"
CAT = (SAMPLES / "cat.jpg").read_bytes()


def _until(condition: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g}s waiting for {what}"
        time.sleep(0.05)


def _sockets_to(url: str) -> int:
    """TCP connections this process holds to the Redis at ``url``."""
    port = urlparse(url).port
    return sum(1 for c in psutil.Process().net_connections("tcp")
               if c.raddr and c.raddr.port == port)


def _calls(r: redis.Redis) -> dict[str, int]:
    """Calls per command since the last CONFIG RESETSTAT, as Redis counts them."""
    return {name.removeprefix("cmdstat_"): stat["calls"]
            for name, stat in r.info("commandstats").items()}


def test_many_waits_in_one_process_share_one_reply_list(
        redis_url: str, r: redis.Redis, start_worker: WorkerFactory) -> None:
    """300 threads wait at once. The per-request wait needed a connection each (past the
    pool's 100: MaxConnectionsError) and a GET and a BLPOP each; now one reader serves
    them all, over one connection, three calls per group of results."""
    with Client(redis_url, model=NULL) as client:
        ids = client.submit_many([CAT] * 300, timeout_s=120)  # queued: no worker yet
        got: dict[str, ResultEnvelope] = {}

        def wait(rid: str) -> None:
            got[rid] = client.result(rid, timeout_s=120)

        threads = [threading.Thread(target=wait, args=(rid,)) for rid in ids]
        for thread in threads:
            thread.start()
        _until(lambda: client.reply_waits[NULL].waiting == 300, 30, "every wait registered")
        # The reader's, the idle one submit_many used, and the fixture's.
        assert _sockets_to(redis_url) <= 3
        r.config_resetstat()
        start_worker(model=NULL)
        for thread in threads:
            thread.join(120)
    assert len(got) == 300 and all(result.ok for result in got.values())
    calls = _calls(r)
    assert calls.get("get", 0) < 30, calls
    # The reader wakes once per worker flush (a MULTI/EXEC) at most, plus idle slices.
    assert calls.get("blpop", 0) <= calls.get("exec", 0) + 10, calls


@pytest.mark.serial
def test_as_completed_yields_results_in_the_order_they_finish(
        redis_url: str, r: redis.Redis, start_worker: WorkerFactory) -> None:
    with Client(redis_url, model=NULL) as client:
        ids = [client.submit(CAT, timeout_s=120) for _ in range(4)]
        order: list[str] = []

        def collect() -> None:
            order.extend(res.request_id for res in client.as_completed(ids[::-1], 120))

        collector = threading.Thread(target=collect)
        collector.start()
        _until(lambda: client.reply_waits[NULL].waiting == 4, 30, "the waits registered")
        # One job at a time: they finish in the order they were queued.
        start_worker("--max-inflight", "1", "--max-batch-size", "1", model=NULL)
        collector.join(120)
        assert order == ids, "in the order they finished, not the order asked"
        assert [res.request_id for res in client.results(ids[::-1])] == ids[::-1]


@pytest.mark.parametrize("fault", ["killed", "stopped"])
@pytest.mark.serial
def test_waits_on_the_reply_list_honour_their_timeout_when_redis_is_gone_or_hung(
        server: RedisServer, fault: str) -> None:
    client = Client(server.url, model=TEST_MODEL)
    ids = client.submit_many([b"x"] * 5)
    assert server.pid is not None
    if fault == "killed":
        server.kill()
    else:
        os.kill(server.pid, signal.SIGSTOP)
    took = _timed_out(lambda: client.results(ids, timeout_s=1.0))
    assert 1.0 <= took < 1.0 + SLACK_S, took
    took = _timed_out(lambda: list(client.as_completed(ids, timeout_s=0.5)))
    assert 0.5 <= took < 0.5 + SLACK_S, took
    started = time.monotonic()
    client.close()
    assert time.monotonic() - started < SLACK_S, "close() is not held up by the reader"


@pytest.mark.parametrize("fault", ["killed", "stopped"])
@pytest.mark.serial
def test_async_waits_on_the_reply_list_honour_their_timeout_when_redis_is_gone_or_hung(
        server: RedisServer, fault: str) -> None:
    async def run() -> tuple[float, float]:
        client = AsyncClient(server.url, model=TEST_MODEL)
        ids = await client.submit_many([b"x"] * 5)
        assert server.pid is not None
        if fault == "killed":
            server.kill()
        else:
            os.kill(server.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(ResultTimeout):
            [res async for res in client.as_completed(ids, timeout_s=1.0)]
        took = time.monotonic() - started
        started = time.monotonic()
        await client.close()
        assert asyncio.all_tasks() == {asyncio.current_task()}, "the reader task is gone"
        return took, time.monotonic() - started

    took, closing = asyncio.run(run())
    assert 1.0 <= took < 1.0 + SLACK_S, took
    assert closing < SLACK_S, closing


def test_a_planted_reply_list_makes_the_client_poll_and_say_so_once(
        redis_url: str, r: redis.Redis, start_worker: WorkerFactory,
        caplog: pytest.LogCaptureFixture) -> None:
    keys = Keys(NULL)
    with Client(redis_url, model=NULL) as client, \
            caplog.at_level(logging.WARNING, logger=replies.__name__):
        r.set(keys.reply(client.name), "planted")  # BLPOP on it answers WRONGTYPE
        first = client.submit(CAT, timeout_s=120)
        start_worker(model=NULL)
        # Its announcement failed (the worker dead-letters it), its result was written.
        assert client.result(first, timeout_s=60).ok
        second = client.submit(CAT, timeout_s=120)
        assert client.result(second, timeout_s=60).ok
        assert client.results([first, second], timeout_s=60)[1].ok
    said = [rec for rec in caplog.records if "cannot pop reply list" in rec.getMessage()]
    assert len(said) == 1, said
    _until(lambda: r.exists(keys.dlq()), 30, "the dead letter")
    dead = [fields[b"rid"].decode() for _, fields in r.xrange(keys.dlq())]
    assert dead == [first], "the second job named no reply list: nothing to dead-letter"
    assert r.get(keys.reply(client.name)) == b"planted"


def test_a_planted_result_key_raises_a_clear_error_on_the_reply_list_too(
        redis_url: str, r: redis.Redis, start_worker: WorkerFactory) -> None:
    """The worker cannot write the result (it dead-letters the job), but announces the id:
    the wait reads the key, and says what is wrong with it instead of timing out."""
    keys = Keys(NULL)
    r.rpush(keys.result("victim"), "planted")
    raised: list[BaseException] = []

    def wait() -> None:
        try:
            client.result("victim", timeout_s=30)
        except ResultUnreadable as e:
            raised.append(e)

    with Client(redis_url, model=NULL) as client:
        client.submit(CAT, request_id="victim", timeout_s=120)
        waiter = threading.Thread(target=wait)
        waiter.start()
        _until(lambda: client.reply_waits[NULL].waiting == 1, 10, "the wait registered")
        start_worker(model=NULL)
        waiter.join(40)
    assert raised and "WRONGTYPE" in str(raised[0]), raised


@pytest.mark.serial
def test_an_id_lost_off_the_reply_list_is_found_by_the_sweep(
        redis_url: str, r: redis.Redis, start_worker: WorkerFactory) -> None:
    """As if a BLPOP's reply were cut off with the connection: the id is gone from the
    list. Here a BLPOP queued before the client's reader takes it (Redis serves blocked
    clients in order)."""
    keys = Keys(NULL)
    stolen: list[object] = []
    got: list[ResultEnvelope] = []
    with Client(redis_url, model=NULL) as client, redis.Redis.from_url(
            redis_url, client_name="thief") as thief:
        reply = keys.reply(client.name)
        taker = threading.Thread(target=lambda: stolen.append(thief.blpop([reply], timeout=60)))
        taker.start()
        _until(lambda: any(c["name"] == "thief" and "b" in c["flags"]
                           for c in r.client_list()), 10, "the thief blocked")
        rid = client.submit(CAT, timeout_s=120)
        _until(lambda: r.info("clients")["blocked_clients"] == 2, 10, "the reader blocked")
        waiter = threading.Thread(target=lambda: got.append(client.result(rid, timeout_s=60)))
        waiter.start()  # before any answer: its first look finds nothing
        _until(lambda: client.reply_waits[NULL].waiting == 1, 10, "the wait registered")
        start_worker(model=NULL)
        _until(lambda: r.exists(keys.result(rid)), 60, "the answer")
        answered = time.monotonic()
        waiter.join(60)
        took = time.monotonic() - answered
        taker.join(10)
    assert stolen and stolen[0] == (reply.encode(), rid.encode())
    assert got and got[0].ok
    assert took < 2 * replies.SWEEP_EVERY_S + SLACK_S, took


def test_a_client_that_only_submits_forgets_its_ids(
        redis_url: str, r: redis.Redis, start_worker: WorkerFactory,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Bookkeeping lasts SUBMITTED_KEPT_S (the result TTL) at most, and ends when a result
    is read; an id forgotten is still served, per request."""
    monkeypatch.setattr(replies, "SUBMITTED_KEPT_S", 2.0)
    start_worker(model=NULL)
    with Client(redis_url, model=NULL) as client:
        ids = client.submit_many([CAT] * 20, timeout_s=120)
        waits = client.reply_waits[NULL]
        _until(lambda: waits.finished == 20, 60, "the reader took every id")
        assert r.llen(waits.key) == 0 and waits.remembered == 20
        assert all(res.ok for res in client.results(ids[:10]))  # finished: read at once
        assert (waits.remembered, waits.finished, waits.waiting) == (10, 10, 0)
        time.sleep(2.1)
        client.submit(CAT, timeout_s=120)
        assert (waits.remembered, waits.finished) == (1, 0), "the old ones forgotten"
        assert all(res.ok for res in client.results(ids[10:], timeout_s=30))


@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_client_never_closed_does_not_keep_its_process_alive(
        redis_url: str, r: redis.Redis, face: str) -> None:
    code = {"sync": "c = Client(sys.argv[1], model='null'); c.submit(b'x')",
            "async": "async def main():\n    c = AsyncClient(sys.argv[1], model='null')\n"
                     "    await c.submit(b'x')\nasyncio.run(main())"}[face]
    script = ("import asyncio, sys\nfrom redbatch.producer.client import AsyncClient, Client\n"
              f"{code}\nprint('submitted')\n")
    done = subprocess.run([sys.executable, "-c", script, redis_url], capture_output=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout == b"submitted\n", done.stderr[-2000:]


def test_the_package_exports_the_clients_and_one_error_hierarchy() -> None:
    """``from redbatch import Client`` (and the errors), without ``import redbatch`` loading
    the client; every error a client raises is a RedbatchError with its code."""
    code = ("import sys, redbatch; assert 'redbatch.producer.client' not in sys.modules; "
            "from redbatch import Client; assert 'redbatch.producer.client' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    import redbatch
    from redbatch.producer import client as module

    assert redbatch.Client is module.Client and redbatch.AsyncClient is module.AsyncClient
    for name in ("DuplicateRequestId", "JobFailed", "ProtocolError", "QueueFull",
                 "RedisRefusedCall", "RedisUnreachable", "ResultTimeout", "ResultUnreadable"):
        assert issubclass(getattr(redbatch, name), redbatch.RedbatchError), name
    assert issubclass(redbatch.ResultTimeout, TimeoutError), "existing handlers keep working"
    assert redbatch.QueueFull.code is ErrorCode.QUEUE_FULL
    assert redbatch.DuplicateRequestId.code is ErrorCode.DUPLICATE_REQUEST_ID
    assert redbatch.ResultTimeout("r1", 2).code == "timeout"
    assert ResultUnreadable("r1", "k", "why").code is ErrorCode.BAD_ENVELOPE
    with pytest.raises(AttributeError):
        _ = redbatch.NoSuchThing  # type: ignore[attr-defined]


def test_an_error_result_is_a_value_or_raises_on_request(
        redis_url: str, start_worker: WorkerFactory) -> None:
    """A bad image comes back as an error result, or, asked for, raises JobFailed carrying
    its code, message, request id and the result itself; an ok result passes through."""
    from redbatch import JobFailed, RedbatchError

    start_worker(model="null")
    cat = (SAMPLES / "cat.jpg").read_bytes()
    with Client(redis_url, model="null") as client:
        bad = client.predict(b"not an image", timeout_s=60)
        assert not bad.ok and bad.error_code is ErrorCode.BAD_IMAGE
        with pytest.raises(RedbatchError) as info:
            client.predict(b"not an image either", timeout_s=60, raise_on_error=True)
        e = info.value
        assert isinstance(e, JobFailed) and e.code is ErrorCode.BAD_IMAGE and e.message
        assert e.result.request_id == e.request_id and str(e).startswith("bad_image: ")
        ok = client.predict(cat, timeout_s=60, raise_on_error=True)
        assert ok.raise_for_error() is ok and len(ok.output["mean_rgb"]) == 3

    async def run() -> ErrorCode | None:
        async with AsyncClient(redis_url, model="null") as aclient:
            try:
                await aclient.predict(b"nope", timeout_s=60, raise_on_error=True)
            except JobFailed as failed:
                return failed.code
        return None

    assert asyncio.run(run()) is ErrorCode.BAD_IMAGE


def test_readiness_follows_the_workers_heartbeats(
        redis_url: str, start_worker: WorkerFactory) -> None:
    """``is_ready``/``workers`` read the heartbeat records: none before a worker starts, its
    own record while it runs, none once it stopped (a clean stop deletes its record)."""
    from redbatch.cli.local_stack import stop_worker

    with Client(redis_url, model="null") as client:
        assert client.workers() == [] and not client.is_ready()
        proc = start_worker(model="null")
        ready_by = time.monotonic() + 20  # its first heartbeat may follow its joining
        while not client.is_ready() and time.monotonic() < ready_by:
            time.sleep(0.1)
        (record,) = client.workers()
        assert record.pid == proc.pid and record.max_batch_size >= 1 and record.consumer

        async def ready() -> bool:
            async with AsyncClient(redis_url, model="null") as aclient:
                return await aclient.is_ready() and len(await aclient.workers()) == 1

        assert asyncio.run(ready())
        assert stop_worker(proc) == 0
        assert not client.is_ready()
