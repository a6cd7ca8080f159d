"""How many commands Redis runs per job, counted by Redis itself (``INFO commandstats``,
the commands the admission script calls included), end to end: submitting, the worker's
read, write and acknowledgement, and the client's wait. A real worker (null model) and
real clients, small real JPEGs; the jobs are queued before the worker starts, so they
move in groups as they do under load.

The budgets (BENCHMARKS.md "Redis calls per job"): on the reply-list path each job costs
its XADD, its owner SET and its result SET, and everything else is paid per group; on the
per-request path a job also costs its done token (RPUSH and PEXPIRE: a list cannot be
created with a TTL) and its client's BLPOP, which pops the result envelope itself; a
``done_only`` job saves the result SET (its done list is its answer's only home).
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Sequence
from typing import cast

import pytest
import redis
from conftest import WorkerFactory
from PIL import Image
from redbatch.common.protocol import Keys, ResultEnvelope
from redbatch.producer.client import Client

#: These count Redis commands a job over a thousand jobs: they run alone (scripts/test.sh).
pytestmark = pytest.mark.serial

NULL = "null"
N_JOBS = 1000
#: Batches as a GPU runs them (a calibrated profile picks 64 or more there); the default,
#: 8, suits this CPU's real models.
GPU_LIKE = ("--max-batch-size", "64", "--max-inflight", "256")
#: A per-request waiter's block, s (PROTOCOL.md: a few seconds at a time; any count will
#: do). Long enough that no slice ends empty while the worker starts and serves the 1000
#: jobs on a loaded machine: an empty slice costs a pop and a GET that the clock made, not
#: the job (with 5 s, two cores under load gave 2000 pops for 1000 jobs).
SLICE_S = 30


def _small_jpeg() -> bytes:
    """A real JPEG small enough that decoding it costs about what redbatch's own work does,
    as a tensor or a thumbnail would: the groups then form as they do on a GPU."""
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 120, 40)).save(buf, format="JPEG")
    return buf.getvalue()


PHOTO = _small_jpeg()


def _calls(r: redis.Redis) -> dict[str, int]:
    """Calls per command since the last CONFIG RESETSTAT, as Redis counts them."""
    return {name.removeprefix("cmdstat_"): stat["calls"]
            for name, stat in r.info("commandstats").items()}


def _per_job(calls: dict[str, int], *names: str) -> float:
    return sum(calls.get(name, 0) for name in names) / N_JOBS


def _total(calls: dict[str, int]) -> int:
    # CONFIG (RESETSTAT) and INFO are the test's own; HELLO and CLIENT SETINFO come once
    # per connection (the per-request waiters open one each), not per job.
    return sum(n for name, n in calls.items()
               if not name.startswith(("config", "info", "hello", "client")))


#: Calls made by the clock, not by jobs: the test's wait for its worker (ZRANGE of the
#: fleet, XINFO, XLEN), the worker's start-up (XGROUP, XPENDING, its first heartbeat) and
#: its once-a-second fleet status. Their count depends on how long the run takes.
CLOCK = ("zrange", "zadd", "zremrangebyscore", "xinfo|groups", "xinfo|consumers", "xlen",
         "ping", "time", "xgroup|create", "xpending", "script|load", "function|load")


def _job_path(calls: dict[str, int]) -> int:
    """The calls the jobs made: the total without the clock's."""
    return _total(calls) - sum(calls.get(name, 0) for name in CLOCK)


def _per_request(redis_url: str, r: redis.Redis, start_worker: WorkerFactory,
                 done_only: bool,
                 wait_one: Callable[[redis.Redis, str], object]
                 ) -> tuple[Sequence[str], dict[str, int]]:
    """Queue N_JOBS jobs that name no reply list (``done_only`` as given), start one
    waiter thread per job running ``wait_one(client, request id)`` (which returns the
    result envelope), then the worker; returns the ids and Redis's call counts, after
    checking every waiter got its own envelope."""
    with Client(redis_url, model=NULL) as client:
        client.submit_many([PHOTO], timeout_s=60)  # the admission script is loaded
        r.config_resetstat()
        ids = client.submit_jobs([client.job(PHOTO, timeout_s=120, done_only=done_only)
                                  for _ in range(N_JOBS)])
    # A socket timeout well past the waits' slices: a slice that ends empty comes back as
    # None, instead of racing the socket.
    pool = redis.ConnectionPool.from_url(redis_url, max_connections=N_JOBS + 10,
                                         socket_timeout=2 * SLICE_S)
    waiter = redis.Redis(connection_pool=pool)
    got: dict[str, object] = {}
    threads = [threading.Thread(target=lambda rid=rid: got.update({rid: wait_one(waiter, rid)}))
               for rid in ids]
    for thread in threads:
        thread.start()
    start_worker(*GPU_LIKE, model=NULL)
    for thread in threads:
        thread.join(90)
    pool.disconnect()
    assert len(got) == N_JOBS and all(got.values())
    assert {ResultEnvelope.decode(cast(bytes, data)).request_id
            for data in got.values()} == set(ids)
    return ids, _calls(r)


def test_the_reply_list_path_costs_three_calls_a_job_and_the_rest_per_group(
        redis_url: str, r: redis.Redis, start_worker: WorkerFactory) -> None:
    """Client.submit_many + results: the client's jobs name its reply list."""
    with Client(redis_url, model=NULL) as client:
        client.submit_many([PHOTO], timeout_s=60)  # the admission script is loaded
        r.config_resetstat()
        ids = client.submit_many([PHOTO] * N_JOBS, timeout_s=120)
        start_worker(*GPU_LIKE, model=NULL)
        results = client.results(ids, timeout_s=120)
        calls = _calls(r)
    assert all(res.ok for res in results)
    print(f"\nreply-list path: {_total(calls) / N_JOBS:.2f} calls per job, "
          f"{_job_path(calls) / N_JOBS:.2f} without the clock's: {calls}")
    # What each job pays alone: its entry, its owner claim and its result.
    assert calls.get("xadd", 0) == N_JOBS, calls
    assert calls.get("set", 0) <= 2 * N_JOBS + 20, calls  # + the fleet status keys
    assert "exists" not in calls and "rpush" in calls, calls
    # Paid per group (a write, a pop, a submission), not per job.
    assert _per_job(calls, "pexpire", "rpush", "get", "fcall", "hget", "hmget") < 0.5, calls
    # Each flush (one MULTI) costs its transaction, acknowledgement, delete, wake-ups and
    # the reads that filled it, 9-10 calls measured; how many jobs share one moves with
    # how fast decoding and the model keep pace: 72 flushes on a quiet run (3.69 calls a
    # job), 119 of about 8 jobs in a CI run (4.08 a job, over the 4 this test once asked).
    flushes = calls.get("multi", 0)
    assert 0 < flushes <= N_JOBS / 4, calls
    assert _job_path(calls) - 3 * N_JOBS <= 12 * flushes, calls


def test_the_per_request_path_costs_a_token_and_one_wait_per_job_on_top(
        redis_url: str, r: redis.Redis, start_worker: WorkerFactory) -> None:
    """Jobs that name no reply list, each awaited as PROTOCOL.md says by a waiter of its
    own (BLPOP of its done list, which pops the envelope; GET only when a slice ends
    empty): the done token (RPUSH, PEXPIRE) and the pop come on top of the reply-list
    path's three calls."""
    keys = Keys(NULL)

    def wait(waiter: redis.Redis, rid: str) -> object:
        while (popped := waiter.blpop([keys.done(rid)], timeout=SLICE_S)) is None:
            if (data := waiter.get(keys.result(rid))) is not None:
                return data
        return popped[1]

    _, calls = _per_request(redis_url, r, start_worker, False, wait)
    own = _per_job(calls, "xadd", "set", "rpush", "pexpire", "blpop", "get")
    print(f"\nper-request path: {_total(calls) / N_JOBS:.2f} calls per job, "
          f"{_job_path(calls) / N_JOBS:.2f} without the clock's, {own:.2f} of them each "
          f"job's own: {calls}")
    assert calls.get("xadd", 0) == N_JOBS, calls
    # A token each (RPUSH, PEXPIRE); the warm-up job's reply list and the fleet's keys
    # add a few.
    assert N_JOBS <= calls.get("rpush", 0) <= N_JOBS + 5, calls
    assert N_JOBS <= calls.get("pexpire", 0) <= N_JOBS + 10, calls
    assert calls.get("blpop", 0) <= N_JOBS + 5 and calls.get("get", 0) <= 5, calls
    # Two admission calls, three worker writes and one pop each; the groups' share (a
    # read and its owner check, one MGET a partition: PROTOCOL.md "Request ids are unique";
    # a transaction, an acknowledgement per flush) on top, which moves with how the jobs fall
    # into batches: 0.30 to 0.53 a job measured, and 0.62 on a loaded CI machine before reads
    # waited for a group of places (NOTE [ Reading in groups ]); 0.26 after, loaded.
    assert own <= 6 + 0.1, calls
    assert _job_path(calls) <= 6.6 * N_JOBS, calls


def test_the_done_only_per_request_path_costs_at_most_six_calls_per_job(
        redis_url: str, r: redis.Redis, start_worker: WorkerFactory) -> None:
    """Done-only jobs (PROTOCOL.md "Waiting for the result"), each awaited by a waiter of its
    own that BLMOVEs its done list onto itself: no result key, so a job costs its entry, its
    owner claim, its done list (RPUSH, PEXPIRE) and its wait, five calls, and the groups'
    share stays under one more."""
    keys = Keys(NULL)

    def wait(waiter: redis.Redis, rid: str) -> object:
        done = keys.done(rid)
        while (first := waiter.blmove(done, done, SLICE_S, "LEFT", "LEFT")) is None:
            pass
        return first

    ids, calls = _per_request(redis_url, r, start_worker, True, wait)
    assert all(r.llen(keys.done(rid)) == 1 for rid in ids[:20])  # read, not consumed
    own = _per_job(calls, "xadd", "set", "rpush", "pexpire", "blmove", "get")
    print(f"\ndone-only per-request path: {_total(calls) / N_JOBS:.2f} calls per job, "
          f"{_job_path(calls) / N_JOBS:.2f} without the clock's, {own:.2f} of them each "
          f"job's own: {calls}")
    assert calls.get("xadd", 0) == N_JOBS, calls
    # The owner claims alone: no result key (+ the fleet status keys).
    assert N_JOBS <= calls.get("set", 0) <= N_JOBS + 20, calls
    assert N_JOBS <= calls.get("rpush", 0) <= N_JOBS + 5, calls
    assert calls.get("blmove", 0) <= N_JOBS + 5 and calls.get("get", 0) <= 5, calls
    assert own <= 5 + 0.1, calls
    assert _job_path(calls) <= 6 * N_JOBS, calls
