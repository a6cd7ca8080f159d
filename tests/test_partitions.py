"""Partitions (PROTOCOL.md "Partitions"): the key layout of partition p, the hash that
picks it, the partition history key and its raise script, the scripts on partition keys,
and every command and reader over all partitions of a model (status and top, the
sampler's gauges, dlq, limit, acl users, score), against a real redis-server and real
workers."""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner
from conftest import WorkerFactory, settings_free_env
from redbatch.cli import main
from redbatch.cli.acl_rules import user_url
from redbatch.cli.fleet import _top_frames
from redbatch.cli.local_stack import stop_worker
from redbatch.cli.redis_server import RedisServer
from redbatch.common import protocol as p
from redbatch.common.protocol import DeadLetters, ErrorCode, JobEnvelope, Keys, Lane, ResultEnvelope
from redbatch.gpu_worker.metrics import Health, WorkerMetrics
from redbatch.gpu_worker.streams.intake import Intake
from redbatch.gpu_worker.streams.partitions import BULK_RECHECK_S, read_rounds
from redbatch.gpu_worker.streams.sampler import Sampler
from redbatch.producer import core
from redbatch.producer.admission import admission_call
from redbatch.producer.client import Client, QueueFull
from redbatch.scoring.bulk import BulkScorer, ScoreSettings
from redbatch.scoring.inputs import Item
from redbatch.scoring.output import OutputWriter
from spawned_workers import spawned_workers


def test_partition_zero_is_todays_layout_and_others_carry_their_number() -> None:
    k = Keys("m")
    assert k.part(0) == k and k.stream(Lane.BULK) == "redbatch:{m}:jobs:bulk"
    k3 = k.part(3)
    assert k3.stream(Lane.INTERACTIVE) == "redbatch:{m#3}:jobs:interactive"
    assert k3.result("a") == "redbatch:{m#3}:result:a"
    assert k3.owner("a") == "redbatch:{m#3}:owner:a"
    assert k3.reply("c") == "redbatch:{m#3}:reply:c"
    assert k3.partitions() == k.partitions() == "redbatch:{m}:partitions"
    assert p.parse_job_stream("redbatch", k3.stream(Lane.BULK)) == ("m", Lane.BULK)
    assert k.parts(3) == [k, k.part(1), k.part(2)]
    # A reply list's NAME, whatever its partition: where a job's list is, in its own.
    assert k.reply_name(k3.reply("c")) == k.reply_name(k.reply("c")) == "c"
    assert k.reply_name(Keys("mm").reply("c")) is None
    assert k.reply_name(k3.result("c")) is None
    with pytest.raises(ValueError):
        Keys("m#3")  # no model name holds the separator
    with pytest.raises(ValueError):
        k.part(p.MAX_PARTITIONS)


def test_partition_of_is_crc32_of_the_id_mod_p() -> None:
    assert zlib.crc32(b"abc") == 0x352441C2
    assert p.partition_of("abc", 1) == 0
    assert p.partition_of("abc", 7) == 0x352441C2 % 7 == 5
    assert Keys("m").of("abc", 7) == Keys("m", partition=5)
    spread = {p.partition_of(p.new_request_id(), 3) for _ in range(200)}
    assert spread == {0, 1, 2}


def test_history_parses_and_candidates_cover_every_count() -> None:
    assert p.parse_partition_history(None) == p.parse_partition_history([]) == (1,)
    assert p.parse_partition_history([b"1", b"2", b"6"]) == (1, 2, 6)
    assert p.parse_partition_history([b"2", b"1"]) == (1,)
    assert p.parse_partition_history([b"x"]) == (1,)
    # crc32("a") = 0xE8B7BE43: mod 1, 2, 6 = 0, 1, 3; newest P first.
    assert p.candidate_partitions("a", (1, 2, 6)) == [3, 1, 0]
    assert p.candidate_partitions("abc", (1, 2, 6)) == [0]  # 0 under every count


def test_raise_script_only_raises_and_keeps_the_history(r: redis.Redis) -> None:
    key = Keys("m").partitions()
    raise_to = r.register_script(p.RAISE_PARTITIONS_SCRIPT)
    assert raise_to([key], [1]) == [] and not r.exists(key)  # today's P: nothing written
    assert raise_to([key], [2]) == [b"1", b"2"]
    assert raise_to([key], [6]) == [b"1", b"2", b"6"]
    with pytest.raises(redis.ResponseError, match="LOWER_PARTITIONS P is 6"):
        raise_to([key], [3])
    with pytest.raises(redis.ResponseError, match="BAD_CALL"):
        raise_to([key], [p.MAX_PARTITIONS + 1])
    assert p.parse_partition_history(r.lrange(key, 0, -1)) == (1, 2, 6)


def _job(rid: str) -> JobEnvelope:
    return JobEnvelope(request_id=rid, model="m", payload=b"x", content_type="a/b",
                       submitted_ms=0, deadline_ms=None, lane=Lane.BULK, params={})


def test_admission_status_and_cancel_take_a_partitions_keys(r: redis.Redis) -> None:
    k3 = Keys("m", partition=3)
    call = admission_call(k3, [_job("j1")])
    replies = r.eval(p.ADMIT_SCRIPT, len(call.keys), *call.keys, *call.args)
    assert isinstance(replies[0], bytes) and r.xlen(k3.stream(Lane.BULK)) == 1
    assert r.get(k3.owner("j1")).endswith(b" bulk")
    status = r.eval(p.STATUS_SCRIPT, 4, k3.result("j1"), k3.owner("j1"),
                    k3.stream(Lane.INTERACTIVE), k3.stream(Lane.BULK))
    assert p.job_status("j1", status).state is p.JobState.QUEUED
    # Keys of two partitions (or an odd tag) do not belong together.
    mixed = admission_call(k3, [_job("j2")])
    mixed_keys = [mixed.keys[0], Keys("m").limits(), *mixed.keys[2:]]
    with pytest.raises(redis.ResponseError, match="BAD_CALL"):
        r.eval(p.ADMIT_SCRIPT, len(mixed_keys), *mixed_keys, *mixed.args)
    odd = [key.replace("{m#3}", "{m#03}") for key in mixed.keys]
    with pytest.raises(redis.ResponseError, match="BAD_CALL"):
        r.eval(p.ADMIT_SCRIPT, len(odd), *odd, *mixed.args)


MODEL = "null_tensor"
CLI = [sys.executable, "-m", "redbatch.cli"]
FOUR = b"\0" * 16  # four float32 zeros: null_tensor's input


def _set_partitions(r: redis.Redis, count: int) -> bytes:
    return r.eval(p.RAISE_PARTITIONS_SCRIPT, 1, Keys(MODEL).partitions(), count)


def test_three_partitions_two_workers_answer_every_job(redis_url: str, r: redis.Redis,
                                                       start_worker: WorkerFactory) -> None:
    _set_partitions(r, 3)
    for _ in range(2):  # few jobs in flight each, so that neither takes them all
        start_worker("--max-inflight", "4", "--max-batch-size", "2", model=MODEL)
    with Client(redis_url, model=MODEL) as client:
        handles = client.submit_many([FOUR] * 90, timeout_s=60)
        ids = [h.request_id for h in handles]
        results = client.results(ids, timeout_s=60)
        assert [res.request_id for res in results] == ids and all(res.ok for res in results)
        assert client.status(ids[0]).state is p.JobState.DONE
    parts = {p.partition_of(rid, 3) for rid in ids}
    assert parts == {0, 1, 2}
    for rid in ids:  # each answer in its own partition's keys, none elsewhere
        mine = Keys(MODEL).of(rid, 3)
        assert r.exists(mine.result(rid))
        assert not any(r.exists(Keys(MODEL, partition=q).result(rid)) for q in range(3)
                       if q != mine.partition)
    for q in range(3):  # both workers read every partition, both lanes
        for lane in Lane:
            consumers = r.xinfo_consumers(Keys(MODEL, partition=q).stream(lane), p.GROUP)
            assert len(consumers) == 2, (q, lane, consumers)
    for q in range(3):  # every entry acknowledged and deleted, in both lanes
        assert all(r.xlen(Keys(MODEL, partition=q).stream(lane)) == 0 for lane in Lane)


def _answered_once(r: redis.Redis, rid: str, history: tuple[int, ...]) -> bool | None:
    """True: one answer, in one of the id's candidate partitions; None: not yet; False:
    more than one answer, or answers in two partitions."""
    lengths = [r.llen(Keys(MODEL, partition=q).done(rid))
               for q in p.candidate_partitions(rid, history)]
    if sum(lengths) == 0:
        return None
    return sorted(lengths)[-1] == 1 == sum(lengths)


def test_raising_partitions_while_jobs_queue_and_come_loses_nothing(
        redis_url: str, r: redis.Redis, start_worker: WorkerFactory,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """P from 2 to 6 (the CLI) while jobs wait and more are submitted: every accepted id is
    answered exactly once (one envelope on its done list), in its own partition."""
    monkeypatch.setattr(core, "PARTITIONS_REFRESH_S", 0.3)  # this client; workers: 5 s
    raise_while_submitting(redis_url, r, lambda: start_worker(
        "--max-inflight", "8", "--max-batch-size", "4", model=MODEL))


def _consumers(r: redis.Redis, stream: str) -> int:
    try:
        return len(r.xinfo_consumers(stream, p.GROUP))
    except redis.ResponseError:  # no stream or no group yet
        return 0


def _workers_read_every_partition(r: redis.Redis, count: int, workers: int) -> bool:
    return all(_consumers(r, Keys(MODEL, partition=q).stream(lane)) >= workers
               for q in range(count) for lane in Lane)


def raise_while_submitting(url: str, r: redis.Redis, start: Callable[[], object]) -> None:
    """Queue jobs under P = 2, start two workers (``start``, twice), submit 10 jobs at a time
    and raise P to 6 with the CLI 1.5 s in; go on submitting until both workers read all six
    partitions (they look every 5 s), and for 50 jobs more, then check every id answered
    once, where it went."""
    _set_partitions(r, 2)
    ids: list[str] = []
    with Client(url, model=MODEL) as client:
        queued = client.submit_jobs([client.job(FOUR) for _ in range(60)])  # no worker yet
        ids += [h.request_id for h in queued]
        for _ in range(2):
            start()
        started = time.monotonic()
        raised, after_join = False, -1
        while after_join < 50 or len(ids) <= 300:
            assert time.monotonic() - started < 60, "the workers read the new partitions"
            ids += [h.request_id for h in client.submit_jobs([client.job(FOUR)
                                                              for _ in range(10)])]
            if not raised and time.monotonic() - started > 1.5:
                out = subprocess.run([*CLI, "partitions", "--model", MODEL, "--set", "6",
                                      "--redis", url], capture_output=True, text=True)
                assert out.returncode == 0 and '"history": [1, 2, 6]' in out.stdout, out
                raised = True
            if after_join >= 0:
                after_join += 10
            elif raised and _workers_read_every_partition(r, 6, 2):
                after_join = 0
            time.sleep(0.05)
    history = (1, 2, 6)
    assert len(set(ids)) == len(ids) > 300
    deadline = time.monotonic() + 90
    while (missing := [rid for rid in ids if _answered_once(r, rid, history) is None]) \
            and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not missing, f"{len(missing)} of {len(ids)} ids never answered"
    assert all(_answered_once(r, rid, history) for rid in ids), "an id answered twice"
    where = [next(q for q in range(6) if r.exists(Keys(MODEL, partition=q).done(rid)))
             for rid in ids]
    assert set(where[:60]) == {0, 1}, "queued under P = 2"
    assert set(where[-50:]) - {0, 1}, "submitted under P = 6: some in the new partitions"
    for q in range(6):
        assert all(r.xlen(Keys(MODEL, partition=q).stream(lane)) == 0 for lane in Lane)


def test_a_queue_bound_is_set_in_every_partition_and_holds_in_each(
        redis_url: str, r: redis.Redis) -> None:
    """``set_queue_limit`` writes every partition's limits hash; the admission script
    counts the partition's own stream (no worker: every admitted job stays queued)."""
    _set_partitions(r, 3)
    with Client(redis_url, model=MODEL) as client:
        client.set_queue_limit(Lane.BULK, 2)
        assert [r.hget(Keys(MODEL, partition=q).limits(), "bulk") for q in range(3)] == [b"2"] * 3
        admitted, refused = 0, 0
        for i in range(40):  # fixed ids: at least 2 in each of the three partitions
            try:
                client.submit(FOUR, lane=Lane.BULK, request_id=f"bound-{i}")
                admitted += 1
            except QueueFull:
                refused += 1
        assert admitted == 6 and refused == 34, (admitted, refused)
        client.set_queue_limit(Lane.BULK, None)
        assert not any(r.hexists(Keys(MODEL, partition=q).limits(), "bulk") for q in range(3))
    assert [r.xlen(Keys(MODEL, partition=q).stream(Lane.BULK)) for q in range(3)] == [2] * 3


def test_a_client_with_only_an_id_finds_its_job_after_p_rose(
        redis_url: str, r: redis.Redis, start_worker: WorkerFactory) -> None:
    """A job queued under P = 1 whose id falls in partition 1 under P = 3: a client that
    did not submit it reads its status and waits for its result there (partition 0),
    trying each count of the history."""
    rid = "old-0"
    assert p.partition_of(rid, 3) != 0
    with Client(redis_url, model=MODEL) as first:
        first.submit_jobs([first.job(FOUR, request_id=rid)])
    _set_partitions(r, 3)
    assert r.exists(Keys(MODEL).owner(rid))
    with Client(redis_url, model=MODEL) as other:
        assert other.status(rid).state is p.JobState.QUEUED
        start_worker(model=MODEL)
        result = other.result(rid, timeout_s=30)
        assert result.ok and result.request_id == rid
        assert other.status(rid).state is p.JobState.DONE


def test_an_id_taken_under_an_older_count_is_refused_after_p_rose(
        redis_url: str, r: redis.Redis) -> None:
    """Issue 28, item 9: ``dup-N`` queued at P = 1 (partition 0), then P = 3, where the id
    falls in another partition: a new client's submit of the same id is refused
    DUPLICATE_REQUEST_ID (the admission function checks the id's owner in every partition
    the history allows), and nothing is added there; a fresh id in the same call is
    admitted."""
    from redbatch.producer.client import DuplicateRequestId

    rid = next(f"dup-{i}" for i in itertools.count() if p.partition_of(f"dup-{i}", 3) != 0)
    moved = Keys(MODEL, partition=p.partition_of(rid, 3))
    fresh = _ids_in(moved.partition, 3, 1, "fresh")[0]
    with Client(redis_url, model=MODEL) as first:
        first.submit_jobs([first.job(FOUR, request_id=rid)])
    first_owner = r.get(Keys(MODEL).owner(rid))
    _set_partitions(r, 3)
    with Client(redis_url, model=MODEL) as again:
        with pytest.raises(DuplicateRequestId) as refused:
            again.submit_jobs([again.job(FOUR, request_id=rid),
                               again.job(FOUR, request_id=fresh)])
    assert refused.value.duplicates == [rid] and refused.value.accepted == [fresh]
    assert r.xlen(moved.stream(Lane.INTERACTIVE)) == 1, "the fresh job only"
    assert not r.exists(moved.owner(rid)) and r.get(Keys(MODEL).owner(rid)) == first_owner


# ------------------------------------------------------------- every command, every partition


def cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """A command as an operator runs it, in its own process."""
    return subprocess.run([*CLI, *args, "--redis", url], capture_output=True, text=True,
                          timeout=120, env=settings_free_env())


def _ids_in(partition: int, count: int, n: int, prefix: str = "id") -> list[str]:
    """``n`` request ids (``prefix-N``) that fall in ``partition`` of ``count``."""
    found = (f"{prefix}-{i}" for i in itertools.count())
    return list(itertools.islice((rid for rid in found
                                  if p.partition_of(rid, count) == partition), n))


def _until(predicate: Callable[[], Any], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.05)


def test_status_top_and_the_sampler_sum_every_partition(
        redis_url: str, r: redis.Redis, start_worker: WorkerFactory) -> None:
    """Answers in every partition's recent list, a dead letter in partitions 1 and 2 (junk
    entries a real worker read), then with the worker gone a bulk backlog of 2, 3 and 4
    jobs in partitions 0-2, two of partition 2's held by a consumer that left: `status
    --json`, its table, a frame of `top` and the worker's sampler count every partition."""
    _set_partitions(r, 3)
    worker = start_worker(model=MODEL)
    with Client(redis_url, model=MODEL) as client:
        answered = [rid for q in range(3) for rid in _ids_in(q, 3, 10, "done")]
        client.submit_jobs([client.job(FOUR, request_id=rid) for rid in answered])
        assert all(res.ok for res in client.results(answered, timeout_s=60))
    for q in (1, 2):
        r.xadd(Keys(MODEL, partition=q).stream(Lane.INTERACTIVE), {"junk": b"x"})
    _until(lambda: all(r.xlen(Keys(MODEL, partition=q).dlq()) for q in (1, 2)), 30,
           "dead letters")
    assert stop_worker(worker) == 0
    with Client(redis_url, model=MODEL) as client:
        client.submit_jobs([client.job(FOUR, lane=Lane.BULK, request_id=rid)
                            for q in range(3) for rid in _ids_in(q, 3, 2 + q, "queued")])
    held = r.xreadgroup(p.GROUP, "gone", {Keys(MODEL, partition=2).stream(Lane.BULK): ">"},
                        count=2)
    assert len(held[0][1]) == 2

    out = cli(redis_url, "status", "--json")
    assert out.returncode == 0, out.stderr
    (model,) = json.loads(out.stdout)["models"]
    assert (model["model"], model["partitions"], model["dead_letters"]) == (MODEL, 3, 2)
    interactive, bulk = model["lanes"]
    assert (bulk["length"], bulk["pending"], bulk["lag"]) == (9, 2, 7), bulk
    per = model["by_partition"]
    assert [x["partition"] for x in per] == [0, 1, 2]
    assert [x["dead_letters"] for x in per] == [0, 1, 1]
    assert [(x["lanes"][1]["length"], x["lanes"][1]["pending"]) for x in per] == \
        [(2, 0), (3, 0), (4, 2)]
    assert all(x["lanes"][0]["results"] >= 10 for x in per), per
    assert interactive["results"] == sum(x["lanes"][0]["results"] for x in per)
    assert interactive["p50_ms"] is not None

    table = cli(redis_url, "status")
    assert table.returncode == 0, table.stderr
    row = next(line for line in table.stdout.splitlines() if line.startswith(MODEL))
    # LENGTH PENDING LAG DLQ WORKERS LAST_BEAT PARTS
    assert row.split()[:9] == [MODEL, "interactive", "0", "0", "0", "2", "0", "-", "3"], row
    frame = _top_frames(r, p.DEFAULT_PREFIX, ())()
    assert row in frame.splitlines(), frame

    metrics = WorkerMetrics(MODEL, 8)
    Sampler(redis.Redis.from_url(redis_url), Keys(MODEL), metrics, Health(), "cpu").sample()

    def gauge(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"model": MODEL, **labels})

    assert [gauge(f"redbatch_stream_{x}", lane="bulk") for x in ("length", "pending", "lag")] \
        == [9, 2, 7]
    assert gauge("redbatch_stream_length", lane="interactive") == 0
    assert gauge("redbatch_dead_letters") == 2


def _dead_letter(r: redis.Redis, keys: Keys, rid: str, reply_to: str | None = None) -> None:
    """What a worker leaves of a job it dead-lettered in the partition of ``keys``: the
    letter (source: the bulk lane) and the job's ``dead_lettered`` result."""
    job = JobEnvelope(rid, MODEL, FOUR, lane=Lane.BULK, reply_to=reply_to)
    pipe = r.pipeline(transaction=False)
    DeadLetters(keys).add(pipe, p.dead_letter(job.encode(), keys.stream(Lane.BULK), b"1-1",
                                              ErrorCode.DEAD_LETTERED, "test", 4))
    pipe.set(keys.result(rid), ResultEnvelope.error(rid, ErrorCode.DEAD_LETTERED, "test")
             .encode(), px=120_000)
    pipe.execute()


def _moving(n: int) -> tuple[list[str], list[str]]:
    """Ids in partitions 0 and 1 of 2 that stay there under 3, and ids of each that move."""
    ids = [f"dl-{i}" for i in range(1000)]
    stay = [next(i for i in ids if p.partition_of(i, 2) == p.partition_of(i, 3) == q)
            for q in range(2)]
    move = [next(i for i in ids if p.partition_of(i, 2) == q != p.partition_of(i, 3))
            for q in range(2)]
    return stay, move


def test_dlq_lists_replays_and_purges_every_partition(
        redis_url: str, r: redis.Redis, start_worker: WorkerFactory) -> None:
    """Letters in both partitions of 2, then P raised to 3: `dlq list` shows them all with
    their partitions, oldest first; `purge --partition` deletes one; `retry --all` holds to
    a bound, then puts each job in its id's partition under 3 (a job that moved names its
    reply list there), where a real worker answers it."""
    model = Keys(MODEL)
    _set_partitions(r, 2)
    stay, move = _moving(2)
    letters = [*stay, *move]
    for rid in letters:
        old = model.of(rid, 2)
        _dead_letter(r, old, rid, old.reply("waiter") if rid == move[0] else None)
    DeadLetters(model.part(1)).add(r, {"source": model.part(1).stream(Lane.BULK),
                                        "reason": "bad_request_id: test"})
    assert cli(redis_url, "partitions", "--model", MODEL, "--set", "3").returncode == 0

    listed = cli(redis_url, "dlq", "list", "--model", MODEL)
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert sorted((row["request_id"], row["partition"]) for row in rows) == \
        sorted([*((rid, p.partition_of(rid, 2)) for rid in letters), ("", 1)])
    order = [tuple(map(int, row["dlq_id"].split("-"))) for row in rows]
    assert order == sorted(order), "oldest first, across partitions"
    wrong = cli(redis_url, "dlq", "list", "--model", MODEL, "--partition", "3")
    assert wrong.returncode != 0 and "no partition 3" in wrong.stderr, wrong
    assert "Traceback" not in wrong.stderr
    junk = next(row["dlq_id"] for row in rows if not row["request_id"])
    purged = cli(redis_url, "dlq", "purge", junk, "--partition", "1", "--model", MODEL)
    assert "deleted 1" in purged.stdout, purged

    r.hset(model.of(letters[0], 3).limits(), "bulk", 0)  # a replay respects the bound
    refused = cli(redis_url, "dlq", "retry", "--all", "--model", MODEL)
    assert refused.returncode == 1 and "at its bound of 0" in refused.stderr, refused
    assert "requeued 0" in refused.stdout
    r.hdel(model.of(letters[0], 3).limits(), "bulk")
    start_worker(model=MODEL)
    out = cli(redis_url, "dlq", "retry", "--all", "--model", MODEL)
    assert out.returncode == 0 and "requeued 4" in out.stdout, out
    assert not any(r.xlen(model.part(q).dlq()) for q in range(3))
    with Client(redis_url, model=MODEL) as client:
        assert all(res.ok for res in client.results(letters, timeout_s=60))
    for rid in letters:
        assert r.exists(model.of(rid, 3).result(rid)), rid
    for rid in move:
        assert not r.exists(model.of(rid, 2).result(rid)), "the old answer went"
    assert r.lrange(model.of(move[0], 3).reply("waiter"), 0, -1) == [move[0].encode()]


def test_limit_shows_every_partition_and_a_raise_copies_the_bound(
        redis_url: str, r: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """`redbatch limit` with P = 3 sets the bound in every partition and shows the jobs
    summed and each partition's; the client's room counts every partition; raising P gives
    the new partition the bound (no worker: admitted jobs stay queued)."""
    monkeypatch.setattr(core, "PARTITIONS_REFRESH_S", 0.0)

    def limit(*args: str) -> dict[str, dict[str, Any]]:
        result = CliRunner().invoke(main, ["limit", "--model", MODEL, "--redis", redis_url,
                                           *args])
        assert result.exit_code == 0, result.output
        return {rec["lane"]: rec for rec in map(json.loads, result.output.splitlines())}

    _set_partitions(r, 3)
    shown = limit("--lane", "bulk", "--max-jobs", "2")["bulk"]
    assert shown["partitions"] == 3 and shown["by_partition"] == [{"max_jobs": 2, "queued": 0}] * 3
    with Client(redis_url, model=MODEL) as client:
        client.submit_jobs([client.job(FOUR, lane=Lane.BULK, request_id=rid)
                            for q in range(3) for rid in _ids_in(q, 3, 2)])
        assert limit()["bulk"] == {"model": MODEL, "lane": "bulk", "max_jobs": 2, "queued": 6,
                                   "max_tokens": None, "tokens": 0,
                                   "partitions": 3, "by_partition": [{"max_jobs": 2,
                                                                      "queued": 2}] * 3}
        assert client.queue_state(Lane.BULK).room == 0
        assert cli(redis_url, "partitions", "--model", MODEL, "--set", "4").returncode == 0
        assert r.hget(Keys(MODEL, partition=3).limits(), "bulk") == b"2"
        assert client.queue_state(Lane.BULK).room == 2
        assert limit()["bulk"]["by_partition"][3] == {"max_jobs": 2, "queued": 0}
        cleared = limit("--lane", "bulk", "--clear")["bulk"]
        assert cleared["max_jobs"] is None and client.queue_state(Lane.BULK).room is None
        assert [x["max_jobs"] for x in cleared["by_partition"]] == [None] * 4


def _manifest(folder: Path, n: int) -> Path:
    """A .txt manifest of ``n`` files holding null_tensor's input."""
    folder.mkdir()
    for i in range(n):
        (folder / f"in-{i}.bin").write_bytes(FOUR)
    manifest = folder / "inputs.txt"
    manifest.write_text("".join(f"in-{i}.bin\n" for i in range(n)))
    return manifest


def _left_in_redis(r: redis.Redis) -> list[bytes]:
    """Per-job keys a finished run should have deleted: results, done and reply lists, owners."""
    return [k for k in r.scan_iter(count=1000) if re.search(rb":(result|done|reply|owner):", k)]


ADMIN = "admin-pw-1"
PASSWORDS = {"REDBATCH_ACL_PRODUCER_PASSWORD": "producer-pw-1",
             "REDBATCH_ACL_WORKER_PASSWORD": "worker-pw-1"}


@pytest.fixture
def acl_server() -> Iterator[RedisServer]:
    """A redis-server of the test's own whose default user is the admin, with the users of
    `redbatch acl --apply --model null_tensor` on it."""
    with RedisServer(password=ADMIN) as server:
        made = subprocess.run([*CLI, "acl", "--apply", "--model", MODEL, "--redis", server.url],
                              capture_output=True, text=True, timeout=60,
                              env={**settings_free_env(), **PASSWORDS})
        assert made.returncode == 0, made.stderr
        yield server


def test_acl_users_reach_every_partition_of_their_model_and_nothing_else(
        acl_server: RedisServer, tmp_path: Path) -> None:
    """With P = 3 a worker and a producer logged in as the users `acl` made serve, submit,
    look up, bound-check and score in every partition, and Redis refuses none of it; a
    partition of another model (one whose name starts with ours too) stays out of reach."""
    admin = redis.Redis.from_url(acl_server.url)
    admin.eval(p.RAISE_PARTITIONS_SCRIPT, 1, Keys(MODEL).partitions(), 3)
    urls = {role: user_url(acl_server.url, f"redbatch-{role}",
                           PASSWORDS[f"REDBATCH_ACL_{role.upper()}_PASSWORD"])
            for role in ("producer", "worker")}
    with spawned_workers(tmp_path) as start:
        start(urls["worker"], model=MODEL, ready_url=acl_server.url)
        with Client(urls["producer"], model=MODEL) as client:
            rids = [rid for q in range(3) for rid in _ids_in(q, 3, 4)]
            client.submit_jobs([client.job(FOUR, request_id=rid) for rid in rids])
            assert all(res.ok for res in client.results(rids, timeout_s=60))
            assert client.status(rids[-1]).state is p.JobState.DONE
            assert client.queue_state(Lane.BULK).queued == 0
        out = tmp_path / "out.jsonl"
        scored = subprocess.run([*CLI, "score", str(_manifest(tmp_path / "in", 60)), "--model",
                                 MODEL, "-o", str(out), "--redis", urls["producer"]],
                                capture_output=True, text=True, timeout=120,
                                env=settings_free_env())
        assert scored.returncode == 0, scored.stderr[-3000:]
        records = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(records) == 60 and all(rec["status"] == "ok" for rec in records)
    # Only the one BLMOVE a client tries before it polls instead (PROTOCOL.md "Waiting for
    # the result": a producer may not BLMOVE).
    refused = [(e["username"], e["object"]) for e in admin.acl_log()
               if str(e.get("username")).startswith("redbatch-")]
    assert set(refused) <= {("redbatch-producer", "blmove")}, refused
    producer, worker = (redis.Redis.from_url(urls[role]) for role in ("producer", "worker"))
    for other in (Keys("null_tensor2", partition=1), Keys("other", partition=2),
                  Keys("null_tensor2")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            producer.xadd(other.stream(Lane.BULK), {"rid": "x"})
        with pytest.raises(redis.exceptions.NoPermissionError):
            producer.get(other.result("x"))
        with pytest.raises(redis.exceptions.NoPermissionError):
            worker.xadd(other.dlq(), {"rid": "x"})
    with pytest.raises(redis.exceptions.NoPermissionError):  # a producer writes no result
        producer.set(Keys(MODEL, partition=2).result("x"), b"forged")
    producer.close()
    worker.close()


def test_score_spreads_a_run_over_the_partitions_and_follows_a_raise(
        redis_url: str, r: redis.Redis, start_worker: WorkerFactory, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A run of 300 jobs during which P rises from 2 to 4: each job goes to its id's
    partition under the count its submit read, the run collects it from its reply list
    there, every record is ok and nothing of the run stays in Redis."""
    monkeypatch.setattr(core, "PARTITIONS_REFRESH_S", 0.2)
    _set_partitions(r, 2)
    start_worker("--max-batch-size", "8", model=MODEL)
    payload = tmp_path / "four.bin"
    payload.write_bytes(FOUR)

    def items() -> Iterator[Item]:
        for i in range(300):
            if i == 100:
                _set_partitions(r, 4)
                time.sleep(0.3)  # past the client's trust in the count it read
            yield Item(f"item-{i}", str(payload))

    out = tmp_path / "out.jsonl"
    writer = OutputWriter(str(out), "jsonl", append=False)
    with Client(redis_url, model=MODEL) as client:
        scorer = BulkScorer(client, writer, ScoreSettings(window=32, timeout_s=60))
        try:
            assert scorer.run(items())
        finally:
            writer.close()
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(rec["id"] for rec in records) == sorted(f"item-{i}" for i in range(300))
    assert all(rec["status"] == "ok" for rec in records), records[:3]
    read = [int(r.xinfo_groups(Keys(MODEL, partition=q).stream(Lane.BULK))[0]["entries-read"])
            for q in range(4)]
    assert all(read) and sum(read) == 300, read
    assert _left_in_redis(r) == []
    assert not any(r.xlen(Keys(MODEL, partition=q).stream(lane)) for q in range(4)
                   for lane in Lane)


def test_read_rounds_share_the_room_and_never_ask_for_more() -> None:
    """A read's rounds: the room shared among the streams that may hold more (the first
    get the remainder), drained streams left out, never more asked than room left."""
    rounds = read_rounds(["a", "b", "c", "d", "e"], 12)
    assert next(rounds) == [("a", 3), ("b", 3), ("c", 2), ("d", 2), ("e", 2)]
    # c drained (0 of 2); the 2 left go to the streams that gave all they were asked.
    assert rounds.send([3, 3, 0, 2, 2]) == [("a", 1), ("b", 1)]
    assert rounds.send([1, 1]) == []  # room filled
    rounds = read_rounds(["a", "b", "c"], 2)  # less room than streams: one each, in turn
    assert next(rounds) == [("a", 1), ("b", 1)]
    assert rounds.send([0, 0]) == [("c", 2)]
    assert rounds.send([1]) == []  # every stream drained
    rounds = read_rounds(["x"], 5)  # one partition: one call, as ever
    assert next(rounds) == [("x", 5)] and rounds.send([5]) == []


def _queue_raw(r: redis.Redis, keys: Keys, lane: Lane, n: int, tag: str) -> None:
    """``n`` jobs added straight to a lane stream of one partition (no admission)."""
    pipe = r.pipeline(transaction=False)
    for i in range(n):
        job = JobEnvelope(request_id=f"{tag}-{keys.partition}-{lane.value}-{i}", model=MODEL,
                          payload=FOUR, lane=lane)
        pipe.xadd(keys.stream(lane), job.encode())  # type: ignore[arg-type]
    pipe.execute()


def test_a_worker_reads_every_partition_interactive_first_and_never_past_its_room(
        r: redis.Redis) -> None:
    """Four partitions on one Redis, each with ten jobs in each lane: a read of six takes
    them from every partition (none twice more than another) and only from the
    interactive lanes; bulk comes once interactive is drained (and once BULK_RECHECK_S
    passed since a read found the bulk lanes empty); no read returns more than its room,
    though a blocked read may answer from both lanes."""
    _set_partitions(r, 4)
    parts = [Keys(MODEL, partition=q) for q in range(4)]
    intake = Intake(r, Keys(MODEL), "reader-1", 1 << 20)
    intake.ensure_groups()
    intake.read(1, 1, 0)  # own pending entries (none): the recovery pass
    for keys in parts:
        for lane in Lane:
            _queue_raw(r, keys, lane, 10, "rr")
    jobs, bad = intake.read(6, 6, 0)
    assert not bad and len(jobs) == 6 and not any(job.bulk for job in jobs)
    per_part = [sum(job.stream == keys.stream(Lane.INTERACTIVE) for job in jobs)
                for keys in parts]
    assert sorted(per_part) == [1, 1, 2, 2], per_part
    jobs, _ = intake.read(30, 30, 0)  # 34 interactive left: all 30 interactive
    assert len(jobs) == 30 and not any(job.bulk for job in jobs)
    time.sleep(BULK_RECHECK_S)  # the first read found the bulk lanes empty: not before
    jobs, _ = intake.read(30, 30, 0)  # the last 4 interactive, then 26 bulk
    assert len(jobs) == 30 and sum(not job.bulk for job in jobs) == 4
    jobs, _ = intake.read(30, 30, 0)  # 14 bulk left, however the room is shared
    assert len(jobs) == 14 and all(job.bulk for job in jobs)
    assert intake.read(30, 30, 0) == ([], [])
    # Blocked on both lanes of a partition whose lanes both hold jobs (as when two
    # arrive during the block): a room of one still gets one job.
    _queue_raw(r, parts[0], Lane.INTERACTIVE, 2, "blk")
    _queue_raw(r, parts[0], Lane.BULK, 2, "blk")
    assert len(intake._block(1, 1, 100, parts[0])) == 1
    assert len(intake._block(3, 3, 100, parts[0])) == 2  # one a lane: half the room each
