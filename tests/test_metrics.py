"""Metrics and health endpoints: a live worker's /metrics names, labels and moving counters."""

from __future__ import annotations

import http.client
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from conftest import SAMPLES, WorkerFactory
from prometheus_client.parser import text_string_to_metric_families
from redbatch.common.protocol import ErrorCode, Keys, Lane
from redbatch.gpu_worker.metrics import Health, MetricsServer, WorkerMetrics
from redbatch.gpu_worker.streams.sampler import group_state
from redbatch.producer.client import Client

PHOTOS = [(SAMPLES / name).read_bytes() for name in ("cat.jpg", "coffee.jpg", "rocket.jpg")]

#: The contract (gpu_worker/metrics.py): sample name -> its labels besides ``model``.
CONTRACT = {
    "redbatch_requests_total": {"lane", "outcome"},
    "redbatch_executions_total": set(),
    "redbatch_inferences_total": set(),
    "redbatch_dead_lettered_total": set(),
    "redbatch_reclaimed_total": set(),
    "redbatch_queue_seconds_count": {"lane"},
    "redbatch_preprocess_seconds_count": set(),
    "redbatch_batch_wait_seconds_count": set(),
    "redbatch_request_seconds_count": {"lane"},
    "redbatch_inference_seconds_count": set(),
    "redbatch_batch_size_count": set(),
    "redbatch_batch_fill_ratio_count": set(),
    "redbatch_inflight_requests": set(),
    "redbatch_pool_processes": set(),
    "redbatch_pool_busy_processes": set(),
    "redbatch_shm_slots": set(),
    "redbatch_shm_slots_in_use": set(),
    "redbatch_stream_length": {"lane"},
    "redbatch_stream_pending": {"lane"},
    "redbatch_stream_lag": {"lane"},
    "redbatch_dead_letters": set(),
    "redbatch_worker_info": {"consumer", "version", "device", "max_batch_size"},
}
GPU_ONLY = {"redbatch_gpu_memory_allocated_bytes": {"device"},
            "redbatch_gpu_memory_reserved_bytes": {"device"}}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def scrape(base: str) -> Samples:
    status, text = get(f"{base}/metrics")
    assert status == 200
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples named ``name`` that carry (at least) ``labels``."""
    want = set(labels.items())
    return sum(v for (n, have), v in samples.items() if n == name and want <= have)


def wait_for(check: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


@pytest.fixture
def worker_metrics(start_worker: WorkerFactory) -> str:
    """A worker on a free metrics port, ready; its base URL."""
    port = free_port()
    start_worker("--metrics-port", str(port), "--metrics-host", "127.0.0.1",
                 "--max-batch-size", "4")
    base = f"http://127.0.0.1:{port}"
    wait_for(lambda: get(f"{base}/readyz")[0] == 200)
    return base


def test_health_endpoints_of_a_ready_worker(worker_metrics: str) -> None:
    assert get(f"{worker_metrics}/healthz") == (200, "ok\n")
    assert get(f"{worker_metrics}/readyz") == (200, "ok\n")
    assert get(f"{worker_metrics}/nothing")[0] == 404


def test_metrics_have_the_contract_names_and_move_with_traffic(
        worker_metrics: str, redis_url: str, r: redis.Redis, keys: Keys) -> None:
    before = scrape(worker_metrics)
    r.xadd(keys.stream(Lane.INTERACTIVE), {"junk": "no request id"})  # to the DLQ
    with Client(redis_url) as client:
        ids = client.submit_many(PHOTOS, timeout_s=60)
        bulk_ids = client.submit_many(PHOTOS[:2], timeout_s=60, lane=Lane.BULK)
        bad_id = client.submit(b"not an image", timeout_s=60)
        assert all(client.result(i, timeout_s=60).ok for i in ids + bulk_ids)
        assert client.result(bad_id, timeout_s=60).error_code is ErrorCode.BAD_IMAGE

    served = len(PHOTOS) + 2
    # Every entry is counted, also the one with no request id (under the code it was
    # rejected with); a result is readable a moment before the worker counts it.
    wait_for(lambda: value(scrape(worker_metrics), "redbatch_requests_total") -
             value(before, "redbatch_requests_total") == served + 2)
    after = scrape(worker_metrics)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("redbatch_requests_total", lane="interactive", outcome="ok") == len(PHOTOS)
    assert moved("redbatch_requests_total", lane="bulk", outcome="ok") == 2
    assert moved("redbatch_requests_total", outcome="bad_image") == 1
    assert moved("redbatch_dead_lettered_total") == 1
    assert moved("redbatch_inferences_total") == served
    assert 1 <= moved("redbatch_executions_total") <= served
    assert moved("redbatch_batch_size_count") == moved("redbatch_executions_total")
    assert moved("redbatch_batch_size_sum") == served
    assert moved("redbatch_request_seconds_count") == served  # ok results only
    assert moved("redbatch_preprocess_seconds_count") == served
    assert_contract(after)
    # Sampled from Redis every ~2 s.
    wait_for(lambda: value(scrape(worker_metrics), "redbatch_dead_letters") == 1)


def assert_contract(samples: Samples) -> None:
    labels_of: dict[str, set[str]] = {}
    for name, labels in samples:
        labels_of.setdefault(name, set()).update(k for k, _ in labels)
    info = [dict(labels) for name, labels in samples if name == "redbatch_worker_info"]
    expected = dict(CONTRACT)
    if info[0]["device"].startswith("cuda"):
        expected.update(GPU_ONLY)
    for name, label_names in expected.items():
        assert name in labels_of, f"{name} missing from /metrics"
        assert labels_of[name] - {"le"} == {"model", *label_names}, name
    for name in ("redbatch_stream_length", "redbatch_stream_pending", "redbatch_stream_lag"):
        assert {value(samples, name, lane=lane.value) >= 0 for lane in Lane} == {True}
        lanes = {dict(labels).get("lane") for n, labels in samples if n == name}
        assert lanes == {lane.value for lane in Lane}, name
    assert info[0]["max_batch_size"] == "4" and info[0]["version"]


def test_worker_whose_metrics_port_is_taken_still_serves_jobs(
        start_worker: WorkerFactory, redis_url: str, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start_worker("--metrics-port", str(port), "--metrics-host", "127.0.0.1")
        with Client(redis_url) as client:
            assert client.predict(PHOTOS[0], timeout_s=60).ok
    log = (tmp_path / "worker-0.log").read_text()
    assert "metrics server not started" in log and str(port) in log


def test_readiness_follows_loading_redis_and_stopping() -> None:
    health = Health(redis_stale_s=10)
    assert health.alive() == (True, "ok")  # loading a model is not a hang
    assert health.ready() == (False, "model loading")
    health.model_loaded = True
    assert health.ready() == (False, "Redis not reachable")
    health.redis_reached()
    assert health.ready() == (True, "ok")
    health.stopping = True
    assert health.ready() == (False, "stopping")
    stalled = Health(stall_s=0.0)
    stalled.stepped()
    time.sleep(0.01)
    assert not stalled.alive()[0]


def test_server_on_port_zero_serves_the_registry_with_gpu_gauges_on_cuda() -> None:
    metrics = WorkerMetrics("m", max_batch_size=8)
    metrics.batch(3, 0.01)
    metrics.started("c", "0.1.0", "cuda:0", pool_processes=2, shm_slots=16)
    metrics.gpu_memory("cuda:0", allocated=10, reserved=20)
    server = MetricsServer(metrics, Health())
    assert server.start("127.0.0.1", 0)
    try:
        base = f"http://127.0.0.1:{server.port}"
        samples = scrape(base)
        assert value(samples, "redbatch_batch_size_sum", model="m") == 3
        assert value(samples, "redbatch_batch_fill_ratio_sum", model="m") == 3 / 8
        assert value(samples, "redbatch_gpu_memory_reserved_bytes", device="cuda:0") == 20
        assert get(f"{base}/readyz") == (503, "model loading\n")
        # HEAD answers as GET does, headers only (a probe's `curl -I`).
        for path, status in (("/healthz", 200), ("/readyz", 503), ("/nowhere", 404)):
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
            conn.request("HEAD", path)
            reply = conn.getresponse()
            assert (reply.status, reply.read()) == (status, b""), path
            assert int(reply.headers["Content-Length"]) > 0, path
            conn.close()
    finally:
        server.close()


def test_lag_is_derived_when_redis_cannot_count_it() -> None:
    group = {"name": b"workers", "pending": 3, "lag": None}
    assert group_state([group], length=10) == (3, 7)
    assert group_state([{**group, "lag": 5}], length=10) == (3, 5)
    assert group_state([], length=4) == (0, 4)  # no group yet: nothing read


def test_a_group_is_recorded_as_the_same_jobs_one_by_one_would_be() -> None:
    """``answered`` takes a whole group (one update per series, observe_many into the
    histograms, which reaches into prometheus_client's series): the exposition must be what
    per-job ``observe`` and ``inc`` give, bucket edges included (a value equal to a bound
    counts in that bucket)."""
    from prometheus_client import generate_latest
    from redbatch.gpu_worker.metrics import LATENCY_BUCKETS_S, Answered

    edges_ms = [b * 1000 for b in LATENCY_BUCKETS_S]
    values_ms = [0.0, 0.1, *edges_ms, *(e * 1.001 for e in edges_ms), 45_000.0, 3.3]
    group: list[Answered] = [(Lane.INTERACTIVE.value if i % 3 else Lane.BULK.value, "ok",
              {"queue_ms": v, "preprocess_ms": v / 2, "batch_wait_ms": 1.0, "total_ms": v + 1},
              False) for i, v in enumerate(values_ms)]
    group += [(Lane.BULK.value, ErrorCode.BAD_IMAGE.value, {}, True),
              (Lane.INTERACTIVE.value, ErrorCode.EXPIRED.value, None, False)]
    grouped, one_by_one = WorkerMetrics("m", 8), WorkerMetrics("m", 8)
    grouped.answered(group)
    for lane, outcome, timings, dead in group:
        one_by_one.requests.labels("m", lane, outcome).inc()
        one_by_one.dead_lettered.inc(dead)
        if outcome == "ok" and timings:
            for field, histogram in one_by_one._stages_of(lane):
                histogram.observe(timings[field] / 1000)
    def samples(metrics: WorkerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        text = generate_latest(metrics.registry).decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    expected = samples(one_by_one)
    assert any(name == "redbatch_queue_seconds_bucket" and value > 0
               for (name, _), value in expected.items())
    # Equal, but for the last bits of the sums (added in another order).
    assert samples(grouped) == pytest.approx(expected, rel=1e-12)
