"""Partitions (PROTOCOL.md "Partitions") on a real Redis Cluster (3 masters, 3 replicas;
tests/cluster.py, the session's one from conftest.py): each partition's transactions stay in
its own slot, and a client and two real workers serve a model of three partitions, spread
over the masters."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from cluster import LocalCluster
from redbatch.common import protocol as p
from redbatch.common.protocol import AnswerKeys, DeadLetters, JobEnvelope, Keys, Lane, ReplyList
from redbatch.gpu_worker.transaction import Commands
from redbatch.producer import core
from redbatch.producer.client import Client
from redbatch.producer.core import _admit
from redis.crc import key_slot
from spawned_workers import spawned_workers
from test_partitions import raise_while_submitting

MODEL = "null_tensor"
FOUR = b"\0" * 16


def test_each_partitions_transactions_stay_in_its_slot(rc: redis.Redis) -> None:
    """The writer's transaction and the admission call of partition q name keys of one
    slot, q's own; the partitions list lives in partition 0's slot."""
    slots = []
    for q in range(6):
        keys = Keys(MODEL, partition=q)
        commands = Commands()
        AnswerKeys(keys).write(commands, "r1", b"x", 1000, True, True)
        ReplyList(keys.reply("c1")).announce(commands, ["r1"], 1000)
        DeadLetters(keys).add(commands, p.dead_letter({}, keys.stream(Lane.BULK), b"1-1",
                                                      p.ErrorCode.DEAD_LETTERED, "x", 1))
        commands.execute_command("LPUSH", keys.recent(), b"x")
        jobs = [JobEnvelope(request_id=f"r{i}", model=MODEL, payload=b"x") for i in range(3)]
        admit = _admit(keys, jobs)
        commands.execute_command("EVALSHA", "0" * 40, len(admit.keys), *admit.keys, *admit.args)
        slot = key_slot(keys.stream(Lane.BULK).encode())
        assert {rc.determine_slot(*args) for args in commands.args} == {slot}  # type: ignore[attr-defined]
        slots.append(slot)
    assert len(set(slots)) == 6
    assert key_slot(Keys(MODEL).partitions().encode()) == slots[0]


def test_three_partitions_on_a_cluster_two_workers_answer_every_job(
        cluster: LocalCluster, rc: redis.Redis, tmp_path: Path) -> None:
    rc.eval(p.RAISE_PARTITIONS_SCRIPT, 1, Keys(MODEL).partitions(), 3)
    masters = {cluster.master_of(Keys(MODEL, partition=q).stream(Lane.BULK)).port
               for q in range(3)}
    assert len(masters) == 3, "slots 6087, 2884, 15143: one partition per master"
    with spawned_workers(tmp_path) as start:
        for _ in range(2):
            start(cluster.url, "--max-inflight", "4", "--max-batch-size", "2", model=MODEL)
        with Client(cluster.url, model=MODEL) as client:
            ids = [h.request_id for h in client.submit_many([FOUR] * 90, timeout_s=60)]
            results = client.results(ids, timeout_s=60)
            assert all(res.ok for res in results) and [res.request_id for res in results] == ids
            assert client.status(ids[-1]).state is p.JobState.DONE
    assert {p.partition_of(rid, 3) for rid in ids} == {0, 1, 2}
    assert all(rc.exists(Keys(MODEL).of(rid, 3).result(rid)) for rid in ids)
    for q in range(3):  # both workers read every partition, both lanes
        for lane in Lane:
            consumers = rc.xinfo_consumers(Keys(MODEL, partition=q).stream(lane), p.GROUP)
            assert len(consumers) == 2, (q, lane, consumers)
    for q in range(3):
        assert all(rc.xlen(Keys(MODEL, partition=q).stream(lane)) == 0 for lane in Lane)


def test_raising_partitions_on_a_cluster_while_jobs_queue_and_come_loses_nothing(
        cluster: LocalCluster, rc: redis.Redis, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """As on one Redis (test_partitions.py): P from 2 to 6 while jobs wait and come; the
    six partitions spread over the three masters."""
    monkeypatch.setattr(core, "PARTITIONS_REFRESH_S", 0.3)
    with spawned_workers(tmp_path) as start:
        raise_while_submitting(cluster.url, rc, lambda: start(
            cluster.url, "--max-inflight", "8", "--max-batch-size", "4", model=MODEL))
