"""Token bounds (PROTOCOL.md "Admission control", issue 31): a lane's queued generation
jobs may be charged at most its ``<lane>:tokens`` bound, checked atomically at submit by
the admission function with a real Redis; a job past it is refused at once, queue_full.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import cast

import pytest
import redis
from redbatch.common.protocol import GROUP, Keys, Lane, token_bound_field
from redbatch.common.protocol.generation import (
    DEFAULT_MAX_NEW_TOKENS,
    MAX_PAYLOAD_BYTES,
    job_charge,
)
from redbatch.producer.client import Client, QueueFull, RedisRefusedCall

JSON = "application/json"
RECOUNTED = b"recounted"  # the charges hash's field of the last recount's time
TOTAL = b"total"  # its field of the charges the last admission left


def prompt(text: str, max_new_tokens: int | None = 100) -> bytes:
    body: dict[str, object] = {"prompt": text}
    if max_new_tokens is not None:
        body["max_new_tokens"] = max_new_tokens
    return json.dumps(body).encode()


@pytest.mark.parametrize("payload, content_type, answer", [
    (b'{"prompt": "Hi", "max_new_tokens": 5}', JSON, 5),
    (b'{"messages": [{"role": "user", "content": "Hi"}]}', JSON, DEFAULT_MAX_NEW_TOKENS),
    # Not an integer from 1 to 1,024: the default stands in (the worker refuses the job).
    (b'{"prompt": "Hi", "max_new_tokens": true}', JSON, DEFAULT_MAX_NEW_TOKENS),
    (b'{"prompt": "Hi", "max_new_tokens": 5000}', JSON, DEFAULT_MAX_NEW_TOKENS),
    ('{"prompt": "Grüße"}'.encode(), JSON, DEFAULT_MAX_NEW_TOKENS),
    # Not a generation payload: no charge.
    (b'{"prompt": "Hi", "max_new_tokens": 5}', "text/plain", None),
    (b'{"text": "Hi"}', JSON, None),
    (b'["prompt"]', JSON, None),
    (b"\xff\xfe", JSON, None),
    (b"[" * 60_000, JSON, None),  # nested past the JSON parser's recursion limit
    (b'{"prompt": "' + b"x" * MAX_PAYLOAD_BYTES + b'"}', JSON, None),  # past the limit
])
def test_a_jobs_charge_is_its_generation_payloads_bytes_plus_its_answer(
        payload: bytes, content_type: str, answer: int | None) -> None:
    charge = job_charge(payload, content_type)
    assert charge == (0 if answer is None else len(payload) + answer)
    assert job_charge('{"prompt": "Grüße"}'.encode(), JSON) == 21 + DEFAULT_MAX_NEW_TOKENS


def _charges(r: redis.Redis, keys: Keys, lane: Lane = Lane.INTERACTIVE) -> dict[str, int]:
    """The charges held, by entry id (without the field ``recounted``)."""
    raw = cast(dict[bytes, bytes], r.hgetall(keys.charges(lane)))
    return {k.decode(): int(v) for k, v in raw.items() if k not in (RECOUNTED, TOTAL)}


def _entry(r: redis.Redis, keys: Keys, rid: str) -> str:
    return cast(bytes, r.get(keys.owner(rid))).decode().split()[0]


def test_a_token_bound_admits_while_the_charges_fit_and_refuses_at_once(
        client: Client, r: redis.Redis, keys: Keys) -> None:
    job = prompt("Name three rivers of Europe.")
    charge = job_charge(job, JSON)
    client.set_token_limit(Lane.INTERACTIVE, 2 * charge + 1)
    assert r.hget(keys.limits(), token_bound_field(Lane.INTERACTIVE)) == \
        str(2 * charge + 1).encode()
    first, second = (client.submit(job, content_type=JSON) for _ in range(2))
    with pytest.raises(QueueFull) as full:
        client.submit(job, content_type=JSON, request_id="third")
    assert full.value.tokens and full.value.bound == 2 * charge + 1
    assert full.value.refused == ["third"] and full.value.code == "queue_full"
    assert str(full.value) == (
        f"queue_full: the interactive queue of model {keys.model!r} is at its bound of "
        f"{2 * charge + 1} tokens; submit again later")
    assert r.xlen(keys.stream(Lane.INTERACTIVE)) == 2 and not r.exists(keys.owner("third"))
    # What is charged, by entry id: exactly the two admitted jobs.
    assert _charges(r, keys) == {_entry(r, keys, first): charge,
                                 _entry(r, keys, second): charge}
    # A job that is no generation is charged nothing, and never refused for tokens; nor is
    # another lane, which has no token bound.
    client.submit(b"\xff\xd8 not a prompt")
    client.submit(job, content_type=JSON, lane=Lane.BULK)
    assert r.xlen(keys.stream(Lane.INTERACTIVE)) == 3 and not r.exists(keys.charges(Lane.BULK))
    # A batch: the jobs that fit are admitted, the rest refused, in one call.
    client.set_token_limit(Lane.INTERACTIVE, 4 * charge)
    with pytest.raises(QueueFull) as batch:
        client.submit_many([job] * 4, content_type=JSON)
    assert len(batch.value.accepted) == 2 and len(batch.value.refused) == 2
    state = client.queue_state(Lane.INTERACTIVE)
    assert (state.token_bound, state.tokens) == (4 * charge, 4 * charge)
    # A single job charged past the whole bound is refused even on an empty lane.
    client.set_token_limit(Lane.INTERACTIVE, charge - 1)
    r.delete(keys.charges(Lane.INTERACTIVE))
    with pytest.raises(QueueFull):
        client.submit(job, content_type=JSON)
    client.set_token_limit(Lane.INTERACTIVE, None)
    assert client.queue_state(Lane.INTERACTIVE).token_bound is None
    client.submit(job, content_type=JSON)  # unbounded again: admitted, and charged nothing
    assert _charges(r, keys) == {}


@pytest.mark.parametrize("raw, admitted", [
    ("lots", 3), ("nan", 3), ("0x400", 3),  # not a bound: unbounded, nothing recorded
    ("0", 0), ("-5", 0), ("250.5", 1), ("1e9", 3),
])
def test_a_token_bound_is_read_like_a_job_bound(
        raw: str, admitted: int, client: Client, r: redis.Redis, keys: Keys) -> None:
    job = prompt("Hello there", 100)
    assert job_charge(job, JSON) == 148
    r.hset(keys.limits(), token_bound_field(Lane.INTERACTIVE), raw)
    ids = []
    for _ in range(3):
        try:
            ids.append(client.submit(job, content_type=JSON))
        except QueueFull as e:
            assert e.tokens
    assert len(ids) == admitted, raw
    bound = client.queue_state(Lane.INTERACTIVE).token_bound
    recorded = admitted if bound is not None else 0
    assert len(_charges(r, keys)) == recorded
    client.submit(b"a photo")  # charge 0: admitted under any bound
    assert r.xlen(keys.stream(Lane.INTERACTIVE)) == admitted + 1


def test_before_refusing_the_function_recounts_what_the_workers_no_longer_hold(
        client: Client, r: redis.Redis, keys: Keys) -> None:
    """A charge stays counted while its entry is queued or pending; one whose entry the
    group read and no longer holds (answered by a worker that does not delete charges),
    a planted field and a job cancelled while queued (once the workers read past it) are
    deleted by the recount before a job would be refused."""
    job = prompt("Write a haiku about rain.")
    charge = job_charge(job, JSON)
    stream = keys.stream(Lane.INTERACTIVE)
    client.set_token_limit(Lane.INTERACTIVE, 2 * charge)
    r.xgroup_create(stream, GROUP, id="0", mkstream=True)
    j1, j2 = (client.submit(job, content_type=JSON) for _ in range(2))
    e1, e2 = _entry(r, keys, j1), _entry(r, keys, j2)
    # A worker reads j1 and answers it without deleting its charge; j2 stays queued.
    assert r.xreadgroup(GROUP, "old-worker", {stream: ">"}, count=1)[0][1][0][0] == e1.encode()
    r.xack(stream, GROUP, e1)
    r.xdel(stream, e1)
    r.hset(keys.charges(Lane.INTERACTIVE), mapping={"planted": 10**9, "9-9": 10**9})
    j3 = client.submit(job, content_type=JSON)  # fits once e1 and the plants are recounted
    e3 = _entry(r, keys, j3)
    assert _charges(r, keys) == {e2: charge, e3: charge}
    # Refusals within a second share that recount: a plant now stays until a second later.
    r.hset(keys.charges(Lane.INTERACTIVE), "planted", 1)
    with pytest.raises(QueueFull):
        client.submit(job, content_type=JSON)
    assert _charges(r, keys) == {e2: charge, e3: charge, "planted": 1}
    last = cast(bytes, r.hget(keys.charges(Lane.INTERACTIVE), RECOUNTED))
    assert last.startswith(b"@") and abs(int(last[1:]) - time.time() * 1000) < 60_000
    r.hset(keys.charges(Lane.INTERACTIVE), RECOUNTED, f"@{int(last[1:]) - 1000}")
    with pytest.raises(QueueFull):  # j2 queued, j3 queued: full
        client.submit(job, content_type=JSON)
    r.xreadgroup(GROUP, "w", {stream: ">"}, count=1)  # j2 now pending: still counted
    with pytest.raises(QueueFull):
        client.submit(job, content_type=JSON)
    assert client.cancel(j3)  # taken out while queued: counted until the workers pass it
    with pytest.raises(QueueFull):
        client.submit(job, content_type=JSON)
    assert _charges(r, keys) == {e2: charge, e3: charge}
    r.xreadgroup(GROUP, "w", {stream: ">"}, count=10)  # the cancel entry: past e3
    r.hset(keys.charges(Lane.INTERACTIVE), RECOUNTED, "@0")  # as if a second later
    j4 = client.submit(job, content_type=JSON)
    assert _charges(r, keys) == {e2: charge, _entry(r, keys, j4): charge}


def test_a_user_who_may_not_charge_adds_nothing_under_a_token_bound(
        redis_url: str, r: redis.Redis, keys: Keys) -> None:
    """The function checks HSET and HDEL of the charges (and what the recount reads)
    before its first write: without them a token-bounded lane refuses the whole call
    NOPERM and nothing is queued; a lane with no token bound needs none of them."""
    user = f"producer-{uuid.uuid4().hex[:8]}"
    charges = keys.charges(Lane.INTERACTIVE)
    r.execute_command("ACL", "SETUSER", user, "reset", "on", ">pw", "~*", "+@all",
                      "-hset")
    try:
        url = redis_url.replace("redis://", f"redis://{user}:pw@", 1)
        with Client(url, model=keys.model) as limited:
            limited.submit(prompt("Hi"), content_type=JSON)  # no token bound: fine
            r.hset(keys.limits(), token_bound_field(Lane.INTERACTIVE), 10_000)
            with pytest.raises(RedisRefusedCall) as info:
                limited.submit(prompt("Hi"), content_type=JSON)
        assert str(info.value).endswith(f"this user may not charge {charges}")
        assert r.xlen(keys.stream(Lane.INTERACTIVE)) == 1 and not r.exists(charges)
    finally:
        r.acl_deluser(user)


def test_a_lane_far_from_its_bound_costs_one_read_and_answers_are_summed_away(
        client: Client, r: redis.Redis, keys: Keys) -> None:
    """NOTE [ Token charges ]: while jobs fit, admission trusts the ``total`` field (no
    HVALS, however many jobs the lane holds); workers leave it above what they free, and
    an admission that would not fit by it sums the fields first, which admits the job
    with no recount when answers freed the room."""
    job = prompt("What is the capital of Peru?")
    charge = job_charge(job, JSON)
    charges = keys.charges(Lane.INTERACTIVE)
    client.set_token_limit(Lane.INTERACTIVE, 40 * charge)
    client.submit_many([job] * 20, content_type=JSON)  # the first call sums: no total yet
    r.config_resetstat()
    for _ in range(10):
        client.submit(job, content_type=JSON)
    stats = r.info("commandstats")
    assert "cmdstat_hvals" not in stats and "cmdstat_hgetall" not in stats, stats
    assert r.hget(charges, TOTAL) == f"={30 * charge}".encode()
    assert sum(_charges(r, keys).values()) == 30 * charge
    # A worker answers 25 of them: their entries and charges go, the total stays.
    held = list(_charges(r, keys))[:25]
    r.xdel(keys.stream(Lane.INTERACTIVE), *held)
    r.hdel(charges, *held)
    assert r.hget(charges, TOTAL) == f"={30 * charge}".encode()
    client.submit_many([job] * 12, content_type=JSON)  # by the total 10 fit; the sum: all
    assert len(_charges(r, keys)) == 5 + 12 and not r.hexists(charges, RECOUNTED)
    assert r.hget(charges, TOTAL) == f"={17 * charge}".encode()
