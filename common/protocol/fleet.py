"""Fleet status records (PROTOCOL.md "Fleet status keys"): what workers write for
``redbatch status`` and ``top``. Clients need none of it, and every key expires."""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass

from redbatch.common.protocol.envelopes import (
    MAX_ENVELOPE_OVERHEAD_BYTES,
    _check_fields,
    packb,
    unpackb,
)
from redbatch.common.protocol.errors import ErrorCode, ProtocolError
from redbatch.common.protocol.keys import Lane

# --------------------------------------------------------------------------- fleet status
# Written by workers for `redbatch status` / `top`; clients need none of it. Every key expires.

HEARTBEAT_INTERVAL_S = 2.0
"""How often a worker writes its WorkerRecord and its score in Keys.workers()."""
WORKER_RECORD_TTL_MS = 3 * 2000
"""A worker record outlives three missed heartbeats, then the worker counts as gone."""
WORKERS_TTL_MS = 3600 * 1000
"""Members of Keys.workers() not seen for this long are removed; the set itself expires
this long after the last heartbeat of any worker."""
RECENT_MAX = 4096
"""Result records kept in Keys.recent() (LTRIM), enough for p99 over a minute of load."""
RECENT_TTL_MS = 3600 * 1000
"""Keys.recent() expires this long after the last result was written."""


_WORKER_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "consumer": (str,), "host": (str,), "pid": (int,), "version": (str,), "device": (str,),
    "max_batch_size": (int,), "started_ms": (int,), "last_seen_ms": (int,), "inflight": (int,),
    "metrics_port": (int, type(None)),
}


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """What a live worker says about itself in its heartbeat (Keys.worker)."""

    consumer: str
    host: str
    pid: int
    version: str
    device: str
    max_batch_size: int
    started_ms: int
    """Worker's wall clock when it started serving, Unix ms."""
    last_seen_ms: int
    """Worker's wall clock at this heartbeat, Unix ms."""
    inflight: int
    """Jobs read and not yet answered."""
    metrics_port: int | None = None
    """Port of its /metrics endpoint, or None when it serves none."""

    def encode(self) -> bytes:
        return packb({name: getattr(self, name) for name in _WORKER_FIELD_TYPES})

    @classmethod
    def decode(cls, data: bytes) -> WorkerRecord:
        body = unpackb(data, MAX_ENVELOPE_OVERHEAD_BYTES)
        _check_fields(body, _WORKER_FIELD_TYPES)
        return cls(**{name: body[name] for name in _WORKER_FIELD_TYPES})


_RECENT_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "finished_ms": (int,), "lane": (str,), "outcome": (str,), "total_ms": (float, int, type(None)),
}


_NIL = b"\xc0"
_DOUBLE = struct.Struct(">d").pack


def _float64(value: float) -> bytes:
    """A float as msgpack writes it: 0xcb, then the IEEE 754 double, big-endian."""
    return b"\xcb" + _DOUBLE(value)


@dataclass(frozen=True, slots=True)
class RecentResult:
    """One written result, as Keys.recent() keeps it for throughput and latency figures."""

    finished_ms: int
    """Worker's wall clock when the result was written, Unix ms."""
    lane: Lane
    outcome: str
    """``ok`` or the ErrorCode value."""
    total_ms: float | None
    """End-to-end time (the result's ``total_ms``); None for entries rejected unread."""

    def encode(self) -> bytes:
        return self.pack(self.finished_ms, Lane(self.lane).value, self.outcome, self.total_ms)

    @staticmethod
    def pack(finished_ms: int, lane: str, outcome: str, total_ms: float | None) -> bytes:
        """What ``RecentResult(...).encode()`` returns, without the object (``lane``: the
        Lane's value)."""
        return packb({"finished_ms": finished_ms, "lane": lane, "outcome": outcome,
                      "total_ms": total_ms})

    @staticmethod
    def pack_many(finished_ms: int,
                  answers: Iterable[tuple[str, str, float | None]]) -> list[bytes]:
        """``pack(finished_ms, lane, outcome, total_ms)`` of each ``(lane, outcome,
        total_ms)``, byte for byte, as a worker encodes a flush: the map up to ``total_ms``
        is the same for every answer of one lane and outcome, so it is packed once for each,
        and each record adds only its float (msgpack float 64, as ``packb`` writes a float)."""
        heads: dict[tuple[str, str], bytes] = {}
        out = []
        for lane, outcome, total_ms in answers:
            head = heads.get((lane, outcome))
            if head is None:  # the map with a nil total_ms, less the nil: its last byte
                head = heads[lane, outcome] = RecentResult.pack(finished_ms, lane, outcome,
                                                                None)[:-1]
            out.append(head + (_NIL if total_ms is None else _float64(total_ms)))
        return out

    @classmethod
    def decode(cls, data: bytes) -> RecentResult:
        body = unpackb(data, MAX_ENVELOPE_OVERHEAD_BYTES)
        _check_fields(body, _RECENT_FIELD_TYPES)
        try:
            lane = Lane(body["lane"])
        except ValueError as e:
            raise ProtocolError(ErrorCode.BAD_ENVELOPE, str(e)) from e
        total = body["total_ms"]
        return cls(body["finished_ms"], lane, body["outcome"],
                   None if total is None else float(total))
