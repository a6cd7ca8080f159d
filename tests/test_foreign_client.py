"""A Node.js client written only from PROTOCOL.md submits jobs to a real worker and waits.

The client lives in tests/clients/node/submit.mjs and shares no code with the project, so
these tests check that PROTOCOL.md alone is enough to talk to redbatch from another language.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, cast

import msgpack
import pytest
import redis
from conftest import CAT_LABELS, SAMPLES, TEST_MODEL, WorkerFactory
from redbatch.common.config import LimitSettings
from redbatch.handlers.text import AllMiniLmL6V2
from test_text_model import MODEL as TEXT_MODEL
from test_text_model import embed

NODE_DIR = Path(__file__).resolve().parent / "clients" / "node"
STREAM = f"redbatch:{{{TEST_MODEL}}}:jobs:interactive"
GROUP = "workers"
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def node_client() -> Path:
    """The path of submit.mjs, with its node_modules installed (npm ci) if missing."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        # Not a skip: without Node the foreign-client check would silently stop running.
        pytest.fail("node and npm are required for the foreign-client test "
                    f"(node={node}, npm={npm})", pytrace=False)
    if not (NODE_DIR / "node_modules").is_dir():
        proc = subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR,
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            pytest.fail(f"npm ci failed in {NODE_DIR} (rc={proc.returncode}):\n"
                        f"{proc.stdout}\n{proc.stderr}", pytrace=False)
    return NODE_DIR / "submit.mjs"


def run_client(script: Path, *args: str, rc: int = 0) -> dict[str, Any]:
    """Run the node client; check its exit status is ``rc``; return the one JSON line it
    prints."""
    node = shutil.which("node")
    assert node is not None
    proc = subprocess.run([node, str(script), *args], cwd=script.parent,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == rc, (f"node client exited {proc.returncode}\n"
                                   f"stdout: {proc.stdout}\nstderr: {proc.stderr}")
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, f"expected one line of JSON, got: {proc.stdout!r}"
    result: dict[str, Any] = json.loads(lines[0])
    return result


def pending_count(r: redis.Redis) -> int:
    summary = r.xpending(STREAM, GROUP)
    return int(summary["pending"])


def test_node_client_embeds_a_text(node_client: Path, redis_url: str, tmp_path: Path,
                                   start_worker: WorkerFactory) -> None:
    # The text model from the page alone: a .txt file's UTF-8 bytes as text/plain.
    text = "The train to Edinburgh was delayed by forty minutes. Über 40 Minuten!"
    (tmp_path / "query.txt").write_text(text, encoding="utf-8")
    start_worker(model=TEXT_MODEL)
    out = run_client(node_client, redis_url, str(tmp_path / "query.txt"), TEXT_MODEL)
    assert out["status"] == "ok", out
    vector = out["result"]["output"]["embedding"]
    expected = embed(AllMiniLmL6V2(LimitSettings()), [text])[0].tolist()
    assert len(vector) == len(expected) == 384
    assert sum(a * b for a, b in zip(vector, expected, strict=True)) >= 0.999


def test_node_client_classifies_cat(node_client: Path, redis_url: str, r: redis.Redis,
                                    start_worker: WorkerFactory) -> None:
    start_worker()
    out = run_client(node_client, redis_url, str(SAMPLES / "cat.jpg"), TEST_MODEL)

    assert out["status"] == "ok", out
    assert out["error_code"] is None, out
    assert out["label"] in CAT_LABELS, out
    envelope = out["result"]
    assert envelope["v"] == 1
    assert envelope["id"] == out["id"]
    assert envelope["model"] == TEST_MODEL
    assert envelope["batch_size"] >= 1
    assert len(envelope["output"]["top5"]) == 5
    assert pending_count(r) == 0


def test_node_client_garbage_gets_bad_envelope(node_client: Path, redis_url: str,
                                               r: redis.Redis,
                                               start_worker: WorkerFactory) -> None:
    start_worker()
    out = run_client(node_client, redis_url, "--raw-garbage", TEST_MODEL)

    assert out["status"] == "error", out
    assert out["error_code"] == "bad_envelope", out
    assert out["label"] is None, out
    assert out["result"]["output"] is None
    assert pending_count(r) == 0


def test_node_client_cat_then_garbage_leaves_nothing_pending(
        node_client: Path, redis_url: str, r: redis.Redis,
        start_worker: WorkerFactory) -> None:
    """Both kinds of entry on one worker; afterwards the group has nothing pending."""
    start_worker()
    ok = run_client(node_client, redis_url, str(SAMPLES / "cat.jpg"))
    bad = run_client(node_client, redis_url, "--raw-garbage")

    assert (ok["status"], ok["label"] in CAT_LABELS) == ("ok", True), ok
    assert (bad["status"], bad["error_code"]) == ("error", "bad_envelope"), bad
    assert pending_count(r) == 0
    assert r.xlen(STREAM) == 0  # each entry left the stream together with its result


def test_node_client_admits_through_the_pages_script_and_reads_its_refusals(
        node_client: Path, redis_url: str, r: redis.Redis,
        start_worker: WorkerFactory) -> None:
    """The Node client takes the admission script (revision 4) from PROTOCOL.md, calls it
    with one job, and reads the first element of the array reply: an entry id, or an error
    element (QUEUE_FULL, DUPLICATE_REQUEST_ID), whose first word it matches as node-redis
    hands it over (no "ERR " stripping there); an error reply to the whole call (BAD_CALL)
    is reported the same way."""
    start_worker()
    cat = str(SAMPLES / "cat.jpg")
    ok = run_client(node_client, redis_url, cat, "--admit", "--rid=node-1")
    assert (ok["id"], ok["status"], ok["label"] in CAT_LABELS) == ("node-1", "ok", True), ok
    owner = r.get(f"redbatch:{{{TEST_MODEL}}}:owner:node-1")
    assert owner is not None and r.pttl(f"redbatch:{{{TEST_MODEL}}}:owner:node-1") > 0
    xadded = r.xinfo_stream(STREAM)
    assert (xadded["entries-added"], xadded["length"]) == (1, 0), "one entry, answered"
    again = run_client(node_client, redis_url, cat, "--admit", "--rid=node-1", rc=3)
    assert again == {"id": "node-1", "admit_code": "DUPLICATE_REQUEST_ID",
                     "admit_error": f"DUPLICATE_REQUEST_ID {owner.decode().split()[0]}"}, again
    assert r.xlen(STREAM) == 0, "no entry of the duplicate is left"
    added = r.xinfo_stream(STREAM)["entries-added"]
    bad = run_client(node_client, redis_url, cat, "--admit", "--rid=node 2", rc=3)
    assert bad == {"id": "node 2", "admit_code": "BAD_CALL",
                   "admit_error": "BAD_CALL unusable request id of job 1"}, bad
    r.hset(f"redbatch:{{{TEST_MODEL}}}:limits", "interactive", 0)
    full = run_client(node_client, redis_url, cat, "--admit", rc=3)
    assert (full["admit_code"], full["admit_error"]) == ("QUEUE_FULL", "QUEUE_FULL 0"), full
    assert r.exists(f"redbatch:{{{TEST_MODEL}}}:owner:{full['id']}") == 0
    assert r.xinfo_stream(STREAM)["entries-added"] == added, "BAD_CALL, QUEUE_FULL: no XADD"
    assert r.xlen(STREAM) == 0 and pending_count(r) == 0


def test_node_client_admitted_entry_is_the_pages(node_client: Path, redis_url: str,
                                                 r: redis.Redis) -> None:
    """Without a worker the entry stays queued: it has the fields rid, job and adm (1) the
    page gives, and its request id's owner key names it."""
    proc = subprocess.Popen([shutil.which("node") or "node", str(node_client), redis_url,
                             str(SAMPLES / "cat.jpg"), "--admit", "--rid=node-q"],
                            cwd=node_client.parent, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(200):
            if r.xlen(STREAM):
                break
            proc.poll()
            assert proc.returncode is None, proc.communicate()
            time.sleep(0.05)
        (entry_id, fields), = cast(list[tuple[bytes, dict[bytes, bytes]]], r.xrange(STREAM))
        assert set(fields) == {b"rid", b"job", b"adm"}, fields
        assert (fields[b"rid"], fields[b"adm"]) == (b"node-q", b"1")
        job = msgpack.unpackb(fields[b"job"], raw=False)
        assert (job["lane"], job["model"], job["v"]) == ("interactive", TEST_MODEL, 1)
        assert r.get(f"redbatch:{{{TEST_MODEL}}}:owner:node-q") == entry_id + b" interactive"
    finally:
        proc.kill()
        proc.communicate()


def test_node_client_reads_status_and_cancels_with_the_pages_scripts(
        node_client: Path, redis_url: str, r: redis.Redis, start_worker: WorkerFactory) -> None:
    """Status and cancel written from the page alone: a job queued before any worker is
    ``queued``; the Node client cancels it (a second time says the same); its status is
    ``cancelled``; a worker then answers it ``cancelled`` without running it, which both
    clients see. A job answered ok is ``done``; an id nobody used is ``unknown``."""
    from redbatch.producer.client import Client

    with Client(redis_url) as client:
        doomed = client.submit(b"not an image", timeout_s=TIMEOUT_S)
        kept = client.submit((SAMPLES / "cat.jpg").read_bytes(), timeout_s=TIMEOUT_S)
        status = run_client(node_client, redis_url, "--status", f"--rid={doomed}")
        assert status["state"] == "queued", status
        for _ in range(2):
            cancel = run_client(node_client, redis_url, "--cancel", f"--rid={doomed}")
            assert cancel["cancelled"] and cancel["cancel"].startswith("cancelled "), cancel
        assert run_client(node_client, redis_url, "--status", f"--rid={doomed}")["state"] == \
            "cancelled"
        start_worker()
        answer = client.result(doomed, timeout_s=TIMEOUT_S)
        assert answer.error_code is not None and answer.error_code.value == "cancelled"
        assert client.result(kept, timeout_s=TIMEOUT_S).ok
    after = run_client(node_client, redis_url, "--status", f"--rid={doomed}")
    assert (after["state"], after["error_code"]) == ("cancelled", "cancelled"), after
    assert run_client(node_client, redis_url, "--status", f"--rid={kept}")["state"] == "done"
    late = run_client(node_client, redis_url, "--cancel", f"--rid={kept}")
    assert not late["cancelled"] and late["cancel"] == "taken", late
    assert run_client(node_client, redis_url, "--status", "--rid=nobody")["state"] == "unknown"


def test_node_client_done_only_job_is_answered_in_its_done_list_alone(
        node_client: Path, redis_url: str, r: redis.Redis, start_worker: WorkerFactory) -> None:
    """A done-only job written from the page: the worker writes no result key, only the
    done list; the Node client's wait (BLMOVE onto itself) leaves the envelope there, so
    the page's status script (five keys) says ``done`` and a Python client that did not
    submit it reads it, twice, without consuming it."""
    from redbatch.producer.client import Client

    start_worker()
    out = run_client(node_client, redis_url, str(SAMPLES / "cat.jpg"), "--admit",
                     "--done-only", "--rid=node-done-only")
    assert (out["status"], out["label"] in CAT_LABELS) == ("ok", True), out
    base = f"redbatch:{{{TEST_MODEL}}}"
    assert not r.exists(f"{base}:result:node-done-only")
    assert r.llen(f"{base}:done:node-done-only") == 1
    assert r.pttl(f"{base}:done:node-done-only") > 0
    status = run_client(node_client, redis_url, "--status", "--rid=node-done-only")
    assert status["state"] == "done", status
    with Client(redis_url) as client:
        for _ in range(2):
            assert client.result("node-done-only", timeout_s=10).output == out["result"]["output"]
        assert client.status("node-done-only").state.value == "done"
    assert r.llen(f"{base}:done:node-done-only") == 1
    assert pending_count(r) == 0
