"""Partitions (PROTOCOL.md "Partitions") on a real Redis Cluster (3 masters, 3 replicas;
tests/cluster.py, the session's one from conftest.py): each partition's transactions stay
in its own slot, a client and two real workers serve a model of three partitions, spread
over the masters, and the commands over every partition (acl users, score, status, dlq)
work across slots."""

from __future__ import annotations

import itertools
import json
import logging
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.cluster
from cluster import LocalCluster, wait_replicated
from conftest import settings_free_env
from redbatch.cli.acl_rules import user_url
from redbatch.cli.local_stack import count_consumers
from redbatch.common import protocol as p
from redbatch.common.protocol import AnswerKeys, DeadLetters, JobEnvelope, Keys, Lane, ReplyList
from redbatch.common.protocol.functions import ADMIT_FUNCTION, LIBRARY, load_library
from redbatch.common.redis_io import connect, refresh_slots
from redbatch.gpu_worker.streams.transaction import Commands
from redbatch.producer import core
from redbatch.producer.admission import admission_call
from redbatch.producer.client import Client, DuplicateRequestId, QueueFull
from redis.crc import key_slot
from spawned_workers import spawned_workers
from test_partitions import (
    CLI,
    PASSWORDS,
    _dead_letter,
    _manifest,
    _moving,
    _until,
    cli,
    raise_while_submitting,
)

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
        admit = admission_call(keys, jobs)
        commands.execute_command("FCALL", ADMIT_FUNCTION, len(admit.keys), *admit.keys,
                                 *admit.args)
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
        # The second start saw the first worker's consumer and did not wait: wait for both
        # (a fast first worker could answer every job before the second reads at all).
        deadline = time.monotonic() + 120
        while count_consumers(rc, Keys(MODEL)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        with Client(cluster.url, model=MODEL) as client:
            # start() returns once the group has a consumer, which the first worker's is:
            # both beat (a worker beats once its reader thread runs) before the jobs go.
            _until(lambda: len(client.workers()) == 2, 120, "two live workers")
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


@pytest.mark.full
def test_raising_partitions_on_a_cluster_while_jobs_queue_and_come_loses_nothing(
        cluster: LocalCluster, rc: redis.Redis, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """As on one Redis (test_partitions.py): P from 2 to 6 while jobs wait and come; the
    six partitions spread over the three masters."""
    monkeypatch.setattr(core, "PARTITIONS_REFRESH_S", 0.3)
    with spawned_workers(tmp_path) as start:
        raise_while_submitting(cluster.url, rc, lambda: start(
            cluster.url, "--max-inflight", "8", "--max-batch-size", "4", model=MODEL))


def test_acl_users_score_status_and_dlq_over_partitions_on_three_masters(
        cluster: LocalCluster, rc: redis.Redis, tmp_path: Path) -> None:
    """P raised from 2 to 3, its partitions on three masters: a worker and `score` logged
    in as the users `acl --apply` made serve every partition (the run's reply lists lie in
    three slots, collected one at a time) and no node refuses them; `status` sums the
    partitions; `dlq retry` moves a letter of partition 1 to its id's partition under 3,
    on another master (two transactions), where the worker answers it."""
    model = Keys(MODEL)
    rc.eval(p.RAISE_PARTITIONS_SCRIPT, 1, model.partitions(), 2)
    rid = _moving(2)[1][1]  # partition 1 under 2, another under 3
    _dead_letter(rc, model.of(rid, 2), rid)
    assert cli(cluster.url, "partitions", "--model", MODEL, "--set", "3").returncode == 0
    assert cluster.master_of(model.of(rid, 2).dlq()).port != \
        cluster.master_of(model.of(rid, 3).stream(Lane.BULK)).port
    applied = subprocess.run([*CLI, "acl", "--model", MODEL, "--apply", "--redis", cluster.url],
                             capture_output=True, text=True, timeout=60,
                             env={**settings_free_env(), **PASSWORDS})
    assert applied.returncode == 0, applied.stderr
    urls = {role: user_url(cluster.url, f"redbatch-{role}",
                           PASSWORDS[f"REDBATCH_ACL_{role.upper()}_PASSWORD"])
            for role in ("producer", "worker")}
    with spawned_workers(tmp_path) as start:
        start(urls["worker"], model=MODEL, ready_url=cluster.url)
        out = tmp_path / "out.jsonl"
        scored = subprocess.run([*CLI, "score", str(_manifest(tmp_path / "in", 60)), "--model",
                                 MODEL, "-o", str(out), "--redis", urls["producer"]],
                                capture_output=True, text=True, timeout=120,
                                env=settings_free_env())
        assert scored.returncode == 0, scored.stderr[-3000:]
        records = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(records) == 60 and all(rec["status"] == "ok" for rec in records)
        junk = model.part(2)
        rc.xadd(junk.stream(Lane.INTERACTIVE), {"junk": b"x"})  # no request id
        _until(lambda: rc.xlen(junk.dlq()), 30, "the junk's dead letter")
        retried = cli(cluster.url, "dlq", "retry", "--all", "--model", MODEL)
        assert retried.returncode == 0 and "requeued 1" in retried.stdout, retried
        with Client(cluster.url, model=MODEL) as client:
            assert client.result(rid, timeout_s=60).ok
        assert rc.exists(model.of(rid, 3).result(rid))
        assert not rc.exists(model.of(rid, 2).result(rid))
        assert rc.xlen(model.of(rid, 2).dlq()) == 0
        status = cli(cluster.url, "status", "--json", "--model", MODEL)
        assert status.returncode == 0, status.stderr
        (shown,) = json.loads(status.stdout)["models"]
        assert (shown["partitions"], shown["dead_letters"], shown["workers_alive"]) == (3, 1, 1)
        assert [x["dead_letters"] for x in shown["by_partition"]] == [0, 0, 1]
        assert sum(x["lanes"][1]["results"] for x in shown["by_partition"]) >= 60
    for node in cluster.nodes:
        log = redis.Redis.from_url(cluster.node_url(node)).acl_log()
        assert not [e for e in log if str(e.get("username")).startswith("redbatch-")], node.port


def _master_calls(cluster: LocalCluster) -> dict[str, int]:
    """Calls per command since the last CONFIG RESETSTAT, summed over the masters."""
    calls: dict[str, int] = {}
    for node in cluster.live():
        r = redis.Redis(port=node.port)
        if r.info("replication")["role"] == "master":
            for name, stat in r.info("commandstats").items():
                name = name.removeprefix("cmdstat_")
                calls[name] = calls.get(name, 0) + stat["calls"]
        r.close()
    return calls


def test_a_cluster_job_costs_what_it_costs_on_one_redis_in_groups_per_partition(
        cluster: LocalCluster, rc: redis.Redis, tmp_path: Path) -> None:
    """Six partitions over three masters; 600 jobs submitted in one call, queued before a
    worker starts (so they move in groups, as under load), then awaited. Counted by Redis
    itself (INFO commandstats, summed over the masters): one admission call per partition
    for the whole submission, no key look-up round trips (COMMAND GETKEYS), and per job
    its entry, its owner claim and its result, with the groups' share on top as on one
    Redis (tests/test_redis_calls.py: four calls a job at most)."""
    n_jobs, count = 600, 6
    rc.eval(p.RAISE_PARTITIONS_SCRIPT, 1, Keys(MODEL).partitions(), count)
    load_library(rc)  # on every master: no load and resend in the count
    with spawned_workers(tmp_path) as start, Client(cluster.url, model=MODEL) as client:
        for node in cluster.live():
            redis.Redis(port=node.port).config_resetstat()
        ids = client.submit_many([FOUR] * n_jobs, timeout_s=120)
        start(cluster.url, "--max-batch-size", "64", "--max-inflight", "256", model=MODEL)
        results = client.results(ids, timeout_s=120)
        calls = _master_calls(cluster)
    assert all(res.ok for res in results) and len(results) == n_jobs
    assert {p.partition_of(rid, count) for rid in ids} == set(range(count))
    clock = sum(calls.get(name, 0) for name in (
        "config|resetstat", "info", "hello", "client|setinfo", "cluster|slots", "command",
        "zrange", "zadd", "zremrangebyscore", "xinfo|groups", "xinfo|consumers", "xlen",
        "ping", "time", "xgroup|create", "xpending", "script|load", "function|load",
        "lrange"))
    # The worker's departed-consumer script (reclaim.py) runs on the clock too: every
    # EVALSHA (the admission calls are FCALLs).
    clock += calls.get("evalsha", 0)
    job_path = sum(calls.values()) - clock
    print(f"\ncluster, P = {count}: {job_path / n_jobs:.2f} calls a job without the clock's, "
          f"{sum(calls.values()) / n_jobs:.2f} in all: {calls}")
    assert calls.get("command|getkeys", 0) == 0, calls  # keys found by the client itself
    # One admission call per partition for the 600 jobs, all in one pipeline: each call
    # reads its lane's two bounds once (HMGET).
    assert calls.get("hmget", 0) == count, calls
    assert calls.get("xadd", 0) == n_jobs, calls
    assert calls.get("set", 0) <= 2 * n_jobs + 20, calls  # owner claims, results, fleet
    # Reads, writes, announcements and pops: paid per group and partition, not per job
    # (one of each a job would be nine a job; measured about 0.6 in all).
    assert sum(calls.get(name, 0) for name in (
        "xreadgroup", "multi", "exec", "xack", "xdel", "rpush", "pexpire", "blmpop",
        "mget")) < n_jobs, calls
    assert job_path <= 4 * n_jobs, calls


def test_an_id_taken_under_an_older_count_is_refused_on_a_cluster_too(
        cluster: LocalCluster, rc: redis.Redis) -> None:
    """Issue 28, item 9, where the id's older partition is on another master: the client
    reads the owners there first (one MGET per partition), so a resubmit after P rose from
    1 to 3 is refused DUPLICATE_REQUEST_ID and queues nothing."""
    rid = next(f"dup-{i}" for i in range(1000) if p.partition_of(f"dup-{i}", 3) != 0)
    moved = Keys(MODEL, partition=p.partition_of(rid, 3))
    with Client(cluster.url, model=MODEL) as first:
        first.submit_jobs([first.job(FOUR, request_id=rid)])
    rc.eval(p.RAISE_PARTITIONS_SCRIPT, 1, Keys(MODEL).partitions(), 3)
    with Client(cluster.url, model=MODEL) as again:
        with pytest.raises(DuplicateRequestId):
            again.submit_jobs([again.job(FOUR, request_id=rid)])
    assert rc.xlen(moved.stream(Lane.INTERACTIVE)) == 0 and not rc.exists(moved.owner(rid))


def test_a_submission_loads_the_library_on_the_masters_that_lack_it_and_sends_those_again(
        cluster: LocalCluster, rc: redis.Redis) -> None:
    """One pipeline of admission calls over six partitions, the function library on one
    master only: the masters without it answer "Function not found" (and ran nothing), the
    client loads it (on every master) and sends those calls again, and only those: every
    job queued once (a call sent twice would have answered DUPLICATE_REQUEST_ID)."""
    rc.eval(p.RAISE_PARTITIONS_SCRIPT, 1, Keys(MODEL).partitions(), 6)
    rc.function_flush()
    knows = cluster.master_of(Keys(MODEL).stream(Lane.INTERACTIVE))
    redis.Redis(port=knows.port).function_load(LIBRARY)
    with Client(cluster.url, model=MODEL) as client:
        ids = [h.request_id for h in client.submit_many([FOUR] * 120, timeout_s=60)]
    assert len(set(ids)) == 120
    queued = [rc.xlen(Keys(MODEL, partition=q).stream(Lane.INTERACTIVE)) for q in range(6)]
    assert sum(queued) == 120 and all(queued), queued


def test_a_failover_of_one_partitions_master_loses_no_accepted_job(
        cluster: LocalCluster, rc: redis.Redis, tmp_path: Path) -> None:
    """Three partitions, one per master; the master of partition 1 SIGKILLed with jobs
    queued and more arriving. The workers' reads (one pipeline over the three masters) and
    writes, the client's submissions (one pipeline too) and its reply readers all ride
    the failover: every job the client got an id for is answered ok, and the workers
    never exit (as tests/test_cluster.py, where the model has one partition)."""
    rc.eval(p.RAISE_PARTITIONS_SCRIPT, 1, Keys(MODEL).partitions(), 3)
    victim = Keys(MODEL, partition=1)
    with spawned_workers(tmp_path) as start:
        workers = [start(cluster.url, "--reclaim-idle-ms", "2000", model=MODEL)
                   for _ in range(2)]
        with Client(cluster.url, model=MODEL) as client:
            ids = [h.request_id for h in client.submit_many([FOUR] * 300, timeout_s=600)]
            master = cluster.master_of(victim.stream(Lane.INTERACTIVE))
            wait_replicated(master)
            master.kill()
            deadline = time.monotonic() + 60
            while len(ids) < 600 and time.monotonic() < deadline:
                try:  # refused or cut off during the failover: nothing queued, try again
                    ids += [h.request_id for h in client.submit_many([FOUR] * 30,
                                                                     timeout_s=600)]
                except (redis.RedisError, ConnectionError, QueueFull, DuplicateRequestId):
                    time.sleep(0.2)
            assert len(ids) == 600, "the new master takes jobs within a minute"
            results = client.results(ids, timeout_s=120)
        assert [r.request_id for r in results] == ids
        assert all(r.ok for r in results), [r for r in results if not r.ok][:3]
        assert all(proc.poll() is None for proc, _ in workers), "workers never exit"
    assert cluster.master_of(victim.stream(Lane.INTERACTIVE)) is not master
    master.start()  # back as a replica of the new master, for any test after this one
    cluster.wait_ok(60)
    refresh_slots(rc)  # the fixture flushes the masters of today's map


def test_every_partition_waits_for_its_replica_on_its_own_master(
        cluster: LocalCluster, rc: redis.Redis) -> None:
    """Issue 28 item 5 on a cluster: three partitions, one per master, one flush over all
    three; each master ran one WAIT, on the connection that wrote (before the fix,
    partition 0's master alone did)."""
    from redbatch.gpu_worker.metrics import WorkerMetrics
    from redbatch.gpu_worker.streams.results import Answer, ResultWriter
    from redbatch.gpu_worker.streams.transaction import ReplicaWait

    parts = [Keys(MODEL, partition=q) for q in range(3)]
    masters = [cluster.master_of(keys.stream(Lane.INTERACTIVE)) for keys in parts]
    assert len({m.port for m in masters}) == 3
    answers = []
    for keys in parts:
        stream = keys.stream(Lane.INTERACTIVE)
        rc.xgroup_create(stream, p.GROUP, id="0", mkstream=True)
        for i in range(2):
            rc.xadd(stream, {"rid": f"w{keys.partition}-{i}", "job": b"x"})
        entries = rc.xreadgroup(p.GROUP, "w", {stream: ">"}, count=2)[0][1]
        answers += [Answer(stream, entry_id, f"w{keys.partition}-{i}", b"result")
                    for i, (entry_id, _) in enumerate(entries)]

    def waits(node: object) -> int:
        r = redis.Redis(port=node.port, socket_timeout=2)  # type: ignore[attr-defined]
        try:
            return int(r.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))
        finally:
            r.close()

    before = [waits(m) for m in masters]
    metrics = WorkerMetrics(MODEL, 8)
    writer = ResultWriter(connect(cluster.url), parts[0], "w", 60, ReplicaWait(1, 5000),
                          metrics.result_waited)
    assert writer.write_and_ack(answers).held == []
    assert [waits(m) - b for m, b in zip(masters, before, strict=True)] == [1, 1, 1]
    assert metrics.result_waits["acked"]._value.get() == 3
    assert all(rc.xpending(keys.stream(Lane.INTERACTIVE), p.GROUP)["pending"] == 0
               for keys in parts)


@pytest.fixture(scope="module")
def bare_cluster() -> Iterator[LocalCluster]:
    """3 masters, no replicas, serving the slots they still have when one is lost
    (``cluster-require-full-coverage no``): a lost master stays lost."""
    with LocalCluster(replicas=0, extra_args=["--cluster-require-full-coverage", "no"]) as c:
        yield c


def _ids_in(parts: set[int], count: int, n: int, tag: str) -> list[str]:
    """``n`` request ids whose partition among ``count`` is in ``parts``."""
    ids = (f"{tag}-{i}" for i in itertools.count())
    return list(itertools.islice((rid for rid in ids if p.partition_of(rid, count) in parts), n))


def test_a_lost_master_stops_only_its_own_partitions(
        bare_cluster: LocalCluster, tmp_path: Path) -> None:
    """Item 6 on a cluster: four partitions on three masters, no replicas; the master of
    partitions 2 and 3 SIGKILLed for good while jobs are in flight. Every job of the live
    partitions (0 and 1), in flight then or submitted after, is answered, and the worker
    never exits. Before: 0 answered until the master came back (reads were one pipeline
    over every master, and failed whole)."""
    rc = connect(bare_cluster.url)
    rc.eval(p.RAISE_PARTITIONS_SCRIPT, 1, Keys(MODEL).partitions(), 4)
    victim = bare_cluster.master_of(Keys(MODEL, partition=2).stream(Lane.BULK))
    assert victim is bare_cluster.master_of(Keys(MODEL, partition=3).stream(Lane.BULK))
    assert victim is not bare_cluster.master_of(Keys(MODEL).stream(Lane.BULK))
    with spawned_workers(tmp_path) as start:
        worker, log = start(bare_cluster.url, "--max-inflight", "8", model=MODEL)
        with Client(bare_cluster.url, model=MODEL) as client:
            assert all(r.ok for r in client.results(client.submit_many([FOUR] * 12,
                                                                       timeout_s=120)))
            live = _ids_in({0, 1}, 4, 30, "live")
            flying = [client.submit(FOUR, request_id=rid, timeout_s=120) for rid in live[:10]]
            victim.kill()
            after = [client.submit(FOUR, request_id=rid, timeout_s=120) for rid in live[10:]]
            results = client.results([*flying, *after], timeout_s=90)
        assert [r.request_id for r in results] == live
        assert all(r.ok for r in results), [r for r in results if not r.ok][:3]
        assert worker.poll() is None, "the worker never exits"
    text = log.read_text(errors="replace")
    assert "skipped, retried with back-off" in text
    assert "Traceback" not in text, text[-3000:]
    rc.close()


def test_a_model_without_a_count_spreads_over_the_masters_once(
        cluster: LocalCluster, rc: redis.Redis, r: redis.Redis,
        caplog: pytest.LogCaptureFixture) -> None:
    """Item 11: the first worker to meet a model with no partition count on a cluster of
    three masters sets it to 3 (history ``1 3``: ids sent before went to partition 0),
    once: a second worker finds it set. ``partitions --set 1`` first keeps a model on one
    master; on one Redis nothing is set."""
    from click.testing import CliRunner
    from redbatch.cli import main
    from redbatch.gpu_worker.streams.intake import Intake

    caplog.set_level(logging.INFO)
    first = Intake(rc, Keys(MODEL), "c1", 1 << 20)
    first.ensure_groups()
    assert first.partitions.count == 3
    assert rc.lrange(Keys(MODEL).partitions(), 0, -1) == [b"1", b"3"]
    assert all(rc.xinfo_groups(Keys(MODEL, partition=q).stream(lane))
               for q in range(3) for lane in Lane)
    second = Intake(rc, Keys(MODEL), "c2", 1 << 20)
    second.ensure_groups()
    assert second.partitions.count == 3
    assert rc.lrange(Keys(MODEL).partitions(), 0, -1) == [b"1", b"3"]
    said = [rec.getMessage() for rec in caplog.records if "had no partition count" in
            rec.getMessage()]
    assert len(said) == 1 and "3 now" in said[0], said
    out = CliRunner().invoke(main, ["partitions", "--model-name", "null", "--set", "1",
                                    "--redis", cluster.url])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["history"] == [1]
    kept = Intake(rc, Keys("null"), "c3", 1 << 20)
    kept.ensure_groups()
    assert kept.partitions.count == 1 and rc.lrange(Keys("null").partitions(), 0, -1) == [b"1"]
    alone = Intake(r, Keys(MODEL), "c4", 1 << 20)
    alone.ensure_groups()
    assert alone.partitions.count == 1 and not r.exists(Keys(MODEL).partitions())
