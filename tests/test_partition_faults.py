"""Partitions that fail alone (issue 28, items 6-8): a partition Redis refuses, a key of
another type at one lane stream or at the partitions key, stop only what they touch; the
other partitions and lanes are read, written and answered. Against a real redis-server
(intake and writer driven directly, and real workers)."""

from __future__ import annotations

import logging

import pytest
import redis
from redbatch.common.protocol import JobEnvelope, Keys, Lane
from redbatch.gpu_worker.streams.intake import Intake
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
