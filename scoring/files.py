"""Submit files from disk and print their results as JSON lines (the ``submit`` command)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from redbatch.common.config import DEFAULT_MAX_PAYLOAD_BYTES
from redbatch.common.protocol import Lane, ResultEnvelope, payloads
from redbatch.producer.client import Client, QueueFull, ResultTimeout
from redbatch.producer.errors import RESULT_TIMEOUT
from redbatch.scoring.output import record, result_record
from redbatch.scoring.watch import WorkerWatch

#: Files submitted per pipelined round trip.
CHUNK = 256

CONTENT_TYPES = {".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".png": "image/png",
                 ".webp": "image/webp", ".bmp": "image/bmp", ".gif": "image/gif",
                 ".tif": "image/tiff", ".tiff": "image/tiff", ".txt": payloads.TEXT,
                 ".json": payloads.JSON, ".npy": payloads.NPY}


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def _chunks(paths: list[Path]) -> Iterator[list[Path]]:
    for i in range(0, len(paths), CHUNK):
        yield paths[i:i + CHUNK]


def _read(path: Path, max_bytes: int) -> bytes | str:
    """The file's bytes, or a message saying why it cannot be sent."""
    try:
        if path.stat().st_size > max_bytes:
            return f"file is larger than {max_bytes} bytes"
        return path.read_bytes()
    except OSError as e:
        return f"cannot read file: {e.strerror or e}"


def submit_files(redis_url: str, paths: list[Path], *, model: str, prefix: str, wait: bool,
                 timeout_s: float, lane: str = Lane.INTERACTIVE.value) -> bool:
    """Submit every file, then (with ``wait``) print each result in input order, one record
    each in the schema ``redbatch score`` writes (``output.record``: id, path, status,
    output or error, latency_ms, batch_size, worker; the id is the job's request id).

    Returns False when some file could not be submitted (unreadable, or refused by
    admission control: ``queue_full``) or a result did not arrive in time; per-file
    error results do not make it fail.
    """
    ok = True
    limit = DEFAULT_MAX_PAYLOAD_BYTES
    with Client(redis_url, model=model, prefix=prefix) as client, \
            WorkerWatch(client, model) if wait else nullcontext():
        for chunk in _chunks(paths):
            submitted: list[tuple[Path, str, float]] = []
            for path in chunk:
                data = _read(path, limit)
                if isinstance(data, str):
                    ok = False
                    _emit(record("", str(path), "error", error=("unreadable_file", data)))
                    continue
                try:
                    rid = client.submit(data, timeout_s=timeout_s, lane=lane,
                                        content_type=CONTENT_TYPES.get(path.suffix.lower(),
                                                                       "application/octet-stream"))
                except QueueFull as e:
                    ok = False
                    _emit(record("", str(path), "error", error=(e.code.value, e.message)))
                    continue
                submitted.append((path, rid, time.monotonic()))
            ok &= _report(client, submitted, wait, timeout_s)
    return ok


def _report(client: Client, submitted: list[tuple[Path, str, float]], wait: bool,
            timeout_s: float) -> bool:
    """Print the chunk's records in input order; latency_ms is from submitting to the
    result's arrival, as ``score`` measures it (results are taken as they finish)."""
    if not wait:
        for path, rid, _ in submitted:
            _emit(record(rid, str(path), "submitted"))
        return True
    arrived: dict[str, tuple[ResultEnvelope, float]] = {}
    try:
        for result in client.as_completed([rid for _, rid, _ in submitted], timeout_s):
            arrived[result.request_id] = (result, time.monotonic())
    except ResultTimeout:
        pass  # the ones missing are written as timeouts below
    for path, rid, sent in submitted:
        if rid not in arrived:
            _emit(record(rid, str(path), "error",
                         error=(RESULT_TIMEOUT, f"no result within {timeout_s:g}s")))
            continue
        result, at = arrived[rid]
        _emit(result_record(rid, str(path), result, (at - sent) * 1000))
    return len(arrived) == len(submitted)
