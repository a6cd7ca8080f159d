"""``redbatch acl``: least-privilege users, tested by running the real thing under them.

A private redis-server whose default user is the admin (requirepass). The users are made
by the command itself; a real worker serves real photos under the worker user, submitted
by a Client and by ``redbatch score`` under the producer user, and Redis's ACL LOG must
then hold no refusal. What each role must not do is refused with NOPERM.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import redis
from click.testing import CliRunner
from conftest import SAMPLES, TEST_MODEL, settings_free_env
from redbatch.cli import main
from redbatch.cli.acl_rules import Role, build_user, server_version, user_url
from redbatch.cli.redis_server import RedisServer
from redbatch.common.protocol import (
    ADMIT_SCRIPT,
    GROUP,
    ErrorCode,
    JobState,
    Keys,
    Lane,
    RedbatchError,
    token_bound_field,
)
from redbatch.common.protocol.functions import (
    ADMIT_FUNCTION,
    LIBRARY,
    LIBRARY_NAME,
    load_library,
)
from redbatch.common.protocol.generation import STOP_TTL_MS, STOP_VALUE
from redbatch.producer.client import Client, QueueFull
from redbatch.producer.errors import FunctionsMissing
from spawned_workers import spawned_workers

ADMIN = "admin/p@ss"
PRODUCER_PW = "prod:uc/er@pw"
WORKER_PW = "wo/rk@er:pw"
OTHER = "other_model"
KEYS = Keys(TEST_MODEL)
THEIRS = Keys(OTHER)


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = settings_free_env()
    return subprocess.run([sys.executable, "-m", "redbatch.cli", *args],
                          env={**base, **(env or {})}, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=300)


def url_of(text: str, user: str) -> str:
    """The URL the command printed for ``user``."""
    match = re.search(rf"ACL user {user} .*connect with (\S+)", text)
    assert match, text
    return match.group(1)


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with RedisServer(password=ADMIN) as s:
        yield s


@pytest.fixture(scope="module")
def users(server: RedisServer) -> dict[str, str]:
    """The users made by ``redbatch acl --apply``; their URLs by role."""
    out = cli("acl", "--apply", "--model", TEST_MODEL, "--redis", server.url,
              env={"REDBATCH_ACL_PRODUCER_PASSWORD": PRODUCER_PW,
                   "REDBATCH_ACL_WORKER_PASSWORD": WORKER_PW})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("applied ACL user") for line in lines)
    for secret in (PRODUCER_PW, WORKER_PW, ADMIN):
        assert secret not in out.stdout + out.stderr
    redis.Redis.from_url(server.url).acl_log_reset()
    given = {"producer": PRODUCER_PW, "worker": WORKER_PW}
    return {role: url_of(out.stdout, f"redbatch-{role}").replace("***", quote(pw, safe=""))
            for role, pw in given.items()}


@pytest.fixture
def as_user(users: dict[str, str]) -> Iterator[Callable[[str], redis.Redis]]:
    made: list[redis.Redis] = []

    def connect(role: str) -> redis.Redis:
        made.append(redis.Redis.from_url(users[role]))
        return made[-1]

    yield connect
    for client in made:
        client.close()


def consumers(admin: redis.Redis) -> set[bytes]:
    groups = admin.xinfo_consumers(KEYS.stream(Lane.INTERACTIVE), GROUP)
    return {c["name"] if isinstance(c["name"], bytes) else c["name"].encode() for c in groups}


def refusals(server: RedisServer) -> list[dict[str, Any]]:
    return [entry for entry in redis.Redis.from_url(server.url).acl_log()
            if entry["username"] in ("redbatch-producer", "redbatch-worker")]


def strand_jobs(admin: redis.Redis, producer_url: str, photo: bytes) -> str:
    """A job read by a consumer that died (pending, for a takeover) and an entry with no
    request id (for the dead-letter stream); returns the stranded job's request id."""
    stream = KEYS.stream(Lane.INTERACTIVE)
    with Client(producer_url) as client:
        stranded = client.submit(photo, timeout_s=120)
    admin.xgroup_create(stream, GROUP, id="0", mkstream=True)
    assert admin.xreadgroup(GROUP, "gone", {stream: ">"}, count=1)
    admin.xadd(stream, {"job": b"nobody to answer"})
    return stranded


def test_everything_documented_works_under_the_two_users(
        server: RedisServer, users: dict[str, str], tmp_path: Path) -> None:
    photos = SAMPLES / "cat.jpg", SAMPLES / "coffee.jpg", SAMPLES / "rocket.jpg"
    folder = tmp_path / "photos"
    folder.mkdir()
    for photo in photos:
        (folder / photo.name).write_bytes(photo.read_bytes())
    admin = redis.Redis.from_url(server.url)
    stranded = strand_jobs(admin, users["producer"], photos[1].read_bytes())
    with Client(users["producer"]) as client:  # status and cancel, as a producer
        assert client.status(stranded).state is JobState.RUNNING
        cancelled = client.submit(photos[2].read_bytes(), timeout_s=120)
        assert cancelled.status().state is JobState.QUEUED and cancelled.cancel()
    with spawned_workers(tmp_path) as start:
        # Short leases: takeover, renewal and the departed-consumer script all run.
        worker, log = start(users["worker"], "--reclaim-idle-ms", "300")
        with Client(users["producer"]) as client:
            ready_by = time.monotonic() + 60  # its first heartbeat may follow its joining
            while not client.is_ready() and time.monotonic() < ready_by:
                time.sleep(0.1)
            assert [w.pid for w in client.workers()] == [worker.pid], log.read_text()[-3000:]
            assert client.result(stranded, timeout_s=120).ok  # taken over from "gone"
            assert client.result(cancelled, timeout_s=120).error_code is ErrorCode.CANCELLED
            assert client.status(cancelled).state is JobState.CANCELLED
            assert client.predict(photos[0].read_bytes(), timeout_s=120).ok
            ids = client.submit_many([p.read_bytes() for p in photos], timeout_s=120)
            assert all(client.result(i, timeout_s=120).ok for i in ids)
        assert admin.xlen(KEYS.dlq()) == 1
        deadline = time.monotonic() + 30
        while b"gone" in consumers(admin) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert b"gone" not in consumers(admin), "the departed consumer was removed"
        out = tmp_path / "scores.jsonl"
        scored = cli("score", str(folder), "-o", str(out), "--redis", users["producer"])
        assert scored.returncode == 0, scored.stderr
        records = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(records) == 3 and all(r["status"] == "ok" for r in records), records
        shown = cli("limit", "--redis", users["producer"])
        assert shown.returncode == 0 and '"lane": "bulk"' in shown.stdout, shown.stderr
        assert worker.poll() is None
    assert worker.returncode == 0
    text = log.read_text(errors="replace")
    assert "took over 1 jobs" in text and "removed departed consumers" in text
    assert "NOPERM" not in text
    # A client's first wait for an id it did not submit tries BLMOVE (not a producer's:
    # issue 28, item 3), and polls from then on.
    refused = [(e["username"], e["object"]) for e in refusals(server)]
    assert set(refused) <= {("redbatch-producer", "blmove")}, \
        f"a command the roles send is missing from their rules: {refused}"


def nopermed(call: Callable[[], object]) -> bool:
    """True when Redis refuses the call for want of permission (NOPERM, or inside a script
    its "user executing the script can't" error)."""
    try:
        call()
    except redis.exceptions.NoPermissionError:
        return True
    except redis.ResponseError as e:
        return "executing the script can't" in str(e)
    return False


def test_a_producer_may_not_answer_take_over_or_administer(
        as_user: Callable[[str], redis.Redis]) -> None:
    p = as_user("producer")
    forbidden: dict[str, Callable[[], object]] = {
        "SET result": lambda: p.set(KEYS.result("x"), b"forged"),
        "SET done": lambda: p.set(KEYS.done("x"), b"1"),
        "RPUSH done": lambda: p.rpush(KEYS.done("x"), b"1"),
        "RPUSH reply": lambda: p.rpush(KEYS.reply("theirs"), b"x"),
        "XADD another model": lambda: p.xadd(THEIRS.stream(Lane.BULK), {"rid": "x"}),
        "GET another model's result": lambda: p.get(THEIRS.result("x")),
        "read the jobs (payloads)": lambda: p.xrange(KEYS.stream(Lane.BULK)),
        "XREADGROUP": lambda: p.xreadgroup("workers", "c", {KEYS.stream(Lane.BULK): ">"}),
        "HSET limits": lambda: p.hset(KEYS.limits(), "bulk", 1),
        "ZADD workers (a fake worker)": lambda: p.zadd(KEYS.workers(), {"fake": 1}),
        "SET a worker record": lambda: p.set(KEYS.worker("fake"), b"x"),
        "DEL a worker record": lambda: p.delete(KEYS.worker("fake")),
        "DEL a stream": lambda: p.delete(KEYS.stream(Lane.BULK)),
        "SET a stream": lambda: p.set(KEYS.stream(Lane.BULK), b"x"),
        "the DLQ": lambda: p.xrange(KEYS.dlq()),
        "a script writing a result": lambda: p.eval(
            "return redis.call('SET', KEYS[1], 'forged')", 1, KEYS.result("x")),
        "a script changing a bound": lambda: p.eval(
            "return redis.call('HSET', KEYS[1], 'bulk', 0)", 1, KEYS.limits()),
        "the admission script of another model": lambda: p.eval(
            ADMIT_SCRIPT, 3, THEIRS.stream(Lane.BULK), THEIRS.limits(), THEIRS.owner("x"),
            "bulk", 1000, "rid", "x", "job", b"x"),
        "the admission function on another model": lambda: p.fcall(
            ADMIT_FUNCTION, 4, THEIRS.stream(Lane.BULK), THEIRS.limits(),
            THEIRS.charges(Lane.BULK), THEIRS.owner("x"), "bulk", 1000, "x", 0, b"x"),
        "charge another model's lane": lambda: p.hset(THEIRS.charges(Lane.BULK), "1-1", 5),
        # Issue 28, item 3: a done list moved onto another id's done list or result key
        # would plant an answer there (the victim pops another job's envelope, or its
        # answer is dead-lettered undeliverable).
        "BLMOVE onto another id's done list": lambda: p.blmove(
            KEYS.done("mine"), KEYS.done("victim"), 0.01),
        "BLMOVE onto another id's result key": lambda: p.blmove(
            KEYS.done("mine"), KEYS.result("victim"), 0.01),
        "LMOVE from a reply list onto a done list": lambda: p.lmove(
            KEYS.reply("mine"), KEYS.done("victim")),
        "RPUSH owner": lambda: p.rpush(KEYS.owner("x"), b"1"),
        "FLUSHALL": p.flushall, "CONFIG": lambda: p.config_get("*"), "KEYS": lambda: p.keys(),
        "SCAN": lambda: p.scan(), "SCRIPT FLUSH": p.script_flush, "ACL": p.acl_list,
        "SUBSCRIBE": lambda: p.publish("x", "y"),
    }
    allowed = {name for name, call in forbidden.items() if not nopermed(call)}
    assert allowed == set()


def test_a_producer_runs_no_lua_of_its_own(server: RedisServer, users: dict[str, str],
                                           as_user: Callable[[str], redis.Redis]) -> None:
    """Issue 28, item 1: EVAL (any Lua, a loop that holds every client at BUSY) and every
    way to load or change code are refused; the producer calls the loaded functions only."""
    admin = redis.Redis.from_url(server.url)
    looping = redis.Redis.from_url(users["producer"], socket_timeout=5)
    try:
        assert nopermed(lambda: looping.eval("while true do end", 0))
    finally:
        looping.close()
        try:
            admin.script_kill()  # only if the loop ran: then this test has failed already
        except redis.ResponseError:
            pass  # NOTBUSY
    p = as_user("producer")
    forbidden: dict[str, Callable[[], object]] = {
        "EVAL": lambda: p.eval("return 1", 0),
        "EVALSHA": lambda: p.evalsha("0" * 40, 0),
        "EVAL_RO": lambda: p.execute_command("EVAL_RO", "return 1", 0),
        "SCRIPT LOAD": lambda: p.script_load("return 1"),
        "FUNCTION LOAD": lambda: p.function_load(
            "#!lua name=mine\nredis.register_function('mine', function() end)"),
        "FUNCTION LOAD REPLACE of ours": lambda: p.function_load(LIBRARY, replace=True),
        "FUNCTION DELETE": lambda: p.function_delete(LIBRARY_NAME),
        "FUNCTION FLUSH": p.function_flush,
        "FUNCTION RESTORE": lambda: p.function_restore(b"x"),
        "FUNCTION DUMP": p.function_dump,
    }
    allowed = {name for name, call in forbidden.items() if not nopermed(call)}
    assert allowed == set()
    assert LIBRARY_NAME in {lib["library_name"] for lib in _libraries(admin)}


def _libraries(admin: redis.Redis) -> list[dict[str, Any]]:
    return [{(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes)
                                                          else v)
             for k, v in zip(lib[::2], lib[1::2], strict=True)}
            for lib in admin.function_list()]


def test_without_the_library_a_producer_gets_one_stable_error(
        server: RedisServer, users: dict[str, str]) -> None:
    """No worker has loaded the functions and the producer may not: FunctionsMissing (ours,
    with its code), nothing queued; once an admin loads them, submit, status and cancel
    work as the producer."""
    admin = redis.Redis.from_url(server.url)
    stream = KEYS.stream(Lane.INTERACTIVE)
    before = admin.xlen(stream)
    admin.function_delete(LIBRARY_NAME)
    try:
        with Client(users["producer"]) as client:
            with pytest.raises(FunctionsMissing) as missing:
                client.submit(b"x", timeout_s=5)
            with pytest.raises(FunctionsMissing):
                client.status("anything")
        assert isinstance(missing.value, RedbatchError)
        assert missing.value.code == "functions_missing" and "\n" not in str(missing.value)
        assert admin.xlen(stream) == before
    finally:
        load_library(admin)
    with Client(users["producer"]) as client:
        job = client.submit(b"x", timeout_s=5)
        assert job.status().state is JobState.QUEUED
        assert job.cancel() and job.status().state is JobState.CANCELLED


def test_a_worker_may_not_touch_another_model_or_administer(
        as_user: Callable[[str], redis.Redis]) -> None:
    w = as_user("worker")
    forbidden: dict[str, Callable[[], object]] = {
        "another model's jobs": lambda: w.xreadgroup("workers", "c",
                                                     {THEIRS.stream(Lane.BULK): ">"}),
        "another model's group": lambda: w.xgroup_create(THEIRS.stream(Lane.BULK), "workers",
                                                         mkstream=True),
        "another model's result": lambda: w.set(THEIRS.result("x"), b"forged"),
        "another model's DLQ": lambda: w.xadd(THEIRS.dlq(), {"rid": "x"}),
        "change a bound": lambda: w.hset(KEYS.limits(), "bulk", 0),
        "FLUSHALL": w.flushall, "FLUSHDB": w.flushdb, "CONFIG": lambda: w.config_get("*"),
        "KEYS": lambda: w.keys(), "SHUTDOWN": lambda: w.execute_command("SHUTDOWN"),
        "ACL SETUSER": lambda: w.acl_setuser("x"), "CLIENT LIST": w.client_list,
        "CLIENT KILL": lambda: w.client_kill_filter(skipme=True),
    }
    allowed = {name for name, call in forbidden.items() if not nopermed(call)}
    assert allowed == set()


def test_the_printed_rules_load_as_they_are(server: RedisServer, tmp_path: Path) -> None:
    """Piped into redis-cli, and as ACL file lines of a server started with them."""
    made = cli("acl", "--model", "piped", "--producer-user", "piped-p", "--worker-user",
               "piped-w", "--redis", server.url)
    assert made.returncode == 0 and len(made.stdout.splitlines()) == 2
    assert made.stdout.startswith("ACL SETUSER piped-p reset on #")
    # redis-cli 7.0 does not percent-decode a URL's password: it takes it from REDISCLI_AUTH.
    loaded = subprocess.run(["redis-cli", "-p", str(server.port)], input=made.stdout,
                            env={**os.environ, "REDISCLI_AUTH": ADMIN}, capture_output=True,
                            text=True, timeout=30)
    assert loaded.stdout.split() == ["OK", "OK"], loaded
    for user in ("piped-p", "piped-w"):  # the printed URL names the --redis host
        assert redis.Redis.from_url(url_of(made.stderr, user)).ping()

    lines = cli("acl", "--model", "filed", "--format", "aclfile", "--redis", server.url)
    aclfile = tmp_path / "users.acl"
    aclfile.write_text("user default on nopass ~* &* +@all\n" + lines.stdout)
    with RedisServer(extra_args=["--aclfile", str(aclfile)]) as filed:
        for user in ("redbatch-producer", "redbatch-worker"):
            client = redis.Redis.from_url(url_of(lines.stderr, user).replace(
                f"@127.0.0.1:{server.port}", f"@127.0.0.1:{filed.port}"))
            assert client.ping() and nopermed(client.flushall)


def test_apply_shows_no_password_and_needs_an_admin(users: dict[str, str]) -> None:
    no_password = CliRunner().invoke(main, ["acl", "--apply", "--model", "m", "--redis",
                                            users["producer"]])
    assert no_password.exit_code == 2 and "shows no password" in no_password.output
    not_admin = cli("acl", "--apply", "--model", "m", "--redis", users["producer"],
                    env={"REDBATCH_ACL_PRODUCER_PASSWORD": "a",
                         "REDBATCH_ACL_WORKER_PASSWORD": "b"})
    assert not_admin.returncode == 1 and "Traceback" not in not_admin.stderr
    assert PRODUCER_PW not in not_admin.stderr and "NOPERM" in not_admin.stderr


def test_one_user_for_several_models_gets_each_and_no_other(server: RedisServer) -> None:
    admin = redis.Redis.from_url(server.url)
    version = server_version(admin)
    models = [Keys("m1"), Keys("m2", "staging")]
    for role in (Role.PRODUCER, Role.WORKER):
        user = build_user(f"multi-{role.value}", role, "pw", models, version)
        admin.execute_command("ACL", "SETUSER", user.name, *user.setuser_args())

    def may(user: str, *command: str) -> bool:
        return bool(admin.execute_command("ACL", "DRYRUN", user, *command) == b"OK")

    for keys in models:
        stream = keys.stream(Lane.INTERACTIVE)
        assert may("multi-producer", "XADD", stream, "*", "rid", "x")
        assert may("multi-producer", "GET", keys.result("x"))
        assert may("multi-worker", "XREADGROUP", "GROUP", "workers", "c", "STREAMS", stream, ">")
        assert may("multi-worker", "SET", keys.result("x"), "r", "NX", "GET", "PX", "1000")
    assert not may("multi-producer", "XADD", Keys("m1", "staging").stream(Lane.BULK), "*",
                   "rid", "x")
    assert not may("multi-worker", "XLEN", Keys("m3").stream(Lane.BULK))
    assert not may("multi-producer", "SET", models[1].result("x"), "forged")


CHAT = "smollm2_135m"
CHAT_KEYS = Keys(CHAT)
CHAT_USERS = ("chat-producer", "chat-worker", "chat-acme", "chat-beta")


def test_generation_streams_and_cancels_under_the_users(server: RedisServer,
                                                        tmp_path: Path) -> None:
    """A real chat worker under the worker user; a producer generates, streams and cancels
    (the stop key, as PROTOCOL.md "Token stream" says) with no refusal in the ACL LOG. It
    may not forge a token (XADD), nor touch another model's stream; a tenant reads its
    own token streams only."""
    admin = redis.Redis.from_url(server.url)
    made = cli("acl", "--apply", "--model", CHAT, "--producer-user", CHAT_USERS[0],
               "--worker-user", CHAT_USERS[1], "--redis", server.url,
               env={"REDBATCH_ACL_PRODUCER_PASSWORD": PRODUCER_PW,
                    "REDBATCH_ACL_WORKER_PASSWORD": WORKER_PW})
    assert made.returncode == 0, made.stderr
    producer, worker_url = (url_of(made.stdout, user).replace("***", quote(pw, safe=""))
                            for user, pw in zip(CHAT_USERS[:2], (PRODUCER_PW, WORKER_PW),
                                                strict=True))
    version = server_version(admin)
    for user, tenant in zip(CHAT_USERS[2:], ("acme", "beta"), strict=True):
        made_user = build_user(user, Role.TENANT, "pw", [CHAT_KEYS], version, tenant)
        admin.execute_command("ACL", "SETUSER", made_user.name, *made_user.setuser_args())
    acme = redis.Redis.from_url(user_url(server.url, CHAT_USERS[2], "pw"))
    admin.acl_log_reset()
    long_story = b'{"prompt": "Tell me a long story:", "max_new_tokens": 400}'
    # A token bound: the producer's admissions charge the lane, the worker frees each.
    admin.hset(CHAT_KEYS.limits(), token_bound_field(Lane.INTERACTIVE), 100_000)
    with spawned_workers(tmp_path) as start:
        start(worker_url, model=CHAT, ready_url=server.url)
        with Client(producer, model=CHAT) as client:
            assert client.generate("Count to five:", max_new_tokens=4)
            assert "".join(client.stream(messages=[{"role": "user", "content": "Hi"}],
                                         max_new_tokens=4))
            p = client.redis
            rid = client.submit(long_story, content_type="application/json", timeout_s=120)
            tokens = CHAT_KEYS.tokens(rid)
            assert p.xread({tokens: "0-0"}, count=1, block=60_000)  # it is running
            assert p.set(CHAT_KEYS.stop(rid), STOP_VALUE, px=STOP_TTL_MS)
            assert p.get(CHAT_KEYS.stop(rid)) == STOP_VALUE.encode()
            out = client.result(rid, timeout_s=60).raise_for_error().output
            assert out["finish_reason"] == "cancelled" and out["completion_tokens"] < 400
            assert len(p.xrange(tokens)) >= 1
            # The tenant reads and stops its own; the job is submitted under its id.
            mine = client.submit(b'{"prompt": "Hi", "max_new_tokens": 2}', timeout_s=60,
                                 content_type="application/json", request_id="acme:own")
            assert client.result(mine, timeout_s=60).ok
            assert acme.xrange(CHAT_KEYS.tokens("acme:own"))
            assert acme.xread({CHAT_KEYS.tokens("acme:own"): "0-0"}, block=10)
            assert acme.set(CHAT_KEYS.stop("acme:own"), STOP_VALUE, px=STOP_TTL_MS)
            # All answered: no charge is left, only the function's own total.
            assert admin.hkeys(CHAT_KEYS.charges(Lane.INTERACTIVE)) == [b"total"]
            # A refusal past the token bound recounts the charges under the producer's rules.
            admin.hset(CHAT_KEYS.limits(), token_bound_field(Lane.INTERACTIVE), 10)
            with pytest.raises(QueueFull):
                client.submit(long_story, content_type="application/json")
            assert admin.hexists(CHAT_KEYS.charges(Lane.INTERACTIVE), "recounted")
            admin.hdel(CHAT_KEYS.limits(), token_bound_field(Lane.INTERACTIVE))
            admin.delete(CHAT_KEYS.charges(Lane.INTERACTIVE))
            refused = [(e["username"], e["object"]) for e in admin.acl_log()
                       if e["username"] in CHAT_USERS]
            assert refused == [], f"a command generation sends is missing: {refused}"
            forbidden: dict[str, Callable[[], object]] = {
                "forge a token (XADD)": lambda: p.xadd(tokens, {"tokens": "1", "text": "x"}),
                "XADD a new token stream": lambda: p.xadd(CHAT_KEYS.tokens("new"),
                                                           {"tokens": "1", "text": "x"}),
                "DEL a token stream": lambda: p.delete(tokens),
                "XTRIM a token stream": lambda: p.xtrim(tokens, 0),
                "PEXPIRE a token stream": lambda: p.pexpire(tokens, 1),
                "read another model's tokens": lambda: p.xrange(THEIRS.tokens(rid)),
                "XREAD another model's tokens": lambda: p.xread({THEIRS.tokens(rid): "0-0"}),
                "stop another model's job": lambda: p.set(THEIRS.stop(rid), STOP_VALUE),
                "tenant: read another tenant's tokens": lambda: acme.xrange(
                    CHAT_KEYS.tokens("beta:x")),
                "tenant: XREAD another tenant's tokens": lambda: acme.xread(
                    {CHAT_KEYS.tokens("beta:x"): "0-0"}),
                "tenant: read an id of no tenant": lambda: acme.xrange(tokens),
                "tenant: stop another tenant's job": lambda: acme.set(
                    CHAT_KEYS.stop("beta:x"), STOP_VALUE),
                "tenant: forge its own tokens": lambda: acme.xadd(
                    CHAT_KEYS.tokens("acme:own"), {"tokens": "1", "text": "x"}),
            }
            allowed = {name for name, call in forbidden.items() if not nopermed(call)}
            assert allowed == set()
    w = redis.Redis.from_url(worker_url)
    assert nopermed(lambda: w.xadd(THEIRS.tokens("x"), {"tokens": "1", "text": "x"}))
    assert nopermed(lambda: w.set(CHAT_KEYS.stop("x"), STOP_VALUE))  # it reads stops only
    assert nopermed(lambda: w.mget([THEIRS.stop("x")]))


def test_a_sweep_takes_back_what_a_producer_pinned(
        server: RedisServer, users: dict[str, str],
        as_user: Callable[[str], redis.Redis]) -> None:
    """Issue 28, item 4: the producer may SET owner and stop keys (the admission function
    runs as the caller), with any value and no TTL; Redis ACLs cannot bind arguments. The
    admin's ``redbatch sweep`` mends what no protocol writer leaves, and nothing else."""
    p, admin = as_user("producer"), redis.Redis.from_url(server.url)
    big = b"x" * (10 << 20)
    second = Keys(TEST_MODEL).part(2)
    planted = {KEYS.owner("pinned"): big, second.owner("pinned"): big,
               KEYS.owner("forever"): b"1712345678901-0 bulk", KEYS.stop("pinned"): big,
               KEYS.stop("forever"): STOP_VALUE.encode()}
    for key, value in planted.items():
        assert p.set(key, value)  # what the ACL cannot refuse
    admin.set(THEIRS.owner("pinned"), big)  # another model: outside --model
    with Client(users["producer"], model=TEST_MODEL) as client:
        real = client.submit(b"not a photo", timeout_s=60)
    before = admin.pttl(KEYS.owner(real))
    used = admin.info("memory")["used_memory"]
    out = cli("sweep", "--redis", server.url, "--model", TEST_MODEL)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["deleted"] == {"owner": 2} and report["shrunk"] == {"stop": 1}
    assert report["expiry_set"] == {"owner": 1, "stop": 1}  # the shrunk one got its TTL
    assert not admin.exists(KEYS.owner("pinned"), second.owner("pinned"))
    assert admin.get(KEYS.stop("pinned")) == STOP_VALUE.encode()  # still stopped
    assert 0 < admin.pttl(KEYS.stop("pinned")) <= STOP_TTL_MS
    assert 0 < admin.pttl(KEYS.stop("forever")) <= STOP_TTL_MS
    assert 6 * 86400_000 < admin.pttl(KEYS.owner("forever")) <= 7 * 86400_000
    assert admin.get(KEYS.owner("forever")) == b"1712345678901-0 bulk"
    assert before - 5000 < admin.pttl(KEYS.owner(real)) <= before  # a real owner untouched
    assert admin.strlen(THEIRS.owner("pinned")) == len(big)
    assert admin.info("memory")["used_memory"] < used - 25 * (1 << 20)
    again = json.loads(cli("sweep", "--redis", server.url, "--model", TEST_MODEL).stdout)
    assert again["deleted"] == {"owner": 0} and again["expiry_set"] == {"owner": 0, "stop": 0}
    dry = json.loads(cli("sweep", "--redis", server.url, "--dry-run").stdout)
    assert dry["deleted"] == {"owner": 1} and admin.strlen(THEIRS.owner("pinned")) == len(big)
    for key in (KEYS.owner("forever"), KEYS.stop("pinned"), KEYS.stop("forever"),
                KEYS.owner(real), THEIRS.owner("pinned")):
        admin.delete(key)
    admin.close()


def test_a_sweep_is_the_admins(users: dict[str, str]) -> None:
    out = cli("sweep", "--redis", users["producer"])
    assert out.returncode == 1 and out.stdout == ""
    assert len(out.stderr.strip().splitlines()) == 1 and PRODUCER_PW not in out.stderr


@pytest.mark.parametrize(("kind", "value", "ttl_ms", "action"), [
    ("owner", b"1712345678901-0 bulk", 5000, None),
    ("owner", b"1712345678901-0 interactive cancel", -1, "expire"),
    ("owner", b"1712345678901-0", 5000, None),  # an older writer's bare entry id
    ("owner", b"taken first", 5000, "delete"),
    ("owner", b"1-1 bulk" + b" " * 60, 5000, "delete"),
    ("stop", STOP_VALUE.encode(), 5000, None),
    ("stop", b"anything short", -1, "expire"),
    ("stop", b"x" * 65, 5000, "shrink"),
])
def test_what_a_sweep_mends(kind: Any, value: bytes, ttl_ms: int, action: str | None) -> None:
    from redbatch.cli.sweep import MAX_VALUE_BYTES, decide
    assert decide(kind, len(value), value[:MAX_VALUE_BYTES], ttl_ms) == action


def test_a_repeating_sweep_rides_out_redis_away() -> None:
    """``--every``: a pass Redis fails is one warning, the next pass runs once Redis is
    back, and SIGTERM ends the loop with exit 0."""
    import signal
    import threading
    with RedisServer() as s:
        proc = subprocess.Popen([sys.executable, "-m", "redbatch.cli", "sweep", "--redis",
                                 s.url, "--every", "1"], env=settings_free_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        watchdog = threading.Timer(120, proc.kill)  # a hang ends the reads below (EOF)
        watchdog.start()
        try:
            assert proc.stdout is not None and proc.stderr is not None
            assert json.loads(proc.stdout.readline())["deleted"] == {"owner": 0}
            s.kill()
            for line in proc.stderr:
                if "Redis not reachable" in line:
                    break
            s.start()
            redis.Redis.from_url(s.url).set(KEYS.owner("planted"), b"x" * 100)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if json.loads(proc.stdout.readline())["deleted"] == {"owner": 1}:
                    break
            else:
                raise AssertionError("no pass after Redis came back")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        finally:
            watchdog.cancel()
            proc.kill()
