"""Redis itself refuses or fails, or holds keys a hostile client planted: no worker ends.

Each test injects one fault into a real redis-server (its own, where the fault changes the
server) under real workers, then checks that the workers are alive and that the invariant
of tests/test_faults.py holds: every accepted job has exactly one result (or the error the
test expects), nothing is pending, every key but the streams expires.
"""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import redis
from audit import read_results
from conftest import SAMPLES, TEST_MODEL, WorkerFactory
from redbatch.cli.local_stack import spawn_worker, stop_worker, wait_worker_ready
from redbatch.cli.redis_server import RedisServer, free_port
from redbatch.common.protocol import GROUP, JobEnvelope, Keys, Lane
from redbatch.common.redis_io import StreamEntry
from redbatch.producer.client import Client
from test_faults import FAST_RECLAIM, TESTS, check_invariant

CAT = (SAMPLES / "cat.jpg").read_bytes()


def wait_until(condition: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g}s waiting for {what}"
        time.sleep(0.05)


def readyz(port: int) -> tuple[int, str]:
    """Status and body of the worker's /readyz."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as e:
        return int(e.code), e.read().decode()
    except OSError as e:
        return 0, str(e)


def all_results(r: redis.Redis, keys: Keys, ids: list[str]) -> Callable[[], bool]:
    """A condition: every id has a result (read with GET, as any client may)."""
    def check() -> bool:
        try:
            return all(v is not None for v in read_results(r, keys, ids).values())
        except redis.RedisError:
            return False
    return check


@pytest.fixture
def servers() -> Iterator[Callable[[], RedisServer]]:
    """Private redis-servers, for faults that change the server itself."""
    started: list[RedisServer] = []

    def start() -> RedisServer:
        started.append(RedisServer().start())
        return started[-1]

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Real workers on a given Redis, logging to tmp_path; stopped after the test."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(url: str, *args: str, model: str = TEST_MODEL,
              name: str = TEST_MODEL) -> subprocess.Popen[bytes]:
        log = tmp_path / f"worker-{len(procs)}.log"
        metrics = [] if "--metrics-port" in args else ["--metrics-port", "0"]
        with open(log, "wb") as out:
            proc = spawn_worker(url, ["--model", model, "--model-name", name, *metrics, *args],
                                env={"PYTHONPATH": TESTS}, stdout=out,
                                stderr=subprocess.STDOUT)
        procs.append(proc)
        wait_worker_ready(url, Keys(name), proc)
        return proc

    yield start
    for proc in procs:
        stop_worker(proc, timeout_s=20)


def test_keys_of_another_type_where_answers_go_never_end_a_worker(
        redis_url: str, r: redis.Redis, start_worker: WorkerFactory, tmp_path: Path) -> None:
    # A client holding only the key patterns PROTOCOL.md names plants keys of the wrong
    # type where three answers and the fleet's recent list will be written. Those answers
    # share their batches with twelve good ones.
    keys = Keys("null")
    planted = [keys.done("victim-done"), keys.result("victim-result"), keys.reply("planted"),
               keys.recent()]
    r.set(planted[0], "planted")
    r.rpush(planted[1], "planted")
    r.set(planted[2], "planted")
    r.set(planted[3], "planted")
    with Client(redis_url, model="null") as client:
        victims = [client.job(CAT, request_id="victim-done", timeout_s=300),
                   client.job(CAT, request_id="victim-result", timeout_s=300),
                   client.job(CAT, request_id="victim-reply", reply_to=planted[2],
                              timeout_s=300)]
        good = [client.job(CAT, timeout_s=300) for _ in range(12)]
        client.submit_jobs([victims[0], *good[:6], victims[1], *good[6:], victims[2]])
        # All 15 jobs fill one batch (a long wait covers slow preprocessing on a busy box).
        worker = start_worker("--model-name", "null", "--max-batch-size", "15",
                              "--max-wait-ms", "5000", model="null")
        wait_until(lambda: r.xlen(keys.stream(Lane.INTERACTIVE)) == 0 and
                   r.exists(keys.dlq()) and r.xlen(keys.dlq()) == 3, 60, "every entry answered")
        assert worker.poll() is None, "the worker is alive"
        dead = {f[b"rid"].decode(): f[b"reason"].decode() for _, f in r.xrange(keys.dlq())}
        assert sorted(dead) == ["victim-done", "victim-reply", "victim-result"]
        for rid, key in (("victim-done", planted[0]), ("victim-result", planted[1]),
                         ("victim-reply", planted[2])):
            assert dead[rid].startswith("undeliverable: ") and key in dead[rid], dead[rid]
        # What could be written was: the result whose wake-up token failed, and the one
        # whose reply list failed. The planted result key is left as it was.
        written = client.result("victim-done", timeout_s=5)
        assert written.ok and written.batch_size > 1, "it shared a batch with good jobs"
        assert client.result("victim-reply", timeout_s=5).ok
        assert r.type(planted[1]) == b"list"
        for key in planted:  # the attacker's keys, not ours; then the invariant
            r.delete(key)
        assert client.predict(CAT, timeout_s=60).ok, "still serving"
    check_invariant(r, keys, dict.fromkeys([j.request_id for j in good] +
                                           ["victim-done", "victim-reply"]))
    log = (tmp_path / "worker-0.log").read_text(errors="replace")
    assert "Traceback" not in log


def test_dead_letters_wait_while_the_dead_letter_stream_holds_another_type(
        redis_url: str, r: redis.Redis, start_worker: WorkerFactory) -> None:
    # A dead letter is never acknowledged without its record: while the dead-letter stream
    # key holds a string, the entry stays pending and every other job is answered.
    keys = Keys("null")
    stream = keys.stream(Lane.INTERACTIVE)
    r.set(keys.dlq(), "planted")
    worker = start_worker("--model-name", "null", model="null")
    entry = r.xadd(stream, {"job": b"no request id, so nobody can be answered"})
    with Client(redis_url, model="null") as client:
        assert client.predict(CAT, timeout_s=60).ok
        time.sleep(1.0)
        assert r.xlen(stream) == 1 and int(r.xpending(stream, GROUP)["pending"]) == 1
        r.delete(keys.dlq())
        wait_until(lambda: r.exists(keys.dlq()) and r.xlen(stream) == 0, 30,
                   "the dead letter written once the key was gone")
    [(_, fields)] = cast(list[StreamEntry], r.xrange(keys.dlq()))
    assert fields[b"job"] == b"no request id, so nobody can be answered"
    assert b"rid" not in fields, "fields are copied as they were: none is made up"
    assert fields[b"entry"] == entry and fields[b"reason"].startswith(b"bad_request_id: ")
    assert worker.poll() is None
    check_invariant(r, keys, {})


def test_a_full_redis_holds_the_answers_until_memory_frees(
        servers: Callable[[], RedisServer], workers: Callable[..., Any]) -> None:
    # maxmemory with noeviction: Redis refuses every write. The worker keeps its answers,
    # retries with back-off, says it is not ready, and writes everything once there is room.
    server = servers()
    r = redis.Redis.from_url(server.url)
    keys, port = Keys(TEST_MODEL), free_port()
    worker = workers(server.url, "--metrics-port", str(port), "--metrics-host", "127.0.0.1")
    with Client(server.url) as client:
        ids = client.submit_many([CAT] * 60, timeout_s=300)
    r.config_set("maxmemory", 1)
    try:
        wait_until(lambda: readyz(port)[0] == 503 and "OOM" in readyz(port)[1], 60,
                   "/readyz to say Redis refuses writes")
        written = sum(v is not None for v in read_results(r, keys, ids).values())
        time.sleep(1.5)
        assert sum(v is not None for v in read_results(r, keys, ids).values()) == written
        assert written < len(ids), "answers were waiting when Redis filled up"
        assert worker.poll() is None
    finally:
        r.config_set("maxmemory", 0)
    wait_until(all_results(r, keys, ids), 120, "every result once memory is free")
    wait_until(lambda: readyz(port)[0] == 200, 30, "/readyz to recover")
    check_invariant(r, keys, dict.fromkeys(ids))
    r.close()


def test_a_worker_rides_out_its_redis_turned_replica_and_promoted_back(
        servers: Callable[[], RedisServer], workers: Callable[..., Any]) -> None:
    # A failover gone wrong: B takes a copy of A and is promoted, and A becomes B's replica,
    # so the worker's writes and reads get READONLY. A is promoted back. Writes A took
    # after B's copy are lost with the resync: those jobs are pending again and are run again.
    a, b = servers(), servers()
    ra, rb = redis.Redis.from_url(a.url), redis.Redis.from_url(b.url)
    for each in (ra, rb):
        each.config_set("repl-diskless-sync-delay", 0)
    keys, port = Keys(TEST_MODEL), free_port()
    worker = workers(a.url, *FAST_RECLAIM, "--metrics-port", str(port))
    with Client(a.url) as client:
        ids = client.submit_many([CAT] * 60, timeout_s=300)
    wait_until(lambda: any(read_results(ra, keys, ids).values()), 60, "a first result")
    rb.replicaof("127.0.0.1", a.port)
    wait_until(lambda: rb.info("replication").get("master_link_status") == "up", 30, "B synced")
    rb.replicaof("NO", "ONE")
    ra.replicaof("127.0.0.1", b.port)
    wait_until(lambda: readyz(port)[0] == 503 and "READONLY" in readyz(port)[1], 60,
               "/readyz to say Redis refuses writes")
    time.sleep(1.0)
    assert worker.poll() is None
    ra.replicaof("NO", "ONE")
    wait_until(all_results(ra, keys, ids), 180, "every result on A once it is a master again")
    wait_until(lambda: readyz(port)[0] == 200, 30, "/readyz to recover")
    assert worker.poll() is None
    wait_until(lambda: int(ra.xpending(keys.stream(Lane.INTERACTIVE), GROUP)["pending"]) == 0,
               60, "jobs run again after the resync to be acknowledged")
    check_invariant(ra, keys, dict.fromkeys(ids))
    ra.close()
    rb.close()


def _stranded(r: redis.Redis, keys: Keys, consumer: str, rid: str) -> bytes:
    """A job read by ``consumer`` (a worker that then vanished), in one transaction so that
    a live worker blocked on the stream cannot read it first; returns its entry id."""
    pipe = r.pipeline(transaction=True)
    pipe.xadd(keys.stream(Lane.INTERACTIVE), JobEnvelope(rid, keys.model, CAT).encode())
    pipe.xreadgroup(GROUP, consumer, {keys.stream(Lane.INTERACTIVE): ">"}, count=1)
    entry_id, _ = pipe.execute()
    return entry_id  # type: ignore[no-any-return]


def test_redis_restarted_empty_while_a_takeover_waits(
        servers: Callable[[], RedisServer], workers: Callable[..., Any],
        tmp_path: Path) -> None:
    # A job taken over from a departed worker waits for the model (busy with a slow batch)
    # when Redis restarts without persistence: its stream and the group are gone, so
    # counting its delivery answers NOGROUP. The worker runs it anyway, creates the group
    # again, and serves what comes next. The jobs queued before are lost with Redis (no
    # persistence: RELIABILITY.md), so only the new ones are audited.
    server = servers()
    r = redis.Redis.from_url(server.url)
    keys = Keys("killer")
    stream = keys.stream(Lane.INTERACTIVE)
    worker = workers(server.url, "--reclaim-idle-ms", "1000", "--cpu-lanes", "1",
                     "--max-batch-size", "1", "--max-inflight", "2",
                     model="handlers_for_tests:killer", name="killer")
    with Client(server.url, model="killer") as client:
        client.submit(CAT, params={"sleep_s": 8}, timeout_s=300)  # holds the only lane
        wait_until(lambda: int(r.xpending(stream, GROUP)["pending"]) == 1, 30, "a slow batch")
        entry = _stranded(r, keys, "departed-worker", "stranded")
        wait_until(lambda: r.xpending_range(stream, GROUP, entry, entry, 1)[0]["consumer"]
                   != b"departed-worker", 20, "the takeover")
        server.restart()
        log = tmp_path / "worker-0.log"
        wait_until(lambda: "could not count a delivery" in log.read_text(errors="replace"), 30,
                   "the takeover to run after the restart")
        assert worker.poll() is None, "the worker rode it out"
        fresh = client.predict(CAT, timeout_s=60)
        assert fresh.ok, fresh
    check_invariant(r, keys, {fresh.request_id: None})
    r.close()


def test_client_pause_under_load_delays_but_loses_nothing(
        servers: Callable[[], RedisServer], workers: Callable[..., Any]) -> None:
    # CLIENT PAUSE (an operator's maintenance, or a failover by a proxy) stalls every
    # command for 3 s while a worker is busy reading and writing.
    server = servers()
    r = redis.Redis.from_url(server.url)
    keys = Keys(TEST_MODEL)
    worker = workers(server.url)
    with Client(server.url) as client:
        ids = client.submit_many([CAT] * 40, timeout_s=300)
    wait_until(lambda: any(read_results(r, keys, ids).values()), 60, "a first result")
    r.client_pause(3000, all=True)
    wait_until(all_results(r, keys, ids), 120, "every result after the pause")
    assert worker.poll() is None
    check_invariant(r, keys, dict.fromkeys(ids))
    r.close()
