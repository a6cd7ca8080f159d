"""redbatch unchanged on a real Redis Cluster (3 masters, 3 replicas; tests/cluster.py):
clients and two real workers on a ``redis+cluster://`` URL, ``status`` reading the fleet
through every master, and every multi-key call of a model within one slot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.cluster
from cluster import LocalCluster
from conftest import CAT_LABELS, SAMPLES
from redbatch.common import protocol as p
from redbatch.common.protocol import AnswerKeys, DeadLetters, Keys, Lane, ReplyList
from redbatch.common.redis_io import connect, connect_async, is_cluster
from redbatch.gpu_worker.transaction import Commands
from redis.crc import key_slot
from spawned_workers import spawned_workers

COFFEE_LABELS = {"espresso", "cup", "coffee mug"}
PHOTOS = {name: (SAMPLES / name).read_bytes() for name in ("cat.jpg", "coffee.jpg")}
EXPECTED = {"cat.jpg": CAT_LABELS, "coffee.jpg": COFFEE_LABELS}
CLI = [sys.executable, "-m", "redbatch.cli"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster() as c:
        yield c


@pytest.fixture
def rc(cluster: LocalCluster) -> Iterator[redis.Redis]:
    """A cluster client; every master flushed before and after the test."""
    client = connect(cluster.url)
    client.flushall(target_nodes=redis.cluster.RedisCluster.PRIMARIES)  # type: ignore[call-arg]
    yield client
    client.flushall(target_nodes=redis.cluster.RedisCluster.PRIMARIES)  # type: ignore[call-arg]
    client.close()


def cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args, "--redis", url], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "REDBATCH_PREFIX": p.DEFAULT_PREFIX})


def test_a_cluster_url_gives_cluster_clients(cluster: LocalCluster) -> None:
    sync, asynchronous = connect(cluster.url), connect_async(cluster.url)
    assert isinstance(sync, redis.cluster.RedisCluster) and is_cluster(asynchronous)
    assert sync.ping() and len(sync.get_primaries()) == 3  # type: ignore[attr-defined]
    sync.close()
    plain = connect(cluster.node_url(cluster.nodes[0]))
    assert isinstance(plain, redis.Redis) and not is_cluster(plain)
    plain.close()


def test_two_workers_answer_real_photos_and_status_sees_them(
        cluster: LocalCluster, rc: redis.Redis, tmp_path: Path) -> None:
    from redbatch.producer.client import Client
    keys = Keys("efficientnet_lite0")
    with spawned_workers(tmp_path) as start:
        start(cluster.url)
        start(cluster.url)
        with Client(cluster.url) as client:
            sent = [(name, client.submit(PHOTOS[name], timeout_s=120))
                    for name in list(PHOTOS) * 8]
            for name, rid in sent:
                result = client.result(rid, timeout_s=120)
                assert result.ok, result
                assert result.request_id == rid and result.output["label"] in EXPECTED[name]
        deadline = time.monotonic() + 20  # a heartbeat may be late on two busy cores
        while True:
            out = cli(cluster.url, "status", "--json")
            assert out.returncode == 0, out.stderr
            (model,) = json.loads(out.stdout)["models"]
            if model["workers_alive"] == 2 or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert model["model"] == keys.model and model["workers_alive"] == 2, model
    for stream in keys.streams():
        assert rc.xlen(stream) == 0


def test_every_multi_key_call_stays_in_one_slot(rc: redis.Redis) -> None:
    """The writer's transaction and each of a model's keys hash to the model's slot."""
    keys = Keys("efficientnet_lite0")
    commands = Commands()
    AnswerKeys(keys).write(commands, "r1", b"x", 1000, True, True)
    ReplyList(keys.reply("c1")).announce(commands, ["r1"], 1000)
    DeadLetters(keys).add(commands, p.dead_letter({}, keys.stream(Lane.BULK), b"1-1",
                                                  p.ErrorCode.DEAD_LETTERED, "x", 1))
    slot = key_slot(keys.dlq().encode())
    assert {rc.determine_slot(*args) for args in commands.args} == {slot}  # type: ignore[attr-defined]
    all_keys = [*keys.streams(), keys.result("r"), keys.done("r"), keys.dlq(), keys.reply("c"),
                keys.owner("r"), keys.limits(), keys.workers(), keys.worker("w"), keys.recent()]
    assert {key_slot(k.encode()) for k in all_keys} == {slot}


def test_acl_users_score_dlq_and_status_across_masters(
        cluster: LocalCluster, rc: redis.Redis, tmp_path: Path) -> None:
    """`acl --apply` makes the users on every node; a worker and `score` log in with them;
    a dead letter shows in `dlq list`; `status` finds models whose keys live on different
    masters (it scans every master)."""
    env = {"REDBATCH_ACL_PRODUCER_PASSWORD": "producer-pw-1", "REDBATCH_ACL_WORKER_PASSWORD":
           "worker-pw-1"}
    applied = subprocess.run([*CLI, "acl", "--model", "null", "--apply", "--redis", cluster.url],
                             capture_output=True, text=True, timeout=60,
                             env={**os.environ, **env})
    assert applied.returncode == 0, applied.stderr
    for node in cluster.nodes:  # replicas too: a failover must not lock the users out
        users = redis.Redis.from_url(cluster.node_url(node)).acl_users()
        assert {"redbatch-producer", "redbatch-worker"} <= set(users), node.port
    hosts = cluster.url.split("://", 1)[1]
    worker_url = f"redis+cluster://redbatch-worker:worker-pw-1@{hosts}"
    producer_url = f"redis+cluster://redbatch-producer:producer-pw-1@{hosts}"
    idle = "idle_model"
    assert cluster.master_of(Keys(idle).dlq()) is not cluster.master_of(Keys("null").dlq())
    with spawned_workers(tmp_path) as start:
        start(worker_url, model="null", ready_url=cluster.url)
        out = tmp_path / "out.jsonl"
        scored = subprocess.run([*CLI, "score", str(SAMPLES), "--model", "null", "-o", str(out),
                                 "--redis", producer_url], capture_output=True, text=True,
                                timeout=120, env=os.environ.copy())
        assert scored.returncode == 0, scored.stderr
        records = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(records) == len(list(SAMPLES.glob("*.jpg")))
        assert all(rec["status"] == "ok" for rec in records), records
        null = Keys("null")
        junk = rc.xadd(null.stream(Lane.INTERACTIVE), {"junk": b"x"})  # no request id
        deadline = time.monotonic() + 30
        while rc.xlen(null.dlq()) == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        listed = cli(cluster.url, "dlq", "list", "--model", "null")
        assert listed.returncode == 0, listed.stderr
        (letter,) = [json.loads(line) for line in listed.stdout.splitlines()]
        assert (letter["source"], letter["entry"]) == (null.stream(Lane.INTERACTIVE),
                                                       junk.decode())
        rc.xadd(Keys(idle).stream(Lane.BULK), {"rid": b"r1", "job": b"x"})
        status = cli(cluster.url, "status", "--json")
        assert status.returncode == 0, status.stderr
        models = {m["model"]: m for m in json.loads(status.stdout)["models"]}
        assert set(models) == {"null", idle} and models["null"]["workers_alive"] == 1
