"""A client that follows PROTOCOL.md literally is right the first time.

It speaks raw RESP over a socket (no redis-py, so no library strips or maps an error
reply), takes the admission script, its call, the key patterns and the owner-TTL formula
from PROTOCOL.md itself, and checks every reply exactly as the page says it arrives; then
it submits a real photo to a real worker and decodes the result as the page describes.
"""

from __future__ import annotations

import hashlib
import re
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import msgpack
import pytest
import redis
from conftest import SAMPLES, TEST_MODEL, WorkerFactory

DOC = (Path(__file__).resolve().parent.parent / "PROTOCOL.md").read_text()
PREFIX = "redbatch"
CAT_LABELS = {"tabby", "tiger cat", "Egyptian cat", "Persian cat", "Siamese cat", "lynx"}
TIMINGS = {"queue_ms", "preprocess_ms", "batch_wait_ms", "inference_ms", "total_ms"}


# ------------------------------------------------------------------ what the page says


def _page_table(heading: str) -> list[list[str]]:
    """Rows of the first table under ``heading``, as cells without their backticks."""
    section = DOC.split(heading, 1)[1].split("\n#", 1)[0]
    rows = [line.strip("|").split(" | ") for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| ---")]
    return [[cell.strip().strip("`") for cell in row] for row in rows[1:]]


SCRIPT = re.search(r"```lua\n(.*?)```", DOC, re.S).group(1)  # type: ignore[union-attr]
CALL = re.search(r"^EVALSHA <sha1> .*$", DOC, re.M).group(0)  # type: ignore[union-attr]
KEY_PATTERNS = [row[0] for row in _page_table("## Keys")]
TTL_PAD_MS = int(re.search(r"`max\(0, deadline_ms - submitted_ms\) \+ (\d+)`",  # type: ignore[union-attr]
                           DOC).group(1))
NO_DEADLINE_TTL_MS = int(re.search(r"`(\d+)` for a job without one", DOC).group(1))  # type: ignore[union-attr]


def key(kind: str, rid: str = "", lane: str = "") -> bytes:
    """The page's key pattern whose third part is ``kind``, filled in."""
    (pattern,) = [k for k in KEY_PATTERNS if k.split(":")[2] == kind
                  and (not lane or k.endswith(lane))]
    filled = pattern.replace("P:", f"{PREFIX}:", 1).replace("{M}", f"{{{TEST_MODEL}}}")
    return re.sub(r":ID$", f":{rid}", filled).encode()


def envelope(rid: str, payload: bytes, lane: str, *, deadline_ms: int | None = None,
             **extra: Any) -> tuple[bytes, int]:
    """The msgpack job envelope of the page's table, and the owner TTL of the page."""
    now = int(time.time() * 1000)
    body = {"v": 1, "model": TEST_MODEL, "payload": payload, "content_type": "image/jpeg",
            "submitted_ms": now, "deadline_ms": deadline_ms, "lane": lane, "params": {},
            **extra}
    required = {row[0] for row in _page_table("### Job envelope")} - {"reply_to"}
    assert required <= set(body), required - set(body)
    ttl = NO_DEADLINE_TTL_MS if deadline_ms is None else \
        max(0, deadline_ms - now) + TTL_PAD_MS
    return msgpack.packb(body, use_bin_type=True), ttl


# ------------------------------------------------------------------ raw RESP


@dataclass(frozen=True)
class Error:
    """An error reply, as it arrived after its '-'."""

    text: str


class Resp:
    """A RESP2 client over one socket: commands out, replies as they are."""

    def __init__(self, url: str) -> None:
        u = urlparse(url)
        self.sock = socket.create_connection((u.hostname or "127.0.0.1", u.port or 6379), 10)
        self.file = self.sock.makefile("rb")
        if u.password:
            assert self(b"AUTH", unquote(u.password)) == "OK"

    def __call__(self, *args: bytes | str | int) -> Any:
        parts = [a if isinstance(a, bytes) else str(a).encode() for a in args]
        self.sock.sendall(b"*%d\r\n" % len(parts)
                          + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts))
        return self._reply()

    def _reply(self) -> Any:
        line = self.file.readline()
        kind, rest = line[:1], line[1:-2]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            return Error(rest.decode())
        if kind == b":":
            return int(rest)
        if kind == b"$":
            return None if rest == b"-1" else self.file.read(int(rest) + 2)[:-2]
        if kind == b"*":
            return None if rest == b"-1" else [self._reply() for _ in range(int(rest))]
        raise AssertionError(f"not RESP: {line!r}")

    def close(self) -> None:
        self.file.close()
        self.sock.close()


@pytest.fixture
def resp(redis_url: str, r: redis.Redis) -> Iterator[Resp]:  # r: flushed per test
    conn = Resp(redis_url)
    yield conn
    conn.close()


def submit(resp: Resp, rid: str, body: bytes, ttl: int | str, lane: str = "bulk") -> Any:
    """The page's EVALSHA line, with its placeholders filled in."""
    sha = hashlib.sha1(SCRIPT.encode()).hexdigest()
    line = (CALL.replace("<request id>", "{rid}").replace("<msgpack job envelope>", "{job}")
            .replace("<owner ttl ms>", "{ttl}").replace("<lane>", "{lane}")
            .replace("<sha1>", sha).replace("P:{M}", f"{PREFIX}:{{{{{TEST_MODEL}}}}}"))
    args = [body if word == "{job}" else
            word.format(rid=rid, ttl=ttl, lane=lane).encode() for word in line.split()]
    return resp(*args)


def nothing_added(resp: Resp, before: int) -> None:
    assert resp(b"DBSIZE") == before


# ------------------------------------------------------------------ the replies


def test_every_reply_arrives_as_the_page_says(resp: Resp) -> None:
    sha = hashlib.sha1(SCRIPT.encode()).hexdigest()
    body, ttl = envelope("j1", b"x", "bulk")
    # Before SCRIPT LOAD: NOSCRIPT, and nothing added. (Other tests' clients loaded the
    # script into this server; redis-py loads it again when it gets NOSCRIPT.)
    assert resp(b"SCRIPT", b"FLUSH") == "OK"
    refused = submit(resp, "j1", body, ttl)
    assert isinstance(refused, Error) and refused.text.startswith("NOSCRIPT "), refused
    nothing_added(resp, 0)
    assert resp(b"SCRIPT", b"LOAD", SCRIPT) == sha.encode()

    first = submit(resp, "j1", body, ttl)
    assert re.fullmatch(rb"\d+-\d+", first), first
    assert resp(b"XLEN", key("jobs", lane="bulk")) == 1
    assert resp(b"GET", key("owner", "j1")) == first
    assert 0 < resp(b"PTTL", key("owner", "j1")) <= ttl

    assert submit(resp, "j1", body, ttl) == Error(f"DUPLICATE_REQUEST_ID {first.decode()}")
    nothing_added(resp, 2)

    assert resp(b"HSET", key("limits"), b"bulk", b"1") == 1
    body2, ttl2 = envelope("j2", b"x", "bulk")
    assert submit(resp, "j2", body2, ttl2) == Error("QUEUE_FULL 1")
    nothing_added(resp, 3)
    assert resp(b"EXISTS", key("owner", "j2")) == 0
    assert resp(b"HDEL", key("limits"), b"bulk") == 1


@pytest.mark.parametrize("rid, ttl, lane", [
    ("j3", -5, "bulk"),           # a deadline long past, without the page's max(0, ...)
    ("j3", 0, "bulk"),
    ("j3", "1e3", "bulk"),
    ("j3\n", 1000, "bulk"),       # not a request id: matched whole
    ("j3", 1000, "vip"),
])
def test_a_bad_call_is_refused_with_bad_call_and_adds_nothing(
        resp: Resp, rid: str, ttl: int | str, lane: str) -> None:
    resp(b"SCRIPT", b"LOAD", SCRIPT)
    body, _ = envelope("j3", b"x", "bulk")
    reply = submit(resp, rid, body, ttl, lane)
    assert isinstance(reply, Error) and reply.text.startswith("BAD_CALL "), reply
    nothing_added(resp, 0)
    good = submit(resp, "j3", body, 1000)  # and the id is still free
    assert isinstance(good, bytes), good


def test_redis_puts_err_before_a_script_error_without_a_space(resp: Resp) -> None:
    """Why every reply of the script is "CODE text" (the page says so)."""
    assert resp(b"EVAL", b"return redis.error_reply('DUPLICATE_REQUEST_ID')", 0) == \
        Error("ERR DUPLICATE_REQUEST_ID")
    assert resp(b"EVAL", b"return redis.error_reply('QUEUE_FULL 5')", 0) == \
        Error("QUEUE_FULL 5")


# ------------------------------------------------------------------ through a real worker


def wait(resp: Resp, rid: str, give_up_s: float = 60) -> dict[str, Any]:
    """The page's wait: GET; else BLPOP the done list a few whole seconds; GET again."""
    give_up = time.monotonic() + give_up_s
    while (raw := resp(b"GET", key("result", rid))) is None:
        assert time.monotonic() < give_up, f"no result for {rid}"
        reply = resp(b"BLPOP", key("done", rid), 2)
        assert not isinstance(reply, Error), reply
    result: dict[str, Any] = msgpack.unpackb(raw, raw=False)
    assert set(result) == {row[0] for row in _page_table("### Result envelope")}
    assert result["v"] == 1 and result["id"] == rid and result["model"] == TEST_MODEL
    return result


def test_a_photo_and_refusals_through_a_real_worker(resp: Resp,
                                                    start_worker: WorkerFactory) -> None:
    start_worker()
    resp(b"SCRIPT", b"LOAD", SCRIPT)
    cat = (SAMPLES / "cat.jpg").read_bytes()
    now = int(time.time() * 1000)
    jobs = {  # rid: (envelope, ttl, stream lane)
        "cat": (*envelope("cat", cat, "interactive", deadline_ms=now + 60_000), "interactive"),
        "late": (*envelope("late", cat, "bulk", deadline_ms=now - 10**9), "bulk"),
        "mislabelled": (*envelope("mislabelled", cat, "interactive"), "bulk"),
        "ppm": (*envelope("ppm", b"P6\n1 1\n255\n\x00\x00\x00", "bulk"), "bulk"),
    }
    for rid, (body, ttl, lane) in jobs.items():
        assert isinstance(submit(resp, rid, body, ttl, lane), bytes)
    assert jobs["late"][1] == TTL_PAD_MS, "a deadline long past: budget 0"

    ok = wait(resp, "cat")
    assert ok["status"] == "ok" and ok["error"] is None, ok["error"]
    assert ok["output"]["label"] in CAT_LABELS and len(ok["output"]["top5"]) == 5
    assert set(ok["timings"]) == TIMINGS and ok["batch_size"] >= 1
    answers = {rid: wait(resp, rid) for rid in ("late", "mislabelled", "ppm")}
    codes = {rid: a["error"]["code"] for rid, a in answers.items()}
    assert codes == {"late": "expired", "mislabelled": "wrong_lane",
                     "ppm": "unsupported_format"}, answers
    # The page's timings rule: all five names after acceptance, none for a refused entry.
    assert set(answers["late"]["timings"]) == TIMINGS == set(answers["ppm"]["timings"])
    assert answers["mislabelled"]["timings"] == {}
    assert all(a["batch_size"] == 0 and a["output"] is None for a in answers.values())
    for lane in ("interactive", "bulk"):
        assert resp(b"XLEN", key("jobs", lane=lane)) == 0


def test_envelopes_past_the_pages_rules_are_answered_and_the_worker_serves_on(
        resp: Resp, start_worker: WorkerFactory) -> None:
    """Plain XADD, as the page allows: each breaks one rule of the page and gets the code
    the page gives it; an id with a newline is no id, so nobody is answered under it."""
    start_worker()
    stream = key("jobs", lane="interactive")
    deep, _ = envelope("deep", b"x", "interactive")
    deep = b"\x89" + deep[1:] + b"\xa5extra" + b"\x91" * 1100 + b"\xc0"  # one more key
    cases = {
        "newline-model": envelope("x", b"x", "interactive", model=f"{TEST_MODEL}\n")[0],
        "bin-param-key": envelope("x", b"x", "interactive", params={b"k": 1})[0],
        "long-content-type": envelope("x", b"x", "interactive", content_type="t" * 4097)[0],
        "deep": deep,
    }
    for rid, body in cases.items():
        assert isinstance(resp(b"XADD", stream, b"*", b"rid", rid, b"job", body), bytes)
    resp(b"XADD", stream, b"*", b"rid", b"newline\n", b"job", cases["bin-param-key"])
    answers = {rid: wait(resp, rid) for rid in cases}
    assert {rid: a["error"]["code"] for rid, a in answers.items()} == dict.fromkeys(
        cases, "bad_envelope")
    assert answers["deep"]["error"]["message"] == \
        "body nests arrays or maps deeper than 1024 levels"
    assert all(a["timings"] == {} for a in answers.values())
    cat, ttl = envelope("cat", (SAMPLES / "cat.jpg").read_bytes(), "interactive")
    resp(b"SCRIPT", b"LOAD", SCRIPT)
    assert isinstance(submit(resp, "cat", cat, ttl, "interactive"), bytes)
    assert wait(resp, "cat")["status"] == "ok", "still serving"
    (_, fields), = resp(b"XRANGE", key("dlq"), b"-", b"+")
    record = dict(zip(fields[::2], fields[1::2], strict=True))
    assert record[b"rid"] == b"newline\n" and record[b"reason"].startswith(b"bad_request_id:")
    assert resp(b"EXISTS", key("result", "newline\n"), key("result", "newline")) == 0
