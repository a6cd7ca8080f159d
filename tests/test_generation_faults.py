"""A failed or hung device under the generation worker (RELIABILITY.md "Device failures"):
a real worker process serving the real smollm2_135m whose engine steps are made to raise or
hang after a few (tests/faulty_engine.py), real Redis, a real prompt.

The worker exits with code 3 (for its supervisor: restart me) with one line saying why and
no traceback; the generation it was running is not answered with an error but stays
pending, and a healthy worker takes it over from its token stream and answers it in full.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import cast

import pytest
import redis
from redbatch.cli.local_stack import spawn_worker, stop_worker, wait_worker_ready
from redbatch.common.protocol import GROUP, Keys, Lane
from redbatch.producer.client import Client

MODEL = "smollm2_135m"
KEYS = Keys(MODEL)
GOLDEN = json.loads((Path(__file__).parent / "data" / "smollm2_golden.json").read_text())
FAULTY = Path(__file__).parent / "faulty_engine.py"
ARGS = ["--model", MODEL, "--metrics-port", "0", "--calibrate", "off",
        "--reclaim-idle-ms", "1500"]


def _faulty(redis_url: str, log: Path, mode: str, *args: str) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, str(FAULTY), mode, "3", *ARGS, *args],
            env={**os.environ, "REDBATCH_REDIS_URL": redis_url}, stdin=subprocess.DEVNULL,
            stdout=out, stderr=out, start_new_session=True)


def _pending(r: redis.Redis) -> int:
    return sum(int(r.xpending(KEYS.stream(lane), GROUP)["pending"]) for lane in Lane)


@pytest.mark.parametrize(("mode", "says"), [
    ("raise", "device failure in a generation step"),
    # The watchdog is the image worker's (tests/test_watchdog.py): full tier only.
    pytest.param("hang", "device hung: generation step did not return within 3 s",
                 marks=pytest.mark.full),
])
def test_a_failed_device_exits_3_and_its_generation_is_taken_over(
        redis_url: str, tmp_path: Path, mode: str, says: str) -> None:
    r = redis.Redis.from_url(redis_url)
    r.flushall()
    case = GOLDEN["cases"][0]
    body = {"messages": case["messages"], "max_new_tokens": GOLDEN["max_new_tokens"]}
    log = tmp_path / "faulty.log"
    faulty = _faulty(redis_url, log, mode, "--batch-timeout-s", "3")
    healthy = None
    try:
        wait_worker_ready(redis_url, KEYS, faulty)
        with Client(redis_url, model=MODEL) as client:
            rid = client.submit(json.dumps(body).encode(), content_type="application/json",
                                request_id=uuid.uuid4().hex, timeout_s=120)
            code = faulty.wait(timeout=90)
            text = log.read_text(errors="replace")
            assert code == 3, text
            assert says in text and "Traceback" not in text, text
            # Not answered with an error: still pending, and no last chunk on its stream.
            assert not r.exists(KEYS.result(rid)) and _pending(r) == 1
            entries = cast(list[tuple[bytes, dict[bytes, bytes]]], r.xrange(KEYS.tokens(rid)))
            assert all(b"finish" not in fields for _, fields in entries)
            with open(tmp_path / "healthy.log", "wb") as out:
                healthy = spawn_worker(redis_url, ARGS, stdout=out, stderr=out)
            wait_worker_ready(redis_url, KEYS, healthy, consumers_before=1)
            res = client.result(rid, timeout_s=120)
        assert res.ok, res
        assert res.output["text"] == case["output_text"]
        assert res.output["token_ids"] == case["output_ids"]
    finally:
        for proc in (faulty, healthy):
            if proc is not None and proc.poll() is None:
                stop_worker(proc, timeout_s=20)
        r.flushall()
        r.close()
