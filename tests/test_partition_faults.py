"""Partitions that fail alone (issue 28, items 6-8): a partition Redis refuses, a key of
another type at one lane stream or at the partitions key, stop only what they touch; the
other partitions and lanes are read, written and answered. Against a real redis-server
(intake and writer driven directly, and real workers)."""

from __future__ import annotations

import logging
import time

import pytest
import redis
from conftest import SAMPLES, WorkerFactory
from redbatch.common import protocol as p
from redbatch.common.protocol import JobEnvelope, Keys, Lane
from redbatch.common.redis_io import RedisRefused
from redbatch.gpu_worker.events import Written
from redbatch.gpu_worker.metrics import Health
from redbatch.gpu_worker.outbox import Outbox
from redbatch.gpu_worker.streams.intake import Intake
from redbatch.gpu_worker.streams.results import Answer, Flushed, ResultWriter
from redbatch.producer.client import Client

MODEL = "null_tensor"
FOUR = b"\0" * 16  # four float32 zeros: null_tensor's input


def _queue_raw(r: redis.Redis, keys: Keys, lane: Lane, n: int, tag: str) -> list[str]:
    """``n`` jobs added straight to a lane stream of one partition; their ids."""
    ids = [f"{tag}-{keys.partition}-{lane.value}-{i}" for i in range(n)]
    for rid in ids:
        job = JobEnvelope(request_id=rid, model=MODEL, payload=FOUR, lane=lane)
        r.xadd(keys.stream(lane), job.encode())  # type: ignore[arg-type]
    return ids


def test_a_string_at_the_partitions_key_reads_as_one_partition(
        redis_url: str, r: redis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    """Item 8: PROTOCOL.md says an unreadable count reads as 1. The worker reads
    partition 0 and the client submits there, each warning once, not WRONGTYPE."""
    r.set(Keys(MODEL).partitions(), "3")
    caplog.set_level(logging.WARNING)
    intake = Intake(r, Keys(MODEL), "reader-1", 1 << 20)
    intake.ensure_groups()
    intake.refresh_partitions(force=True)
    assert intake.partitions.count == 1
    intake.read(1, 1, 0)  # own pending entries (none): the recovery pass
    with Client(redis_url, model=MODEL) as client:
        handles = client.submit_many([FOUR] * 4, timeout_s=60)
        client._histories.clear()  # read the count again: still one warning
        handles += client.submit_many([FOUR] * 2, timeout_s=60)
    jobs, bad = intake.read(10, 10, 0)
    assert not bad and sorted(j.request_id for j in jobs) == sorted(h.request_id
                                                                    for h in handles)
    warned = [rec for rec in caplog.records if "partitions" in rec.getMessage()
              and "not a list" in rec.getMessage()]
    assert [rec.name for rec in warned] == ["redbatch.gpu_worker.streams.partitions",
                                            "redbatch.producer.core"], warned


def _read_into_group(r: redis.Redis, keys: Keys, n: int, tag: str) -> list[Answer]:
    """``n`` jobs of one partition read into the group (pending), each with an answer
    that names the partition's reply list ``c1``."""
    stream = keys.stream(Lane.INTERACTIVE)
    r.xgroup_create(stream, p.GROUP, id="0", mkstream=True)
    ids = _queue_raw(r, keys, Lane.INTERACTIVE, n, tag)
    entries = r.xreadgroup(p.GROUP, "w", {stream: ">"}, count=n)[0][1]
    return [Answer(stream, entry_id, rid, b"result", reply_to=keys.reply("c1"))
            for rid, (entry_id, _) in zip(ids, entries, strict=True)]


@pytest.mark.parametrize("refused_first", [True, False])
def test_a_refused_partitions_write_holds_back_only_its_own_answers(
        redis_url: str, r: redis.Redis, refused_first: bool) -> None:
    """Item 6, writes: the worker's user may not write partition 1 (an ACL: NOPERM, so
    Redis refuses its transaction whole). A flush over partitions 0 and 1, in either
    order, writes partition 0's answers and its dead letter once, and hands back
    partition 1's alone; the outbox retries those on partition 1's clock, while a new
    answer of partition 0 ships at once. Before: the flush raised, holding partition 0's
    answers back (refused first), or writing them again on the retry (refused last)."""
    zero, one = Keys(MODEL), Keys(MODEL, partition=1)
    answers0, answers1 = _read_into_group(r, zero, 5, "w0"), _read_into_group(r, one, 5, "w1")
    answers0[0].dead_letter = p.dead_letter({}, answers0[0].stream, answers0[0].entry_id,
                                            p.ErrorCode.DEAD_LETTERED, "test", 3)
    r.acl_setuser("no-part-1", enabled=True, passwords=["+pw1"], commands=["+@all"],
                  keys=[f"~{_tag(zero)}*", f"%R~{_tag(one)}*"], reset=True)
    try:
        writer = ResultWriter(redis.Redis.from_url(_as_user(redis_url, "no-part-1", "pw1")),
                              zero, "w", 60)
        flushed = writer.write_and_ack(answers1 + answers0 if refused_first
                                       else answers0 + answers1)
    finally:
        r.acl_deluser("no-part-1")
    assert flushed.failed == answers1 and isinstance(flushed.error, RedisRefused)
    assert "NOPERM" in str(flushed.error)
    assert r.lrange(zero.reply("c1"), 0, -1) == [a.request_id.encode() for a in answers0]
    assert all(r.get(zero.result(a.request_id or "")) == b"result" for a in answers0)
    assert r.xlen(zero.dlq()) == 1
    assert r.xpending(zero.stream(Lane.INTERACTIVE), p.GROUP)["pending"] == 0
    assert r.xpending(one.stream(Lane.INTERACTIVE), p.GROUP)["pending"] == 5
    assert not r.exists(one.reply("c1"))
    # The outbox: partition 0's answers are done, partition 1's wait out their back-off.
    sent: list[list[Answer]] = []
    outbox = Outbox(Health(), sent.append)
    outbox.extend(answers0 + answers1)
    outbox.ship(0.0)
    written, _ = outbox.settle(Written(sent[-1], flushed), 100.0)
    assert written == answers0
    late = Answer(zero.stream(Lane.INTERACTIVE), b"9-9", "late", b"x")
    outbox.add(late)
    outbox.ship(100.0)
    assert sent[-1] == [late], "partition 0 ships at once"
    outbox.settle(Written(sent[-1], Flushed()), 100.0)
    outbox.ship(100.0)
    assert len(sent) == 2, "partition 1 backs off"
    outbox.ship(200.0)
    assert sent[-1] == answers1


def _tag(keys: Keys) -> str:
    """The start of every key of one partition (``redbatch:{M#p}:``)."""
    return keys.stream(Lane.BULK).rsplit("jobs:", 1)[0]


def _as_user(url: str, user: str, password: str) -> str:
    return url.replace("redis://", f"redis://{user}:{password}@", 1)


def _read_all(intake: Intake, want: int, within_s: float = 15.0) -> list[str]:
    """Read until ``want`` jobs came (or ``within_s``); their ids. Bad entries fail."""
    got: list[str] = []
    deadline = time.monotonic() + within_s
    while len(got) < want and time.monotonic() < deadline:
        jobs, bad = intake.read(50, 50, 20)
        assert not bad, bad
        got += [job.request_id for job in jobs]
    return got


def test_a_key_of_another_type_at_one_lane_stream_stops_that_stream_alone(
        r: redis.Redis, caplog: pytest.LogCaptureFixture) -> None:
    """Item 7: three partitions, a string planted at partition 1's interactive stream
    before the worker starts. Its groups are made on the other five streams, their jobs
    are read (both lanes, every partition), the planted stream is logged once however
    many reads pass, and once the key is deleted its group is made and its jobs read.
    Before: creating the groups raised WRONGTYPE, and so did every read after."""
    r.eval(p.RAISE_PARTITIONS_SCRIPT, 1, Keys(MODEL).partitions(), 3)
    parts = [Keys(MODEL, partition=q) for q in range(3)]
    planted = parts[1].stream(Lane.INTERACTIVE)
    r.set(planted, "not a stream")
    caplog.set_level(logging.WARNING)
    intake = Intake(r, Keys(MODEL), "reader-1", 1 << 20)
    intake.ensure_groups()
    intake.read(1, 1, 0)  # own pending entries (none): the recovery pass
    ids = [rid for keys in parts for lane in Lane if keys.stream(lane) != planted
           for rid in _queue_raw(r, keys, lane, 4, "ok")]
    assert sorted(_read_all(intake, 20)) == sorted(ids)
    for _ in range(5):
        assert intake.read(10, 10, 10) == ([], [])
    lines = [rec.getMessage() for rec in caplog.records if planted in rec.getMessage()]
    assert len(lines) == 1 and "WRONGTYPE" in lines[0], lines
    r.delete(planted)
    late = _queue_raw(r, parts[1], Lane.INTERACTIVE, 3, "late")
    assert sorted(_read_all(intake, 3)) == sorted(late)
    assert any("served again" in rec.getMessage() for rec in caplog.records)


def test_one_planted_lane_of_one_partition_leaves_the_other_lane_served(
        r: redis.Redis) -> None:
    """Item 7 with one partition: the interactive stream planted, bulk jobs are read, and
    an idle read blocks on the bulk lane alone without an error."""
    keys = Keys(MODEL)
    r.set(keys.stream(Lane.INTERACTIVE), "not a stream")
    intake = Intake(r, keys, "reader-1", 1 << 20)
    intake.ensure_groups()
    intake.read(1, 1, 0)
    ids = _queue_raw(r, keys, Lane.BULK, 5, "bulk")
    assert sorted(_read_all(intake, 5)) == sorted(ids)
    started = time.monotonic()
    assert intake.read(4, 4, 200) == ([], [])
    assert time.monotonic() - started >= 0.15, "it blocked on the bulk lane"


def test_every_stream_refused_fails_the_read_and_startup_waits(r: redis.Redis) -> None:
    """A Redis that refuses every stream (here: each planted, so group creation fails
    with WRONGTYPE on all, which is no reason to hold start-up) reads nothing and raises
    from the read, so that the reader backs off and says why; one that cannot take the
    groups at all (out of memory) still holds start-up."""
    keys = Keys(MODEL)
    for lane in Lane:
        r.set(keys.stream(lane), "x")
    intake = Intake(r, keys, "reader-1", 1 << 20)
    intake.ensure_groups()
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        intake.read(4, 4, 10)
    r.flushall()
    r.config_set("maxmemory", 1)
    try:
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            Intake(r, keys, "reader-2", 1 << 20).ensure_groups()
    finally:
        r.config_set("maxmemory", 0)


def test_a_two_model_worker_started_on_a_planted_stream_serves_the_other_model(
        redis_url: str, r: redis.Redis, start_worker: WorkerFactory) -> None:
    """Item 7: a worker of ``null`` and ``null_tensor`` started while a string sits at
    ``null``'s interactive stream: ``null_tensor`` is served, and so is ``null``'s bulk
    lane. Before: start-up waited on the first model's groups for good, no job of either
    model answered."""
    r.set(Keys("null").stream(Lane.INTERACTIVE), "not a stream")
    start_worker("--model", MODEL, model="null", wait=False)
    photo = (SAMPLES / "cat.jpg").read_bytes()
    with Client(redis_url, model=MODEL) as client:
        tensors = client.submit_many([FOUR] * 4, timeout_s=120)
        bulk = [client.submit(photo, model="null", lane=Lane.BULK, timeout_s=120)
                for _ in range(2)]
        results = client.results(tensors, timeout_s=90)
        results += client.results(bulk, model="null", timeout_s=90)
    assert all(res.ok for res in results), results


def test_protocol_md_holds_both_partition_scripts_verbatim() -> None:
    doc = (SAMPLES.parent / "PROTOCOL.md").read_text()
    for script in (p.RAISE_PARTITIONS_SCRIPT, p.DEFAULT_PARTITIONS_SCRIPT):
        assert f"```lua\n{script}```" in doc, script.splitlines()[0]
