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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

import pytest
import redis
from audit import audit
from conftest import SAMPLES, WorkerFactory
from redbatch.common.protocol import (
    FIELD_ADMITTED,
    GROUP,
    ErrorCode,
    Keys,
    ResultEnvelope,
    Status,
)
from redbatch.common.redis_io import StreamEntry
from redbatch.producer.client import Client
from redis.typing import EncodableT, FieldT

TESTS = str(Path(__file__).resolve().parent)
CAT = (SAMPLES / "cat.jpg").read_bytes()
#: Short leases so that takeovers happen within a test's patience.
FAST_RECLAIM = ("--reclaim-idle-ms", "1500")


def check_invariant(r: redis.Redis, keys: Keys, expected: dict[str, ErrorCode | None]) -> None:
    """Each id: exactly one result with the expected outcome; nothing pending; keys expire."""
    problems = audit(r, keys, expected)
    assert not problems, problems


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


def _killer_worker(redis_url: str, log: Path, *extra: str,
                   model: str = "killer") -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "redbatch.cli", "worker", "--redis", redis_url,
           "--model", f"handlers_for_tests:{model}", "--model-name", model,
           "--reclaim-idle-ms", "1000", "--max-deliveries", "2", "--max-wait-ms", "20",
           "--metrics-port", "0", *extra]
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": TESTS}, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def supervise(procs: list[subprocess.Popen[bytes]], start: Callable[[], subprocess.Popen[bytes]],
              done: Callable[[], bool], timeout_s: float) -> list[int]:
    """Keep one worker running (restarting it when it dies) until ``done``; the exit codes
    of the workers that died."""
    deaths: list[int] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not done():
        if not procs or procs[-1].poll() is not None:
            if procs:
                deaths.append(procs[-1].returncode)
            procs.append(start())
        time.sleep(0.2)
    return deaths


def test_poison_job_that_kills_its_worker_is_dead_lettered(
        redis_url: str, r: redis.Redis, supervised: list[subprocess.Popen[bytes]],
        tmp_path: Path) -> None:
    keys = Keys("killer")
    with Client(redis_url, model="killer") as client:
        poison = client.submit(CAT, params={"kill_worker": True}, timeout_s=300)
        good = client.submit_many([CAT] * 6, timeout_s=300)
        deaths = supervise(supervised, lambda: _killer_worker(redis_url, tmp_path / "w.log"),
                           lambda: all(r.exists(keys.result(i)) for i in [poison, *good]), 150)
        assert deaths, "the poison job did kill workers"
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
    cli = [sys.executable, "-m", "redbatch.cli", "dlq"]
    listed = subprocess.run([*cli, "list", "--redis", redis_url], capture_output=True,
                            text=True, timeout=60, check=True)
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert len(rows) == 1 and "bad_request_id" in rows[0]["reason"]
    purged = subprocess.run([*cli, "purge", "--all", "--redis", redis_url],
                            capture_output=True, text=True, timeout=60, check=True)
    assert "deleted 1" in purged.stdout and r.xlen(keys.dlq()) == 0
    assert all(int(r.xpending(s, GROUP)["pending"]) == 0 for s in keys.streams())
    empty = subprocess.run([*cli, "list", "--redis", redis_url], capture_output=True,
                           text=True, timeout=60, check=True)
    assert empty.stdout == "", "stdout holds JSON lines only"
    assert empty.stderr == f"no dead letters of model {keys.model!r}\n", empty.stderr


def test_dlq_retry_requeues_and_the_client_gets_the_new_result(
        redis_url: str, r: redis.Redis, start_worker: WorkerFactory, keys: Keys) -> None:
    # A job dead-lettered earlier (written as a worker would) is retried and then served.
    from redbatch.common.protocol import JobEnvelope

    job = JobEnvelope("retry-me", keys.model, CAT)
    fields: dict[FieldT, EncodableT] = {k: v for k, v in job.encode().items()}
    r.xadd(keys.dlq(), {**fields, "source": keys.streams()[0], "entry": "1-0",
                        "reason": "dead_lettered: test", "deliveries": "4", "at_ms": "0"})
    r.set(keys.result("retry-me"),
          ResultEnvelope.error("retry-me", ErrorCode.DEAD_LETTERED, "test").encode(), px=60000)
    start_worker()
    retry = [sys.executable, "-m", "redbatch.cli", "dlq", "retry", "--all", "--redis",
             redis_url]
    r.hset(keys.limits(), "interactive", 0)  # a replay respects the lane's bound too
    refused = subprocess.run(retry, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "at its bound of 0" in refused.stderr, refused
    assert "requeued 0" in refused.stdout and r.xlen(keys.dlq()) == 1
    r.delete(keys.limits())
    out = subprocess.run(retry, capture_output=True, text=True, timeout=60, check=True)
    assert "requeued 1" in out.stdout
    with Client(redis_url) as client:
        assert client.result("retry-me", timeout_s=60).ok
    check_invariant(r, keys, {"retry-me": None})


def test_duplicate_request_ids_are_refused_and_never_replace_the_first_result(
        redis_url: str, r: redis.Redis, start_worker: WorkerFactory, keys: Keys) -> None:
    from redbatch.common.protocol import JobEnvelope
    from redbatch.producer.client import DuplicateRequestId

    def raw_xadd(rid: str, payload: bytes) -> None:  # a producer that skips the script
        r.xadd(keys.streams()[0], JobEnvelope(rid, keys.model, payload).encode())

    # Both queued before any worker runs: the second (garbage) must not pre-empt the first.
    raw_xadd("twin", CAT)
    raw_xadd("twin", b"not an image, same id")
    # A forged admission (issue 28, item 2): a plain XADD under a queued job's id, with the
    # field only the admission function should write. The owner key names the first entry.
    with Client(redis_url) as client:
        client.submit(CAT, request_id="victim", timeout_s=60)
    forged: dict[FieldT, EncodableT] = {
        k: v for k, v in JobEnvelope("victim", keys.model, b"forged").encode().items()}
    forged[FIELD_ADMITTED] = b"1"
    r.xadd(keys.streams()[0], forged)
    start_worker()
    with Client(redis_url) as client:
        first = client.predict(CAT, request_id="same-id", timeout_s=60)
        with pytest.raises(DuplicateRequestId) as refused:
            client.submit(b"not an image this time", request_id="same-id", timeout_s=60)
        assert refused.value.duplicates == ["same-id"]
        assert "duplicate_request_id" in str(refused.value)
        raw_xadd("same-id", b"garbage after the first finished")
        deadline = time.monotonic() + 30
        while r.xlen(keys.dlq()) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.result("same-id", timeout_s=5) == first, "first result kept"
        assert client.result("twin", timeout_s=30).ok, "the first twin ran"
        assert client.result("victim", timeout_s=30).ok, "the victim got its own answer"
    reasons = sorted((f[b"rid"], f[b"reason"].split(b":")[0]) for _, f in r.xrange(keys.dlq()))
    assert reasons == [(b"same-id", b"duplicate_request_id"), (b"twin", b"duplicate_request_id"),
                       (b"victim", b"duplicate_request_id")]
    check_invariant(r, keys, {"same-id": None, "twin": None, "victim": None})


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
    from redbatch.cli.local_stack import spawn_worker, stop_worker, wait_worker_ready
    from redbatch.cli.redis_server import RedisServer

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


def pending_on(r: redis.Redis, keys: Keys, consumer: str, rid: str) -> bytes:
    """Queue a job for ``rid`` and read it as ``consumer`` (a worker that then vanished);
    returns its entry id."""
    from redbatch.common.protocol import JobEnvelope

    stream = keys.streams()[0]
    if not r.exists(stream):
        r.xgroup_create(stream, GROUP, id="0", mkstream=True)
    r.xadd(stream, JobEnvelope(rid, keys.model, CAT).encode())
    # RESP2's reply shape; redis-py types it as the union of every shape it can take.
    reply = cast(list[tuple[bytes, list[StreamEntry]]],
                 r.xreadgroup(GROUP, consumer, {stream: ">"}, count=1))
    [[_, [(entry_id, _)]]] = reply
    return entry_id


def test_a_result_written_but_never_acknowledged_is_not_answered_twice(
        redis_url: str, r: redis.Redis, start_worker: WorkerFactory, keys: Keys) -> None:
    # A worker that dies between writing a result and acknowledging its job. redbatch's
    # writer does both in one MULTI, so this state only arises from a writer without the
    # transaction (or a hand-made one, as here): the job is pending on a dead consumer and
    # its result exists. The job is taken over and may run again, but its client sees the
    # first result, unchanged, and the entry leaves the stream.
    stream = keys.streams()[0]
    pending_on(r, keys, "dead-worker", "written-once")
    written = ResultEnvelope("written-once", Status.OK, output={"by": "dead-worker"},
                             worker="dead-worker").encode()
    r.set(keys.result("written-once"), written, px=600_000)
    start_worker(*FAST_RECLAIM)
    deadline = time.monotonic() + 60
    while r.xlen(stream) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert r.xlen(stream) == 0, "the entry was taken over and acknowledged"
    assert r.get(keys.result("written-once")) == written, "the first result stands"
    check_invariant(r, keys, {"written-once": None})


@pytest.mark.full
def test_workers_sigkilled_at_random_moments_lose_and_duplicate_nothing(
        redis_url: str, r: redis.Redis, start_worker: WorkerFactory, tmp_path: Path) -> None:
    # With a null model the worker spends its time reading, writing and acknowledging, so
    # kills at random moments land inside the write path too.
    import random

    keys = Keys("null")
    rng = random.Random(7)
    args = ("--model-name", "null", *FAST_RECLAIM, "--max-batch-size", "16")
    victim = start_worker(*args, model="null")
    with Client(redis_url, model="null") as client:
        ids: list[str] = []
        for _ in range(3):
            ids += client.submit_many([CAT] * 150, timeout_s=300)
            time.sleep(rng.uniform(0.05, 0.4))
            os.kill(victim.pid, signal.SIGKILL)
            victim.wait()
            victim = start_worker(*args, model="null")
        wait_results(client, ids, timeout_s=120)
        firsts = {i: r.get(keys.result(i)) for i in ids}
    deadline = time.monotonic() + 30  # taken-over jobs may run again: wait for them
    while time.monotonic() < deadline and any(
            int(r.xpending(s, GROUP)["pending"]) for s in keys.streams() if r.exists(s)):
        time.sleep(0.1)
    assert {i: r.get(keys.result(i)) for i in ids} == firsts, "no result was replaced"
    assert victim.poll() is None
    check_invariant(r, keys, dict.fromkeys(ids))


def test_a_lone_hung_batch_times_out_beside_a_free_lane(
        redis_url: str, supervised: list[subprocess.Popen[bytes]], tmp_path: Path) -> None:
    # Two CPU lanes: one hung batch leaves the other lane free, so the model never counts
    # as busy. The timeout used to be checked only when it was, and this worker hung forever.
    worker = _killer_worker(redis_url, tmp_path / "w.log", "--batch-timeout-s", "2",
                            "--cpu-lanes", "2")
    supervised.append(worker)
    with Client(redis_url, model="killer") as client:
        client.submit(CAT, params={"hang": True}, timeout_s=300)
        assert worker.wait(timeout=60) == 3
    assert "looks hung" in (tmp_path / "w.log").read_text(errors="replace")


def _exits_hung(worker: subprocess.Popen[bytes], log: Path, within_s: float) -> str:
    """The log of a worker that exited 3 within ``within_s``, one line of it saying so and
    no traceback; a worker still running is killed."""
    try:
        code = worker.wait(timeout=within_s)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait()
        pytest.fail(f"still running after {within_s} s:\n{log.read_text(errors='replace')}")
    text = log.read_text(errors="replace")
    assert code == 3, text
    assert "Traceback" not in text, text
    return text


def test_a_forward_pass_hung_in_a_lane_ends_its_worker_with_code_3(
        redis_url: str, tmp_path: Path) -> None:
    # issue 27: a batch stuck in a CPU lane thread (the model itself, not postprocessing)
    # was timed, but the exit then waited for ever for that thread.
    log = tmp_path / "w.log"
    worker = _killer_worker(redis_url, log, "--batch-timeout-s", "2", "--cpu-lanes", "2",
                            model="hangs_in_forward")
    try:
        with Client(redis_url, model="hangs_in_forward") as client:
            client.submit(b"HANGMODEL", timeout_s=300)
            text = _exits_hung(worker, log, 90)
    finally:
        if worker.poll() is None:
            worker.kill()
    assert "looks hung" in text


def test_a_warm_up_that_never_returns_ends_the_worker_naming_the_stage(
        redis_url: str, tmp_path: Path) -> None:
    # Before serving there is no main loop to time a batch: the watchdog bounds each
    # warm-up size (--warmup-timeout-s), and a stuck one exits 3 with one line naming it.
    log = tmp_path / "w.log"
    worker = _killer_worker(redis_url, log, "--warmup-timeout-s", "3", "--calibrate", "off",
                            model="hangs_at_warmup")
    text = _exits_hung(worker, log, 90)
    hung = [line for line in text.splitlines() if "device hung" in line]
    assert len(hung) == 1 and "warm-up at batch 1 (eager) did not return within 3 s" in hung[0]


@pytest.mark.full
def test_a_hung_batch_makes_its_worker_exit_and_the_others_are_answered(
        redis_url: str, r: redis.Redis, supervised: list[subprocess.Popen[bytes]],
        tmp_path: Path) -> None:
    # A stuck consumer: its model never returns (a hung GPU). Past --batch-timeout-s the
    # worker exits with code 3 for its supervisor; the job that hangs every worker is
    # dead-lettered after --max-deliveries, and the jobs that were waiting behind it run.
    keys = Keys("killer")
    with Client(redis_url, model="killer") as client:
        hung = client.submit(CAT, params={"hang": True}, timeout_s=300)
        good = client.submit_many([CAT] * 4, timeout_s=300)
        deaths = supervise(supervised, lambda: _killer_worker(
            redis_url, tmp_path / "w.log", "--batch-timeout-s", "3"),
            lambda: all(r.exists(keys.result(i)) for i in [hung, *good]), 150)
        assert deaths and set(deaths) == {3}, deaths
        assert client.result(hung, timeout_s=1).error_code is ErrorCode.DEAD_LETTERED
        assert all(client.result(i, timeout_s=1).ok for i in good)
    assert supervised[-1].poll() is None
    check_invariant(r, keys, {hung: ErrorCode.DEAD_LETTERED, **dict.fromkeys(good)})


@pytest.mark.full
def test_connections_cut_again_and_again_lose_nothing(
        redis_url: str, r: redis.Redis, start_worker: WorkerFactory, keys: Keys) -> None:
    worker = start_worker()
    with Client(redis_url) as client:
        ids = client.submit_many([CAT] * 40, timeout_s=300)
        for _ in range(5):  # every connection but ours, the worker's included
            time.sleep(0.4)
            r.client_kill_filter(_type="normal", skipme=True)
        ids += client.submit_many([CAT] * 10, timeout_s=300)
        wait_results(client, ids, timeout_s=120)
    assert worker.poll() is None, "the worker reconnected"
    check_invariant(r, keys, dict.fromkeys(ids))


def test_departed_consumers_are_removed_only_when_they_hold_nothing(
        redis_url: str, r: redis.Redis, start_worker: WorkerFactory, keys: Keys) -> None:
    stream = keys.streams()[0]
    pending_on(r, keys, "left-holding-a-job", "held")
    done_id = pending_on(r, keys, "left-with-nothing", "done")
    r.xack(stream, GROUP, done_id)
    r.xdel(stream, done_id)
    # Leases of 500 ms: consumers idle for 3 leases with nothing pending are removed; the
    # one holding a job keeps it until the job is taken over, and only then goes.
    start_worker("--reclaim-idle-ms", "500")
    with Client(redis_url) as client:
        assert client.result("held", timeout_s=60).ok
    deadline = time.monotonic() + 30
    names: set[str] = set()
    while time.monotonic() < deadline:
        names = {c["name"].decode() for c in r.xinfo_consumers(stream, GROUP)}
        if not names & {"left-holding-a-job", "left-with-nothing"}:
            break
        time.sleep(0.2)
    assert not names & {"left-holding-a-job", "left-with-nothing"}, names
    assert len(names) == 1, "the live worker's consumer stays"
    check_invariant(r, keys, {"held": None})


def test_a_scoring_run_rides_out_a_redis_restart(tmp_path: Path, keys: Keys) -> None:
    from redbatch.cli.local_stack import spawn_worker, stop_worker, wait_worker_ready
    from redbatch.cli.redis_server import RedisServer

    photos = tmp_path / "photos"
    photos.mkdir()
    for i in range(60):
        (photos / f"{i:03}.jpg").write_bytes(CAT)
    out = tmp_path / "scores.jsonl"
    with RedisServer(appendonly=True) as server:
        with open(tmp_path / "worker.log", "wb") as log:
            worker = spawn_worker(server.url, ["--metrics-port", "0"], stdout=log,
                                  stderr=subprocess.STDOUT)
        try:
            wait_worker_ready(server.url, keys, worker)
            scorer = subprocess.Popen(
                [sys.executable, "-m", "redbatch.cli", "score", str(photos), "-o",
                 str(out), "--redis", server.url, "--window", "16"],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 120
            while (not out.exists() or out.read_text().count("\n") < 10) and \
                    time.monotonic() < deadline:
                time.sleep(0.1)
            server.restart()  # mid-run: submitting and collecting both break for a while
            log_text = scorer.communicate(timeout=300)[0].decode(errors="replace")
            assert scorer.returncode == 0, log_text
            print(log_text)
            records = [json.loads(line) for line in out.read_text().splitlines()]
            assert sorted(rec["path"] for rec in records) == sorted(
                str(p) for p in photos.iterdir()), "one record per photo, none twice"
            assert all(rec["status"] == "ok" for rec in records), records
            assert worker.poll() is None
        finally:
            stop_worker(worker)


def test_the_bad_input_catalogue_through_a_live_worker(
        redis_url: str, r: redis.Redis, start_worker: WorkerFactory, keys: Keys) -> None:
    # Every entry of RELIABILITY.md's bad-input table, as a producer in another language
    # could send it (plain XADD), to one worker that must answer each and keep serving.
    import pickle

    import msgpack
    from redbatch.common.protocol import JobEnvelope
    from test_decode import _png_header

    def body(**changes: object) -> bytes:
        fields = {"v": 1, "model": keys.model, "payload": CAT, "content_type": "image/jpeg",
                  "submitted_ms": 0, "deadline_ms": None, "lane": "interactive", "params": {}}
        fields.update(changes)
        return msgpack.packb({k: v for k, v in fields.items() if v is not ...})

    def image(payload: bytes) -> bytes:
        return JobEnvelope("x", keys.model, payload).encode()["job"]

    worker = start_worker("--max-payload-bytes", "300000")
    cases: dict[str, tuple[bytes, ErrorCode]] = {
        "truncated-jpeg": (image(CAT[: len(CAT) // 3]), ErrorCode.BAD_IMAGE),
        "zero-bytes": (image(b""), ErrorCode.BAD_IMAGE),
        "not-an-image": (image(b"hello, I am text"), ErrorCode.BAD_IMAGE),
        "pdf": (image(b"%PDF-1.7\n%binary"), ErrorCode.UNSUPPORTED_FORMAT),
        "bomb-100k-x-100k": (image(_png_header(100_000, 100_000)), ErrorCode.IMAGE_TOO_LARGE),
        "over-the-size-limit": (image(b"\xff" * 400_000), ErrorCode.PAYLOAD_TOO_LARGE),
        "not-msgpack": (b"\x93\x01not msgpack", ErrorCode.BAD_ENVELOPE),
        "pickle": (pickle.dumps({"v": 1, "payload": b"x"}), ErrorCode.BAD_ENVELOPE),
        "msgpack-ext-type": (msgpack.packb(msgpack.ExtType(1, b"x")), ErrorCode.BAD_ENVELOPE),
        "wrong-types": (body(payload="text, not bytes"), ErrorCode.BAD_ENVELOPE),
        "missing-fields": (body(model=...), ErrorCode.BAD_ENVELOPE),
        "extra-nesting": (body(params={"a": {"b": [1]}}), ErrorCode.BAD_ENVELOPE),
        "unknown-model": (body(model="resnet_9000"), ErrorCode.WRONG_MODEL),
        "path-like-model": (body(model="../../etc/passwd"), ErrorCode.BAD_ENVELOPE),
        "future-version": (body(v=2), ErrorCode.UNSUPPORTED_VERSION),
        "reply-to-any-key": (body(reply_to="some:other:key"), ErrorCode.BAD_ENVELOPE),
    }
    stream = keys.streams()[0]
    for rid, (job, _) in cases.items():
        r.xadd(stream, {"rid": rid, "job": job})
    r.xadd(stream, {"rid": "has spaces", "job": body()})  # no usable id: dead-lettered
    r.xadd(stream, {"job": body()})
    with Client(redis_url) as client:
        for rid, (_, code) in cases.items():
            result = client.result(rid, timeout_s=60)
            assert result.error_code is code and result.error_message, (rid, result)
        assert client.predict(CAT, timeout_s=60).ok, "still serving"
    dead = [f[b"reason"].split(b":")[0] for _, f in r.xrange(keys.dlq())]
    assert dead == [b"bad_request_id", b"bad_request_id"]
    assert worker.poll() is None
    check_invariant(r, keys, {rid: code for rid, (_, code) in cases.items()})


def test_reliability_md_names_only_tests_that_exist() -> None:
    import re

    doc = (Path(TESTS).parent / "RELIABILITY.md").read_text()
    named = set(re.findall(r"`(?:tests/(test_\w+)\.py::)?(test_\w+)`", doc))
    assert len(named) > 15
    for file, test in named:
        source = (Path(TESTS) / f"{file or 'test_faults'}.py").read_text()
        assert f"def {test}(" in source, f"RELIABILITY.md names {file}::{test}"
