"""What a token bound costs Redis at admission (PROTOCOL.md "Admission control").

    .venv/bin/python bench/admission_tokens.py [--jobs 2000] [--held 0,100,1000]

Submits generation jobs one a call (the Python client, as ``Client.generate`` does) into
a private Redis: without a token bound, then with one while the lane already holds
``--held`` charged jobs, and last with the lane full, so that every call is refused after
the recount. Redis's own time per admission call (INFO commandstats, ``fcall``) is what
every other client of that Redis waits behind: while a job fits, the function reads the
lane's ``total`` (one HGET); one that does not fit by it sums the charges (HVALS), and a
refusal recounts them too, at most once a second (XINFO GROUPS, XPENDING of the running
jobs, HGETALL): NOTE [ Token charges ] in common/protocol/admission.py. Prints µs per
call and, last, the ratios to the call without a bound.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, cast

import redis
from redbatch.cli.redis_server import RedisServer
from redbatch.common.protocol import GROUP, Keys, Lane
from redbatch.common.protocol.generation import job_charge
from redbatch.producer.client import Client, QueueFull

MODEL = "smollm2_135m"
JSON = "application/json"
PAYLOAD = json.dumps({"prompt": "Summarise the plot of Hamlet in two sentences.",
                      "max_new_tokens": 128}).encode()


def fcall_usec(r: redis.Redis) -> tuple[int, float]:
    """Calls of FCALL and their total µs inside Redis since the last reset."""
    stats: dict[str, Any] = r.info("commandstats").get("cmdstat_fcall", {})
    return int(stats.get("calls", 0)), float(stats.get("usec", 0))


def per_call(r: redis.Redis, client: Client, jobs: int, keys: Keys) -> float:
    """µs of Redis time per admission call, over ``jobs`` submits; each admitted job is
    answered at once (its entry and charge deleted, as a worker does), so the lane holds
    the same charges throughout."""
    stream, charges = keys.stream(Lane.INTERACTIVE), keys.charges(Lane.INTERACTIVE)
    r.config_resetstat()
    for _ in range(jobs):
        try:
            rid = client.submit(PAYLOAD, content_type=JSON)
        except QueueFull:
            continue
        entry = cast(bytes, r.get(keys.owner(rid))).split()[0]
        r.xdel(stream, entry)
        r.hdel(charges, entry)
    calls, usec = fcall_usec(r)
    return usec / max(1, calls)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--jobs", type=int, default=2000)
    p.add_argument("--held", default="0,100,1000",
                   help="charged jobs already queued, comma-separated")
    args = p.parse_args()
    keys, charge = Keys(MODEL), job_charge(PAYLOAD, JSON)
    rows: list[tuple[str, float]] = []
    with RedisServer() as server, Client(server.url, model=MODEL) as client:
        r = redis.Redis.from_url(server.url)
        client.submit(PAYLOAD, content_type=JSON)  # the library is loaded
        rows.append(("no token bound", per_call(r, client, args.jobs, keys)))
        for held in (int(x) for x in args.held.split(",")):
            r.flushall()
            client.set_token_limit(Lane.INTERACTIVE, 10**12)
            client.submit_many([PAYLOAD] * held, content_type=JSON) if held else None
            stream = keys.stream(Lane.INTERACTIVE)
            r.xgroup_create(stream, GROUP, id="0", mkstream=True)
            r.xreadgroup(GROUP, "w", {stream: ">"})  # all running: pending, still charged
            rows.append((f"bound, {held} charges held", per_call(r, client, args.jobs, keys)))
            client.set_token_limit(Lane.INTERACTIVE, held * charge)
            rows.append((f"refused, {held} held (1 recount/s)",
                         per_call(r, client, args.jobs, keys)))
    base = rows[0][1]
    for name, usec in rows:
        print(f"{name:<36} {usec:8.1f} µs a call in Redis")
    print("RATIOS to no token bound: " + ", ".join(
        f"{name} {usec / base:.2f}x" for name, usec in rows[1:]))


if __name__ == "__main__":
    main()
