"""The end-of-run invariant, as a list of human-readable problems (empty: it holds).

Every accepted request id has exactly one final result with the expected outcome (ok, or
an error code); nothing is pending in the model's consumer group; every key but the
streams expires. Results are written with ``SET NX``, so one key per id that decodes and
names its own id is "exactly one". The fault tests assert on it, and ``bench/soak.py``
runs it over every id it submitted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import redis
from redbatch.common.protocol import GROUP, ErrorCode, Keys, ProtocolError, ResultEnvelope

#: Commands per pipelined round trip: thousands of ids cost a few round trips, not thousands.
CHUNK = 1000


def _chunks(items: Sequence[str], size: int = CHUNK) -> Iterable[Sequence[str]]:
    return (items[i:i + size] for i in range(0, len(items), size))


def read_results(r: redis.Redis, keys: Keys, ids: Sequence[str]) -> dict[str, bytes | None]:
    """The raw result of each id (None where there is none)."""
    out: dict[str, bytes | None] = {}
    for chunk in _chunks(ids):
        pipe = r.pipeline(transaction=False)
        for rid in chunk:
            pipe.get(keys.result(rid))
        out.update(zip(chunk, pipe.execute(), strict=True))
    return out


def outcome(result: ResultEnvelope) -> str:
    """Its name: "ok" or the error code's value, as metrics and the scorer's output say."""
    if result.ok:
        return "ok"
    return result.error_code.value if result.error_code else "error without a code"


def result_problem(rid: str, raw: bytes | None, expected: ErrorCode | None) -> str | None:
    """What is wrong with the stored result of ``rid``; ``expected`` None means ok."""
    if raw is None:
        return f"{rid}: no result"
    try:
        result = ResultEnvelope.decode(raw)
    except ProtocolError as e:
        return f"{rid}: result does not decode ({e})"
    if result.request_id != rid:
        return f"{rid}: result names request id {result.request_id!r}"
    want = "ok" if expected is None else expected.value
    got = outcome(result)
    if got != want:
        detail = f" ({result.error_message})" if result.error_message else ""
        return f"{rid}: outcome {got}{detail}, expected {want}"
    return None


def check_results(r: redis.Redis, keys: Keys,
                  expected: Mapping[str, ErrorCode | None]) -> list[str]:
    raws = read_results(r, keys, list(expected))
    found = (result_problem(rid, raws[rid], code) for rid, code in expected.items())
    return [p for p in found if p is not None]


def check_pending(r: redis.Redis, keys: Keys) -> list[str]:
    """Entries read by a worker of the group and never acknowledged."""
    problems = []
    for stream in keys.streams():
        try:
            pending = int(r.xpending(stream, GROUP)["pending"])
        except redis.ResponseError:  # no stream or no group yet: nothing was ever read
            continue
        if pending:
            problems.append(f"{stream}: {pending} entries pending in group {GROUP}")
    return problems


def check_ttls(r: redis.Redis) -> list[str]:
    """Keys other than streams that never expire (in the whole database)."""
    problems = []
    batch: list[bytes] = []
    for key in r.scan_iter(count=CHUNK):
        batch.append(key)
        if len(batch) >= CHUNK:
            problems += _without_ttl(r, batch)
            batch = []
    return problems + _without_ttl(r, batch)


def _without_ttl(r: redis.Redis, batch: list[bytes]) -> list[str]:
    pipe = r.pipeline(transaction=False)
    for key in batch:
        pipe.type(key)
        pipe.pttl(key)
    replies = pipe.execute()
    # PTTL -1: no expiry; -2: the key expired since SCAN saw it, which is fine.
    return [f"{key!r} never expires" for key, kind, ttl in
            zip(batch, replies[::2], replies[1::2], strict=True)
            if kind != b"stream" and int(ttl) == -1]


def audit(r: redis.Redis, keys: Keys, expected: Mapping[str, ErrorCode | None]) -> list[str]:
    """Problems with the final state; ``expected`` maps each accepted id to its error code,
    or None for ok. Run it once the fleet is idle: in-flight jobs count as pending."""
    return check_results(r, keys, expected) + check_pending(r, keys) + check_ttls(r)


#: The per-request key families, by the Keys method that names them.
PER_REQUEST = ("result", "done", "owner")


def key_kind(keys: Keys, key: str) -> str:
    """Which of the model's key families ``key`` belongs to: one of PER_REQUEST, reply,
    stream (job streams and the DLQ) or other (the fleet's records, the recent list, the
    limits, other models' keys)."""
    if key in keys.streams() or key == keys.dlq():
        return "stream"
    if keys.is_reply(key):
        return "reply"
    for kind in PER_REQUEST:
        # An empty request id gives the family's prefix, spelled by the protocol module.
        if key.startswith(getattr(keys, kind)("")):
            return kind
    return "other"
