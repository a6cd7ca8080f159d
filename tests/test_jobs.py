"""Job handles, status and cancel (PROTOCOL.md "Job status", "Cancelling a job"), and the
client's payload types ("Payload types"), against a real Redis and real workers."""

from __future__ import annotations

import asyncio
import copy
import json
import pickle
import time
from typing import Any, cast

import msgpack
import numpy as np
import pytest
import redis
from conftest import WorkerFactory
from redbatch.common.protocol import (
    FIELD_CANCEL,
    FIELD_JOB,
    GROUP,
    ErrorCode,
    JobCancelled,
    JobFailed,
    JobState,
    Keys,
    Lane,
    parse_owner,
)
from redbatch.common.protocol.payloads import JSON, NPY, TEXT, decode_payload, encode_payload
from redbatch.producer.client import AsyncClient, AsyncJobHandle, Client, JobHandle
from redbatch.producer.errors import ResultUnreadable

MODEL = "null_tensor"
KEYS = Keys(MODEL)


def floats(*values: float) -> bytes:
    return np.array(values, dtype="<f4").tobytes()


def test_a_queued_job_cancelled_is_answered_cancelled_by_a_worker_and_never_run(
        redis_url: str, r: redis.Redis, start_worker: WorkerFactory) -> None:
    """No worker yet: the jobs are queued. Cancelling one takes it out of its lane before
    any worker could read it; once a worker comes, it answers ``cancelled`` (it would have
    answered ``bad_input`` had it run the 3-byte payload) and the others run."""
    with Client(redis_url, model=MODEL) as client:
        first = client.submit(floats(1, 2, 3, 4), timeout_s=120)
        doomed = client.submit(b"abc", timeout_s=120)
        bulk = client.submit(b"xyz", lane=Lane.BULK, timeout_s=120)
        last = client.submit(floats(1, 1, 1, 1), timeout_s=120)
        queued = doomed.status()
        assert queued.state is JobState.QUEUED and queued.lane is Lane.INTERACTIVE
        assert queued.result is None and not queued.finished
        assert doomed.cancel() and bulk.cancel()
        assert doomed.cancel(), "cancelling again says the same (a lost reply can be retried)"
        assert doomed.status().state is JobState.CANCELLED, "cancelled, answer not yet written"
        assert r.xlen(KEYS.stream(Lane.BULK)) == 0, "the bulk job left its lane"
        # The cancel entries wait in the interactive lane (served first) for a worker.
        assert r.xlen(KEYS.stream(Lane.INTERACTIVE)) == 4
        start_worker(model=MODEL)
        answers = client.results([first, doomed, bulk, last], timeout_s=60)
    assert answers[0].output == {"sum": 10.0} and answers[3].output == {"sum": 4.0}
    for answer in answers[1:3]:
        assert answer.error_code is ErrorCode.CANCELLED, answer
        assert answer.batch_size == 0 and answer.timings == {}
        with pytest.raises(JobCancelled) as raised:
            answer.raise_for_error()
        assert isinstance(raised.value, JobFailed) and raised.value.code == "cancelled"
    with Client(redis_url, model=MODEL) as other:  # any client, by id alone
        assert other.status(doomed).state is JobState.CANCELLED
        assert other.status(doomed).result == answers[1]
        done = other.status(first)
        assert done.state is JobState.DONE and done.finished and done.result == answers[0]
        assert other.status("never-submitted").state is JobState.UNKNOWN
        assert not other.cancel(first), "answered: nothing to cancel"
    assert r.xlen(KEYS.stream(Lane.INTERACTIVE)) == 0 and r.xlen(KEYS.dlq()) == 0


def test_a_taken_job_is_running_cannot_be_cancelled_and_runs_to_its_answer(
        redis_url: str, r: redis.Redis, start_worker: WorkerFactory) -> None:
    """A consumer has read the job (and died holding it): status says running, on which
    consumer; cancel says no and changes nothing; a worker takes it over and answers it."""
    stream = KEYS.stream(Lane.INTERACTIVE)
    with Client(redis_url, model=MODEL) as client:
        job = client.submit(floats(2, 2, 2, 2), timeout_s=120)
        r.xgroup_create(stream, GROUP, id="0", mkstream=True)
        assert r.xreadgroup(GROUP, "gone", {stream: ">"}, count=1)
        running = job.status()
        assert running.state is JobState.RUNNING
        assert (running.worker, running.deliveries) == ("gone", 1)
        assert not job.cancel()
        assert r.xlen(stream) == 1 and job.status().state is JobState.RUNNING
        start_worker("--reclaim-idle-ms", "300", model=MODEL)
        assert job.result(timeout_s=60).output == {"sum": 8.0}
        assert job.status().state is JobState.DONE


def test_status_of_an_answer_expired_or_planted(redis_url: str, r: redis.Redis,
                                                start_worker: WorkerFactory) -> None:
    start_worker(model=MODEL)
    with Client(redis_url, model=MODEL) as client:
        job = client.submit(b"abc", timeout_s=60)
        failed = client.result(job, timeout_s=60)
        status = job.status()
        assert status.state is JobState.FAILED and status.result == failed
        assert failed.error_code is ErrorCode.BAD_INPUT
        r.delete(KEYS.result(job))  # expired: the owner outlives it; the entry was read
        assert job.status().state is JobState.UNKNOWN
        r.hset(KEYS.result(job), "planted", 1)
        with pytest.raises(ResultUnreadable):
            job.status()
        r.delete(KEYS.result(job))
        r.set(KEYS.result(job), b"not msgpack of a result")
        with pytest.raises(ResultUnreadable):
            job.status()
        with pytest.raises(ValueError):
            client.status("not an id")


def test_a_handle_is_its_request_id(redis_url: str, r: redis.Redis,
                                    start_worker: WorkerFactory) -> None:
    """Code that treats the id as a string keeps working: equality, hashing, JSON, pickle,
    and passing it to ``result()``; and the handle answers for its job."""
    start_worker(model=MODEL)
    with Client(redis_url, model=MODEL) as client:
        handle = client.submit(floats(1, 0, 0, 0), request_id="job-1", timeout_s=60)
        assert isinstance(handle, JobHandle) and isinstance(handle, str)
        assert handle == "job-1" and {handle: 1}["job-1"] == 1 and f"{handle}" == "job-1"
        assert type(handle.request_id) is str and json.dumps([handle]) == '["job-1"]'
        for copied in (pickle.loads(pickle.dumps(handle)), copy.copy(handle)):
            assert type(copied) is str and copied == "job-1"
        assert (handle.model, handle.lane) == (MODEL, Lane.INTERACTIVE)
        assert "job-1" in repr(handle) and MODEL in repr(handle)
        assert client.result("job-1", timeout_s=60) == handle.result(timeout_s=60)
        handles = client.submit_many([floats(i, 0, 0, 0) for i in range(5)], lane="bulk",
                                     timeout_s=60)
        assert all(isinstance(h, JobHandle) and h.lane is Lane.BULK for h in handles)
        outputs = [result.output["sum"] for result in client.as_completed(handles, 60)]
        assert sorted(outputs) == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert client.predict(floats(1, 2, 0, 0), raise_on_error=True).output == {"sum": 3.0}


def test_async_handles_are_awaitable_with_status_and_cancel(
        redis_url: str, r: redis.Redis, start_worker: WorkerFactory) -> None:
    async def queued_then_served() -> None:
        async with AsyncClient(redis_url, model=MODEL) as client:
            kept = await client.submit(floats(3, 0, 0, 0), timeout_s=120)
            dropped = await client.submit(floats(5, 0, 0, 0), timeout_s=120)
            assert isinstance(kept, AsyncJobHandle) and kept == kept.request_id
            assert (await kept.status()).state is JobState.QUEUED
            assert await dropped.cancel()
            await asyncio.to_thread(start_worker, model=MODEL)
            assert (await kept).output == {"sum": 3.0}
            answer = await dropped.result(timeout_s=60)
            assert answer.error_code is ErrorCode.CANCELLED
            assert (await client.status(dropped)).state is JobState.CANCELLED
            assert (await kept.status()).state is JobState.DONE

    asyncio.run(queued_then_served())


def test_payload_types_travel_with_their_content_type_and_handlers_read_them(
        redis_url: str, r: redis.Redis, start_worker: WorkerFactory) -> None:
    """bytes, str, JSON values and numpy arrays are each sent with their content type; the
    null_tensor handler reads arrays and JSON lists decoded, and refuses what is not four
    finite numbers with bad_input."""
    payloads: list[object] = [floats(1, 2, 3, 4), np.array([1, 2, 3, 5], dtype=np.float64),
                              [1, 2, 3, 6], "1 2 3 4", {"values": [1, 2, 3, 4]},
                              np.zeros((2, 2)), [1, 2, 3, "x"]]
    with Client(redis_url, model=MODEL) as client:
        handles = [client.submit(p, timeout_s=60) for p in payloads]
        # Read before any worker runs: a worker deletes each entry once it is answered.
        sent = {msgpack.unpackb(fields[FIELD_JOB.encode()])["content_type"]
                for _, fields in r.xrange(KEYS.stream(Lane.INTERACTIVE))}
        start_worker(model=MODEL)
        results = client.results(handles, timeout_s=60)
    assert sent <= {"application/octet-stream", NPY, JSON, TEXT} and len(sent) == 4
    assert [res.output for res in results[:3]] == [{"sum": 10.0}, {"sum": 11.0}, {"sum": 12.0}]
    assert all(res.error_code is ErrorCode.BAD_INPUT for res in results[3:]), results[3:]


@pytest.mark.parametrize("value", [b"\x00\xff", "naïve ✓", {"a": [1, 2.5, None, True]}, [],
                                   0, np.arange(6, dtype=np.int16).reshape(2, 3)])
def test_each_payload_type_decodes_to_what_was_sent(value: object) -> None:
    payload, content_type = encode_payload(value)
    back = decode_payload(payload, content_type)
    if isinstance(value, np.ndarray):
        assert back.dtype == value.dtype and (back == value).all()
    else:
        assert back == value


@pytest.mark.parametrize("value", [{1, 2}, float("nan"), object(),
                                   np.array([object()], dtype=object)])
def test_a_value_no_payload_type_carries_is_a_type_error(value: object) -> None:
    with pytest.raises(TypeError):
        encode_payload(value)


@pytest.mark.parametrize(("payload", "content_type"), [
    (b"\xff\xfe", TEXT), (b"[1, 2", JSON), (b"[NaN]", JSON), (b"[" * 50_000, JSON),
    (b"\x93NUMPY not an array", NPY),
    (b"\x93NUMPY\x01\x00v\x00{'descr': '|O', 'fortran_order': False, 'shape': (1,), }" +
     b" " * 51 + b"\n" + pickle.dumps([1]), NPY),
])
def test_a_payload_that_is_not_what_its_type_says_is_a_value_error(
        payload: bytes, content_type: str) -> None:
    with pytest.raises(ValueError):
        decode_payload(payload, content_type)


def test_the_cancel_script_checks_its_keys_and_replies_by_state(r: redis.Redis) -> None:
    """Called as any client would (raw EVAL): it refuses keys that do not belong together,
    says ``unknown`` for an id nobody owns or an owner that names no lane, and leaves the
    owner naming the cancel entry."""
    from redbatch.common.protocol import CANCEL_SCRIPT, owner_value

    script = r.register_script(CANCEL_SCRIPT)
    streams = [KEYS.stream(lane) for lane in Lane]
    other = Keys("other")
    for keys, args in [([*streams, other.owner("a")], ["a", b""]),
                       ([*reversed(streams), KEYS.owner("a")], ["a", b""]),
                       ([*streams, KEYS.owner("b")], ["a", b""]),
                       ([*streams], ["a", b""])]:
        with pytest.raises(redis.ResponseError, match="^BAD_CALL"):
            script(keys, args)
    assert script([*streams, KEYS.owner("a")], ["a", b""]) == b"unknown"
    entry = r.xadd(streams[0], {"rid": "a"})
    r.set(KEYS.owner("a"), entry)  # a bare entry id, as admission revision 3 wrote it
    assert script([*streams, KEYS.owner("a")], ["a", b""]) == b"unknown"
    r.set(KEYS.owner("a"), owner_value(entry, Lane.INTERACTIVE))
    reply = script([*streams, KEYS.owner("a")], ["a", b"job"]).decode()
    assert reply.startswith("cancelled ")
    cancel = reply.split()[1]
    owner = parse_owner(r.get(KEYS.owner("a")))
    assert owner is not None and owner.cancelled and owner.entry_id == cancel
    [(_, fields)] = cast(list[tuple[bytes, dict[bytes, bytes]]], r.xrange(streams[0]))
    assert fields[FIELD_CANCEL.encode()] == owner_value(entry, Lane.INTERACTIVE).encode()
    assert r.pttl(KEYS.owner("a")) == -1, "KEEPTTL: none before, none after"


def test_an_owner_naming_an_entry_id_out_of_range_is_unknown_and_queues_nothing(
        redis_url: str, r: redis.Redis) -> None:
    """Issue 28, item 10: an owner key planted with an entry id no stream can hold (past
    2^64 - 1). Cancel queues no cancel entry and says False, status says unknown (no raw
    Redis error), and ``redbatch job`` prints its one JSON line, cancelling or not."""
    import subprocess
    import sys

    huge = "99999999999999999999999-0"
    with Client(redis_url, model=MODEL) as client:
        client.submit(floats(1, 1, 1, 1), timeout_s=120)  # the lanes and the library exist
        r.xgroup_create(KEYS.stream(Lane.INTERACTIVE), GROUP, id="0")
        r.set(KEYS.owner("planted"), f"{huge} interactive")
        before = r.xlen(KEYS.stream(Lane.INTERACTIVE))
        assert client.cancel("planted") is False
        assert r.xlen(KEYS.stream(Lane.INTERACTIVE)) == before, "no cancel entry queued"
        assert client.status("planted").state is JobState.UNKNOWN
    for extra in ((), ("--cancel",)):
        proc = subprocess.run([sys.executable, "-m", "redbatch.cli", "job", "--redis",
                               redis_url, "--model", MODEL, "planted", *extra],
                              capture_output=True, text=True, timeout=60)
        assert "Traceback" not in proc.stderr, proc.stderr
        assert json.loads(proc.stdout)["state"] == "unknown", proc.stdout
    assert r.xlen(KEYS.stream(Lane.INTERACTIVE)) == before
    assert r.get(KEYS.owner("planted")) == f"{huge} interactive".encode()


def test_status_of_a_job_whose_worker_is_slow_to_answer_is_running(
        redis_url: str, r: redis.Redis) -> None:
    """Between a worker's read and its answer the job is pending: RUNNING, delivered once;
    a second delivery (a takeover) shows in ``deliveries``."""
    stream = KEYS.stream(Lane.BULK)
    with Client(redis_url, model=MODEL) as client:
        job = client.submit(floats(0, 0, 0, 0), lane="bulk")
        r.xgroup_create(stream, GROUP, id="0", mkstream=True)
        read = cast(list[Any], r.xreadgroup(GROUP, "w1", {stream: ">"}, count=1))
        entry_id: bytes = read[0][1][0][0]
        time.sleep(0.01)
        r.xclaim(stream, GROUP, "w2", 1, [entry_id])
        status = job.status()
    assert (status.state, status.worker, status.deliveries) == (JobState.RUNNING, "w2", 2)
    assert status.lane is Lane.BULK and status.entry_id == entry_id.decode()


def test_the_job_command_shows_and_cancels(redis_url: str, r: redis.Redis,
                                           start_worker: WorkerFactory) -> None:
    """``redbatch job ID`` prints the job's state as one JSON line; ``--cancel`` cancels a
    queued job (exit 0) and says when it is too late (exit 1)."""
    import subprocess
    import sys

    def job_command(*args: str) -> tuple[int, dict[str, object]]:
        proc = subprocess.run([sys.executable, "-m", "redbatch.cli", "job", "--redis",
                               redis_url, "--model", MODEL, *args],
                              capture_output=True, text=True, timeout=60)
        assert "Traceback" not in proc.stderr, proc.stderr
        return proc.returncode, json.loads(proc.stdout)

    with Client(redis_url, model=MODEL) as client:
        queued = client.submit(floats(1, 1, 1, 1), timeout_s=120)
        doomed = client.submit(floats(9, 9, 9, 9), lane=Lane.BULK, timeout_s=120)
        rc, shown = job_command(queued)
        assert rc == 0 and shown["state"] == "queued" and shown["lane"] == "interactive", shown
        rc, shown = job_command(doomed, "--cancel")
        assert (rc, shown["cancelled"], shown["state"]) == (0, True, "cancelled"), shown
        start_worker(model=MODEL)
        client.results([queued, doomed], timeout_s=60)
    rc, shown = job_command(queued)
    assert (rc, shown["state"], shown["output"]) == (0, "done", {"sum": 4.0}), shown
    rc, shown = job_command(doomed)
    assert shown["state"] == "cancelled" and shown["error"]["code"] == "cancelled", shown
    rc, shown = job_command(queued, "--cancel")
    assert (rc, shown["cancelled"], shown["state"]) == (1, False, "done"), shown
    rc, shown = job_command("nobody")
    assert (rc, shown["state"]) == (0, "unknown"), shown


def test_submit_sends_a_text_file_as_text_and_a_json_file_as_json(
        redis_url: str, r: redis.Redis, start_worker: WorkerFactory, tmp_path: object) -> None:
    """``redbatch submit notes.txt`` sends the file (it is not read as a list of paths), with
    the content type of its suffix: the model answers it."""
    import subprocess
    import sys
    from pathlib import Path

    folder = Path(str(tmp_path))
    (folder / "values.json").write_text("[1, 2, 3, 4]")
    (folder / "notes.txt").write_text("Remember to buy milk.\nAnd eggs.\n")
    start_worker(model=MODEL)
    proc = subprocess.run([sys.executable, "-m", "redbatch.cli", "submit", "--wait", "--redis",
                           redis_url, "--model", MODEL, str(folder / "values.json"),
                           str(folder / "notes.txt")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    values, notes = (json.loads(line) for line in proc.stdout.splitlines())
    assert values["status"] == "ok" and values["output"] == {"sum": 10.0}, values
    assert notes["path"].endswith("notes.txt") and notes["error"]["code"] == "bad_input", notes
