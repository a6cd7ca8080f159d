"""The invariant check finds exactly the problems written into Redis by hand."""

from __future__ import annotations

import redis
from audit import audit, key_kind
from redbatch.common.protocol import GROUP, ErrorCode, Keys, ResultEnvelope, Status

TTL_MS = 60_000


def answer(r: redis.Redis, keys: Keys, rid: str, result: ResultEnvelope | None = None) -> None:
    """What a worker leaves for an answered job: its result and its done token, expiring."""
    result = result or ResultEnvelope(rid, Status.OK, output={"label": "cat"})
    r.set(keys.result(rid), result.encode(), px=TTL_MS)
    r.rpush(keys.done(rid), b"1")
    r.pexpire(keys.done(rid), TTL_MS)


def acknowledged_job(r: redis.Redis, keys: Keys) -> str:
    """A stream with its group whose only job was read and acknowledged."""
    stream = keys.streams()[0]
    r.xgroup_create(stream, GROUP, id="0", mkstream=True)
    r.xadd(stream, {"rid": "a", "job": b"x"})
    entries = r.xreadgroup(GROUP, "w1", {stream: ">"})
    r.xack(stream, GROUP, entries[0][1][0][0])
    return stream


def test_a_good_state_has_no_problems(r: redis.Redis, keys: Keys) -> None:
    acknowledged_job(r, keys)
    answer(r, keys, "a")
    answer(r, keys, "b", ResultEnvelope.error("b", ErrorCode.BAD_IMAGE, "not an image"))
    r.xadd(keys.dlq(), {"rid": "c"})  # a stream: needs no TTL
    assert audit(r, keys, {"a": None, "b": ErrorCode.BAD_IMAGE}) == []


def test_each_problem_is_reported_once(r: redis.Redis, keys: Keys) -> None:
    stream = acknowledged_job(r, keys)
    r.xadd(stream, {"rid": "p", "job": b"x"})
    r.xreadgroup(GROUP, "w1", {stream: ">"})  # read, never acknowledged
    answer(r, keys, "good")
    answer(r, keys, "failed", ResultEnvelope.error("failed", ErrorCode.EXPIRED, "too late"))
    answer(r, keys, "should-fail")
    answer(r, keys, "other-id", ResultEnvelope("someone-else", Status.OK))
    r.set(keys.result("garbled"), b"\xc1 not msgpack", px=TTL_MS)
    r.set("forever", b"1")
    expected = {"good": None, "missing": None, "failed": None, "other-id": None,
                "garbled": None, "should-fail": ErrorCode.BAD_IMAGE}
    problems = audit(r, keys, expected)
    garbled = [p for p in problems if p.startswith("garbled: ")]
    assert len(garbled) == 1 and "does not decode" in garbled[0]
    assert sorted(set(problems) - set(garbled)) == sorted([
        "missing: no result",
        "failed: outcome expired (too late), expected ok",
        "should-fail: outcome ok, expected bad_image",
        "other-id: result names request id 'someone-else'",
        f"{stream}: 1 entries pending in group {GROUP}",
        "b'forever' never expires",
    ])
    assert len(problems) == 7


def test_a_key_without_ttl_is_found_among_many(r: redis.Redis, keys: Keys) -> None:
    pipe = r.pipeline(transaction=False)
    for i in range(2500):  # more than one pipelined chunk
        pipe.set(keys.result(f"r{i}"), b"x", px=TTL_MS)
    pipe.execute()
    r.set(keys.done("r7"), b"1")
    assert audit(r, keys, {}) == [f"{keys.done('r7').encode()!r} never expires"]


def test_keys_are_sorted_by_family(keys: Keys) -> None:
    assert key_kind(keys, keys.result("x")) == "result"
    assert key_kind(keys, keys.done("x")) == "done"
    assert key_kind(keys, keys.owner("x")) == "owner"
    assert key_kind(keys, keys.reply("soak")) == "reply"
    assert {key_kind(keys, k) for k in (*keys.streams(), keys.dlq())} == {"stream"}
    assert {key_kind(keys, k) for k in (keys.limits(), keys.workers(), keys.recent())} == {"other"}
    assert key_kind(keys, Keys("other").result("x")) == "other"
