"""gpu_worker/streams/tokens.py against a real Redis: each step's writes in one round trip,
with few commands a token. A stream's TTL is set at its first chunk, its last and when a
quarter of the TTL has passed (not at every chunk); the stop keys of a step are read with
one MGET per partition; a chunk index written twice is refused by Redis and counted. And the
client's side (producer/streaming.py): a stream that stopped short ends with the result."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import redis
from redbatch.common.protocol import Keys
from redbatch.common.protocol.generation import Chunk
from redbatch.gpu_worker.streams.tokens import TokenStreams

TTL_MS = 600_000


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def calls(r: redis.Redis) -> Counter[str]:
    info: Any = r.info("commandstats")
    return Counter({k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items()})


def test_ttl_is_set_at_the_first_and_last_chunk_and_when_due(r: redis.Redis) -> None:
    clock = Clock()
    streams = TokenStreams(r, "w1", TTL_MS, clock)
    key = Keys("chat").tokens("a")
    streams.write_step([(key, Chunk(1, [5], "a"))], [], {})
    assert 0 < r.pttl(key) <= TTL_MS
    r.persist(key)
    clock.now += 10
    streams.write_step([(key, Chunk(2, [6], "b"))], [], {})
    assert r.pttl(key) == -1, "renewed at every chunk"
    clock.now += TTL_MS / 4000
    streams.write_step([(key, Chunk(3, [7], "c"))], [], {})
    assert r.pttl(key) > 0, "not renewed after a quarter of its TTL"
    r.persist(key)
    streams.write_step([(key, Chunk(4, [], "", "stop"))], [], {})
    assert r.pttl(key) > 0, "the last chunk must leave the stream expiring"
    assert [c.index for c in (Chunk.read(i, f) for i, f in r.xrange(key))] == [1, 2, 3, 4]


def test_stop_keys_are_read_with_one_mget_a_partition(r: redis.Redis) -> None:
    streams = TokenStreams(r, "w1", TTL_MS, Clock())
    p0, p1 = Keys("chat"), Keys("chat", partition=1)
    stops = [p0.stop("a"), p0.stop("b"), p1.stop("c"), p0.stop("d")]
    r.set(p0.stop("b"), 1)
    r.set(p1.stop("c"), 1)
    r.rpush(p0.stop("d"), "a list, planted")
    before = calls(r)
    got = streams.write_step([(p0.tokens("a"), Chunk(1, [1], "x"))], stops, {})
    used = calls(r) - before
    assert got.stopped == {p0.stop("b"), p1.stop("c")}
    assert used["mget"] == 2 and used["get"] == 0
    assert used["xadd"] == 1 and used["pexpire"] == 1


def test_a_chunk_written_twice_is_refused_and_counted(r: redis.Redis) -> None:
    streams = TokenStreams(r, "w1", TTL_MS, Clock())
    key = Keys("chat").tokens("a")
    assert streams.write_step([(key, Chunk(1, [1], "x"))], [], {}).refused == 0
    again = TokenStreams(r, "w2", TTL_MS, Clock())  # a worker that took the job over
    got = again.write_step([(key, Chunk(1, [1], "x")), (key, Chunk(2, [2], "y"))], [], {})
    assert got.refused == 1
    assert r.xlen(key) == 2


def test_a_client_stream_that_stopped_short_ends_with_the_result(
        r: redis.Redis, redis_url: str) -> None:
    """PROTOCOL.md "Token stream": a stream can stop without its last chunk (its worker
    stopped past the point of recovery) while the job's result, written after every chunk,
    holds the whole answer. Client.stream read on until its timeout; now it yields the
    rest of the text from the result and ends."""
    from redbatch.common.protocol import GROUP, JobEnvelope, Lane, ResultEnvelope, Status
    from redbatch.common.protocol.functions import load_library
    from redbatch.producer.client import Client

    load_library(r)
    keys = Keys("chat")
    stream = keys.stream(Lane.INTERACTIVE)
    r.xgroup_create(stream, GROUP, id="0", mkstream=True)
    got: list[str] = []
    with Client(redis_url, model="chat") as client:
        reader = threading.Thread(target=lambda: got.extend(
            client.stream("Say hello", max_new_tokens=8, timeout_s=30)))
        reader.start()
        # The worker that stopped: it read the job, streamed two chunks, wrote the result.
        read: Any = []
        while not read:
            read = r.xreadgroup(GROUP, "gone", {stream: ">"}, count=1, block=100)
        entry_id, fields = read[0][1][0]
        rid = JobEnvelope.decode(fields, 1 << 20).request_id
        r.xadd(keys.tokens(rid), Chunk(1, [19556], "Hello").fields(), id="0-1")  # type: ignore[arg-type]
        r.xadd(keys.tokens(rid), Chunk(2, [28], "!").fields(), id="0-2")  # type: ignore[arg-type]
        time.sleep(0.3)  # the reader has read both, and waits on
        output = {"text": "Hello! How are you?", "finish_reason": "stop",
                  "token_ids": [19556, 28, 1073, 359, 346, 47], "prompt_tokens": 30,
                  "completion_tokens": 6, "cached_tokens": 0, "ttft_ms": 12.5}
        r.set(keys.result(rid), ResultEnvelope(rid, Status.OK, output, model="chat").encode())
        r.xack(stream, GROUP, entry_id)
        reader.join(timeout=20)
        assert not reader.is_alive(), "the reader waits on a stream that will never end"
    assert "".join(got) == "Hello! How are you?" and got[:2] == ["Hello", "!"], got
