"""A client that follows PROTOCOL.md literally is right the first time.

It speaks raw RESP over a socket (no redis-py, so no library strips or maps an error
reply), takes the function library (assembled as the page says), the admission
function's call line, the key patterns, the
owner-TTL formula and the limits from PROTOCOL.md itself, builds calls of one job and of
many from that line, and checks every reply exactly as the page's two reply tables say it
arrives (the array of elements; the one error for a whole call), and that a refusal adds
nothing; then it submits a real photo to a real worker and decodes the result as the page
describes.
"""

from __future__ import annotations

import functools
import re
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import msgpack
import pytest
import redis
from conftest import CAT_LABELS, SAMPLES, TEST_MODEL, WorkerFactory
from redbatch.cli.redis_server import RedisServer

DOC = (Path(__file__).resolve().parent.parent / "PROTOCOL.md").read_text()
TEXT = " ".join(DOC.split())  # the page's prose with its line breaks undone
PREFIX = "redbatch"
MODEL_KEYS = f"{PREFIX}:{{{TEST_MODEL}}}"  # what P:{M} stands for here
LANES = ("interactive", "bulk")
TIMINGS = {"queue_ms", "preprocess_ms", "batch_wait_ms", "inference_ms", "total_ms"}


# ------------------------------------------------------------------ what the page says


def _page_tables(heading: str) -> list[list[list[str]]]:
    """The tables of the section under ``heading`` (up to the next heading): each its rows
    but the header, as cells without their backticks."""
    section = DOC.split(heading, 1)[1].split("\n#", 1)[0]
    tables: list[list[list[str]]] = []
    in_table = False
    for line in section.splitlines():
        if line.startswith("| ") and not in_table:
            tables.append([])
        in_table = line.startswith("| ")
        if in_table and not line.startswith("| ---"):
            tables[-1].append([cell.strip().strip("`") for cell in line.strip("|").split(" | ")])
    return [rows[1:] for rows in tables]


def _page_table(heading: str) -> list[list[str]]:
    """Rows of the first table under ``heading``."""
    return _page_tables(heading)[0]


def _found(pattern: str, text: str = TEXT, flags: int = re.M) -> str:
    match = re.search(pattern, text, flags)
    assert match is not None, f"PROTOCOL.md no longer says {pattern!r}"
    return match.group(1) if match.groups() else match.group(0)


SCRIPTS = {m.group(1): m.group(0)[len("```lua\n"):-3] for m in re.finditer(
    r"```lua\n-- redbatch (\w+) script.*?```", DOC, re.S)}
#: The library: the page's frame, each ``<the ... script>`` line that script's text.
LIBRARY = re.sub(r"^<the (\w+) script>", lambda m: SCRIPTS[m.group(1)],
                 _found(r"```lua\n(#!lua name=.*?)```", DOC, re.S), flags=re.M)
LIBRARY_NAME = _found(r"^#!lua name=(\S+)$", LIBRARY)
CALL = _found(r"^FCALL \S+_admit .*$", DOC)
FUNCTION = CALL.split()[1]
KEY_PATTERNS = [row[0] for row in _page_table("## Keys")]
TTL_PAD_MS = int(_found(r"`max\(0, deadline_ms - submitted_ms\) \+ (\d+)`"))
NO_DEADLINE_TTL_MS = int(_found(r"`(\d+)` for a job without one"))
TTL_DIGITS = int(_found(r"positive integer of at most (\d+) digits, written in decimal"))
CHARGE_DIGITS = int(_found(r"`<charge>` is .*?: a non-negative integer of at most (\d+) digits"))
(RID_CHARS,) = (int(_found(r"^1–(\d+) characters", row[1]))
                for row in _page_table("## Names") if row[0] == "request id")
(NAME_CHARS,) = (int(_found(r"^1–(\d+) characters", row[1]))
                 for row in _page_table("## Names") if row[0] == "model name")
#: The envelope keys every job carries (the page's table less its two optional ones).
ENVELOPE_KEYS = {row[0] for row in _page_table("### Job envelope")} - {"reply_to", "done_only"}
REPLIES = "#### Replies, as they arrive"
ELEMENT_TABLE, CALL_ERROR_TABLE = _page_tables(REPLIES)
ELEMENT_FORMS = [row[0] for row in ELEMENT_TABLE]  # an element of the array reply
CALL_ERROR_FORMS = [row[0] for row in CALL_ERROR_TABLE]  # one error for the whole call
(MAX_JOBS,) = (int(_found(r"N from 1 to ([\d,]+)", row[1]).replace(",", ""))
               for row in CALL_ERROR_TABLE if row[0].startswith("-BAD_CALL "))


def page_error(forms: list[str], code: str, **values: str | int | float) -> Error:
    """The error reply the page's table gives for ``code``, its ``<placeholders>`` filled."""
    (form,) = [f for f in forms if f.startswith(f"-{code} <")]
    text = re.sub(r"<(\w+)>", lambda m: str(values.pop(m.group(1))), form[1:])
    assert not values, f"the page's {form!r} has no place for {values}"
    return Error(text)


def is_entry_id(element: Any) -> bool:
    """The page's admitted element: a bulk string, e.g. 1712345678901-0."""
    example = _found(r"^a bulk string, e\.g\. `?(\d+-\d+)`?$", ELEMENT_FORMS[0])
    assert re.fullmatch(r"\d+-\d+", example)
    return isinstance(element, bytes) and re.fullmatch(rb"\d+-\d+", element) is not None


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
    assert ENVELOPE_KEYS <= set(body), ENVELOPE_KEYS - set(body)
    ttl = NO_DEADLINE_TTL_MS if deadline_ms is None else \
        max(0, deadline_ms - now) + TTL_PAD_MS
    return msgpack.packb(body, use_bin_type=True), ttl


@dataclass(frozen=True)
class Job:
    """One job of an admission call: what the call line's per-job placeholders stand for."""

    rid: str
    body: bytes
    ttl: int | str
    charge: int | str = 0


def job(rid: str, lane: str = "bulk", payload: bytes = b"x", *, ttl: int | str | None = None,
        charge: int | str = 0, **extra: Any) -> Job:
    """A job with the page's envelope (``lane`` is the envelope's) and, unless ``ttl`` says
    otherwise, the page's owner TTL; ``charge`` 0, the page's for any job but generation."""
    body, page_ttl = envelope(rid, payload, lane, **extra)
    return Job(rid, body, page_ttl if ttl is None else ttl, charge)


def owner(entry_id: bytes, lane: str = "bulk") -> bytes:
    """What the page says an admitted job's owner key holds: ``<entry id> <lane>``."""
    return entry_id + b" " + lane.encode()


# ------------------------------------------------------------------ raw RESP


@dataclass(frozen=True)
class Error:
    """An error reply, or an error element of an array reply, as it arrived after its '-'."""

    text: str


class Resp:
    """A RESP2 client over one socket: commands out, replies as they are."""

    def __init__(self, url: str) -> None:
        u = urlparse(url)
        self.sock = socket.create_connection((u.hostname or "127.0.0.1", u.port or 6379), 10)
        self.file = self.sock.makefile("rb")
        if u.password:
            user = [unquote(u.username)] if u.username else []
            assert self(b"AUTH", *user, unquote(u.password)) == "OK"

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


# ------------------------------------------------------------------ the page's call line


CALL_WORDS = re.findall(r"(?:[^\s<]|<[^>]*>)+", CALL)  # a <placeholder> is one word


def call_words(n: int) -> list[str]:
    """The page's call line for ``n`` jobs: each run of job 1's words, ``...``, the same
    words of job N, becomes the words of jobs 1 to n, in order."""
    words, out = list(CALL_WORDS), []
    while "..." in words:
        dots = words.index("...")
        start = dots
        while start > 0 and words[start - 1].endswith(" 1>"):
            start -= 1
        run = words[start:dots]
        last = words[dots + 1:dots + 1 + len(run)]
        assert run and last == [w.replace(" 1>", " N>") for w in run], CALL
        out += words[:start] + [w.replace(" 1>", f" {i}>") for i in range(1, n + 1)
                                for w in run]
        words = words[dots + 1 + len(run):]
    return out + words


def call_line(jobs: Sequence[Job], lane: str) -> list[bytes]:
    """The page's FCALL line for ``jobs`` of ``lane``, its placeholders filled in."""
    def value(m: re.Match[str]) -> str:
        name = m.group(1)
        if name == "lane":
            return lane
        if count := re.fullmatch(r"(\d+) \+ N", name):
            return str(int(count.group(1)) + len(jobs))
        if each := re.fullmatch(r"(request id|owner ttl ms|charge) (\d+)", name):
            one = jobs[int(each.group(2)) - 1]
            return {"request id": one.rid, "owner ttl ms": str(one.ttl),
                    "charge": str(one.charge)}[each.group(1)]
        raise AssertionError(f"a placeholder this client does not know: {m.group(0)}")

    def word(w: str) -> bytes:
        if envelope_of := re.fullmatch(r"<msgpack job envelope (\d+)>", w):
            return jobs[int(envelope_of.group(1)) - 1].body
        return re.sub(r"<([^>]*)>", value, w.replace("P:{M}", MODEL_KEYS)).encode()

    return [word(w) for w in call_words(len(jobs))]


def submit(resp: Resp, jobs: Sequence[Job], lane: str = "bulk") -> Any:
    """Send the page's call line for ``jobs``, word for word."""
    return resp(*call_line(jobs, lane))


def call_parts(jobs: Sequence[Job], lane: str = "bulk") -> tuple[list[bytes], list[bytes]]:
    """The keys and the arguments of the page's call line for ``jobs``."""
    words = call_line(jobs, lane)
    assert words[:2] == [b"FCALL", FUNCTION.encode()], words[:3]
    n = int(words[2])
    return words[3:3 + n], words[3 + n:]


def fcall(resp: Resp, keys: Sequence[bytes], args: Sequence[bytes]) -> Any:
    """A call of the function with these keys and arguments, well formed or not."""
    return resp(b"FCALL", FUNCTION, len(keys), *keys, *args)


def load(resp: Resp) -> None:
    assert resp(b"FUNCTION", b"LOAD", b"REPLACE", LIBRARY) == LIBRARY_NAME.encode()


def written(resp: Resp) -> list[Any]:
    """What any write of the script changes: the number of keys, and each lane's stream as
    XINFO STREAM shows it (length, last id, entries ever added, first and last entry)."""
    return [resp(b"DBSIZE"), *(resp(b"XINFO", b"STREAM", key("jobs", lane=lane))
                               for lane in LANES)]


def entries(resp: Resp, lane: str = "bulk") -> list[tuple[bytes, dict[bytes, bytes]]]:
    """The lane's stream: each entry's id and fields."""
    return [(entry_id, dict(zip(fields[::2], fields[1::2], strict=True)))
            for entry_id, fields in resp(b"XRANGE", key("jobs", lane=lane), b"-", b"+")]


def the_pages_entry(one: Job) -> dict[bytes, bytes]:
    """The fields the page gives an admitted entry: rid, job and adm (1)."""
    return {b"rid": one.rid.encode(), b"job": one.body, b"adm": b"1"}


# ------------------------------------------------------------------ the replies


def test_one_job_a_call_and_its_duplicate_arrive_as_the_page_says(resp: Resp) -> None:
    one = job("j1")
    # Before FUNCTION LOAD: not found, and nothing added. (Other tests' clients loaded the
    # library into this server; the Python client loads it again when it is missing.)
    resp(b"FUNCTION", b"DELETE", LIBRARY_NAME)
    before = written(resp)
    refused = submit(resp, [one])
    assert refused == Error("ERR Function not found"), refused
    assert written(resp) == before
    load(resp)

    reply = submit(resp, [one])
    assert isinstance(reply, list) and len(reply) == 1 and is_entry_id(reply[0]), reply
    (first,) = reply
    assert entries(resp) == [(first, the_pages_entry(one))]
    assert resp(b"GET", key("owner", "j1")) == owner(first)
    assert 0 < resp(b"PTTL", key("owner", "j1")) <= int(one.ttl)

    # The same id again: refused, and the script's XADD of it was taken out again.
    keys_before = resp(b"DBSIZE")
    assert submit(resp, [job("j1", payload=b"other")]) == [
        page_error(ELEMENT_FORMS, "DUPLICATE_REQUEST_ID", owner=first.decode())]
    assert resp(b"DBSIZE") == keys_before and entries(resp) == [(first, the_pages_entry(one))]
    assert resp(b"GET", key("owner", "j1")) == owner(first)


def test_several_jobs_in_one_call_get_one_element_each_in_order(resp: Resp) -> None:
    load(resp)
    earlier = job("k0")
    (k0,) = submit(resp, [earlier])
    jobs = [job("k1"), job("k2"), job("k0", payload=b"again"),
            job("k1", payload=b"twice in one call"), job("k3")]
    keys_before = resp(b"DBSIZE")
    reply = submit(resp, jobs)
    assert isinstance(reply, list) and len(reply) == len(jobs), reply
    k1, k2, taken_before, taken_in_this_call, k3 = reply
    assert all(is_entry_id(e) for e in (k1, k2, k3)), reply
    assert taken_before == page_error(ELEMENT_FORMS, "DUPLICATE_REQUEST_ID", owner=k0.decode())
    assert taken_in_this_call == page_error(ELEMENT_FORMS, "DUPLICATE_REQUEST_ID",
                                            owner=k1.decode())
    # Exactly the admitted jobs, in the order of the call; no duplicate's entry is left.
    assert entries(resp) == [(k0, the_pages_entry(earlier)), (k1, the_pages_entry(jobs[0])),
                             (k2, the_pages_entry(jobs[1])), (k3, the_pages_entry(jobs[4]))]
    for rid, entry_id in (("k0", k0), ("k1", k1), ("k2", k2), ("k3", k3)):
        assert resp(b"GET", key("owner", rid)) == owner(entry_id), rid
    assert resp(b"DBSIZE") == keys_before + 3, "an owner key for each admitted job, no more"


def test_an_owner_key_holding_something_else_is_named_with_a_question_mark(
        resp: Resp) -> None:
    load(resp)
    assert resp(b"SET", key("owner", "s1"), b"not an entry id") == "OK"
    assert resp(b"HSET", key("owner", "s2"), b"planted", b"1") == 1
    assert all(is_entry_id(e) for e in submit(resp, [job("s0")]))  # the stream exists
    before = (resp(b"DBSIZE"), entries(resp))
    unknown = page_error(ELEMENT_FORMS, "DUPLICATE_REQUEST_ID", owner="?")
    assert submit(resp, [job("s1"), job("s2")]) == [unknown, unknown]
    assert (resp(b"DBSIZE"), entries(resp)) == before
    assert resp(b"GET", key("owner", "s1")) == b"not an entry id"


def test_queue_full_counts_the_jobs_of_the_call_admitted_before_it(resp: Resp) -> None:
    load(resp)
    (q0,) = submit(resp, [job("q0")])
    assert resp(b"HSET", key("limits"), b"bulk", b"3") == 1
    keys_before = resp(b"DBSIZE")
    jobs = [job("q1"), job("q0", payload=b"dup"), job("q2"), job("q3"), job("q4")]
    q1, dup, q2, full3, full4 = submit(resp, jobs)
    assert is_entry_id(q1) and is_entry_id(q2), (q1, q2)
    # A duplicate is not admitted, so it takes no room.
    assert dup == page_error(ELEMENT_FORMS, "DUPLICATE_REQUEST_ID", owner=q0.decode())
    assert full3 == full4 == page_error(ELEMENT_FORMS, "QUEUE_FULL", bound=3)
    assert [entry_id for entry_id, _ in entries(resp)] == [q0, q1, q2]
    assert resp(b"EXISTS", key("owner", "q3"), key("owner", "q4")) == 0
    assert resp(b"DBSIZE") == keys_before + 2

    # The lane at its bound: every job of a call is refused, and nothing is added.
    before = written(resp)
    assert submit(resp, [job("q5")]) == [page_error(ELEMENT_FORMS, "QUEUE_FULL", bound=3)]
    assert written(resp) == before
    # Another lane has its own bound; 0 refuses every job.
    assert resp(b"HSET", key("limits"), b"interactive", b"0") == 1
    two = [job("i1", "interactive"), job("i2", "interactive")]
    assert submit(resp, two, "interactive") == [
        page_error(ELEMENT_FORMS, "QUEUE_FULL", bound=0)] * 2
    assert written(resp)[1:] == before[1:] and resp(b"XLEN", key("jobs", lane="interactive")) == 0
    # A field that is not a number: unbounded; no field: unbounded.
    assert resp(b"HSET", key("limits"), b"interactive", b"lots") == 0
    assert all(is_entry_id(e) for e in submit(resp, two, "interactive"))
    assert resp(b"HDEL", key("limits"), b"bulk") == 1
    assert all(is_entry_id(e) for e in submit(resp, [job("q3"), job("q4")]))


def test_a_fractional_bound_admits_while_the_lane_holds_fewer(resp: Resp) -> None:
    """The page: a job is admitted only while the stream holds fewer entries than the
    bound, and ``<bound>`` is the field as Lua prints it (``2.5``). With 2.5, the lane
    holds 0, 1, then 2 < 2.5 entries: three jobs are admitted, the fourth refused."""
    load(resp)
    assert resp(b"HSET", key("limits"), b"bulk", b"2.5") == 1
    reply = submit(resp, [job(f"f{i}") for i in range(4)])
    assert [is_entry_id(e) for e in reply[:3]] == [True] * 3, reply
    assert reply[3] == page_error(ELEMENT_FORMS, "QUEUE_FULL", bound=2.5), reply
    assert resp(b"XLEN", key("jobs", lane="bulk")) == 3


def test_a_call_at_the_pages_limits_is_admitted(resp: Resp) -> None:
    """N = the most a call takes, a request id of the most characters, an owner TTL of the
    most digits: all admitted, each with its owner key."""
    load(resp)
    longest = job("r" * RID_CHARS, ttl="9" * TTL_DIGITS)
    jobs = [longest, *(job(f"n{i}") for i in range(MAX_JOBS - 1))]
    reply = submit(resp, jobs)
    assert len(reply) == MAX_JOBS and all(is_entry_id(e) for e in reply), \
        [e for e in reply if not is_entry_id(e)][:3]
    assert resp(b"XLEN", key("jobs", lane="bulk")) == MAX_JOBS
    assert resp(b"GET", key("owner", longest.rid)) == owner(reply[0])
    assert resp(b"PTTL", key("owner", longest.rid)) > 10 ** (TTL_DIGITS - 1)
    assert resp(b"DBSIZE") == MAX_JOBS + 1


def _another(words: list[bytes], *, prefix: str = PREFIX, model: str = TEST_MODEL,
             at: int | None = None) -> list[bytes]:
    """``words`` with the keys of another prefix or model (only ``words[at]`` if given)."""
    other = f"{prefix}:{{{model}}}".encode()
    return [w.replace(MODEL_KEYS.encode(), other) if at in (None, i) else w
            for i, w in enumerate(words)]


SHAPE = f"expected 3 + N keys and 1 + 4N arguments, N from 1 to {MAX_JOBS}"
STREAM_OF_LANE = "KEYS[1] is not the stream of the lane"


@functools.cache
def _bad_calls() -> dict[str, tuple[list[bytes], list[bytes], str]]:
    """Malformed calls of the page's list, each (keys, arguments, the <what> of its
    BAD_CALL); built from two good jobs b1 and b2 of the bulk lane. The bad one is job 2
    where it can be, so job 1 being fine must not add it."""
    two = [job("b1"), job("b2")]
    k, a = call_parts(two)
    one_k, one_a = call_parts(two[:1])
    cases = {
        "N = 0 (the page's line without jobs)": (*call_parts([]), SHAPE),
        f"N = {MAX_JOBS + 1}": (*call_parts([job(f"m{i}") for i in range(MAX_JOBS + 1)]),
                                SHAPE),
        "the stream only": (k[:1], a[:1], SHAPE),
        "one argument missing": (k, a[:-1], SHAPE),
        "one argument more": (k, [*a, b"x"], SHAPE),
        "a job's arguments without its owner key": (k[:-1], a, SHAPE),
        # Keys past the jobs' owners are owner keys of the call's ids in other partitions:
        # job 2's owner key without job 2 is not one.
        "an owner key without its job's arguments": (
            k, a[:-4], f"KEYS[{len(k)}] is not an owner key of a job of the call"),
        "an earlier owner key of another id": (
            [*k, key("owner", "b3")], a,
            f"KEYS[{len(k) + 1}] is not an owner key of a job of the call"),
        "revision 2's call of one job": (
            one_k, [one_a[0], one_a[1], b"rid", one_a[2], b"job", one_a[4]], SHAPE),
        # Library version 1 (revision 6): no charges hash, no charge.
        "revision 6's call of two jobs": (
            [k[0], k[1], *k[3:]], [a[0], a[1], a[2], a[4], a[5], a[6], a[8]], SHAPE),
        "unknown lane": (k, [b"vip", *a[1:]], "unknown lane"),
        "the lane of another stream": (k, [b"interactive", *a[1:]], STREAM_OF_LANE),
        "a stream that is no lane's": ([b"x:{m}:queue", *k[1:]], a, STREAM_OF_LANE),
        "a prefix past the page's length": (
            _another(k, prefix="p" * (NAME_CHARS + 1)), a, STREAM_OF_LANE),
        "a model name past the page's length": (
            _another(k, model="m" * (NAME_CHARS + 1)), a, STREAM_OF_LANE),
        "the limits of another model": (_another(k, model="other", at=1), a,
                                        "KEYS[2] is not the limits hash"),
        "the charges of another model": (_another(k, model="other", at=2), a,
                                         "KEYS[3] is not the charges hash of the lane"),
        "the charges of the other lane": (
            [*k[:2], k[2].replace(b":bulk", b":interactive"), *k[3:]], a,
            "KEYS[3] is not the charges hash of the lane"),
        "the owner key of another model": (_another(k, model="other", at=3), a,
                                           "KEYS[4] is not the owner key of job 1"),
        "the owner key of another request id": ([*k[:4], key("owner", "zz")], a,
                                                "KEYS[5] is not the owner key of job 2"),
        "the owner keys in the other order": ([*k[:3], k[4], k[3]], a,
                                              "KEYS[4] is not the owner key of job 1"),
    }
    for charge in ("-1", "1.5", "", "1e3", "+5", " 5", "1" * (CHARGE_DIGITS + 1)):
        cases[f"charge {charge!r}"] = (*call_parts([two[0], job("b2", charge=charge)]),
                                       "charge of job 2 must be a non-negative integer")
    for rid in ("b2\n", "", "has space", "é", "r" * (RID_CHARS + 1)):
        cases[f"request id {rid[:8]!r}"] = (*call_parts([two[0], job(rid)]),
                                             "unusable request id of job 2")
    for ttl in ("-5", "0", "1e3", "1.5", "", "+5", " 5", "1" * (TTL_DIGITS + 1)):
        cases[f"owner TTL {ttl!r}"] = (*call_parts([two[0], job("b2", ttl=ttl)]),
                                       "owner TTL of job 2 must be a positive integer")
    cases["owner TTL of job 1"] = (*call_parts([job("b1", ttl="0"), two[1]]),
                                   "owner TTL of job 1 must be a positive integer")
    return cases


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_a_malformed_call_is_refused_as_a_whole_and_adds_nothing(resp: Resp,
                                                                 case: str) -> None:
    load(resp)
    assert all(is_entry_id(e) for e in submit(resp, [job("b0")]))  # the stream exists
    call_keys, args, what = _bad_calls()[case]
    before = written(resp)
    assert fcall(resp, call_keys, args) == page_error(CALL_ERROR_FORMS, "BAD_CALL",
                                                        what=what)
    assert written(resp) == before, "not even an entry added and taken out again"
    # Neither request id was taken: the two jobs, called right, are admitted.
    assert all(is_entry_id(e) for e in submit(resp, [job("b1"), job("b2")]))


@pytest.fixture
def acl_user(resp: Resp, redis_url: str) -> Iterator[Callable[..., Resp]]:
    """Makes ACL users (password ``pw``) with the given rules, and a connection as each."""
    made: list[tuple[str, Resp]] = []

    def make(*rules: str) -> Resp:
        name = f"literal-{len(made)}"
        assert resp(b"ACL", b"SETUSER", name, b"reset", b"on", b">pw", *rules) == "OK"
        u = urlparse(redis_url)
        conn = Resp(u._replace(netloc=f"{name}:pw@{u.hostname}:{u.port}").geturl())
        made.append((name, conn))
        return conn

    yield make
    for name, conn in made:
        conn.close()
        resp(b"ACL", b"DELUSER", name)


def test_a_user_who_may_not_run_the_scripts_commands_is_refused_and_adds_nothing(
        resp: Resp, acl_user: Callable[..., Resp]) -> None:
    """Redis 7 checks each command of a script as it runs; the script asks first, for
    every job, so a refusal comes before any write (and names what was refused)."""
    load(resp)
    assert all(is_entry_id(e) for e in submit(resp, [job("p0")]))
    stream, owner1, owner2 = key("jobs", lane="bulk"), key("owner", "p1"), key("owner", "p2")
    cases = [
        (("~*", "+@all", "-xdel"), f"this user may not XADD and XDEL {stream.decode()}"),
        (("~*", "+@all", "-set"), f"this user may not SET {owner1.decode()}"),
        # SET on job 1's owner key only (a selector): job 1 is fine, job 2 is refused.
        (("~*", "+@all", "-set", f"(+set ~{owner1.decode()})"),
         f"this user may not SET {owner2.decode()}"),
    ]
    for rules, what in cases:
        user = acl_user(*rules)
        before = written(resp)
        assert submit(user, [job("p1"), job("p2")]) == page_error(CALL_ERROR_FORMS, "NOPERM",
                                                                  what=what), rules
        assert written(resp) == before, rules
    # Redis itself refuses a user who may not call FCALL: "-NOPERM from Redis itself".
    user = acl_user("~*", "+@all", "-fcall")
    before = written(resp)
    refused = submit(user, [job("p1")])
    assert isinstance(refused, Error) and refused.text.startswith("NOPERM "), refused
    assert written(resp) == before
    assert all(is_entry_id(e) for e in submit(resp, [job("p1"), job("p2")]))


def test_wrongtype_and_oom_are_refused_before_the_first_write(resp: Resp) -> None:
    """The page's "any other error" row: Redis refused the call before the script's first
    write, so nothing was added."""
    load(resp)
    for planted, lane in ((key("jobs", lane="bulk"), "bulk"), (key("limits"), "interactive")):
        assert resp(b"SET", planted, b"another type") == "OK"
        before = written(resp)
        refused = submit(resp, [job("w1", lane), job("w2", lane)], lane)
        assert isinstance(refused, Error) and refused.text.startswith("WRONGTYPE "), refused
        assert written(resp) == before and resp(b"EXISTS", key("owner", "w1")) == 0
        assert resp(b"DEL", planted) == 1
    with RedisServer() as server:
        full = Resp(server.url)
        try:
            load(full)
            assert full(b"CONFIG", b"SET", b"maxmemory", b"1") == "OK"
            refused = submit(full, [job("o1"), job("o2")])
            assert isinstance(refused, Error) and refused.text.startswith("OOM "), refused
            assert full(b"DBSIZE") == 0
            assert full(b"CONFIG", b"SET", b"maxmemory", b"0") == "OK"
            assert all(is_entry_id(e) for e in submit(full, [job("o1"), job("o2")]))
        finally:
            full.close()


def test_redis_puts_err_before_a_script_error_without_a_space(resp: Resp) -> None:
    """Why every reply of the script is "CODE text" (the page says so)."""
    assert resp(b"EVAL", b"return redis.error_reply('DUPLICATE_REQUEST_ID')", 0) == \
        Error("ERR DUPLICATE_REQUEST_ID")
    assert resp(b"EVAL", b"return redis.error_reply('QUEUE_FULL 5')", 0) == \
        Error("QUEUE_FULL 5")
    # An error element of an array reply arrives as its text too.
    assert resp(b"EVAL", b"return {'1-0', {err = 'QUEUE_FULL 5'}}", 0) == \
        [b"1-0", Error("QUEUE_FULL 5")]


# ------------------------------------------------------------------ through a real worker


def wait(resp: Resp, rid: str, give_up_s: float = 60) -> dict[str, Any]:
    """The page's wait for a job of its own that names no reply list: BLPOP the done list a
    few whole seconds, which pops the result envelope (the very bytes of the result key);
    GET when a pop ends empty."""
    give_up = time.monotonic() + give_up_s
    while True:
        assert time.monotonic() < give_up, f"no result for {rid}"
        reply = resp(b"BLPOP", key("done", rid), 2)
        assert not isinstance(reply, Error), reply
        if reply is not None:
            raw = reply[1]
            assert raw == resp(b"GET", key("result", rid)), "the token is the result"
            break
        if (raw := resp(b"GET", key("result", rid))) is not None:
            break
    result: dict[str, Any] = msgpack.unpackb(raw, raw=False)
    assert set(result) == {row[0] for row in _page_table("### Result envelope")}
    assert result["v"] == 1 and result["id"] == rid and result["model"] == TEST_MODEL
    return result


def test_a_photo_and_refusals_through_a_real_worker(resp: Resp,
                                                    start_worker: WorkerFactory) -> None:
    start_worker()
    load(resp)
    cat = (SAMPLES / "cat.jpg").read_bytes()
    now = int(time.time() * 1000)
    photo = job("cat", "interactive", cat, deadline_ms=now + 60_000)
    bulk = [job("late", "bulk", cat, deadline_ms=now - 10**9),
            job("mislabelled", "interactive", cat),  # sent on the bulk stream below
            job("ppm", "bulk", b"P6\n1 1\n255\n\x00\x00\x00")]
    assert bulk[0].ttl == TTL_PAD_MS, "a deadline long past: budget 0"
    (cat_id,) = submit(resp, [photo], "interactive")
    bulk_ids = submit(resp, bulk, "bulk")  # three jobs, one call
    entry_ids = dict(zip(["cat", *(b.rid for b in bulk)], [cat_id, *bulk_ids], strict=True))
    assert all(is_entry_id(e) for e in entry_ids.values()), entry_ids

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
    for lane in LANES:
        assert resp(b"XLEN", key("jobs", lane=lane)) == 0
    # Workers leave the owner key alone when they answer: each id is still its entry's,
    # and, answered within its budget (or without a deadline), outlives its result.
    for rid, entry_id in entry_ids.items():
        lane = "interactive" if rid == "cat" else "bulk"  # the stream it was sent on
        assert resp(b"GET", key("owner", rid)) == owner(entry_id, lane), rid
    for rid in ("cat", "mislabelled", "ppm"):
        assert resp(b"PTTL", key("owner", rid)) >= resp(b"PTTL", key("result", rid)) > 0, rid


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
    load(resp)
    (cat_id,) = submit(resp, [job("cat", "interactive", (SAMPLES / "cat.jpg").read_bytes())],
                       "interactive")
    assert is_entry_id(cat_id), cat_id
    assert wait(resp, "cat")["status"] == "ok", "still serving"
    (_, fields), = resp(b"XRANGE", key("dlq"), b"-", b"+")
    record = dict(zip(fields[::2], fields[1::2], strict=True))
    assert record[b"rid"] == b"newline\n" and record[b"reason"].startswith(b"bad_request_id:")
    assert resp(b"EXISTS", key("result", "newline\n"), key("result", "newline")) == 0
