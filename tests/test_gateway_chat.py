"""Chat and completions through the HTTP gateway (docs/gateway.md "Chat and completions"):
a real generation worker serving smollm2_135m, a real Redis with a tenant's ACL user, and
``redbatch gateway`` as its own process. The official ``openai`` package is the client for
chat and completions, streamed and not; a raw HTTP reader (what a browser's EventSource
does) drops a stream and resumes it with Last-Event-ID; curl streams; a client that leaves
stops its job.

One Redis, one worker and one gateway for the module: the tests only submit and read, each
under ids of its own.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import openai
import pytest
import redis
from conftest import settings_free_env
from redbatch.cli.local_stack import spawn_worker, stop_worker, wait_worker_ready
from redbatch.cli.redis_server import RedisServer, free_port
from redbatch.common.protocol import Keys, Lane, token_bound_field
from test_acl import cli, url_of
from test_gateway import _wait_http

MODEL = "smollm2_135m"
KEYS = Keys(MODEL)
GOLDEN = json.loads((Path(__file__).parent / "data" / "smollm2_golden.json").read_text())
KEY = "sk-chat-0123456789"
ADMIN = "chat-admin-pw"
LONG = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
COUNT = [{"role": "user", "content": "Count from one to twenty in words."}]


@dataclass
class Stack:
    url: str
    port: int
    admin: redis.Redis
    log: Path
    redis_url: str
    tenants: Path
    worker: subprocess.Popen[bytes]

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0,
                             timeout=120)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("gateway-chat")
    with RedisServer(password=ADMIN) as server:
        admin = redis.Redis.from_url(server.url)
        with open(tmp / "worker.log", "wb") as out:  # loads the model meanwhile
            worker = spawn_worker(server.url, ["--model", MODEL, "--metrics-port", "0",
                                               "--calibrate", "off"], stdout=out, stderr=out)
        made = cli("acl", "--apply", "--role", "tenant", "--tenant", "acme", "--model", MODEL,
                   "--redis", server.url, env={"REDBATCH_ACL_TENANT_PASSWORD": "acme-pw"})
        assert made.returncode == 0, made.stderr
        tenant_url = url_of(made.stdout, "redbatch-tenant-acme").replace("***", "acme-pw")
        tenants = tmp / "tenants.toml"
        tenants.write_text(f'[tenants.acme]\nkey_sha256 = '
                           f'"{hashlib.sha256(KEY.encode()).hexdigest()}"\n'
                           f'redis_url = "{tenant_url}"\n')
        port, log = free_port(), tmp / "gateway.log"
        with open(log, "wb") as out:
            gateway = subprocess.Popen(
                [sys.executable, "-m", "redbatch.cli", "gateway", "--redis", server.url,
                 "--port", str(port), "--model", MODEL, "--tenants", str(tenants)],
                env=settings_free_env(), stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_worker_ready(server.url, KEYS, worker, timeout_s=180)
            url = f"http://127.0.0.1:{port}"
            _wait_http(url, gateway, log, 60)
            yield Stack(url, port, admin, log, server.url, tenants, worker)
        finally:
            gateway.terminate()
            gateway.wait(timeout=20)
            stop_worker(worker, timeout_s=20)
        assert ADMIN not in log.read_text() and "acme-pw" not in log.read_text()


def result(stack: Stack, rid: str, wait_s: float = 120) -> dict[str, Any]:
    """The job's result envelope, read as an admin (``acme:<rid>`` in Redis)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        raw = stack.admin.get(KEYS.result(f"acme:{rid}"))
        if raw is not None:
            found: dict[str, Any] = msgpack.unpackb(raw)
            return found
        time.sleep(0.05)
    raise AssertionError(f"no result for {rid}")


def post(stack: Stack, path: str, body: dict[str, Any],
         headers: dict[str, str] | None = None) -> http.client.HTTPResponse:
    """A request whose response is read by the caller (a stream), on its own connection."""
    conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=120)
    conn.request("POST", path, json.dumps(body), {
        "Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **(headers or {})})
    return conn.getresponse()


def sse(response: http.client.HTTPResponse, events: int | None = None) -> list[dict[str, str]]:
    """The events of an SSE response (each {id, event, data}), ``events`` of them at most,
    read as a browser's EventSource reads them."""
    found: list[dict[str, str]] = []
    event: dict[str, str] = {}
    while events is None or len(found) < events:
        line = response.readline()
        if not line:
            break
        text = line.decode().rstrip("\n")
        if text.startswith(":"):
            continue  # a comment (a keep-alive): EventSource skips it
        if not text:
            if event:
                found.append(event)
            event = {}
            continue
        name, _, value = text.partition(":")
        event[name] = event.get(name, "") + value.removeprefix(" ")
    return found


def chat_text(events: list[dict[str, str]]) -> str:
    return "".join(json.loads(e["data"])["choices"][0]["delta"].get("content") or ""
                   for e in events if e.get("data", "[DONE]") != "[DONE]"
                   and json.loads(e["data"])["choices"])


def test_openai_chat_answers_as_the_reference_streamed_or_not(stack: Stack) -> None:
    client = stack.openai()
    case = GOLDEN["cases"][0]
    n = 12
    whole = client.chat.completions.create(model=MODEL, messages=case["messages"],
                                           max_tokens=n, temperature=0)
    choice = whole.choices[0]
    assert case["output_text"].startswith(choice.message.content) and choice.message.content
    assert choice.finish_reason in ("length", "stop") and choice.message.role == "assistant"
    assert whole.usage is not None and whole.usage.completion_tokens <= n
    assert whole.usage.prompt_tokens == len(case["input_ids"])
    assert whole.id.startswith(f"{MODEL}:")
    deltas, finish, usage = [], None, None
    for part in client.chat.completions.create(
            model=MODEL, messages=case["messages"], max_tokens=n, temperature=0, stream=True,
            stream_options={"include_usage": True}):
        if part.choices:
            deltas.append(part.choices[0].delta.content or "")
            finish = part.choices[0].finish_reason or finish
        usage = part.usage or usage
    assert "".join(deltas) == choice.message.content and len(deltas) >= 3
    assert finish == choice.finish_reason
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_openai_completions_take_a_raw_prompt(stack: Stack) -> None:
    client = stack.openai()
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    assert "Paris" in whole.choices[0].text
    streamed = "".join(p.choices[0].text for p in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True) if p.choices)
    assert streamed == whole.choices[0].text


def test_a_dropped_stream_resumes_with_last_event_id(stack: Stack) -> None:
    body = {"model": MODEL, "messages": COUNT, "max_tokens": 60, "temperature": 0,
            "stream": True}
    first = post(stack, "/v1/chat/completions", body, {"X-Redbatch-On-Disconnect": "keep"})
    assert first.status == 200 and first.headers["content-type"].startswith("text/event-stream")
    seen = sse(first, 3)  # the role, then two chunks; then the connection drops
    first.close()
    rid = first.headers["x-request-id"].split(":", 1)[1]
    again = post(stack, "/v1/chat/completions", body, {"Last-Event-ID": seen[-1]["id"]})
    rest = sse(again)
    assert rest[-1]["data"] == "[DONE]"
    indexes = [int(e["id"].rsplit("/", 1)[1]) for e in seen + rest if "id" in e]
    assert indexes == list(range(len(indexes)))  # 0 (the role), then 1..n: no gap, no repeat
    whole = result(stack, rid)["output"]
    assert chat_text(seen + rest) == whole["text"]
    # From the role's own event: the chunks, not the role again.
    again = post(stack, "/v1/chat/completions", body, {"Last-Event-ID": seen[0]["id"]})
    assert [int(e["id"].rsplit("/", 1)[1]) for e in sse(again) if "id" in e] == indexes[1:]
    # An empty Last-Event-ID (an EventSource before its first event) is a new stream.
    fresh = sse(post(stack, "/v1/chat/completions", {**body, "max_tokens": 4},
                     {"Last-Event-ID": ""}))
    assert json.loads(fresh[0]["data"])["choices"][0]["delta"]["role"] == "assistant"
    assert json.loads(rest[-2]["data"])["choices"][0]["finish_reason"] == whole["finish_reason"]
    # Any reader, from any point: the native events of the same job, after chunk 2.
    conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=60)
    conn.request("GET", f"/v1/jobs/{MODEL}:{rid}/events?after=2",
                 headers={"Authorization": f"Bearer {KEY}"})
    native = sse(conn.getresponse())
    assert [int(e["id"].rsplit("/", 1)[1]) for e in native] == list(
        range(3, 3 + len(native)))
    assert whole["text"].endswith("".join(json.loads(e["data"])["text"] for e in native))
    assert json.loads(native[-1]["data"])["finish_reason"] == whole["finish_reason"]


def test_curl_streams_server_sent_events(stack: Stack) -> None:
    out = subprocess.run(
        ["curl", "-sSN", "-H", f"Authorization: Bearer {KEY}", "-H",
         "Content-Type: application/json", "-d", json.dumps(
             {"model": MODEL, "messages": COUNT, "max_tokens": 8, "stream": True,
              "temperature": 0}), f"{stack.url}/v1/chat/completions"],
        capture_output=True, text=True, timeout=120, check=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 3
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_a_client_that_leaves_stops_its_job(stack: Stack) -> None:
    rid = uuid.uuid4().hex
    streamed = post(stack, "/v1/chat/completions",
                    {"model": MODEL, "messages": LONG, "max_tokens": 1000, "stream": True},
                    {"X-Request-Id": rid})
    assert len(sse(streamed, 2)) == 2
    streamed.close()
    out = result(stack, rid)
    assert out["status"] == "ok" and out["output"]["finish_reason"] == "cancelled"
    assert out["output"]["completion_tokens"] < 200
    # Not streamed: the client's socket closes while it waits.
    rid = uuid.uuid4().hex
    with socket.create_connection(("127.0.0.1", stack.port), timeout=30) as s:
        body = json.dumps({"model": MODEL, "messages": LONG, "max_tokens": 1000}).encode()
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                  b"Authorization: Bearer " + KEY.encode() + b"\r\nX-Request-Id: " +
                  rid.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: " +
                  str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 60
        while not stack.admin.exists(KEYS.tokens(f"acme:{rid}")):
            assert time.monotonic() < deadline, "the job never started"
            time.sleep(0.05)
    out = result(stack, rid)
    assert out["status"] == "ok" and out["output"]["finish_reason"] == "cancelled"
    # One that asked to keep its job gets the whole answer written all the same.
    rid = uuid.uuid4().hex
    kept = post(stack, "/v1/completions", {"model": MODEL, "prompt": "Once upon a time",
                                           "max_tokens": 24, "stream": True},
                {"X-Request-Id": rid, "X-Redbatch-On-Disconnect": "keep"})
    assert len(sse(kept, 1)) == 1
    kept.close()
    assert result(stack, rid)["output"]["finish_reason"] == "length"


@pytest.mark.parametrize(("body", "status", "code"), [
    ({"model": MODEL, "messages": COUNT, "n": 2}, 400, "bad_input"),
    ({"model": MODEL, "messages": COUNT, "logprobs": True}, 400, "bad_input"),
    ({"model": MODEL, "messages": COUNT, "tools": [{"type": "function"}]}, 400, "bad_input"),
    ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "bad_input"),
    ({"model": MODEL, "messages": COUNT, "colour": "red"}, 400, "bad_input"),
    # Checked by the worker as it reads the job: still an HTTP error, streamed or not.
    ({"model": MODEL, "messages": COUNT, "max_tokens": 5000}, 400, "bad_input"),
    ({"model": MODEL, "messages": COUNT, "max_tokens": 5000, "stream": True}, 400, "bad_input"),
    ({"model": "no_such_model", "messages": COUNT}, 404, "not_found"),
])
def test_refusals_are_http_errors_with_the_protocol_code(
        stack: Stack, body: dict[str, Any], status: int, code: str) -> None:
    response = post(stack, "/v1/chat/completions", body)
    assert response.status == status
    assert json.loads(response.read())["error"]["code"] == code
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{stack.url}/v1", api_key="sk-wrong", max_retries=0)\
            .chat.completions.create(model=MODEL, messages=COUNT)  # type: ignore[arg-type]


def test_a_stream_kept_waiting_is_kept_alive_and_then_answered(stack: Stack,
                                                              tmp_path: Path) -> None:
    """A gateway with --sse-keepalive-s 0.2, and the worker paused (SIGSTOP) so that the
    job waits unread: the response starts within about that long, with comment lines
    (``: keep-alive``) every 0.2 s while no chunk comes, which proxies see as traffic and
    EventSource readers skip; once the worker goes on, the answer follows in the same
    stream, and the job's native events read back the same chunks."""
    port, log = free_port(), tmp_path / "gateway.log"
    with open(log, "wb") as out:
        gateway = subprocess.Popen(
            [sys.executable, "-m", "redbatch.cli", "gateway", "--redis", stack.redis_url,
             "--port", str(port), "--model", MODEL, "--tenants", str(stack.tenants),
             "--sse-keepalive-s", "0.2"],
            env=settings_free_env(), stdout=out, stderr=subprocess.STDOUT)
    quiet = Stack(f"http://127.0.0.1:{port}", port, stack.admin, log, stack.redis_url,
                  stack.tenants, stack.worker)
    try:
        _wait_http(quiet.url, gateway, log, 60)
        os.kill(stack.worker.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            response = post(quiet, "/v1/chat/completions",
                            {"model": MODEL, "messages": COUNT, "max_tokens": 8,
                             "stream": True})
            assert response.status == 200, response.read()
            assert time.monotonic() - started < 5
            assert [response.readline() for _ in range(4)] == [b": keep-alive\n", b"\n"] * 2
        finally:
            os.kill(stack.worker.pid, signal.SIGCONT)
        found = sse(response)
        assert found[-1]["data"] == "[DONE]" and "error" not in {e.get("event") for e in found}
        assert chat_text(found), found
        job = response.getheader("X-Request-Id")
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("GET", f"/v1/jobs/{job}/events", headers={"Authorization": f"Bearer {KEY}"})
        native = sse(conn.getresponse())
        assert "".join(json.loads(e["data"])["text"] for e in native) == chat_text(found)
    finally:
        gateway.terminate()
        gateway.wait(timeout=20)


def test_a_lane_at_its_token_bound_is_a_429(stack: Stack) -> None:
    """A chat request whose charge does not fit under the lane's token bound is refused at
    once, 429 queue_full with Retry-After, as the tenant's own user (its ACL holds what the
    admission function runs for a token bound); nothing is queued."""
    field = token_bound_field(Lane.INTERACTIVE)
    stack.admin.hset(KEYS.limits(), field, 50)
    try:
        queued = stack.admin.xlen(KEYS.stream(Lane.INTERACTIVE))
        response = post(stack, "/v1/chat/completions",
                        {"model": MODEL, "messages": COUNT, "max_tokens": 8, "stream": True})
        assert response.status == 429 and response.getheader("Retry-After") == "1"
        error = json.loads(response.read())["error"]
        assert error["code"] == "queue_full" and "50 tokens" in error["message"], error
        assert stack.admin.xlen(KEYS.stream(Lane.INTERACTIVE)) == queued
    finally:
        stack.admin.hdel(KEYS.limits(), field)
