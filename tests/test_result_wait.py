"""WAIT after each write of results (--result-replicas): a real master with one real replica
(``redis-server --replicaof``). Satisfied while the replica runs; while it is stopped
(SIGSTOP) the write still returns within the wait's timeout, the jobs are acknowledged all
the same, and the short wait is counted. A real worker with the option answers jobs."""

from __future__ import annotations

import os
import re
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from conftest import SAMPLES
from redbatch.cli.redis_server import RedisServer, free_port
from redbatch.common.protocol import GROUP, ErrorCode, Keys, Lane, dead_letter
from redbatch.common.redis_io import connect
from redbatch.gpu_worker.metrics import WorkerMetrics
from redbatch.gpu_worker.streams.results import Answer, ResultWriter
from redbatch.gpu_worker.streams.transaction import ReplicaWait
from spawned_workers import spawned_workers

KEYS = Keys("null")
STREAM = KEYS.stream(Lane.INTERACTIVE)


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[RedisServer, RedisServer]]:
    """A master and its one replica, in sync."""
    master = RedisServer().start()
    replica = RedisServer(extra_args=["--replicaof", "127.0.0.1", str(master.port)])
    try:
        replica.start()
        r = redis.Redis(port=master.port, socket_timeout=2)
        deadline = time.monotonic() + 20
        while r.info("replication").get("slave0", {}).get("state") != "online":
            assert time.monotonic() < deadline, "the replica never came online"
            time.sleep(0.05)
        r.close()
        yield master, replica
    finally:
        replica.stop()
        master.stop()


@pytest.fixture
def master(pair: tuple[RedisServer, RedisServer]) -> Iterator[redis.Redis]:
    r = redis.Redis(port=pair[0].port, socket_timeout=5)
    r.flushall()
    yield r
    r.flushall()
    r.close()


def _pending(r: redis.Redis, n: int, keys: Keys = KEYS) -> list[Answer]:
    """``n`` real jobs read into the group of ``keys``'s partition (pending), and an
    answer to each."""
    stream = keys.stream(Lane.INTERACTIVE)
    r.xgroup_create(stream, GROUP, id="0", mkstream=True)
    for i in range(n):
        r.xadd(stream, {"rid": f"r{keys.partition}-{i}", "job": b"x"})
    entries = r.xreadgroup(GROUP, "w", {stream: ">"}, count=n)[0][1]
    return [Answer(stream, entry_id, f"r{keys.partition}-{i}", b"result")
            for i, (entry_id, _) in enumerate(entries)]


def _writer(server: RedisServer, timeout_ms: int) -> tuple[ResultWriter, WorkerMetrics]:
    metrics = WorkerMetrics("null", 8)
    return ResultWriter(connect(server.url), KEYS, "w", 60, ReplicaWait(1, timeout_ms),
                        metrics.result_waited), metrics


def _waits(metrics: WorkerMetrics) -> dict[str, float]:
    return {outcome: series._value.get() for outcome, series in metrics.result_waits.items()}


def test_a_running_replica_confirms_every_write(
        pair: tuple[RedisServer, RedisServer], master: redis.Redis) -> None:
    writer, metrics = _writer(pair[0], timeout_ms=5000)
    answers = _pending(master, 5)
    flushed = writer.write_and_ack(answers[:4])
    assert flushed.held == [] and _waits(metrics) == {"acked": 1, "short": 0}
    # The dead-letter path (a WATCHed pipeline) waits on its own connection too.
    answers[4].dead_letter = dead_letter({}, STREAM, answers[4].entry_id,
                                         ErrorCode.DEAD_LETTERED, "test", 3)
    writer.write_and_ack(answers[4:])
    assert _waits(metrics) == {"acked": 2, "short": 0}
    # Confirmed means on the replica already: no waiting for it here.
    replica = redis.Redis(port=pair[1].port, socket_timeout=2)
    assert all(replica.get(KEYS.result(f"r0-{i}")) == b"result" for i in range(5))
    assert replica.xlen(KEYS.dlq()) == 1 and replica.xpending(STREAM, GROUP)["pending"] == 0
    replica.close()


def _waits_run(r: redis.Redis) -> int:
    """How many WAITs the server has run (INFO commandstats)."""
    return int(r.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))


def test_every_partitions_writer_waits_for_the_replica(
        pair: tuple[RedisServer, RedisServer], master: redis.Redis) -> None:
    """Issue 28 item 5: a flush spanning four partitions is four transactions, each
    followed by its WAIT (partitions 1-3 used to skip it), each counted."""
    writer, metrics = _writer(pair[0], timeout_ms=5000)
    answers = [a for q in range(4) for a in _pending(master, 3, KEYS.part(q))]
    before = _waits_run(master)
    assert writer.write_and_ack(answers).held == []
    assert _waits_run(master) - before == 4, "one WAIT per partition's transaction"
    assert _waits(metrics) == {"acked": 4, "short": 0}
    assert all(master.xpending(KEYS.part(q).stream(Lane.INTERACTIVE), GROUP)["pending"] == 0
               for q in range(4))


def test_a_stopped_replica_costs_the_timeout_and_is_counted(
        pair: tuple[RedisServer, RedisServer], master: redis.Redis,
        caplog: pytest.LogCaptureFixture) -> None:
    writer, metrics = _writer(pair[0], timeout_ms=300)
    answers = _pending(master, 6)
    assert pair[1].pid is not None
    os.kill(pair[1].pid, signal.SIGSTOP)
    try:
        for group in (answers[:3], answers[3:5]):
            started = time.monotonic()
            writer.write_and_ack(group)
            took = time.monotonic() - started
            assert 0.29 < took < 3.0, took
        answers[5].dead_letter = dead_letter({}, STREAM, answers[5].entry_id,
                                             ErrorCode.DEAD_LETTERED, "test", 3)
        writer.write_and_ack(answers[5:])
    finally:
        os.kill(pair[1].pid, signal.SIGCONT)
    assert _waits(metrics) == {"acked": 0, "short": 3}
    # Written and acknowledged on the master all the same: the jobs are answered.
    assert all(master.get(KEYS.result(f"r0-{i}")) == b"result" for i in range(6))
    assert master.xpending(STREAM, GROUP)["pending"] == 0
    warnings = [r.getMessage() for r in caplog.records if "replicas" in r.getMessage()]
    assert len(warnings) == 1, "one line a minute, not one per write"
    assert "confirmed by 0 of 1 replicas within 300 ms" in warnings[0]


def test_a_worker_with_the_option_answers_and_counts(
        pair: tuple[RedisServer, RedisServer], master: redis.Redis, tmp_path: Path) -> None:
    from redbatch.producer.client import Client
    photo = (SAMPLES / "cat.jpg").read_bytes()
    with spawned_workers(tmp_path) as start:
        port = free_port()
        start(pair[0].url, "--result-replicas", "1", "--result-wait-ms", "5000",
              "--metrics-port", str(port), model="null")
        with Client(pair[0].url, model="null") as client:
            results = client.results(client.submit_many([photo] * 20, timeout_s=60),
                                     timeout_s=60)
        assert all(r.ok for r in results), results[:3]
        waits = scraped_waits(port)
        assert waits["acked"] >= 1 and waits["short"] == 0, waits


def scraped_waits(port: int) -> dict[str, float]:
    """redbatch_result_waits_total by outcome, from the worker's /metrics; retried briefly:
    the counter follows the write whose result the client already saw."""
    deadline = time.monotonic() + 10
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        waits = {m.group(1): float(m.group(2)) for m in re.finditer(
            r'redbatch_result_waits_total\{model="null",outcome="(\w+)"\} (\S+)', text)}
        if waits.get("acked") or time.monotonic() > deadline:
            return waits
        time.sleep(0.1)
