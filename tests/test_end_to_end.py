"""The whole path with real processes: client -> Redis stream -> worker -> result by request id."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import msgpack
import pytest
import redis
from conftest import CAT_LABELS, SAMPLES, WorkerFactory, shm_entries
from redbatch.cli.local_stack import stop_worker
from redbatch.common.protocol import GROUP, ErrorCode, JobEnvelope, Keys, Lane
from redbatch.producer.client import AsyncClient, Client

COFFEE_LABELS = {"espresso", "cup", "coffee mug"}
PHOTOS = {name: (SAMPLES / name).read_bytes() for name in ("cat.jpg", "coffee.jpg")}
EXPECTED = {"cat.jpg": CAT_LABELS, "coffee.jpg": COFFEE_LABELS}


def pending(r: redis.Redis, keys: Keys) -> int:
    return sum(int(r.xpending(s, GROUP)["pending"]) for s in keys.streams() if r.exists(s))


def backlog(r: redis.Redis, keys: Keys) -> int:
    return sum(int(r.xlen(s)) for s in keys.streams())


def test_real_photos_are_classified(redis_url: str, start_worker: WorkerFactory,
                                    r: redis.Redis, keys: Keys) -> None:
    start_worker()
    with Client(redis_url) as client:
        for name, data in PHOTOS.items():
            result = client.predict(data, timeout_s=60)
            assert result.ok, result
            assert result.output["label"] in EXPECTED[name]
            assert len(result.output["top5"]) == 5
            assert set(result.timings) >= {"queue_ms", "preprocess_ms", "batch_wait_ms",
                                           "inference_ms", "total_ms"}
            assert result.batch_size >= 1 and result.worker
    assert pending(r, keys) == 0 and backlog(r, keys) == 0


def test_two_hundred_jobs_from_eight_clients(redis_url: str, start_worker: WorkerFactory,
                                             r: redis.Redis, keys: Keys) -> None:
    start_worker("--max-batch-size", "16", "--max-inflight", "64")
    names = list(PHOTOS)

    def one_client(i: int) -> list[tuple[str, str, str, str, int]]:
        out: list[tuple[str, str, str, str, int]] = []
        with Client(redis_url) as client:
            sent = [(names[(i + j) % 2], client.submit(PHOTOS[names[(i + j) % 2]], timeout_s=300))
                    for j in range(25)]
            for name, rid in sent:
                result = client.result(rid, timeout_s=300)
                out.append((name, rid, result.request_id, result.output["label"],
                            result.batch_size))
        return out

    with ThreadPoolExecutor(8) as pool:
        rows = [row for rows in pool.map(one_client, range(8)) for row in rows]
    assert len(rows) == 200 and len({rid for _, rid, *_ in rows}) == 200
    assert all(rid == answered for _, rid, answered, _, _ in rows), "each id gets its own result"
    assert all(label in EXPECTED[name] for name, _, _, label, _ in rows)
    sizes = Counter(size for *_, size in rows)
    print("requests by batch size:", dict(sorted(sizes.items())))
    assert max(sizes) > 1, "batches larger than one formed"
    assert pending(r, keys) == 0 and backlog(r, keys) == 0


def test_bad_inputs_are_answered_and_the_worker_keeps_serving(
        redis_url: str, start_worker: WorkerFactory, r: redis.Redis, keys: Keys) -> None:
    worker = start_worker()
    cat = PHOTOS["cat.jpg"]
    cases = {b"": ErrorCode.BAD_IMAGE, b"plain text": ErrorCode.BAD_IMAGE,
             cat[: len(cat) // 3]: ErrorCode.BAD_IMAGE,
             b"%PDF-1.4 xxxxxxxx": ErrorCode.UNSUPPORTED_FORMAT}
    with Client(redis_url) as client:
        ids: dict[str, ErrorCode] = {client.submit(data, timeout_s=60): code
                                     for data, code in cases.items()}
        stream = keys.stream(Lane.INTERACTIVE)
        r.xadd(stream, {"rid": "raw-garbage", "job": b"\x93not msgpack"})
        r.xadd(stream, {"job": b"no request id at all"})
        wrong = JobEnvelope("wrong-model", "other_model", cat)
        r.xadd(stream, wrong.encode())  # type: ignore[arg-type]
        ids.update({"raw-garbage": ErrorCode.BAD_ENVELOPE,
                    "wrong-model": ErrorCode.WRONG_MODEL})
        for rid, code in ids.items():
            result = client.result(rid, timeout_s=60)
            assert not result.ok and result.error_code is code, (rid, result)
            assert result.error_message
        assert client.predict(cat, timeout_s=60).output["label"] in CAT_LABELS
    assert worker.poll() is None
    assert pending(r, keys) == 0 and backlog(r, keys) == 0, "the id-less entry is acked too"


def test_expired_job_is_answered_and_never_computed(redis_url: str, start_worker: WorkerFactory,
                                                    r: redis.Redis, keys: Keys) -> None:
    with Client(redis_url) as client:
        late = client.submit(PHOTOS["cat.jpg"], timeout_s=0.05)
        fine = client.submit(PHOTOS["cat.jpg"], timeout_s=120)
        time.sleep(0.2)  # the first one's budget is spent before any worker exists
        start_worker()
        expired = client.result(late, timeout_s=60)
        assert expired.error_code is ErrorCode.EXPIRED and expired.batch_size == 0
        assert client.result(fine, timeout_s=60).ok, "jobs queued before the worker are served"


def test_a_waiting_client_survives_its_connection_being_killed(
        redis_url: str, start_worker: WorkerFactory, r: redis.Redis) -> None:
    client = Client(redis_url)
    rid = client.submit(PHOTOS["coffee.jpg"], timeout_s=120)
    got = []
    waiter = threading.Thread(target=lambda: got.append(client.result(rid, timeout_s=120)))
    waiter.start()
    time.sleep(0.5)
    killed = r.client_kill_filter(_type="normal", skipme=True)
    assert killed >= 1
    start_worker()
    waiter.join(timeout=120)
    assert got and got[0].ok and got[0].output["label"] in COFFEE_LABELS
    client.close()


def test_async_client_round_trip(redis_url: str, start_worker: WorkerFactory) -> None:
    start_worker()

    async def main() -> list[str]:
        async with AsyncClient(redis_url) as client:
            ids = await client.submit_many([PHOTOS["cat.jpg"]] * 3, timeout_s=60)
            results = await asyncio.gather(*(client.result(i, timeout_s=60) for i in ids))
            single = await client.predict(PHOTOS["coffee.jpg"], timeout_s=60)
            return [res.output["label"] for res in [*results, single]]

    labels = asyncio.run(main())
    assert all(label in CAT_LABELS for label in labels[:3]) and labels[3] in COFFEE_LABELS


def test_sigterm_drains_in_flight_jobs_and_frees_shared_memory(
        redis_url: str, start_worker: WorkerFactory, r: redis.Redis, keys: Keys) -> None:
    before = shm_entries()
    worker = start_worker("--max-inflight", "16")
    with Client(redis_url) as client:
        ids = client.submit_many([PHOTOS["cat.jpg"]] * 40, timeout_s=300)
        time.sleep(1.0)
        assert stop_worker(worker) == 0
        assert pending(r, keys) == 0, "everything read was answered before exit"
        assert shm_entries() <= before, "no shared memory or semaphores left in /dev/shm"
        answered = sum(r.exists(keys.result(i)) for i in ids)
        assert 0 < answered <= 40
        start_worker()  # a new worker serves what the first one never read
        assert all(client.result(i, timeout_s=120).ok for i in ids)


def test_stable_consumer_rereads_its_own_pending_after_a_crash(
        redis_url: str, start_worker: WorkerFactory, r: redis.Redis, keys: Keys) -> None:
    before = shm_entries()
    worker = start_worker("--consumer", "worker-a", "--max-inflight", "32")
    with Client(redis_url) as client:
        ids = client.submit_many([PHOTOS["coffee.jpg"]] * 30, timeout_s=300)
        deadline = time.monotonic() + 60
        while pending(r, keys) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(worker.pid, signal.SIGKILL)  # as the OOM killer would: no drain, no acks
        worker.wait()
        assert pending(r, keys) > 0, "the crash left jobs pending on worker-a"
        # Orphaned pool processes notice within a second and exit; the resource tracker
        # then unlinks the dead worker's shared memory.
        deadline = time.monotonic() + 20
        while not shm_entries() <= before and time.monotonic() < deadline:
            time.sleep(0.2)
        assert shm_entries() <= before, "a SIGKILLed worker's shared memory is reclaimed"
        start_worker("--consumer", "worker-a")
        results = [client.result(i, timeout_s=120) for i in ids]
    assert all(res.ok for res in results)
    assert pending(r, keys) == 0 and backlog(r, keys) == 0


def test_result_is_raw_msgpack_any_client_can_read(redis_url: str, start_worker: WorkerFactory,
                                                   r: redis.Redis, keys: Keys) -> None:
    start_worker()
    with Client(redis_url) as client:
        rid = client.submit(PHOTOS["cat.jpg"], timeout_s=60)
        client.result(rid, timeout_s=60)
    raw = msgpack.unpackb(r.get(keys.result(rid)))
    assert raw["id"] == rid and raw["status"] == "ok" and raw["output"]["label"] in CAT_LABELS
    assert 0 < r.pttl(keys.result(rid)) <= 600_000


@pytest.mark.parametrize("lane", list(Lane))
def test_both_lanes_are_served(redis_url: str, start_worker: WorkerFactory, lane: Lane) -> None:
    start_worker()
    with Client(redis_url) as client:
        assert client.predict(PHOTOS["cat.jpg"], lane=lane, timeout_s=60).ok


def test_a_tensor_model_is_preprocessed_inline_with_no_pool_process(
        redis_url: str, start_worker: WorkerFactory) -> None:
    """The null_tensor model's preprocessing is a copy (``inline_preprocess``): the worker
    runs it in its own loop and starts no pool process; a payload of the wrong size is
    answered ``bad_input`` and the others of its group still run."""
    import numpy as np
    import psutil

    proc = start_worker(model="null_tensor")
    values = [np.array([i, 0.5, -1.0, 2.0], dtype="<f4") for i in range(40)]
    with Client(redis_url, model="null_tensor") as client:
        ids = client.submit_many([v.tobytes() for v in values] + [b"\x00" * 15], timeout_s=60)
        results = client.results(ids, timeout_s=60)
    for v, result in zip(values, results, strict=False):
        assert result.ok, result
        assert result.output == {"sum": pytest.approx(float(v.sum()))}
    assert results[-1].error_code is ErrorCode.BAD_INPUT, results[-1]
    assert max(r.batch_size for r in results[:-1]) > 1, "they ran in batches"
    # Pool processes are multiprocessing's spawned children; the resource tracker stays.
    assert not [c for c in psutil.Process(proc.pid).children(recursive=True)
                if "spawn_main" in " ".join(c.cmdline())], "no pool process"


def test_burst_mode_answers_the_backlog_and_exits(redis_url: str, start_worker: WorkerFactory,
                                                  r: redis.Redis) -> None:
    """`--burst`: a worker started on a backlog answers all of it, then exits 0 by itself
    (the intake thread's next read already holding places must not keep it waiting)."""
    keys = Keys("null")
    with Client(redis_url, model="null") as client:
        ids = client.submit_many([PHOTOS["cat.jpg"]] * 30, timeout_s=120)
        worker = start_worker("--burst", model="null", wait=False)
        try:
            assert worker.wait(timeout=90) == 0
        finally:
            if worker.poll() is None:
                worker.kill()
        results = client.results(ids, timeout_s=10)
    assert all(result.ok for result in results)
    assert pending(r, keys) == 0 and backlog(r, keys) == 0
