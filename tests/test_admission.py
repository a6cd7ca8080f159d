"""Admission control: per-model, per-lane queue bounds checked atomically at submit.

A submit past the bound fails at once with ``queue_full`` and queues nothing; the bulk
scorer is refused too, but backs off and retries until every input is scored.
"""

from __future__ import annotations

import asyncio
import io
import json
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
from conftest import SAMPLES, TEST_MODEL, WorkerFactory, settings_free_env
from PIL import Image
from redbatch.cli import main
from redbatch.common import protocol as p
from redbatch.common.protocol import (
    ADMIT_SCRIPT,
    BAD_CALL_REPLY,
    DUPLICATE_REPLY,
    QUEUE_FULL_REPLY,
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
                return list(map(str, c.submit_many(payloads))), []
            except QueueFull as e:
                return e.accepted, e.refused
        ok: list[str] = []
        bad: list[str] = []
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
    assert [line["path"] for line in lines] == files
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
                             "queued": 1, "max_tokens": None, "tokens": 0}
    tokens = run("--lane", "bulk", "--max-tokens", "5000")["bulk"]
    assert (tokens["max_jobs"], tokens["max_tokens"]) == (1000, 5000)
    assert client.queue_state(Lane.BULK).token_bound == 5000
    cleared = run("--lane", "bulk", "--clear")["bulk"]
    assert cleared["max_jobs"] is None and cleared["max_tokens"] is None
    assert client.queue_state(Lane.BULK).bound is None
    for bad in (["--max-jobs", "3"], ["--lane", "bulk", "--max-jobs", "3", "--clear"],
                ["--lane", "bulk", "--max-jobs", "-1"], ["--max-tokens", "3"],
                ["--lane", "bulk", "--max-tokens", "-1"],
                ["--lane", "bulk", "--max-tokens", "3", "--clear"]):
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
    env = settings_free_env()
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
    from redbatch.scoring.bulk import BulkScorer, ScoreSettings
    from redbatch.scoring.inputs import Item
    from redbatch.scoring.output import OutputWriter

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


def _call(r: redis.Redis, keys: list[str], args: list[str | bytes]) -> list[object]:
    """One call of the script (revision 7); its reply, an array with one element per job
    (an entry id, or a ResponseError instance for an error element). An error reply to
    the whole call is raised."""
    return r.eval(ADMIT_SCRIPT, len(keys), *keys, *args)  # type: ignore[no-any-return]


def _good(keys: Keys, *request_ids: str, lane: Lane = Lane.BULK, ttl: str = "60000",
          charge: str = "0") -> tuple[list[str], list[str | bytes]]:
    """A well-formed call for jobs of these request ids (``a1`` if none; each envelope
    b"\x80"): the stream, the limits hash, the lane's charges hash, each owner key; the
    lane, then each job's TTL, request id, charge and envelope."""
    rids = request_ids or ("a1",)
    return ([keys.stream(lane), keys.limits(), keys.charges(lane),
             *(keys.owner(i) for i in rids)],
            [lane.value, *(arg for i in rids for arg in (ttl, i, charge, b"\x80"))])


def _bad_calls(keys: Keys) -> dict[str, tuple[list[str], list[str | bytes]]]:
    k, a = _good(keys)
    k2, a2 = _good(keys, "a1", "a2")  # two jobs
    other = Keys("other")
    return {
        "negative ttl": (k, [*a[:1], "-5", *a[2:]]),
        "zero ttl": (k, [*a[:1], "0", *a[2:]]),
        "fractional ttl": (k, [*a[:1], "1.5", *a[2:]]),
        "16-digit ttl": (k, [*a[:1], "1" * 16, *a[2:]]),
        "no ttl": (k, [*a[:1], *a[2:]]),
        "negative charge": (k, [*a[:3], "-1", a[4]]),
        "fractional charge": (k, [*a[:3], "2.5", a[4]]),
        "empty charge": (k, [*a[:3], "", a[4]]),
        "16-digit charge": (k, [*a[:3], "9" * 16, a[4]]),
        # Revision 2 took the field names rid and job as arguments; its call of one job
        # (6 arguments) is now malformed, and so is any count that is not 1 + 4N.
        "revision-2 call": (k, [*a[:2], "rid", a[2], "job", a[4]]),
        # Revision 6 (library version 1) took no charges hash and no charge.
        "revision-6 call": ([k[0], k[1], *k2[3:]], [a2[0], *a2[1:3], a2[4], *a2[5:7], a2[8]]),
        "no envelope": (k, a[:-1]),
        "extra argument": (k, [*a, "x"]),
        "ttl and request id swapped": (k, [a[0], a[2], a[1], *a[3:]]),
        "unknown lane": (k, ["vip", *a[1:]]),
        "lane of another stream": (k, ["interactive", *a[1:]]),
        "request id with a newline": ([*k[:3], keys.owner("a1\n")], [*a[:2], "a1\n", *a[3:]]),
        "owner key of another id": ([*k[:3], keys.owner("a2")], a),
        "limits of another model": ([k[0], other.limits(), *k[2:]], a),
        "charges of another model": ([*k[:2], other.charges(Lane.BULK), k[3]], a),
        "charges of another lane": ([*k[:2], keys.charges(Lane.INTERACTIVE), k[3]], a),
        "owner of another model": ([*k[:3], other.owner("a1")], a),
        "stream that is no lane stream": (["x:{m}:queue", *k[1:]], a),
        "two keys": (k[:2], a),
        "three keys": (k[:3], a),
        "no jobs": (k[:3], a[:1]),
        f"{p.MAX_ADMIT_JOBS + 1} jobs": _good(keys, *(f"m{i}"
                                                     for i in range(p.MAX_ADMIT_JOBS + 1))),
        "a second job's arguments without its key": (k, a2),
        "a second key without its job's arguments": (k2, a),
        "second job: bad ttl": (k2, [*a2[:5], "0", *a2[6:]]),
        "second job: bad charge": (k2, [*a2[:7], "x", a2[8]]),
        "second job: owner key of another id": ([*k2[:4], keys.owner("a3")], a2),
        "owner keys in the other order": ([*k2[:3], k2[4], k2[3]], a2),
    }


@pytest.mark.parametrize("case", list(_bad_calls(Keys(TEST_MODEL))))
def test_a_bad_call_is_refused_before_anything_is_written(
        case: str, r: redis.Redis, keys: Keys) -> None:
    """Every check precedes the first write: an error reply means nothing was added, not
    even the jobs of the call that are fine (the revision-1 script queued a job whose owner
    TTL was <= 0, then failed at its SET)."""
    call_keys, args = _bad_calls(keys)[case]
    with pytest.raises(redis.ResponseError) as info:
        _call(r, call_keys, args)
    assert str(info.value).startswith(f"{BAD_CALL_REPLY} "), str(info.value)
    assert r.dbsize() == 0, r.keys()
    # The same jobs, called right, are admitted: the refusal took no request id.
    (entry_id, second) = cast(list[bytes], _call(r, *_good(keys, "a1", "a2")))
    assert r.xlen(keys.stream(Lane.BULK)) == 2 and 0 < r.pttl(keys.owner("a1")) <= 60000
    assert r.get(keys.owner("a1")) == entry_id + b" bulk"
    assert r.get(keys.owner("a2")) == second + b" bulk"


def test_one_call_admits_up_to_the_most_jobs_with_one_element_each(
        r: redis.Redis, keys: Keys) -> None:
    """MAX_ADMIT_JOBS jobs in one call: an entry id each, in order, each entry with the
    fields rid, job and FIELD_ADMITTED, and its id's owner key naming it and its lane."""
    rids = [f"n{i}" for i in range(p.MAX_ADMIT_JOBS)]
    reply = _call(r, *_good(keys, *rids))
    added = cast(list[StreamEntry], r.xrange(keys.stream(Lane.BULK)))
    assert reply == [entry_id for entry_id, _ in added]
    assert [f for _, f in added[:1]] == [{p.FIELD_REQUEST_ID.encode(): b"n0",
                                         p.FIELD_JOB.encode(): b"\x80",
                                         p.FIELD_ADMITTED.encode(): b"1"}]
    assert [f[b"rid"].decode() for _, f in added] == rids
    assert r.mget([keys.owner(i) for i in rids]) == [e + b" bulk" for e in
                                                     cast(list[bytes], reply)], "<id> <lane>"


def test_the_bound_counts_the_jobs_of_the_call_and_duplicates_leave_nothing(
        r: redis.Redis, keys: Keys) -> None:
    (first,) = _call(r, *_good(keys, "c0"))
    r.hset(keys.limits(), Lane.BULK.value, 3)
    before = r.dbsize()
    reply = _call(r, *_good(keys, "c1", "c0", "c1", "c2", "c3"))
    c1, dup, dup_in_call, c2, full = reply
    assert isinstance(c1, bytes) and isinstance(c2, bytes), reply
    assert isinstance(dup, redis.ResponseError)
    assert str(dup) == f"{DUPLICATE_REPLY} {cast(bytes, first).decode()}"
    assert isinstance(dup_in_call, redis.ResponseError)
    assert str(dup_in_call) == f"{DUPLICATE_REPLY} {c1.decode()}"
    assert isinstance(full, redis.ResponseError) and str(full) == f"{QUEUE_FULL_REPLY} 3"
    assert [e for e, _ in cast(list[StreamEntry], r.xrange(keys.stream(Lane.BULK)))] == \
        [first, c1, c2], "the duplicates' entries were taken out again"
    assert r.dbsize() == before + 2 and not r.exists(keys.owner("c3"))


@pytest.mark.parametrize("raw", ["10", "3", "0", "2.5", "0.5", "-4", "lots", "nan", "inf",
                                 "0x4", "1e1"])
def test_the_script_admits_exactly_the_room_the_client_reads(
        raw: str, client: Client, r: redis.Redis, keys: Keys) -> None:
    """The script and parse_queue_bound (queue_state, ``redbatch limit``) read a limits
    field alike: a call of 12 jobs to an empty lane admits min(12, bound) of them, all 12
    when the client reads no bound."""
    r.hset(keys.limits(), Lane.BULK.value, raw)
    bound = client.queue_state(Lane.BULK).bound
    reply = _call(r, *_good(keys, *(f"z{i}" for i in range(12))))
    admitted = [e for e in reply if isinstance(e, bytes)]
    assert len(admitted) == (12 if bound is None else min(12, bound)), (raw, bound, reply)
    assert r.xlen(keys.stream(Lane.BULK)) == len(admitted)


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
    k, a = _good(keys, "dup-1", lane=Lane.INTERACTIVE)
    (raw,) = _call(r, k, a)  # an error element of the array, not an error reply
    assert isinstance(raw, redis.ResponseError), raw
    assert str(raw) == f"{DUPLICATE_REPLY} {entry_id.decode()}"
    with pytest.raises(DuplicateRequestId) as info:
        client.submit(b"second", request_id="dup-1")
    assert str(info.value) == "duplicate_request_id: request id 'dup-1' is already in use"
    ids = client.submit_many([b"a", b"b"])
    with pytest.raises(DuplicateRequestId) as many:
        client.submit_jobs([client.job(b"c", request_id=ids[0]), client.job(b"d")])
    assert many.value.duplicates == [ids[0]] and len(many.value.accepted) == 1
    r.delete(keys.owner("dup-1"))
    r.hset(keys.owner("dup-1"), "planted", 1)  # another type: still taken, owner unknown
    (planted,) = _call(r, k, a)
    assert isinstance(planted, redis.ResponseError), planted
    assert str(planted) == f"{DUPLICATE_REPLY} ?"
    r.set(keys.owner("dup-1"), "not an entry id")
    (planted_string,) = _call(r, k, a)
    assert str(planted_string) == f"{DUPLICATE_REPLY} ?"
    assert r.xlen(keys.stream(Lane.INTERACTIVE)) == 4


@pytest.mark.parametrize("rules, refused", [
    (["+@all", "-set"], "SET {owner1}"),
    (["+@all", "-xdel"], "XADD and XDEL {stream}"),
    # SET only on the first job's owner key (a selector): job 2 is refused, job 1 not added.
    (["+@all", "-set", "(+set ~{owner1})"], "SET {owner2}"),
])
def test_a_user_who_may_not_run_the_scripts_writes_adds_nothing(
        redis_url: str, r: redis.Redis, keys: Keys, rules: list[str], refused: str) -> None:
    """Redis 7 checks ACLs at each command of a script: without the up-front checks (of
    every job's SET, and of the XADD and the XDEL a duplicate needs) a command refused
    after an XADD would leave a job queued although the caller got an error."""
    user = f"producer-{uuid.uuid4().hex[:8]}"
    names = {"owner1": keys.owner("a1"), "owner2": keys.owner("a2"),
             "stream": keys.stream(Lane.BULK)}
    r.execute_command("ACL", "SETUSER", user, "reset", "on", ">pw", "~*",
                      *(rule.format(**names) for rule in rules))
    try:
        url = redis_url.replace("redis://", f"redis://{user}:pw@", 1)
        with redis.Redis.from_url(url) as limited:
            with pytest.raises(redis.exceptions.NoPermissionError) as info:
                _call(limited, *_good(keys, "a1", "a2"))
        assert str(info.value) == f"this user may not {refused.format(**names)}"
        assert r.dbsize() == 0
    finally:
        r.acl_deluser(user)


def test_the_idempotency_window_bounds_how_long_an_id_without_a_deadline_stays_taken(
        redis_url: str, r: redis.Redis) -> None:
    """Issue 28, item 12: a job without a deadline holds its id for the idempotency window
    (one hour by default, PROTOCOL.md "Request ids are unique"), not a day; a client may
    choose another window within the bounds, and a window outside them is a ValueError."""
    keys = p.Keys(TEST_MODEL)
    hour_ms = 3600 * 1000
    with Client(redis_url) as client:
        client.submit(b"x", request_id="no-deadline")
        client.submit(b"x", request_id="with-deadline", timeout_s=30)
    assert hour_ms - 60_000 < r.pttl(keys.owner("no-deadline")) <= hour_ms
    assert 600_000 < r.pttl(keys.owner("with-deadline")) <= 630_000, "budget + 600 s, as ever"
    with Client(redis_url, idempotency_window_s=300) as client:
        client.submit(b"x", request_id="short-window")
    assert 240_000 < r.pttl(keys.owner("short-window")) <= 300_000
    for outside in (59, 7 * 24 * 3600 + 1, float("nan")):
        with pytest.raises(ValueError, match="idempotency window"):
            Client(redis_url, idempotency_window_s=outside)
