"""Fault injection with real workers: every test ends with the same invariant check.

Invariant: each accepted request id has exactly one final result (ok, or the error code the
test expects), nothing is pending in the consumer group, and every key but the streams
expires.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from conftest import SAMPLES, WorkerFactory
from redbatch.common.protocol import GROUP, ErrorCode, Keys, ResultEnvelope
from redbatch.producer.client import Client

TESTS = str(Path(__file__).resolve().parent)
CAT = (SAMPLES / "cat.jpg").read_bytes()
#: Short leases so that takeovers happen within a test's patience.
FAST_RECLAIM = ("--reclaim-idle-ms", "1500")


def check_invariant(r: redis.Redis, keys: Keys, expected: dict[str, ErrorCode | None]) -> None:
    """Each id: exactly one result with the expected outcome; nothing pending; keys expire."""
    for rid, code in expected.items():
        raw = r.get(keys.result(rid))
        assert raw is not None, f"{rid} has no result"
        result = ResultEnvelope.decode(raw)
        assert result.request_id == rid
        assert result.error_code is code, (rid, result.error_code, result.error_message)
    for stream in keys.streams():
        if r.exists(stream):
            assert int(r.xpending(stream, GROUP)["pending"]) == 0, f"{stream} has pending jobs"
    for key in r.scan_iter(count=1000):
        if r.type(key) != b"stream":
            assert r.pttl(key) > 0, f"{key!r} never expires"


def wait_results(client: Client, ids: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for rid in ids:
        client.result(rid, timeout_s=max(0.1, deadline - time.monotonic()))


def test_sigkill_mid_batch_another_worker_answers_all(
        redis_url: str, r: redis.Redis, start_worker: WorkerFactory, keys: Keys) -> None:
    victim = start_worker(*FAST_RECLAIM, "--max-inflight", "48")
    with Client(redis_url) as client:
        ids = client.submit_many([CAT] * 60, timeout_s=300)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not sum(
                int(r.xpending(s, GROUP)["pending"]) for s in keys.streams() if r.exists(s)):
            time.sleep(0.01)
        os.kill(victim.pid, signal.SIGKILL)  # mid-batch: it held jobs it never answered
        victim.wait()
        survivor = start_worker(*FAST_RECLAIM)
        wait_results(client, ids, timeout_s=120)
    assert survivor.poll() is None
    check_invariant(r, keys, dict.fromkeys(ids))


def test_a_live_worker_keeps_its_long_batches(redis_url: str, r: redis.Redis,
                                              start_worker: WorkerFactory, keys: Keys) -> None:
    # Leases of 600 ms are renewed every 200 ms; a second worker must not take jobs the
    # first is still working on, so every result names the worker that read the job.
    first = start_worker("--reclaim-idle-ms", "600", "--max-batch-size", "2",
                         "--max-inflight", "40")
    with Client(redis_url) as client:
        ids = client.submit_many([CAT] * 40, timeout_s=300)
        time.sleep(0.3)
        start_worker("--reclaim-idle-ms", "600")
        wait_results(client, ids, timeout_s=120)
        results = [client.result(i) for i in ids]
    assert first.poll() is None
    reads = r.xinfo_groups(keys.streams()[0])
    assert reads, "the group exists"
    assert all(res.ok for res in results)
    check_invariant(r, keys, dict.fromkeys(ids))


@pytest.fixture
def supervised(redis_url: str, tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Like a container's restart policy: a dead worker is replaced until the test ends."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)


def _killer_worker(redis_url: str, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "redbatch.common.cli", "worker", "--redis", redis_url,
           "--model", "handlers_for_tests:killer", "--model-name", "killer",
           "--reclaim-idle-ms", "1000", "--max-deliveries", "2", "--max-wait-ms", "20"]
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": TESTS}, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def test_poison_job_that_kills_its_worker_is_dead_lettered(
        redis_url: str, r: redis.Redis, supervised: list[subprocess.Popen[bytes]],
        tmp_path: Path) -> None:
    keys = Keys("killer")
    with Client(redis_url, model="killer") as client:
        poison = client.submit(CAT, params={"kill_worker": True}, timeout_s=300)
        good = client.submit_many([CAT] * 6, timeout_s=300)
        deaths = 0
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            if not supervised or supervised[-1].poll() is not None:
                deaths += bool(supervised)
                supervised.append(_killer_worker(redis_url, tmp_path / "workers.log"))
            if all(r.exists(keys.result(i)) for i in [poison, *good]):
                break
            time.sleep(0.2)
        assert deaths >= 1, "the poison job did kill workers"
        result = client.result(poison, timeout_s=1)
        assert result.error_code is ErrorCode.DEAD_LETTERED, result
        assert all(client.result(i, timeout_s=1).ok for i in good), "innocent jobs all ran"
    dead = r.xrange(keys.dlq())
    assert [f[b"rid"].decode() for _, f in dead] == [poison]
    assert b"delivered" in dead[0][1][b"reason"]
    check_invariant(r, keys, {poison: ErrorCode.DEAD_LETTERED, **dict.fromkeys(good)})


def test_entry_without_request_id_goes_to_the_dlq_and_dlq_commands_work(
        redis_url: str, r: redis.Redis, start_worker: WorkerFactory, keys: Keys) -> None:
    start_worker()
    stream = keys.streams()[0]
    r.xadd(stream, {"job": b"no id here"})
    deadline = time.monotonic() + 30
    while not r.exists(keys.dlq()) and time.monotonic() < deadline:
        time.sleep(0.05)
    cli = [sys.executable, "-m", "redbatch.common.cli", "dlq"]
    listed = subprocess.run([*cli, "list", "--redis", redis_url], capture_output=True,
                            text=True, timeout=60, check=True)
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert len(rows) == 1 and "bad_request_id" in rows[0]["reason"]
    purged = subprocess.run([*cli, "purge", "--all", "--redis", redis_url],
                            capture_output=True, text=True, timeout=60, check=True)
    assert "deleted 1" in purged.stdout and r.xlen(keys.dlq()) == 0
    assert all(int(r.xpending(s, GROUP)["pending"]) == 0 for s in keys.streams())


def test_dlq_retry_requeues_and_the_client_gets_the_new_result(
        redis_url: str, r: redis.Redis, start_worker: WorkerFactory, keys: Keys) -> None:
    # A job dead-lettered earlier (written as a worker would) is retried and then served.
    from redbatch.common.protocol import JobEnvelope

    job = JobEnvelope("retry-me", keys.model, CAT)
    fields = {k: v for k, v in job.encode().items()}
    r.xadd(keys.dlq(), {**fields, "source": keys.streams()[0], "entry": "1-0",
                        "reason": "dead_lettered: test", "deliveries": "4", "at_ms": "0"})
    r.set(keys.result("retry-me"),
          ResultEnvelope.error("retry-me", ErrorCode.DEAD_LETTERED, "test").encode(), px=60000)
    start_worker()
    out = subprocess.run([sys.executable, "-m", "redbatch.common.cli", "dlq", "retry", "--all",
                          "--redis", redis_url], capture_output=True, text=True, timeout=60,
                         check=True)
    assert "requeued 1" in out.stdout
    with Client(redis_url) as client:
        assert client.result("retry-me", timeout_s=60).ok
    check_invariant(r, keys, {"retry-me": None})


def test_a_late_duplicate_result_never_replaces_the_first(
        redis_url: str, r: redis.Redis, start_worker: WorkerFactory, keys: Keys) -> None:
    start_worker()
    with Client(redis_url) as client:
        first = client.predict(CAT, request_id="same-id", timeout_s=60)
        again = client.submit(b"not an image this time", request_id="same-id", timeout_s=60)
        assert again == "same-id"
        deadline = time.monotonic() + 30
        while r.xlen(keys.streams()[0]) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.result("same-id", timeout_s=5) == first, "first result kept"
    check_invariant(r, keys, {"same-id": None})


def test_a_failing_request_is_isolated_from_its_batch(redis_url: str, r: redis.Redis,
                                                      start_worker: WorkerFactory) -> None:
    from handlers_for_tests import FAIL, NAN

    keys = Keys("flaky")
    worker = start_worker("--model-name", "flaky", "--max-batch-size", "16",
                          "--max-wait-ms", "300", model="handlers_for_tests:flaky",
                          env={"PYTHONPATH": TESTS})
    with Client(redis_url, model="flaky") as client:
        ids = client.submit_many([CAT] * 4 + [FAIL] + [CAT] * 4 + [NAN] + [CAT] * 2,
                                 timeout_s=120)
        results = [client.result(i, timeout_s=120) for i in ids]
    codes = [res.error_code for res in results]
    assert codes[4] is ErrorCode.INFERENCE_FAILED and "cannot take" in results[4].error_message
    assert codes[9] is ErrorCode.NON_FINITE_OUTPUT
    assert all(res.ok for i, res in enumerate(results) if i not in (4, 9))
    assert max(res.batch_size for res in results) > 1, "they were batched together"
    assert worker.poll() is None
    check_invariant(r, keys, {rid: code for rid, code in zip(ids, codes, strict=True)})


def test_a_killed_preprocessing_process_loses_no_job(redis_url: str, r: redis.Redis,
                                                     start_worker: WorkerFactory,
                                                     keys: Keys) -> None:
    import psutil

    worker = start_worker("--pool-processes", "2")
    with Client(redis_url) as client:
        ids = client.submit_many([CAT] * 40, timeout_s=300)
        time.sleep(0.5)
        pool = [p for p in psutil.Process(worker.pid).children()
                if "multiprocessing.spawn" in " ".join(p.cmdline())]
        assert pool, "the worker has pool processes"
        pool[0].kill()
        wait_results(client, ids, timeout_s=120)
    assert worker.poll() is None
    check_invariant(r, keys, dict.fromkeys(ids))


def test_redis_restart_with_aof_loses_nothing(tmp_path: Path, keys: Keys) -> None:
    from redbatch.common.local_stack import spawn_worker, stop_worker, wait_worker_ready
    from redbatch.common.redis_server import RedisServer

    with RedisServer(appendonly=True) as server:
        with open(tmp_path / "worker.log", "wb") as log:
            worker = spawn_worker(server.url, ["--max-inflight", "16"], stdout=log,
                                  stderr=subprocess.STDOUT)
        try:
            wait_worker_ready(server.url, keys, worker)
            with Client(server.url) as client:
                ids = client.submit_many([CAT] * 40, timeout_s=300)
                client.result(ids[0], timeout_s=120)
                server.restart()  # SIGKILL; AOF with fsync always keeps every write
                wait_results(client, ids, timeout_s=180)
            assert worker.poll() is None, "the worker rode out the restart"
            r = redis.Redis.from_url(server.url)
            check_invariant(r, keys, dict.fromkeys(ids))
            r.close()
        finally:
            stop_worker(worker)
