"""`redbatch status` and `top`: heartbeats, recent results and queue figures from a real fleet."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner
from conftest import SAMPLES, WorkerFactory
from redbatch.cli import main
from redbatch.cli.fleet_state import FleetStatus, ModelStatus, _window, gather
from redbatch.cli.fleet_view import HOME, LANE_COLUMNS, WORKER_COLUMNS, render
from redbatch.cli.local_stack import stop_worker
from redbatch.common import protocol as p
from redbatch.common.protocol import Keys, Lane, RecentResult, WorkerRecord
from redbatch.gpu_worker.streams.heartbeat import Heartbeat
from redbatch.producer.client import Client

PHOTOS = [path.read_bytes() for path in sorted(SAMPLES.glob("*.jpg"))]
DOC = (Path(__file__).resolve().parent.parent / "PROTOCOL.md").read_text()
CLI = [sys.executable, "-m", "redbatch.cli"]


def cli(redis_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The command as an operator runs it, in its own process."""
    return subprocess.run([*CLI, *args, "--redis", redis_url], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "REDBATCH_PREFIX": p.DEFAULT_PREFIX})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def assert_every_key_expires(r: redis.Redis) -> None:
    for key in r.scan_iter(count=1000):
        if r.type(key) != b"stream":
            assert r.pttl(key) > 0, f"{key!r} never expires"


def test_status_shows_a_live_worker_its_queues_and_results(
        redis_url: str, r: redis.Redis, start_worker: WorkerFactory, keys: Keys) -> None:
    port = free_port()
    worker = start_worker("--metrics-port", str(port), "--metrics-host", "127.0.0.1")
    with Client(redis_url) as client:
        ids = {lane: client.submit_many(PHOTOS * 2, timeout_s=120, lane=lane) for lane in Lane}
        for lane_ids in ids.values():
            for rid in lane_ids:
                assert client.result(rid, timeout_s=120).ok
    # A job nobody can answer (no request id) is dead-lettered; another model has a
    # backlog and no worker at all.
    r.xadd(keys.stream(Lane.INTERACTIVE), {"junk": b"x"})
    idle = Client(redis_url, model="idle_model")
    idle.submit_many(PHOTOS, timeout_s=600, lane=Lane.BULK)
    idle.close()
    deadline = time.monotonic() + 30
    while r.xlen(keys.dlq()) == 0 and time.monotonic() < deadline:
        time.sleep(0.1)

    out = cli(redis_url, "status", "--json")
    assert out.returncode == 0, out.stderr
    fleet = json.loads(out.stdout)
    models = {m["model"]: m for m in fleet["models"]}
    assert set(models) == {keys.model, "idle_model"}, "models are found by their streams"

    served = models[keys.model]
    assert served["workers_alive"] == 1 and served["dead_letters"] == 1
    (w,) = served["workers"]
    assert w["alive"] and 0 <= w["heartbeat_age_s"] < 2 * p.HEARTBEAT_INTERVAL_S + 1
    record = w["record"]
    assert (record["pid"], record["device"], record["metrics_port"]) == (worker.pid, "cpu", port)
    assert record["max_batch_size"] == 8 and record["version"]
    for lane in served["lanes"]:
        assert (lane["length"], lane["pending"], lane["lag"]) == (0, 0, 0), lane
        assert lane["results"] >= len(PHOTOS) * 2 and lane["results_per_s"] > 0, lane
        assert 0 < lane["p50_ms"] <= lane["p99_ms"], lane
    assert served["lanes"][0]["errors"] == 0

    backlog = {lane["lane"]: lane for lane in models["idle_model"]["lanes"]}
    assert backlog["bulk"]["length"] == backlog["bulk"]["lag"] == len(PHOTOS)
    assert backlog["bulk"]["pending"] == 0 and backlog["interactive"]["length"] == 0
    assert models["idle_model"]["workers"] == [] and backlog["bulk"]["results"] == 0

    table = cli(redis_url, "status", "--model", keys.model)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert any(line.split() == list(LANE_COLUMNS) for line in lines), table.stdout
    assert any(line.split() == list(WORKER_COLUMNS) for line in lines), table.stdout
    assert "idle_model" not in table.stdout, "--model shows that model only"
    row = next(line for line in lines if line.startswith(keys.model))
    assert row.split()[:7] == [keys.model, "interactive", "0", "0", "0", "1", "1"]
    assert_every_key_expires(r)

    consumer = record["consumer"]
    assert r.exists(keys.worker(consumer))
    assert stop_worker(worker) == 0
    assert not r.exists(keys.worker(consumer)), "a clean stop removes the heartbeat record"
    assert r.zscore(keys.workers(), consumer) is None
    after = json.loads(cli(redis_url, "status", "--json", "--model", keys.model).stdout)
    assert after["models"][0]["workers_alive"] == 0
    assert_every_key_expires(r)


@pytest.mark.serial
@pytest.mark.parametrize("out", ["terminal", "pipe"])
def test_top_redraws_until_ctrl_c(redis_url: str, r: redis.Redis, keys: Keys, out: str) -> None:
    """On a terminal frames are redrawn in place (HOME first); into a pipe they are plain
    snapshots with no terminal code at all, each ending with a blank line."""
    with Client(redis_url) as client:
        client.submit(PHOTOS[0], timeout_s=600)
    reader, writer = pty.openpty() if out == "terminal" else os.pipe()
    proc = subprocess.Popen([*CLI, "top", "--interval", "0.2", "--redis", redis_url],
                            stdout=writer, stderr=subprocess.PIPE)
    os.close(writer)
    try:
        seen = b""
        deadline = time.monotonic() + 60
        while seen.count(b"LAST_BEAT") < 3 and time.monotonic() < deadline:
            ready, _, _ = select.select([reader], [], [], 1.0)
            if ready:
                chunk = os.read(reader, 65536)
                assert chunk, f"top exited early: {proc.wait()} {proc.stderr!r}"
                seen += chunk
        assert seen.count(b"LAST_BEAT") >= 3, seen
        proc.send_signal(signal.SIGINT)
        while select.select([reader], [], [], 0.5)[0]:  # a full pipe would block its exit
            try:
                if not os.read(reader, 65536):
                    break
            except OSError:  # a pty's reader says EIO once the other side is gone
                break
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
    finally:
        os.close(reader)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = seen.decode()
    if out == "terminal":
        frames = text.split(HOME)[1:]  # after the code that enters the alternate screen
    else:
        assert "\x1b" not in text, "no terminal codes into a pipe"
        frames = ["redbatch  prefix" + f for f in text.split("redbatch  prefix")[1:]]
        assert all(f.endswith("\n\n") for f in frames[:-1]), frames
    assert len(frames) >= 3 and all(keys.model in frame and "LAST_BEAT" in frame
                                    for frame in frames[:2]), frames


def test_status_without_redis_reads_the_default_url(monkeypatch: pytest.MonkeyPatch) -> None:
    """Like every command but submit and score: redis://localhost:6379/0. Where nothing
    listens there, one line says so and how to name another. (`top` keeps retrying, as a
    live view does; its --help says the same default: tests/test_cli.py.)"""
    monkeypatch.delenv("REDBATCH_REDIS_URL", raising=False)
    with socket.socket() as s:
        if s.connect_ex(("localhost", 6379)) == 0:
            pytest.skip("a Redis listens at the default URL here: status would read it")
    result = CliRunner().invoke(main, ["status"])
    assert result.exit_code == 1, result.output
    assert result.output.startswith("Error: cannot reach Redis: ")
    assert "localhost:6379" in result.output and "--redis" in result.output


def test_status_says_when_redis_is_unreachable() -> None:
    out = cli(f"redis://127.0.0.1:{free_port()}/0", "status")
    assert out.returncode != 0 and "cannot reach Redis" in out.stderr


# ------------------------------------------------------------------ the heartbeat, alone


def test_heartbeat_record_expires_and_goes_on_stop(r: redis.Redis, redis_url: str,
                                                   keys: Keys) -> None:
    beat = Heartbeat.for_worker(redis.Redis.from_url(redis_url), keys, "w-1", "cpu", 4,
                                lambda: 3, metrics_port=None, interval_s=0.1)
    beat.start()
    try:
        first = WorkerRecord.decode(r.get(keys.worker("w-1")))  # type: ignore[arg-type]
        assert (first.consumer, first.inflight, first.max_batch_size) == ("w-1", 3, 4)
        assert 0 < r.pttl(keys.worker("w-1")) <= p.WORKER_RECORD_TTL_MS
        assert 0 < r.pttl(keys.workers()) <= p.WORKERS_TTL_MS
        time.sleep(0.5)
        later = WorkerRecord.decode(r.get(keys.worker("w-1")))  # type: ignore[arg-type]
        assert later.last_seen_ms > first.last_seen_ms, "it beats on its own thread"
        assert later.started_ms == first.started_ms
    finally:
        beat.stop()
    assert not r.exists(keys.worker("w-1")) and not r.exists(keys.workers())


def test_heartbeat_rides_out_an_unreachable_redis(keys: Keys,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    dead = redis.Redis(port=free_port(), socket_connect_timeout=0.5)
    beat = Heartbeat.for_worker(dead, keys, "w-2", "cpu", 4, lambda: 0)
    for _ in range(3):
        beat.beat()  # must not raise
    beat.stop()
    warnings = [rec for rec in caplog.records if "heartbeat failed" in rec.getMessage()]
    assert len(warnings) == 1, "one line per outage, not one per beat"


# ------------------------------------------------------------------ figures, without workers


def test_rate_over_a_full_recent_list_uses_the_span_it_covers() -> None:
    now = 1_000_000
    # RECENT_MAX results in the last 10 s: 409.6/s, not RECENT_MAX / 60.
    records = [RecentResult(now - i * 10_000 // p.RECENT_MAX, Lane.BULK, "ok", 1.0)
               for i in range(p.RECENT_MAX)]
    done, per_s = _window(records, now, 60)
    assert len(done) == p.RECENT_MAX and per_s == pytest.approx(409.6, rel=0.01)
    done, per_s = _window(records[:100], now, 60)
    assert per_s == pytest.approx(100 / 60)


def test_gather_reads_recent_results_per_lane(r: redis.Redis, keys: Keys) -> None:
    seconds, _ = r.time()
    now = seconds * 1000
    records = [RecentResult(now - 1000, Lane.BULK, "ok", float(ms)) for ms in range(1, 101)]
    records += [RecentResult(now - 2000, Lane.INTERACTIVE, "expired", 5.0),
                RecentResult(now - 120_000, Lane.INTERACTIVE, "ok", 1.0)]  # outside the window
    r.xgroup_create(keys.stream(Lane.BULK), p.GROUP, id="0", mkstream=True)
    r.rpush(keys.recent(), *(x.encode() for x in records))
    lanes = {lane.lane: lane for lane in gather(r, p.DEFAULT_PREFIX).models[0].lanes}
    bulk, interactive = lanes["bulk"], lanes["interactive"]
    assert (bulk.results, bulk.p50_ms, bulk.p99_ms, bulk.errors) == (100, 50.0, 99.0, 0)
    # Latency over ok results only, as Prometheus counts it: an expired job has none.
    assert (interactive.results, interactive.errors, interactive.p50_ms) == (1, 1, None)


def test_a_worker_whose_record_expired_is_listed_as_gone(r: redis.Redis, keys: Keys) -> None:
    seconds, _ = r.time()
    now = seconds * 1000
    record = WorkerRecord("dead-1", "h", 1, "0", "cpu", 8, now - 9000, now - 3000, 0)
    r.xgroup_create(keys.stream(Lane.INTERACTIVE), p.GROUP, id="0", mkstream=True)
    r.zadd(keys.workers(), {"dead-1": now - 3000, "live-1": now})
    r.set(keys.worker("dead-1"), record.encode(), px=100)  # as if it stopped beating
    r.set(keys.worker("live-1"), WorkerRecord("live-1", "h", 2, "0", "cpu", 8, now, now,
                                              0).encode(), px=p.WORKER_RECORD_TTL_MS)
    time.sleep(0.3)
    fleet = gather(r, p.DEFAULT_PREFIX, [keys.model])
    live, dead = fleet.models[0].workers
    assert (live.consumer, live.alive, dead.consumer, dead.alive) == ("live-1", True,
                                                                      "dead-1", False)
    assert dead.record is None and dead.heartbeat_age_s >= 3
    assert fleet.models[0].workers_alive == 1
    assert re.search(r"^dead-1 .* gone ", render(fleet), re.M)


def test_render_without_models_says_so() -> None:
    text = render(FleetStatus("redbatch", 0, 60.0, []))
    assert "no models found" in text
    text = render(FleetStatus("redbatch", 0, 60.0, [ModelStatus("m", 0, [], [])]))
    assert "no workers have sent a heartbeat" in text


def test_protocol_doc_names_the_fleet_keys_and_records() -> None:
    k = Keys("M", "P")
    for key in (k.workers(), k.recent(), k.worker("CONSUMER")):
        assert f"`{key}`" in DOC, key
    section = DOC.split("## Fleet status keys", 1)[1]
    for name in [*WorkerRecord.__slots__, "finished_ms", "lane", "outcome", "total_ms"]:
        assert re.search(rf"`{name}`", section), name
    assert f"newest {p.RECENT_MAX} results" in section
    assert f"PX` {p.WORKER_RECORD_TTL_MS}" in section
