"""Admission control: per-model, per-lane queue bounds checked atomically at submit.

A submit past the bound fails at once with ``queue_full`` and queues nothing; the bulk
scorer is refused too, but backs off and retries until every input is scored.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import cast

import pytest
import redis
from click.testing import CliRunner
from conftest import SAMPLES, TEST_MODEL, WorkerFactory
from PIL import Image
from redbatch.cli import main
from redbatch.common import protocol as p
from redbatch.common.protocol import (
    ADMIT_SCRIPT,
    BAD_CALL_REPLY,
    DUPLICATE_REPLY,
    ErrorCode,
    Keys,
    Lane,
)
from redbatch.common.redis_io import StreamEntry
from redbatch.producer.client import AsyncClient, Client, DuplicateRequestId, QueueFull


def test_submit_past_the_bound_fails_at_once_and_adds_nothing(
        client: Client, r: redis.Redis, keys: Keys) -> None:
    client.set_queue_limit(Lane.INTERACTIVE, 5)
    ids = [client.submit(b"job %d" % i) for i in range(5)]
    assert len(set(ids)) == 5
    started = time.monotonic()
    with pytest.raises(QueueFull) as info:
        client.submit(b"one too many", request_id="refused-1")
    assert time.monotonic() - started < 1.0, "refused at once, not after a wait"
    e = info.value
    assert e.code is ErrorCode.QUEUE_FULL and str(e).startswith("queue_full: ")
    assert (e.lane, e.bound, e.model) == (Lane.INTERACTIVE, 5, TEST_MODEL)
    assert e.refused == ["refused-1"] and e.accepted == []
    assert r.xlen(keys.stream(Lane.INTERACTIVE)) == 5, "nothing was added"
    state = client.queue_state(Lane.INTERACTIVE)
    assert (state.queued, state.bound, state.room) == (5, 5, 0)

    # The bulk lane has no bound of its own.
    client.submit(b"bulk job", lane=Lane.BULK)
    assert r.xlen(keys.stream(Lane.BULK)) == 1
    assert client.queue_state(Lane.BULK).room is None

    # submit_many admits what fits and names the rest.
    client.set_queue_limit(Lane.INTERACTIVE, 7)
    with pytest.raises(QueueFull) as info:
        client.submit_many([b"a", b"b", b"c", b"d"])
    assert len(info.value.accepted) == 2 and len(info.value.refused) == 2
    assert r.xlen(keys.stream(Lane.INTERACTIVE)) == 7
    queued = {f[b"rid"].decode() for _, f in r.xrange(keys.stream(Lane.INTERACTIVE))}
    assert set(info.value.accepted) <= queued and not set(info.value.refused) & queued

    # Clearing the bound admits again.
    client.set_queue_limit(Lane.INTERACTIVE, None)
    assert client.queue_state(Lane.INTERACTIVE).bound is None
    client.submit(b"admitted again")
    assert len(client.submit_many([b"x"] * 3)) == 3
    assert r.xlen(keys.stream(Lane.INTERACTIVE)) == 11


def test_a_bound_of_zero_refuses_everything_and_bad_limits_are_refused(
        client: Client, r: redis.Redis, keys: Keys) -> None:
    client.set_queue_limit(Lane.BULK, 0)
    with pytest.raises(QueueFull):
        client.submit(b"x", lane=Lane.BULK)
    assert r.xlen(keys.stream(Lane.BULK)) == 0
    with pytest.raises(ValueError):
        client.set_queue_limit(Lane.BULK, -1)
    with pytest.raises(ValueError):
        client.set_queue_limit("vip", 3)
    # A field that is not a number means unbounded, for the script and the client alike.
    r.hset(keys.limits(), Lane.BULK.value, "lots")
    client.submit(b"x", lane=Lane.BULK)
    assert client.queue_state(Lane.BULK).bound is None


def test_concurrent_submits_admit_exactly_the_bound(
        redis_url: str, client: Client, r: redis.Redis, keys: Keys) -> None:
    """8 threads, 160 jobs, a bound of 50 and no worker: exactly 50 are admitted, whether
    submitted one by one (odd threads) or pipelined four at a time (even threads)."""
    bound, threads, rounds = 50, 8, 5
    client.set_queue_limit(Lane.INTERACTIVE, bound)
    accepted: list[str] = []
    refused: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(threads)

    def submit_four(c: Client, n: int, i: int) -> tuple[list[str], list[str]]:
        payloads = [b"%d-%d-%d" % (n, i, j) for j in range(4)]
        if n % 2 == 0:
            try:
                return c.submit_many(payloads), []
            except QueueFull as e:
                return e.accepted, e.refused
        ok, bad = [], []
        for payload in payloads:
            rid = f"t{n}-{i}-{payload[-1:].decode()}"
            try:
                ok.append(c.submit(payload, request_id=rid))
            except QueueFull as e:
                assert e.refused == [rid]
                bad.append(rid)
        return ok, bad

    def producer(n: int) -> None:
        with Client(redis_url, model=TEST_MODEL) as c:
            start.wait()
            for i in range(rounds):
                ok, bad = submit_four(c, n, i)
                with lock:
                    accepted.extend(ok)
                    refused.extend(bad)

    pool = [threading.Thread(target=producer, args=(n,)) for n in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout=60)
    assert (len(accepted), len(refused)) == (bound, threads * rounds * 4 - bound)
    assert r.xlen(keys.stream(Lane.INTERACTIVE)) == bound
    queued = [f[b"rid"].decode() for _, f in r.xrange(keys.stream(Lane.INTERACTIVE))]
    assert sorted(queued) == sorted(accepted), "exactly the admitted jobs were queued"


def test_async_client_raises_queue_full(redis_url: str, client: Client, r: redis.Redis,
                                        keys: Keys) -> None:
    async def run() -> None:
        async with AsyncClient(redis_url, model=TEST_MODEL) as ac:
            await ac.set_queue_limit(Lane.INTERACTIVE, 2)
            await ac.submit(b"one")
            with pytest.raises(QueueFull) as info:
                await ac.submit_many([b"two", b"three"])
            assert len(info.value.accepted) == 1 and len(info.value.refused) == 1
            started = time.monotonic()
            with pytest.raises(QueueFull) as single:
                await ac.submit(b"four")
            assert time.monotonic() - started < 1.0
            assert single.value.bound == 2 and single.value.lane is Lane.INTERACTIVE
            assert (await ac.queue_state(Lane.INTERACTIVE)).room == 0
            await ac.set_queue_limit(Lane.INTERACTIVE, None)
            assert len(await ac.submit_many([b"five", b"six"])) == 2

    asyncio.run(run())
    assert r.xlen(keys.stream(Lane.INTERACTIVE)) == 4


# ---------------------------------------------------------------------------- commands


def test_submit_command_prints_queue_full_and_exits_1(
        redis_url: str, client: Client, r: redis.Redis, keys: Keys) -> None:
    client.set_queue_limit(Lane.INTERACTIVE, 1)
    client.submit(b"fills the queue")
    files = [str(SAMPLES / "cat.jpg"), str(SAMPLES / "coffee.jpg")]
    result = CliRunner().invoke(main, ["submit", "--redis", redis_url, *files])
    assert result.exit_code == 1, result.output
    lines = [json.loads(line) for line in result.output.splitlines()]
    assert [line["file"] for line in lines] == files
    for line in lines:
        assert line["status"] == "error" and line["error"]["code"] == "queue_full", line
        assert "bound of 1" in line["error"]["message"]
    assert r.xlen(keys.stream(Lane.INTERACTIVE)) == 1


def test_limit_command_sets_shows_and_clears(redis_url: str, client: Client) -> None:
    def run(*args: str) -> dict[str, dict[str, object]]:
        result = CliRunner().invoke(main, ["limit", "--redis", redis_url, *args])
        assert result.exit_code == 0, result.output
        return {rec["lane"]: rec for rec in map(json.loads, result.output.splitlines())}

    shown = run("--lane", "bulk", "--max-jobs", "1000")
    assert shown["bulk"]["max_jobs"] == 1000 and shown["interactive"]["max_jobs"] is None
    assert shown["bulk"]["model"] == TEST_MODEL and shown["bulk"]["queued"] == 0
    assert client.queue_state(Lane.BULK).bound == 1000
    client.submit(b"x", lane=Lane.BULK)
    assert run()["bulk"] == {"model": TEST_MODEL, "lane": "bulk", "max_jobs": 1000,
                             "queued": 1}
    assert run("--lane", "bulk", "--clear")["bulk"]["max_jobs"] is None
    assert client.queue_state(Lane.BULK).bound is None
    for bad in (["--max-jobs", "3"], ["--lane", "bulk", "--max-jobs", "3", "--clear"],
                ["--lane", "bulk", "--max-jobs", "-1"]):
        result = CliRunner().invoke(main, ["limit", "--redis", redis_url, *bad])
        assert result.exit_code == 2, (bad, result.output)


# ---------------------------------------------------------------------------- bulk scorer


def _tiny_jpegs(folder: Path, n: int) -> set[str]:
    folder.mkdir()
    blobs = []
    for i in range(8):
        buf = io.BytesIO()
        Image.new("RGB", (32, 32), (30 * i, 255 - 30 * i, 90)).save(buf, "JPEG")
        blobs.append(buf.getvalue())
    paths = set()
    for i in range(n):
        path = folder / f"img-{i:04d}.jpg"
        path.write_bytes(blobs[i % len(blobs)])
        paths.add(str(path))
    return paths


def test_bulk_scorer_backs_off_and_completes_within_the_bound(
        redis_url: str, r: redis.Redis, start_worker: WorkerFactory, tmp_path: Path) -> None:
    bound, n = 10, 300
    expected = _tiny_jpegs(tmp_path / "photos", n)
    with Client(redis_url, model="null") as c:
        c.set_queue_limit(Lane.BULK, bound)
    start_worker(model="null")
    stream = Keys("null").stream(Lane.BULK)

    lengths: list[int] = []
    done = threading.Event()

    def sample() -> None:
        with redis.Redis.from_url(redis_url) as probe:
            while not done.is_set():
                lengths.append(probe.xlen(stream))
                time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out = tmp_path / "out.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDBATCH_")}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "redbatch.cli", "score", str(tmp_path / "photos"),
             "-o", str(out), "--redis", redis_url, "--model", "null", "--window", "64"],
            env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
    finally:
        done.set()
        sampler.join(timeout=5)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    ids = Counter(rec["id"] for rec in records)
    assert set(ids) == expected and max(ids.values()) == 1, "every input once"
    assert Counter(rec["status"] for rec in records) == {"ok": n}, \
        Counter(rec.get("error", {}).get("code") for rec in records)
    assert proc.stderr.count("is full (bound 10): backing off") == 1, proc.stderr[-3000:]
    print(f"\nbulk stream length: max {max(lengths)} over {len(lengths)} samples")
    assert len(lengths) > 50 and max(lengths) <= bound, max(lengths)
    assert r.xlen(stream) == 0


def test_bulk_scorer_without_room_writes_timeouts_and_finishes(
        redis_url: str, r: redis.Redis, tmp_path: Path) -> None:
    """No worker and a bound of 3: three jobs are queued (and time out unanswered), the
    other inputs are refused again and again and are written as timeouts too: the run
    ends, with one record per input and never more than the bound queued."""
    from redbatch.producer.bulk import BulkScorer, ScoreSettings
    from redbatch.producer.inputs import Item
    from redbatch.producer.output import OutputWriter

    paths = sorted(_tiny_jpegs(tmp_path / "photos", 10))
    out = tmp_path / "out.jsonl"
    with Client(redis_url, model="null") as c:
        c.set_queue_limit(Lane.BULK, 3)
        writer = OutputWriter(str(out), "jsonl", append=False)
        scorer = BulkScorer(c, writer, ScoreSettings(window=8, timeout_s=1.0))
        started = time.monotonic()
        assert scorer.run(iter(Item(p, p) for p in paths)) is True
        writer.close()
    assert time.monotonic() - started < 10
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(rec["id"] for rec in records) == paths
    messages = Counter(rec["error"]["message"].split(":")[0] for rec in records)
    assert messages == {"no result within 1s": 3, "not admitted within 1s": 7}, messages
    assert r.xlen(Keys("null").stream(Lane.BULK)) == 3


# ---------------------------------------------------------------------------- the script


def _call(r: redis.Redis, keys: list[str], args: list[str | bytes]) -> bytes:
    return r.eval(ADMIT_SCRIPT, len(keys), *keys, *args)  # type: ignore[no-any-return]


def _good(keys: Keys, rid: str = "a1", lane: Lane = Lane.BULK,
          ttl: str = "60000") -> tuple[list[str], list[str | bytes]]:
    return ([keys.stream(lane), keys.limits(), keys.owner(rid)],
            [lane.value, ttl, "rid", rid, "job", b"\x80"])


def _bad_calls(keys: Keys) -> dict[str, tuple[list[str], list[str | bytes]]]:
    k, a = _good(keys)
    other = Keys("other")
    return {
        "negative ttl": (k, [*a[:1], "-5", *a[2:]]),
        "zero ttl": (k, [*a[:1], "0", *a[2:]]),
        "fractional ttl": (k, [*a[:1], "1.5", *a[2:]]),
        "16-digit ttl": (k, [*a[:1], "1" * 16, *a[2:]]),
        "no ttl": (k, [*a[:1], *a[2:]]),
        "odd field count": (k, a[:-1]),
        "extra field": (k, [*a, "x", "y"]),
        "fields swapped": (k, [*a[:2], "job", b"\x80", "rid", "a1"]),
        "unknown lane": (k, ["vip", *a[1:]]),
        "lane of another stream": (k, ["interactive", *a[1:]]),
        "request id with a newline": ([*k[:2], keys.owner("a1\n")], [*a[:3], "a1\n", *a[4:]]),
        "owner key of another id": ([*k[:2], keys.owner("a2")], a),
        "limits of another model": ([k[0], other.limits(), k[2]], a),
        "owner of another model": ([*k[:2], other.owner("a1")], a),
        "stream that is no lane stream": (["x:{m}:queue", *k[1:]], a),
        "two keys": (k[:2], a),
    }


@pytest.mark.parametrize("case", list(_bad_calls(Keys(TEST_MODEL))))
def test_a_bad_call_is_refused_before_anything_is_written(
        case: str, r: redis.Redis, keys: Keys) -> None:
    """Every check precedes the first write: an error reply means nothing was added (the
    revision-1 script queued a job whose owner TTL was <= 0, then failed at its SET)."""
    call_keys, args = _bad_calls(keys)[case]
    with pytest.raises(redis.ResponseError) as info:
        _call(r, call_keys, args)
    assert str(info.value).startswith(f"{BAD_CALL_REPLY} "), str(info.value)
    assert r.dbsize() == 0, r.keys()
    # The same job, called right, is admitted: the refusal took no request id.
    _call(r, *_good(keys))
    assert r.xlen(keys.stream(Lane.BULK)) == 1 and 0 < r.pttl(keys.owner("a1")) <= 60000


def test_a_deadline_long_past_is_admitted_once(
        redis_url: str, client: Client, r: redis.Redis, keys: Keys) -> None:
    rid = client.submit(b"x", timeout_s=-10**6, request_id="late-1")
    assert r.xlen(keys.stream(Lane.INTERACTIVE)) == 1
    assert 590_000 < r.pttl(keys.owner(rid)) <= p.OWNER_TTL_PAD_MS
    with pytest.raises(DuplicateRequestId) as info:
        client.submit(b"x", timeout_s=-10**6, request_id="late-1")
    assert info.value.duplicates == ["late-1"]
    assert r.xlen(keys.stream(Lane.INTERACTIVE)) == 1


def test_the_duplicate_reply_names_the_owner_and_the_client_matches_its_first_word(
        client: Client, r: redis.Redis, keys: Keys) -> None:
    client.submit(b"first", request_id="dup-1")
    (entry_id, _), = cast(list[StreamEntry], r.xrange(keys.stream(Lane.INTERACTIVE)))
    k, a = _good(keys, "dup-1", Lane.INTERACTIVE)
    with pytest.raises(redis.ResponseError) as raw:
        _call(r, k, a)
    assert str(raw.value) == f"{DUPLICATE_REPLY} {entry_id.decode()}"
    with pytest.raises(DuplicateRequestId) as info:
        client.submit(b"second", request_id="dup-1")
    assert str(info.value) == "duplicate_request_id: request id 'dup-1' is already in use"
    ids = client.submit_many([b"a", b"b"])
    with pytest.raises(DuplicateRequestId) as many:
        client.submit_jobs([client.job(b"c", request_id=ids[0]), client.job(b"d")])
    assert many.value.duplicates == [ids[0]] and len(many.value.accepted) == 1
    r.delete(keys.owner("dup-1"))
    r.hset(keys.owner("dup-1"), "planted", 1)  # another type: still taken, owner unknown
    with pytest.raises(redis.ResponseError) as planted:
        _call(r, k, a)
    assert str(planted.value) == f"{DUPLICATE_REPLY} ?"
    assert r.xlen(keys.stream(Lane.INTERACTIVE)) == 4


def test_a_user_who_may_not_set_the_owner_key_adds_nothing(
        redis_url: str, r: redis.Redis, keys: Keys) -> None:
    """Redis 7 checks ACLs at each command of a script: without the up-front check the
    XADD ran, the SET was refused, and the caller got an error for a queued job."""
    user = f"producer-{uuid.uuid4().hex[:8]}"
    r.acl_setuser(user, enabled=True, passwords=["+pw"], keys=["*"],
                  commands=["+@all", "-set"])
    try:
        url = redis_url.replace("redis://", f"redis://{user}:pw@", 1)
        with redis.Redis.from_url(url) as limited:
            with pytest.raises(redis.exceptions.NoPermissionError) as info:
                _call(limited, *_good(keys))
        assert str(info.value) == f"this user may not SET {keys.owner('a1')}"
        assert r.dbsize() == 0
    finally:
        r.acl_deluser(user)
