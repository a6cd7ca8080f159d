"""redbatch unchanged on a real Redis Cluster (3 masters, 3 replicas; tests/cluster.py, the
session's one from conftest.py): clients and two real workers on a ``redis+cluster://`` URL,
``status`` reading the fleet through every master, and every multi-key call of a model
within one slot."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import redis.cluster
from cluster import LocalCluster, wait_replicated
from conftest import CAT_LABELS, SAMPLES
from redbatch.cli.redis_server import free_port
from redbatch.common import protocol as p
from redbatch.common.protocol import (
    AnswerKeys,
    DeadLetters,
    JobEnvelope,
    JobState,
    Keys,
    Lane,
    ReplyList,
)
from redbatch.common.protocol.functions import ADMIT_FUNCTION
from redbatch.common.redis_io import connect, connect_async, is_cluster
from redbatch.gpu_worker.streams.transaction import Commands
from redbatch.producer.admission import admission_call
from redis.crc import key_slot
from spawned_workers import spawned_workers
from test_result_wait import scraped_waits

COFFEE_LABELS = {"espresso", "cup", "coffee mug"}
PHOTOS = {name: (SAMPLES / name).read_bytes() for name in ("cat.jpg", "coffee.jpg")}
EXPECTED = {"cat.jpg": CAT_LABELS, "coffee.jpg": COFFEE_LABELS}
CLI = [sys.executable, "-m", "redbatch.cli"]


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


@pytest.mark.full
def test_two_workers_answer_real_photos_and_status_sees_them(
        cluster: LocalCluster, rc: redis.Redis, tmp_path: Path) -> None:
    from redbatch.producer.client import Client
    keys = Keys("efficientnet_lite0")
    with spawned_workers(tmp_path) as start:
        logs = [start(cluster.url)[1], start(cluster.url)[1]]
        with Client(cluster.url) as client:
            sent = [(name, client.submit(PHOTOS[name], timeout_s=120))
                    for name in list(PHOTOS) * 8]
            for name, rid in sent:
                result = client.result(rid, timeout_s=120)
                assert result.ok, result
                assert result.request_id == rid and result.output["label"] in EXPECTED[name]
            # The status and cancel scripts (Redis refuses keys of two slots: CROSSSLOT).
            assert sent[0][1].status().state is JobState.DONE
            assert not client.cancel(sent[0][1])
        assert asyncio.run(_async_predict(cluster.url)) in CAT_LABELS
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
    for log in logs:  # no read or write failed and was retried: none was needed
        text = log.read_text(errors="replace")
        assert "Traceback" not in text and "failed" not in text, text[-3000:]


def test_a_worker_waiting_for_replicas_answers_on_the_cluster(
        cluster: LocalCluster, rc: redis.Redis, tmp_path: Path) -> None:
    """--result-replicas 1: the WAIT after each write goes to the master of the model's
    slot, on the connection of the cluster transaction, and its replica confirms it."""
    from redbatch.producer.client import Client
    port = free_port()
    with spawned_workers(tmp_path) as start:
        _, log = start(cluster.url, "--result-replicas", "1", "--result-wait-ms", "5000",
                       "--metrics-port", str(port), model="null")
        with Client(cluster.url, model="null") as client:
            ids = client.submit_many([PHOTOS["cat.jpg"]] * 20, timeout_s=60)
            results = client.results(ids, timeout_s=60)
        assert all(r.ok for r in results), results[:3]
        waits = scraped_waits(port)
        assert waits["acked"] >= 1 and waits["short"] == 0, waits
        assert "Traceback" not in log.read_text(errors="replace")


async def _async_get(url: str) -> object:
    client = connect_async(url)
    try:
        return await client.get("x")
    finally:
        await client.aclose()


async def _async_predict(url: str) -> str:
    from redbatch.producer.client import AsyncClient
    async with AsyncClient(url) as client:
        results = [await client.predict(PHOTOS["cat.jpg"], timeout_s=120) for _ in range(2)]
        jobs = await client.submit_many([PHOTOS["cat.jpg"]] * 4, timeout_s=120)
        results += await client.results(jobs, timeout_s=120)
    assert all(r.ok for r in results), results
    assert {r.output["label"] for r in results} <= CAT_LABELS
    return str(results[0].output["label"])


def test_every_multi_key_call_stays_in_one_slot(rc: redis.Redis) -> None:
    """The writer's transaction and each of a model's keys hash to the model's slot."""
    keys = Keys("efficientnet_lite0")
    commands = Commands()
    AnswerKeys(keys).write(commands, "r1", b"x", 1000, True, True)
    ReplyList(keys.reply("c1")).announce(commands, ["r1"], 1000)
    DeadLetters(keys).add(commands, p.dead_letter({}, keys.stream(Lane.BULK), b"1-1",
                                                  p.ErrorCode.DEAD_LETTERED, "x", 1))
    jobs = [JobEnvelope(request_id=f"r{i}", model=keys.model, payload=b"x") for i in range(3)]
    admit = admission_call(keys, jobs)
    commands.execute_command("FCALL", ADMIT_FUNCTION, len(admit.keys), *admit.keys, *admit.args)
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


def test_workers_wait_out_a_cluster_that_is_away(
        cluster: LocalCluster, rc: redis.Redis, tmp_path: Path) -> None:
    """Every node killed (no persistence: the data goes with them) and started again: the
    running worker retries through it and serves again; one started while the cluster is
    away waits for it instead of exiting; neither logs a traceback (the cluster client's
    'cannot be connected' is a ConnectionError to the code, like a plain client's)."""
    from redbatch.producer.client import Client
    with spawned_workers(tmp_path) as start:
        running, running_log = start(cluster.url, model="null")
        probe = connect(cluster.url)
        for node in cluster.nodes:
            node.kill()
        for _ in range(3):  # what the code catches as Redis being away, never another type
            with pytest.raises(redis.ConnectionError):
                probe.get("x")
            with pytest.raises(redis.ConnectionError):  # redis-py 8 raised another type here
                with probe.pipeline(transaction=True) as pipe:
                    pipe.set("{x}a", 1).set("{x}b", 2).execute()
            with pytest.raises(redis.ConnectionError):
                asyncio.run(_async_get(cluster.url))
        probe.close()
        late, late_log = start(cluster.url, model="null", ready=False)
        deadline = time.monotonic() + 60
        while "not reachable" not in late_log.read_text(errors="replace"):
            assert time.monotonic() < deadline and late.poll() is None, late_log.read_text()
            time.sleep(0.2)
        for node in cluster.nodes:
            node.start()
        cluster.wait_ok(60)
        with Client(cluster.url, model="null") as client:
            results = client.results(client.submit_many([PHOTOS["cat.jpg"]] * 20,
                                                        timeout_s=120), timeout_s=120)
            assert all(r.ok for r in results), results[:3]
            # Both beat again (the records went too). A worker backs off while the cluster is
            # away; on two loaded cores its next beat took past 20 s now and then.
            deadline = time.monotonic() + 120
            while len(client.workers()) < 2 and time.monotonic() < deadline:
                time.sleep(0.5)
            assert len(client.workers()) == 2
        assert running.poll() is None and late.poll() is None, "workers never exit"
        for log in (running_log, late_log):
            assert "Traceback" not in log.read_text(errors="replace"), log.read_text()[-3000:]


@pytest.mark.full
def test_a_failover_under_load_loses_no_accepted_job(
        cluster: LocalCluster, rc: redis.Redis, tmp_path: Path) -> None:
    """SIGKILL the master of the model's slot with jobs queued and more arriving: its replica
    takes over, both workers ride it out (retrying with back-off, never exiting), and every
    job the client got an id for is answered ok. Jobs submitted before the kill are waited
    on until replicated (Redis replicates asynchronously: a write acknowledged in the last
    moments before a master dies can be lost; RELIABILITY.md "What a failover can lose").
    Answers the dead master took but never replicated are lost with it, and their jobs run
    again (at least once)."""
    from redbatch.producer.client import Client
    keys = Keys("null")
    photo = PHOTOS["cat.jpg"]
    with spawned_workers(tmp_path) as start:
        workers = [start(cluster.url, "--reclaim-idle-ms", "2000", model="null")
                   for _ in range(2)]
        with Client(cluster.url, model="null") as client:
            ids = list(client.submit_many([photo] * 200, timeout_s=600))
            master = cluster.master_of(keys.dlq())
            wait_replicated(master)
            master.kill()
            deadline = time.monotonic() + 60
            while len(ids) < 400 and time.monotonic() < deadline:
                try:  # refused or cut off during the failover: nothing queued, try again
                    ids += client.submit_many([photo] * 20, timeout_s=600)
                except (redis.RedisError, ConnectionError):
                    time.sleep(0.2)
            assert len(ids) == 400, "the new master takes jobs within a minute"
            results = client.results(ids, timeout_s=120)
        assert [r.request_id for r in results] == ids
        assert all(r.ok for r in results), [r for r in results if not r.ok][:3]
        assert all(proc.poll() is None for proc, _ in workers), "workers never exit"
    assert cluster.master_of(keys.dlq()) is not master and rc.xlen(keys.dlq()) == 0
    # The ``cluster`` fixture starts it again, as a replica, before the next cluster test.


def test_a_sweep_reaches_every_master(cluster: LocalCluster, rc: redis.Redis) -> None:
    """``redbatch sweep`` over a cluster: planted owner keys of models whose slots lie on
    each master (and of partitions of one) are all found and mended."""
    models = [f"swept_{i}" for i in range(12)]
    planted = [Keys(m).owner("pinned") for m in models] + [Keys(models[0]).part(3).owner("x")]
    for key in planted:
        rc.set(key, b"y" * 100_000)
    assert len({cluster.master_of(k).port for k in planted}) == cluster.masters
    out = subprocess.run([sys.executable, "-m", "redbatch.cli", "sweep", "--redis", cluster.url],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["deleted"]["owner"] == len(planted)
    assert not any(rc.exists(k) for k in planted)
