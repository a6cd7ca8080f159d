"""redbatch unchanged on a real Redis Cluster (3 masters, 3 replicas; tests/cluster.py):
clients and two real workers on a ``redis+cluster://`` URL, ``status`` reading the fleet
through every master, and every multi-key call of a model within one slot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
        out = cli(cluster.url, "status", "--json")
        assert out.returncode == 0, out.stderr
        (model,) = json.loads(out.stdout)["models"]
        assert model["model"] == keys.model and model["workers_alive"] == 2
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
