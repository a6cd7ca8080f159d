"""Generation over Redis (PROTOCOL.md "Generation"): a real worker process serving the real
smollm2_135m, real Redis, real prompts. One worker for the module (loading the model costs
seconds); the takeover test starts a second one.

Greedy answers through Redis equal the reference's (tests/data/smollm2_golden.json); every
token stream holds each index once, in order; a reader that drops reads on with no gap and
no duplicate; a stop key cancels a running generation within a step; bad input is answered
with a stable code and the worker serves on; a worker SIGKILLed mid-generation loses
nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import redis
from deploy_files import (
    GENERATION_DASHBOARD,
    dashboard_queries,
    exposition_series,
    load_dashboards,
    metric_names,
)
from prometheus_client.parser import text_string_to_metric_families
from redbatch.cli.local_stack import spawn_worker, stop_worker, wait_worker_ready
from redbatch.common.protocol import GROUP, ErrorCode, JobEnvelope, Keys, Lane
from redbatch.common.protocol.generation import Chunk
from redbatch.producer.client import AsyncClient, Client, JobFailed, QueueFull, RedbatchError
from test_foreign_client import node_client, run_client  # noqa: F401
from test_redis_faults import wait_until

MODEL = "smollm2_135m"
KEYS = Keys(MODEL)
GOLDEN = json.loads((Path(__file__).parent / "data" / "smollm2_golden.json").read_text())
WAIT_S = 120


#: The module worker's /metrics address.
METRICS: dict[str, str] = {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(redis_url: str, log: Path, metrics_port: int = 0) -> Any:
    with open(log, "wb") as out:
        proc = spawn_worker(redis_url, ["--model", MODEL, "--metrics-port", str(metrics_port),
                                        "--calibrate", "off", "--reclaim-idle-ms", "1500"],
                            stdout=out, stderr=out)
    return proc


@pytest.fixture(scope="module")
def gen(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[redis.Redis]:
    """A client of the session's Redis with one generation worker serving the model."""
    r = redis.Redis.from_url(redis_url)
    r.flushall()
    log = tmp_path_factory.mktemp("gen") / "worker.log"
    port = free_port()
    METRICS["url"] = f"http://127.0.0.1:{port}"
    proc = _worker(redis_url, log, port)
    try:
        wait_worker_ready(redis_url, KEYS, proc)
        yield r
    finally:
        stop_worker(proc, timeout_s=20)
        if os.environ.get("REDBATCH_TEST_SHOW_LOGS"):
            print(log.read_text(errors="replace"))
        r.flushall()
        r.close()


def submit(r: redis.Redis, body: dict[str, Any] | bytes, rid: str | None = None) -> str:
    rid = rid or uuid.uuid4().hex
    payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    env = JobEnvelope(rid, MODEL, payload, "application/json", int(time.time() * 1000))
    r.xadd(KEYS.stream(Lane.INTERACTIVE), env.encode())  # type: ignore[arg-type]
    return rid


def result(r: redis.Redis, rid: str) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:  # short pops: the client's socket timeout is longer
        got = r.blpop([KEYS.done(rid)], 2)
        if got is not None:
            out: dict[str, Any] = msgpack.unpackb(got[1])
            return out
    raise AssertionError(f"no result for {rid}")


def read(r: redis.Redis, rid: str, after: str, count: int | None = None) -> list[Chunk]:
    """Chunks after id ``after`` (XREAD, blocking a little at a time)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        reply: Any = r.xread({KEYS.tokens(rid): after}, count=count, block=2000)
        if reply:
            return [Chunk.read(eid, f) for eid, f in reply[0][1]]
    raise AssertionError(f"no chunk after {after} for {rid}")


def chunks(r: redis.Redis, rid: str) -> list[Chunk]:
    return [Chunk.read(eid, f) for eid, f in r.xrange(KEYS.tokens(rid))]  # type: ignore[union-attr]


def check_stream(r: redis.Redis, rid: str, output: dict[str, Any]) -> list[Chunk]:
    """Indexes 1..n, each once; the chunks add up to the result; only the last ends it."""
    got = chunks(r, rid)
    assert [c.index for c in got] == list(range(1, len(got) + 1))
    assert [c.finish for c in got[:-1]] == [None] * (len(got) - 1)
    assert got[-1].finish == output["finish_reason"]
    assert "".join(c.text for c in got) == output["text"]
    assert [t for c in got for t in c.token_ids] == output["token_ids"]
    assert got[-1].completion_tokens == len(output["token_ids"])
    return got


def test_greedy_answers_through_redis_equal_the_reference(gen: redis.Redis) -> None:
    cases = GOLDEN["cases"][:4]
    n = 12  # the golden's first 12 tokens (of 24): the default run's time is short
    rids = [submit(gen, {"messages": c["messages"], "max_new_tokens": n})
            for c in cases]  # all at once: they share the running batch
    for case, rid in zip(cases, rids, strict=True):
        res = result(gen, rid)
        assert res["status"] == "ok", res
        out = res["output"]
        assert out["token_ids"] == case["output_ids"][:n]
        assert case["output_text"].startswith(out["text"]) and len(out["text"]) >= 10
        if len(case["output_ids"]) <= n:
            assert out["text"] == case["output_text"]
        assert out["prompt_tokens"] == len(case["input_ids"])
        check_stream(gen, rid, out)


def test_metrics_count_tokens_ttft_and_the_batch(gen: redis.Redis) -> None:
    """After the greedy answers: tokens, time to first token, steps and the KV cache are on
    /metrics, and the worker is ready."""
    rid = submit(gen, {"prompt": "The capital of France is", "max_new_tokens": 4})
    assert result(gen, rid)["status"] == "ok"
    with urllib.request.urlopen(METRICS["url"] + "/readyz", timeout=5) as reply:
        assert reply.status == 200
    with urllib.request.urlopen(METRICS["url"] + "/metrics", timeout=5) as reply:
        text = reply.read().decode()
    got = {s.name + "".join(f",{k}={v}" for k, v in sorted(s.labels.items()) if k != "model"):
           s.value for family in text_string_to_metric_families(text) for s in family.samples}
    assert got["redbatch_generated_tokens_total"] >= 4
    assert got["redbatch_time_to_first_token_seconds_count"] >= 1
    assert got["redbatch_inter_token_seconds_count"] >= 1
    assert got["redbatch_generation_steps_total"] >= 1
    assert got["redbatch_prompt_tokens_total,kind=computed"] >= 5
    assert got["redbatch_kv_blocks"] > 0
    assert got["redbatch_requests_total,lane=interactive,outcome=ok"] >= 1
    assert "redbatch_running_sequences" in got and "redbatch_kv_blocks_used" in got
    queries = dashboard_queries(load_dashboards()[GENERATION_DASHBOARD])
    series, _ = exposition_series(text)
    assert set().union(*map(metric_names, queries)) <= series


def test_a_dropped_reader_reads_on_with_no_gap_and_no_duplicate(gen: redis.Redis,
                                                                 redis_url: str) -> None:
    rid = submit(gen, {"prompt": "<|im_start|>user\nCount from one to twenty in words."
                                 "<|im_end|>\n<|im_start|>assistant\n", "max_new_tokens": 48})
    first = redis.Redis.from_url(redis_url)
    seen = read(first, rid, "0-0", count=2)
    first.close()  # the connection drops; another reader, another connection, reads on
    second = redis.Redis.from_url(redis_url)
    while seen[-1].finish is None:
        seen += read(second, rid, f"0-{seen[-1].index}")
    second.close()
    out = result(gen, rid)["output"]
    assert [c.index for c in seen] == list(range(1, len(seen) + 1))
    assert "".join(c.text for c in seen) == out["text"] and len(seen) >= 3


def test_a_stop_key_cancels_a_running_generation_within_a_step(gen: redis.Redis) -> None:
    rid = submit(gen, {"messages": [{"role": "user", "content": "Write a long story about "
                                     "a lighthouse keeper."}], "max_new_tokens": 1024})
    read(gen, rid, "0-0", count=1)
    gen.set(KEYS.stop(rid), "1", px=600_000)
    before = len(chunks(gen, rid))
    res = result(gen, rid)
    assert res["status"] == "ok" and res["output"]["finish_reason"] == "cancelled"
    got = check_stream(gen, rid, res["output"])
    # The worker reads stop keys in every step's round trip: one step computing, the next
    # cancelled (a chunk or two in flight), never the rest of 1024 tokens.
    assert len(got) - before <= 3, (before, len(got))
    assert len(res["output"]["token_ids"]) < 100


@pytest.mark.parametrize(("payload", "code"), [
    ({"prompt": "hi", "colour": "red"}, "bad_input"),                      # unknown field
    ({"prompt": "hi", "max_new_tokens": 5000}, "bad_input"),               # over the limit
    ({"prompt": "hi", "max_new_tokens": "8"}, "bad_input"),                # wrong type
    ({"prompt": "hi", "max_new_tokens": True}, "bad_input"),               # bool is no int
    ({"messages": [{"role": "robot", "content": "x"}]}, "bad_input"),
    ({"prompt": "hi", "messages": []}, "bad_input"),                       # both
    (b"\xff\xfe{not utf-8", "bad_input"),                                  # invalid UTF-8
    (b"[1, 2]", "bad_input"),                                              # not a map
    ({"prompt": "word " * 8000, "max_new_tokens": 1000}, "too_many_tokens"),  # past context
    (b"{" + b" " * 70_000 + b"}", "payload_too_large"),
])
def test_bad_input_gets_a_stable_code_and_the_worker_serves_on(
        gen: redis.Redis, payload: dict[str, Any] | bytes, code: str) -> None:
    rid = submit(gen, payload)
    res = result(gen, rid)
    assert res["status"] == "error" and res["error"]["code"] == code, res
    assert not gen.exists(KEYS.tokens(rid))
    ok = result(gen, submit(gen, {"prompt": "Hello", "max_new_tokens": 2}))
    assert ok["status"] == "ok"


CHAT = [{"role": "user", "content": "Count from one to ten in words."}]


def test_client_generate_and_a_stream_that_resumes_after_its_connection_drops(
        gen: redis.Redis, redis_url: str) -> None:
    with Client(redis_url, model=MODEL) as c:
        whole = c.generate(messages=CHAT, max_new_tokens=30)
        assert len(whole) > 20
        deltas = []
        conn_id = c.redis.client_id()
        for delta in c.stream(messages=CHAT, max_new_tokens=30):
            deltas.append(delta)
            if len(deltas) == 2:  # drop the client's connection under its stream
                gen.client_kill_filter(_id=conn_id)
        assert "".join(deltas) == whole and len(deltas) > 3
        with pytest.raises(JobFailed) as failed:
            c.generate("hi", max_new_tokens=5000)
        assert failed.value.code == "bad_input"
        with pytest.raises(JobFailed):
            list(c.stream("hi", max_new_tokens=5000))
        with pytest.raises(RedbatchError):
            c.generate("hi", colour="red")


def test_async_client_generates_and_streams(gen: redis.Redis, redis_url: str) -> None:
    async def both() -> tuple[str, list[str]]:
        async with AsyncClient(redis_url, model=MODEL) as c:
            whole = await c.generate(messages=CHAT, max_new_tokens=16)
            return whole, [d async for d in c.stream(messages=CHAT, max_new_tokens=16)]

    whole, deltas = asyncio.run(both())
    assert "".join(deltas) == whole and len(whole) > 10


def test_another_client_reads_on_from_an_index_and_stops_the_job(gen: redis.Redis,
                                                                   redis_url: str) -> None:
    """Resume and cancel from anywhere: a second client, which did not submit the job,
    reads its stream on from index 2, and stops it while it runs."""
    long = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
    with Client(redis_url, model=MODEL) as a, Client(redis_url, model=MODEL) as b:
        rid = a.submit(json.dumps({"messages": long, "max_new_tokens": 1024}),
                       content_type="application/json")
        seen = []
        for chunk in b.chunks(rid, after=2):
            seen.append(chunk)
            if len(seen) == 2:
                assert b.stop(rid) is False  # running: not cancelled in its queue
        res = a.result(rid, WAIT_S)
    assert res.output["finish_reason"] == "cancelled" == seen[-1].finish
    assert [c.index for c in seen] == list(range(3, 3 + len(seen)))
    assert res.output["text"].endswith("".join(c.text for c in seen))
    assert len(res.output["token_ids"]) < 200
    # Stopped as soon as it is submitted: cancelled in its queue, or, when the idle worker
    # read it first, at its first steps (a long answer: it cannot end first on its own).
    with Client(redis_url, model=MODEL) as c:
        rid = c.submit(json.dumps({"messages": long, "max_new_tokens": 1024}),
                       content_type="application/json")
        c.stop(rid)
        res = c.result(rid, WAIT_S)
    assert res.error_code is ErrorCode.CANCELLED or res.output["finish_reason"] == "cancelled"


def test_the_generate_command_streams_the_answer(gen: redis.Redis, redis_url: str) -> None:
    out = subprocess.run([sys.executable, "-m", "redbatch.cli", "generate", "--redis",
                          redis_url, "--max-new-tokens", "12",
                          "What is the capital of France?"],
                         capture_output=True, timeout=WAIT_S, check=True)
    assert out.stdout.decode() == "The capital of France is Paris.\n"


def test_score_answers_a_manifest_of_prompts(gen: redis.Redis, redis_url: str,
                                             tmp_path: Path) -> None:
    """``redbatch score`` over a JSONL of prompts (issue 31): one record a prompt, the
    greedy answers the reference's; a row with a field the protocol does not know is an
    error record (bad_input), counted in the summary, the run's exit 1 past the error rate."""
    cases = GOLDEN["cases"][:3]
    rows = [{"id": f"q{i}", "messages": c["messages"], "max_new_tokens": GOLDEN["max_new_tokens"]}
            for i, c in enumerate(cases)]
    rows.append({"id": "bad", "prompt": "Hello", "max_tokens": 5})
    manifest = tmp_path / "prompts.jsonl"
    manifest.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "answers.jsonl"

    def score(*args: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run([sys.executable, "-m", "redbatch.cli", "score", str(manifest),
                               "-o", str(out), "--redis", redis_url, "--model", MODEL, *args],
                              capture_output=True, timeout=WAIT_S)

    run = score("--max-error-rate", "0.5")
    assert run.returncode == 0, run.stderr.decode()
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(records) == {"q0", "q1", "q2", "bad"}
    for i, case in enumerate(cases):
        assert records[f"q{i}"]["status"] == "ok", records[f"q{i}"]
        assert records[f"q{i}"]["output"]["text"] == case["output_text"]
    assert records["bad"]["error"]["code"] == "bad_input", records["bad"]
    assert "bad_input: 1" in run.stderr.decode()
    out.unlink()
    assert score("--max-error-rate", "0").returncode == 1


def test_a_node_client_written_from_the_page_streams_an_answer(
        gen: redis.Redis, redis_url: str, request: pytest.FixtureRequest) -> None:
    """The Node client (tests/clients/node/submit.mjs, written from PROTOCOL.md alone)
    admits a chat job through the page's admission function, reads its token stream two
    entries a read (bounded XREAD BLOCK, on from the last id) until the entry with
    ``finish``, then waits for the result as for any job: it printed the result's text and
    tokens, chunk by chunk, and 12 tokens end ``length``. A job with no stream ends the
    read at its result."""
    script: Path = request.getfixturevalue("node_client")  # test_foreign_client's: npm ci
    rid = f"node-{uuid.uuid4().hex}"
    out = run_client(script, redis_url, "--stream", CHAT[0]["content"], MODEL,
                     "--max-new-tokens=12", "--count=2", f"--rid={rid}")
    assert (out["id"], out["status"], out["error_code"]) == (rid, "ok", None), out
    output, stream = out["result"]["output"], out["stream"]
    assert out["finish_reason"] == output["finish_reason"] == stream["finish"] == "length"
    assert stream["text"] == output["text"] and len(output["text"]) >= 10, out
    assert stream["tokens"] == output["token_ids"] and len(stream["tokens"]) == 12
    assert (stream["prompt_tokens"], stream["completion_tokens"]) == (
        output["prompt_tokens"], 12)
    n = len(stream["entries"])
    assert stream["entries"] == [f"0-{i}" for i in range(1, n + 1)], stream
    assert stream["reads"] >= (n + 1) // 2  # at most two entries a read
    check_stream(gen, rid, output)  # what it read is the whole stream
    assert gen.get(KEYS.owner(rid)).split()[1] == b"interactive"  # admitted by the page's call
    # A job refused as it was read has no stream: the client finds its result instead.
    bad = run_client(script, redis_url, "--stream", "hi", MODEL, "--max-new-tokens=5000")
    assert (bad["status"], bad["error_code"], bad["finish_reason"]) == ("error", "bad_input",
                                                                       None), bad
    assert (bad["stream"]["entries"], bad["stream"]["finish"]) == ([], None), bad


def test_a_token_bound_refuses_at_once_and_answered_jobs_free_their_charge(
        gen: redis.Redis, redis_url: str, request: pytest.FixtureRequest) -> None:
    """With a token bound on the lane, the charges of queued and running generations are
    recorded by the admission function and deleted by the worker with each answer; a job
    that does not fit is refused at once (queue_full), from Python and from the Node
    client written from the page (TOKENS_FULL), and nothing of it is queued."""
    script: Path = request.getfixturevalue("node_client")
    charges = KEYS.charges(Lane.INTERACTIVE)
    story = {"prompt": "Tell me a long story:", "max_new_tokens": 600}
    story_charge = len(json.dumps(story, separators=(",", ":"))) + 600
    with Client(redis_url, model=MODEL) as c:
        c.set_token_limit(Lane.INTERACTIVE, 1_500)
        try:
            assert c.generate(messages=CHAT, max_new_tokens=8)
            assert "".join(c.stream("Say hello.", max_new_tokens=4))
            long = c.submit(story, timeout_s=120)
            assert gen.xread({KEYS.tokens(long): "0-0"}, count=1, block=60_000)  # running
            wait_until(lambda: [int(v) for v in gen.hvals(charges) if v.isdigit()]
                       == [story_charge], 30, "the answered two to free their charges")
            with pytest.raises(QueueFull) as full:  # about 1,100 do not fit in 1,500 - 655
                c.generate("Hi", max_new_tokens=1_024)
            assert full.value.tokens and full.value.bound == 1_500
            refused = run_client(script, redis_url, "--stream", "x" * 1_000, MODEL,
                                 "--max-new-tokens=1000", rc=3)
            assert refused["admit_code"] == "TOKENS_FULL", refused
            assert refused["admit_error"] == "TOKENS_FULL 1500"
            gen.set(KEYS.stop(long), "1", px=60_000)
            assert c.result(long, timeout_s=60).raise_for_error().output[
                "finish_reason"] == "cancelled"
            wait_until(lambda: set(gen.hkeys(charges)) <= {b"recounted", b"total"}, 30,
                       "every answer to free its own charge")
        finally:
            c.set_token_limit(Lane.INTERACTIVE, None)
        # A charges key planted with another type fails only the worker's HDEL: the answer
        # is written all the same, and the worker serves on.
        gen.delete(charges)
        gen.set(charges, "planted")
        try:
            assert c.generate("Say hi.", max_new_tokens=3)
            assert c.generate("Say bye.", max_new_tokens=3)
        finally:
            gen.delete(charges)


def _holder(r: redis.Redis, rid: str) -> str | None:
    """The consumer holding the job of ``rid`` (its pending entry), if any."""
    for lane in Lane:
        for row in r.xpending_range(KEYS.stream(lane), GROUP, "-", "+", 100):
            entry = r.xrange(KEYS.stream(lane), row["message_id"], row["message_id"])
            if entry and entry[0][1][b"rid"].decode() == rid:
                return str(row["consumer"].decode())
    return None


def test_a_job_a_dead_worker_streamed_half_of_goes_on_from_the_next_index(
        gen: redis.Redis) -> None:
    """The cheap takeover: a consumer that read the job, streamed three chunks and died
    (it never comes back); the live worker takes the job over once it is idle, computes
    the prompt and those tokens again, and writes on from chunk 4."""
    case = GOLDEN["cases"][0]
    assert case["output_text"] == "The capital of France is Paris."
    rid = uuid.uuid4().hex
    body = {"messages": case["messages"], "max_new_tokens": GOLDEN["max_new_tokens"]}
    env = JobEnvelope(rid, MODEL, json.dumps(body).encode(), "application/json",
                      int(time.time() * 1000))
    stream = KEYS.stream(Lane.INTERACTIVE)
    pipe = gen.pipeline(transaction=True)  # no live worker can read it in between
    pipe.xadd(stream, env.encode())  # type: ignore[arg-type]
    pipe.xreadgroup(GROUP, "dead-0-gone", {stream: ">"}, count=1)
    pipe.execute()
    ids = case["output_ids"]  # The| capital| of| France| is| Paris|.|<|im_end|>
    streamed = [Chunk(1, ids[:2], "The capital"), Chunk(2, ids[2:3], " of"),
                Chunk(3, ids[3:5], " France is")]
    for c in streamed:
        gen.xadd(KEYS.tokens(rid), c.fields(), id=f"0-{c.index}")  # type: ignore[arg-type]
    res = result(gen, rid)
    assert res["status"] == "ok", res
    assert res["output"]["token_ids"] == ids
    assert res["output"]["text"] == case["output_text"]
    got = check_stream(gen, rid, res["output"])
    assert got[:3] == streamed and len(got) > 3


def test_a_worker_killed_mid_generation_loses_nothing(gen: redis.Redis, redis_url: str,
                                                       tmp_path: Path) -> None:
    case = GOLDEN["cases"][1]
    body = {"messages": case["messages"], "max_new_tokens": GOLDEN["max_new_tokens"]}
    second = _worker(redis_url, tmp_path / "second.log")
    try:
        wait_worker_ready(redis_url, KEYS, second, consumers_before=1)
        rid = submit(gen, body)
        read(gen, rid, "0-0", count=1)
        holder = _holder(gen, rid)
        assert holder is not None
        pid = int(holder.rsplit("-", 2)[1])
        os.kill(pid, signal.SIGKILL)
        res = result(gen, rid)
    finally:
        stop_worker(second, timeout_s=20)
    assert res["status"] == "ok", res
    assert res["worker"] != holder, "the job ended before the kill: nothing was taken over"
    assert res["output"]["token_ids"] == case["output_ids"]
    assert res["output"]["text"] == case["output_text"]
    check_stream(gen, rid, res["output"])
