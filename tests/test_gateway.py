"""The HTTP gateway (docs/gateway.md) against a real worker, a real Redis with ACL users, and
``redbatch gateway`` as its own process: the official ``openai`` package as the client for
embeddings, curl for the native endpoints (raw bytes and multipart photos), and a raw HTTP
client for the refusals (401, 400, 404, 409, 429 with Retry-After, 503, 504).

One Redis, one worker (the text model and ``null``) and one gateway for the module: the
tests only submit and read, each under ids of its own.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
import openai
import pytest
import redis
from conftest import SAMPLES, GoldenVectors, settings_free_env
from redbatch.cli import acl_rules as rules
from redbatch.cli.local_stack import wait_worker_ready
from redbatch.cli.redis_server import RedisServer, free_port
from redbatch.common.protocol import Keys, Lane
from redbatch.common.protocol.tenants import (
    HOLD_FUNCTION,
    HOLD_SCRIPT,
    TENANTS_LIBRARY_NAME,
    hold_args,
)
from redbatch.gateway.coalesce import Coalescer
from redbatch.gateway.tenants import TenantsError, load_tenants
from redbatch.producer.client import AsyncClient, DuplicateRequestId
from spawned_workers import spawned_workers
from test_acl import cli, url_of

ADMIN = "gw-admin-pw"
TEXT, IMAGE, NOBODY, PLANTED = "all_minilm_l6_v2", "null", "null_tensor", "efficientnet_lite0"
MODELS = (TEXT, IMAGE, NOBODY, PLANTED)
ACME_KEY, BETA_KEY = "sk-acme-0123456789", "sk-beta-9876543210"
BETA_MAX_JOBS = 1


@dataclass
class Stack:
    url: str
    admin: redis.Redis
    acme_redis: str
    beta_redis: str
    gateway: subprocess.Popen[bytes]
    log: Path


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the gateway exited {proc.returncode}: {log.read_text()}")
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=2):
                return
        except (TimeoutError, urllib.error.URLError, ConnectionError):
            time.sleep(0.05)
    raise AssertionError(f"the gateway did not answer in {timeout_s} s: {log.read_text()}")


def _tenant_urls(server: RedisServer) -> dict[str, str]:
    """The tenants' ACL users: acme made with ``redbatch acl --apply --role tenant``, beta
    with the same rules in process."""
    models = [a for m in (TEXT, IMAGE, NOBODY, PLANTED) for a in ("--model", m)]
    out = cli("acl", "--apply", "--role", "tenant", "--tenant", "acme", *models,
              "--redis", server.url, env={"REDBATCH_ACL_TENANT_PASSWORD": "acme-pw"})
    assert out.returncode == 0, out.stderr
    acme = url_of(out.stdout, "redbatch-tenant-acme").replace("***", "acme-pw")
    admin = redis.Redis.from_url(server.url)
    user = rules.build_user("gw-beta", rules.Role.TENANT, "beta-pw",
                            [Keys(m) for m in MODELS], rules.server_version(admin), "beta")
    rules.apply(admin, user)
    return {"acme": acme, "beta": rules.user_url(server.url, "gw-beta", "beta-pw")}


def _first_worker(admin: redis.Redis, model: str) -> str:
    """The consumer name of a live worker of ``model``: the worker's second model may beat
    a moment after the first one is ready."""
    deadline = time.monotonic() + 30
    while not (found := admin.zrange(Keys(model).workers(), 0, 0)):
        assert time.monotonic() < deadline, f"no worker of {model} beat in 30 s"
        time.sleep(0.05)
    return str(found[0].decode())


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("gateway")
    with RedisServer(password=ADMIN) as server, spawned_workers(tmp) as start:
        admin = redis.Redis.from_url(server.url)
        # The worker loads its models while the users and the gateway are made.
        worker, worker_log = start(server.url, "--model", IMAGE, model=TEXT, ready=False)
        urls = _tenant_urls(server)
        tenants = tmp / "tenants.toml"
        tenants.write_text(
            f'[tenants.acme]\nkey_sha256 = "{hashlib.sha256(ACME_KEY.encode()).hexdigest()}"\n'
            'redis_url_env = "ACME_REDIS_URL"\n'
            f'[tenants.beta]\nkey = "{BETA_KEY}"\nredis_url = "{urls["beta"]}"\n'
            f"max_jobs = {BETA_MAX_JOBS}\nmodels = [\"{IMAGE}\"]\n")
        port = free_port()
        log = tmp / "gateway.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "redbatch.cli", "gateway", "--redis", server.url,
                 "--port", str(port), *(a for m in MODELS for a in ("--model", m)),
                 "--tenants", str(tenants)],
                env={**settings_free_env(), "ACME_REDIS_URL": urls["acme"]},
                stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_worker_ready(server.url, Keys(TEXT), worker, timeout_s=180)
        except BaseException:
            print(worker_log.read_text(errors="replace")[-4000:])
            proc.terminate()
            raise
        # A worker record of a model no process serves: the gateway sees it alive, so its
        # jobs stay queued (a real worker would take them) and can be cancelled.
        consumer = _first_worker(admin, IMAGE)
        admin.set(Keys(PLANTED).worker(consumer), admin.get(Keys(IMAGE).worker(consumer)) or b"",
                  px=600_000)
        admin.zadd(Keys(PLANTED).workers(), {consumer: time.time() * 1000})
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_http(url, proc, log, 60)
            yield Stack(url, admin, urls["acme"], urls["beta"], proc, log)
        finally:
            proc.terminate()
            proc.wait(timeout=20)
        assert ADMIN not in log.read_text() and "acme-pw" not in log.read_text()


def call(stack: Stack, method: str, path: str, body: Any = None, key: str | None = ACME_KEY,
         headers: dict[str, str] | None = None) -> tuple[int, Any, Any]:
    """One HTTP request; (status, headers (case-insensitive), the JSON body)."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"{stack.url}{path}", data=data, method=method)
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    request.add_header("Content-Type", "application/json" if not isinstance(body, bytes)
                       else "application/octet-stream")
    for name, value in (headers or {}).items():
        request.add_header(name, value)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read())


def curl(stack: Stack, *args: str) -> tuple[int, Any]:
    out = subprocess.run(["curl", "-sS", "-w", "\n%{http_code}", "-H",
                          f"Authorization: Bearer {ACME_KEY}", *args],
                         capture_output=True, text=True, timeout=60, check=True)
    body, _, status = out.stdout.rpartition("\n")
    return int(status), json.loads(body)


def test_openai_client_embeds_texts_as_the_reference_does(stack: Stack,
                                                          reference: GoldenVectors) -> None:
    texts = ["A man is eating food.", "A man is riding a horse."] * 9  # two jobs: 16 + 2
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=ACME_KEY, max_retries=0)
    got = client.embeddings.create(model=TEXT, input=texts)  # base64, the package's default
    assert [d.index for d in got.data] == list(range(len(texts)))
    vectors = np.array([d.embedding for d in got.data], dtype=np.float32)
    want = reference.encode(texts, normalize_embeddings=True)
    assert vectors.shape == (18, 384)
    assert float(np.min(np.sum(vectors * want, axis=1))) > 0.999
    floats = client.embeddings.create(model=TEXT, input=texts[0], encoding_format="float")
    assert np.allclose(floats.data[0].embedding, vectors[0], atol=1e-5)


def test_a_bad_key_is_401_and_no_job_is_queued(stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.embeddings.create(model=TEXT, input="hello")
    status, headers, body = call(stack, "GET", "/v1/models", key=None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert headers["WWW-Authenticate"] == "Bearer"
    assert stack.admin.xlen(Keys(TEXT).stream(Lane.INTERACTIVE)) == 0


def test_native_jobs_serve_photos_raw_and_multipart(stack: Stack) -> None:
    photos = [SAMPLES / "cat.jpg", SAMPLES / "rocket.jpg"]
    status, many = curl(stack, "-F", f"a=@{photos[0]};type=image/jpeg",
                        "-F", f"b=@{photos[1]};type=image/jpeg",
                        f"{stack.url}/v1/models/{IMAGE}/jobs?wait=20")
    assert status == 200, many
    assert [j["status"] for j in many["data"]] == ["done", "done"]
    assert all(len(j["output"]["mean_rgb"]) == 3 for j in many["data"]) or many
    status, one = curl(stack, "--data-binary", f"@{photos[0]}", "-H", "X-Request-Id: cat-1",
                       "-H", "Content-Type: image/jpeg", f"{stack.url}/v1/models/{IMAGE}/jobs")
    assert status == 202 and one["id"] == f"{IMAGE}:cat-1"
    status, _, found = call(stack, "GET", f"/v1/jobs/{IMAGE}:cat-1?wait=20")
    assert status == 200 and found["status"] == "done"
    assert found["output"] == many["data"][0]["output"]
    # The id is the tenant's: in Redis it is acme:cat-1, and taken until its window ends.
    assert stack.admin.exists(Keys(IMAGE).result("acme:cat-1"))
    status, _, again = call(stack, "POST", f"/v1/models/{IMAGE}/jobs", photos[0].read_bytes(),
                            headers={"X-Request-Id": "cat-1"})
    assert status == 409 and again["error"]["code"] == "duplicate_request_id"


def test_bad_input_is_400_with_the_protocol_code(stack: Stack) -> None:
    status, _, body = call(stack, "POST", f"/v1/models/{IMAGE}/jobs?wait=20",
                           b"not an image at all")
    assert status == 400 and body["error"]["code"] == "bad_image", body
    status, _, body = call(stack, "POST", "/v1/embeddings", {"model": TEXT, "input": [[1, 2]]})
    assert status == 400 and body["error"]["code"] == "bad_input"
    assert body["error"]["param"] == "input"
    status, _, body = call(stack, "POST", "/v1/embeddings", {"model": TEXT, "input": "x"},
                           headers={"X-Redbatch-Lane": "fast"})
    assert status == 400 and body["error"]["param"] == "X-Redbatch-Lane"
    status, _, body = call(stack, "POST", "/v1/embeddings", {"model": "gpt-4", "input": "x"})
    assert status == 404 and body["error"]["code"] == "not_found"


def test_no_worker_alive_is_503_and_models_lists_the_live_ones(stack: Stack) -> None:
    status, headers, body = call(stack, "POST", f"/v1/models/{NOBODY}/jobs", b"\0" * 16)
    assert status == 503 and body["error"]["code"] == "no_worker"
    assert headers["Retry-After"] == "1"
    status, _, listed = call(stack, "GET", "/v1/models")
    assert status == 200
    assert {m["id"] for m in listed["data"]} == {TEXT, IMAGE, PLANTED}


def test_a_full_lane_is_429_with_retry_after(stack: Stack) -> None:
    stack.admin.hset(Keys(IMAGE).limits(), Lane.BULK.value, 0)
    try:
        status, headers, body = call(stack, "POST", f"/v1/models/{IMAGE}/jobs",
                                     (SAMPLES / "cat.jpg").read_bytes(),
                                     headers={"X-Redbatch-Lane": "bulk"})
    finally:
        stack.admin.hdel(Keys(IMAGE).limits(), Lane.BULK.value)
    assert status == 429 and body["error"]["code"] == "queue_full"
    assert headers["Retry-After"] == "1"
    status, _, done = call(stack, "POST", f"/v1/models/{IMAGE}/jobs?wait=20",
                           (SAMPLES / "cat.jpg").read_bytes(), headers={"X-Redbatch-Lane": "bulk"})
    assert status == 200 and done["status"] == "done"


def test_a_tenant_bound_is_held_in_redis_until_the_result_is_read(stack: Stack) -> None:
    photo = (SAMPLES / "coffee.jpg").read_bytes()
    status, _, first = call(stack, "POST", f"/v1/models/{IMAGE}/jobs", photo, key=BETA_KEY)
    assert status == 202
    holds = Keys(IMAGE).tenant("beta")
    assert stack.admin.zcard(holds) == BETA_MAX_JOBS  # the count lives in Redis
    status, headers, full = call(stack, "POST", f"/v1/models/{IMAGE}/jobs", photo, key=BETA_KEY)
    assert status == 429 and full["error"]["code"] == "tenant_full"
    assert headers["Retry-After"] == "1"
    # Another tenant neither sees beta's job nor shares its bound.
    assert call(stack, "GET", f"/v1/jobs/{first['id']}")[0] == 404
    assert call(stack, "POST", f"/v1/models/{IMAGE}/jobs", photo)[0] == 202
    status, _, found = call(stack, "GET", f"/v1/jobs/{first['id']}?wait=20", key=BETA_KEY)
    assert status == 200 and found["status"] == "done"
    assert stack.admin.zcard(holds) == 0
    assert call(stack, "POST", f"/v1/models/{IMAGE}/jobs?wait=20", photo, key=BETA_KEY)[0] == 200
    # beta may use its models only.
    status, _, body = call(stack, "POST", "/v1/embeddings", {"model": TEXT, "input": "x"},
                           key=BETA_KEY)
    assert status == 404


def test_a_queued_job_is_cancelled_and_stays_so(stack: Stack) -> None:
    status, _, queued = call(stack, "POST", f"/v1/models/{PLANTED}/jobs?timeout=60",
                             (SAMPLES / "cat.jpg").read_bytes(),
                             headers={"X-Request-Id": "to-cancel"})
    assert status == 202 and queued["status"] == "queued"
    status, _, found = call(stack, "GET", f"/v1/jobs/{PLANTED}:to-cancel")
    assert status == 200 and found["status"] == "queued"
    status, _, gone = call(stack, "DELETE", f"/v1/jobs/{PLANTED}:to-cancel")
    assert status == 200 and gone["cancelled"] is True
    assert call(stack, "GET", f"/v1/jobs/{PLANTED}:to-cancel")[2]["status"] == "cancelled"
    # An answered job cannot be called back: 409, with where it is.
    status, _, done = call(stack, "POST", f"/v1/models/{IMAGE}/jobs?wait=20",
                           (SAMPLES / "cat.jpg").read_bytes(), headers={"X-Request-Id": "late"})
    status, _, refused = call(stack, "DELETE", f"/v1/jobs/{IMAGE}:late")
    assert status == 409 and refused["status"] == "done"
    assert call(stack, "DELETE", f"/v1/jobs/{IMAGE}:never")[0] == 404


def test_a_spent_deadline_is_504(stack: Stack) -> None:
    status, _, body = call(stack, "POST", "/v1/embeddings",
                           {"model": TEXT, "input": "late", "timeout": 0.001})
    assert status == 504 and body["error"]["code"] in ("expired", "timeout")
    status, _, body = call(stack, "POST", "/v1/embeddings",
                           {"model": TEXT, "input": "x", "timeout": -1})
    assert status == 400 and body["error"]["param"] == "timeout"


def test_the_tenant_user_cannot_reach_another_tenants_keys(stack: Stack) -> None:
    acme = redis.Redis.from_url(stack.acme_redis)
    assert acme.exists(Keys(IMAGE).result("acme:cat-1")) in (0, 1)
    with pytest.raises(redis.exceptions.NoPermissionError):
        acme.get(Keys(IMAGE).result("beta:x"))
    with pytest.raises(redis.exceptions.NoPermissionError):
        acme.set(Keys(IMAGE).owner("beta:x"), "1-0 interactive")
    with pytest.raises(redis.exceptions.NoPermissionError):
        acme.zcard(Keys(IMAGE).tenant("beta"))
    assert stack.admin.function_list(library=TENANTS_LIBRARY_NAME)  # the gateway loaded it


def test_starlettes_own_refusals_have_the_openai_shape(stack: Stack) -> None:
    for method, path, status, code in (("GET", "/v1/nothing-here", 404, "not_found"),
                                       ("PUT", "/v1/models", 405, "method_not_allowed")):
        got, _, body = call(stack, method, path, {})
        assert got == status, body
        assert body["error"]["code"] == code and body["error"]["message"], body
        assert set(body["error"]) == {"message", "type", "param", "code"}


def test_health_readiness_and_metrics(stack: Stack) -> None:
    for path, want in (("/healthz", b"ok"), ("/readyz", b"ready")):
        with urllib.request.urlopen(f"{stack.url}{path}", timeout=5) as response:
            assert response.status == 200 and response.read().startswith(want)
    with urllib.request.urlopen(f"{stack.url}/metrics", timeout=5) as response:
        text = response.read().decode()
    assert 'redbatch_gateway_requests_total{route="embeddings",status="200"}' in text
    assert "redbatch_gateway_request_seconds_bucket" in text
    assert "redbatch_gateway_open_streams" in text
    assert quote(ADMIN) not in text


def test_protocol_md_holds_the_hold_script_and_holds_lapse(stack: Stack) -> None:
    doc = (Path(__file__).resolve().parent.parent / "PROTOCOL.md").read_text()
    assert f"```lua\n{HOLD_SCRIPT}```" in doc
    beta = redis.Redis.from_url(stack.beta_redis)
    key = Keys(IMAGE).tenant("beta")
    assert beta.fcall(HOLD_FUNCTION, 1, key, *hold_args(1, [("beta:lapse", 1)])) == 1
    with pytest.raises(redis.ResponseError, match="^BAD_CALL"):
        beta.fcall(HOLD_FUNCTION, 1, key, "1", "beta:x")
    deadline = time.monotonic() + 5  # a hold of 1 ms lapses: the next call may take its place
    while True:
        try:
            assert beta.fcall(HOLD_FUNCTION, 1, key, *hold_args(1, [("beta:next", 60_000)])) == 1
            break
        except redis.ResponseError as e:
            assert str(e).startswith("TENANT_FULL 1") and time.monotonic() < deadline
    beta.zrem(key, "beta:next")


@pytest.mark.parametrize(("text", "why"), [
    ("[tenants.a]\nkey = 'k'\nmax_jobs = -1\n", "max_jobs"),
    ("[tenants.a]\nkey = 'k'\n[tenants.b]\nkey = 'k'\n", "same key"),
    ("[tenants.a]\nkey_sha256 = 'abc'\n", "key_sha256"),
    ("[tenants.'a:b']\nkey = 'k'\n", "invalid tenant name"),
    ("[tenants.a]\nkey = 'k'\nredis_url_env = 'NOT_SET_HERE'\n", "not set"),
    ("[tenants.a]\nkey = 'k'\npassword = 'x'\n", "unknown field"),
    ("tenants = 3\n", "no [tenants.NAME]"),
])
def test_a_wrong_tenants_file_is_one_line_naming_what(tmp_path: Path, text: str, why: str) -> None:
    path = tmp_path / "t.toml"
    path.write_text(text)
    with pytest.raises(TenantsError, match=re.escape(why)):
        load_tenants(path, env={})
    known = tmp_path / "ok.toml"
    known.write_text("[tenants.a]\nkey = 'sk-1'\n")
    tenants = load_tenants(known, env={})
    assert tenants.authenticate("Bearer sk-1") is tenants.all[0]
    assert tenants.authenticate("Bearer sk-2") is None and tenants.authenticate(None) is None


def test_concurrent_submits_go_in_one_admission_call_and_fail_alone(stack: Stack) -> None:
    photo = (SAMPLES / "cat.jpg").read_bytes()

    def fcalls() -> int:
        stats = stack.admin.info("commandstats")
        return int(stats.get("cmdstat_fcall", {}).get("calls", 0))

    async def run() -> list[BaseException | None]:
        client = AsyncClient(stack.acme_redis, model=IMAGE)
        coalescer = Coalescer(client)
        try:
            await client.submit_jobs(client.jobs([photo], request_ids=["acme:co-taken"],
                                                 model=IMAGE, timeout_s=30))
            before = fcalls()
            ids = [["acme:co-1"], ["acme:co-2", "acme:co-3"], ["acme:co-taken"], ["acme:co-4"]]
            got = await asyncio.gather(*(coalescer.submit(client.jobs(
                [photo] * len(i), request_ids=i, model=IMAGE, timeout_s=30)) for i in ids),
                return_exceptions=True)
            assert fcalls() - before == 1  # four requests, one admission call
            await client.results(["acme:co-1", "acme:co-2", "acme:co-3", "acme:co-4"], 30,
                                 model=IMAGE)
            return [g if isinstance(g, BaseException) else None for g in got]
        finally:
            await client.close()

    outcomes = asyncio.run(run())
    assert outcomes[0] is None and outcomes[1] is None and outcomes[3] is None
    assert isinstance(outcomes[2], DuplicateRequestId)
    assert outcomes[2].duplicates == ["acme:co-taken"]


def test_requests_arriving_while_a_call_is_out_go_together_in_the_next(stack: Stack) -> None:
    """Group commit: with the one call allowed out held by Redis (CLIENT PAUSE WRITE), the
    requests of three later turns wait for it and go in one call, each admitted."""
    photo = (SAMPLES / "cat.jpg").read_bytes()

    async def run() -> tuple[int, list[BaseException | None]]:
        client = AsyncClient(stack.acme_redis, model=IMAGE)
        coalescer = Coalescer(client, in_flight=1)
        try:
            def submit(rid: str) -> asyncio.Task[None]:
                return asyncio.ensure_future(coalescer.submit(client.jobs(
                    [photo], request_ids=[rid], model=IMAGE, timeout_s=30)))
            await client.partitions(IMAGE)  # the history read before the pause
            stack.admin.execute_command("CLIENT", "PAUSE", 300, "WRITE")
            tasks = [submit("acme:gc-0")]
            for i in range(1, 4):  # each in a turn of its own, the first call still out
                for _ in range(3):
                    await asyncio.sleep(0)
                tasks.append(submit(f"acme:gc-{i}"))
            got = await asyncio.gather(*tasks, return_exceptions=True)
            await client.results([f"acme:gc-{i}" for i in range(4)], 30, model=IMAGE)
            return coalescer.calls, [g if isinstance(g, BaseException) else None for g in got]
        finally:
            stack.admin.execute_command("CLIENT", "UNPAUSE")
            await client.close()

    calls, outcomes = asyncio.run(run())
    assert outcomes == [None] * 4
    assert calls == 2  # the first alone, the three that came meanwhile together
