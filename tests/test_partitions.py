"""Partitions (PROTOCOL.md "Partitions"): the key layout of partition p, the hash that
picks it, the partition history key and its raise script, the scripts on partition keys,
against a real redis-server."""

from __future__ import annotations

import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from conftest import WorkerFactory
from redbatch.common import protocol as p
from redbatch.common.protocol import JobEnvelope, Keys, Lane
from redbatch.producer import core
from redbatch.producer.client import Client, QueueFull
from redbatch.producer.core import _admit


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
    call = _admit(k3, [_job("j1")])
    replies = r.eval(p.ADMIT_SCRIPT, len(call.keys), *call.keys, *call.args)
    assert isinstance(replies[0], bytes) and r.xlen(k3.stream(Lane.BULK)) == 1
    assert r.get(k3.owner("j1")).endswith(b" bulk")
    status = r.eval(p.STATUS_SCRIPT, 4, k3.result("j1"), k3.owner("j1"),
                    k3.stream(Lane.INTERACTIVE), k3.stream(Lane.BULK))
    assert p.job_status("j1", status).state is p.JobState.QUEUED
    # Keys of two partitions (or an odd tag) do not belong together.
    mixed = _admit(k3, [_job("j2")])
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


def test_score_refuses_a_partitioned_model_in_one_line(redis_url: str, r: redis.Redis,
                                                       tmp_path: Path) -> None:
    """Bulk scoring is not partition-aware yet: it says so instead of scoring wrongly."""
    _set_partitions(r, 2)
    (tmp_path / "in.json").write_text("[0, 0, 0, 0]")
    out = subprocess.run([*CLI, "score", str(tmp_path / "in.json"), "--model", MODEL, "-o",
                          str(tmp_path / "out.jsonl"), "--redis", redis_url],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "several partitions" in out.stderr, out
    assert "Traceback" not in out.stderr


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
