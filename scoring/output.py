"""The scoring output: one JSON line (or CSV row) per input, and what --resume reads back.

Each record is flushed as it is written, so an interrupted run leaves a
valid file. A line cut short by a crash is dropped when the run resumes.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
from array import array
from bisect import bisect_left
from collections.abc import Iterable, Iterator
from typing import IO, Any

from redbatch.common.protocol import ErrorCode, ResultEnvelope

FORMATS = ("jsonl", "csv")
CSV_COLUMNS = ["id", "path", "status", "label", "class_id", "score", "error_code",
               "error_message", "latency_ms", "batch_size", "worker", "text"]


def record(item_id: str, path: str, status: str, *, output: Any = None,
           error: tuple[str, str] | None = None, latency_ms: float | None = None,
           batch_size: int = 0, worker: str = "") -> dict[str, Any]:
    """The output object of one input."""
    rec: dict[str, Any] = {"id": item_id, "path": path, "status": status}
    if error is None:
        rec["output"] = output
    else:
        rec["error"] = {"code": error[0], "message": error[1]}
    rec.update(latency_ms=None if latency_ms is None else round(latency_ms, 2),
               batch_size=batch_size, worker=worker)
    return rec


def result_record(item_id: str, path: str, result: ResultEnvelope,
                  latency_ms: float) -> dict[str, Any]:
    """The record of one answered input: ``ok`` with its output, or ``error`` with the
    result's code and message (``score`` writes it, ``submit`` prints it)."""
    if result.ok:
        return record(item_id, path, "ok", output=result.output, latency_ms=latency_ms,
                      batch_size=result.batch_size, worker=result.worker)
    code = result.error_code.value if result.error_code else ErrorCode.INTERNAL.value
    return record(item_id, path, "error", error=(code, result.error_message),
                  latency_ms=latency_ms, batch_size=result.batch_size, worker=result.worker)


def _csv_row(rec: dict[str, Any]) -> list[Any]:
    output = rec.get("output")
    out: dict[str, Any] = output if isinstance(output, dict) else {}
    err = rec.get("error") or {}
    return [rec["id"], rec["path"], rec["status"], out.get("label", ""), out.get("class_id", ""),
            out.get("score", ""), err.get("code", ""), err.get("message", ""),
            rec.get("latency_ms", ""), rec.get("batch_size", ""), rec.get("worker", ""),
            out.get("text", "")]


class OutputWriter:
    """Appends records to the output file in the chosen format."""

    def __init__(self, path: str, fmt: str, append: bool) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}")
        self.fmt = fmt
        fresh = not append or not os.path.exists(path) or os.path.getsize(path) == 0
        self._file: IO[str] = open(path, "a" if append else "w", encoding="utf-8",  # noqa: SIM115
                                   newline="")
        self._csv = csv.writer(self._file) if fmt == "csv" else None
        if self._csv is not None and fresh:
            self._csv.writerow(CSV_COLUMNS)

    def write(self, rec: dict[str, Any]) -> None:
        if self._csv is not None:
            self._csv.writerow(_csv_row(rec))
        else:
            self._file.write(json.dumps(rec, ensure_ascii=False) + "\n")

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _id_hash(item_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(item_id.encode(), digest_size=8).digest(), "little")


def _ids_in(path: str, fmt: str) -> Iterator[str]:
    with open(path, encoding="utf-8", newline="") as f:
        if fmt == "csv":
            rows = csv.reader(f)
            next(rows, None)  # header
            yield from (row[0] for row in rows if row)
            return
        for line in f:
            try:
                yield str(json.loads(line)["id"])
            except (ValueError, KeyError, TypeError):
                continue  # a cut-short last line; its input is scored again


def drop_partial_last_line(path: str) -> None:
    """Cut the file after its last newline: a crash may have left half a record."""
    with open(path, "rb+") as f:
        f.seek(0, io.SEEK_END)
        size = f.tell()
        if size == 0:
            return
        back = min(size, 1 << 20)
        f.seek(size - back)
        tail = f.read(back)
        cut = tail.rfind(b"\n")
        keep = size - back + cut + 1 if cut >= 0 else (0 if back == size else size)
        f.truncate(keep)


class DoneIndex:
    """The ids already in an output file, as a sorted array of 64-bit hashes.

    Eight bytes per scored input (8 MB for a million) instead of a set of
    strings; a hash collision (odds about n^2 / 2^65) would skip one input.
    Standard library only (``array`` and ``bisect``), so that a client-only install
    (no numpy) resumes too; sorting briefly holds the hashes as Python ints (about
    40 bytes each) while the index is built.
    """

    def __init__(self, hashes: Iterable[int]) -> None:
        self._hashes = array("Q", sorted(set(hashes)))

    @classmethod
    def empty(cls) -> DoneIndex:
        return cls(())

    @classmethod
    def from_output(cls, path: str, fmt: str) -> DoneIndex:
        if not os.path.exists(path):
            return cls.empty()
        drop_partial_last_line(path)
        return cls(_id_hash(i) for i in _ids_in(path, fmt))

    def __len__(self) -> int:
        return len(self._hashes)

    def __contains__(self, item_id: str) -> bool:
        h = _id_hash(item_id)
        i = bisect_left(self._hashes, h)
        return i < len(self._hashes) and self._hashes[i] == h
