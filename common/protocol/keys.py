"""Names and keys (PROTOCOL.md "Names", "Keys"): every Redis key, stream, group and field
name of a model, the name rules, and request ids. The only module that spells a key."""

from __future__ import annotations

import re
import uuid
import zlib
from dataclasses import dataclass
from enum import StrEnum

DEFAULT_PREFIX = "redbatch"
GROUP = "workers"
"""The consumer group every worker of a model joins, on each lane's stream."""

FIELD_REQUEST_ID = "rid"
"""Stream field holding the request id, kept apart from the body so that a
body that fails to decode can still be answered."""
FIELD_JOB = "job"
"""Stream field holding the msgpack job envelope."""
FIELD_ADMITTED = "adm"
"""Stream field the admission script adds (value ``1``): it already made the entry its
request id's owner, so workers need not claim the id again when they read it."""
FIELD_CANCEL = "cancel"
"""Stream field of a cancel entry (the cancel script adds it, with the owner value of the
queued job it took out): the worker answers its request id ``cancelled`` and runs nothing."""

#: Fields of a dead-letter entry (besides FIELD_REQUEST_ID and FIELD_JOB, copied as they were).
DLQ_SOURCE = "source"
DLQ_ENTRY = "entry"
DLQ_REASON = "reason"
DLQ_DELIVERIES = "deliveries"
DLQ_AT_MS = "at_ms"
#: Dead-letter entries kept at most (approximate trim), so the DLQ cannot grow without bound.
DLQ_MAX_LEN = 100_000

MAX_NAME_CHARS = 64
"""Longest model, prefix or reply-list name."""
MAX_REQUEST_ID_CHARS = 128
"""Longest request id."""
# fullmatch only: "$" in re.match also matches before a trailing newline.
_NAME_RE = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.\-]{{0,{MAX_NAME_CHARS - 1}}}")
_REQUEST_ID_RE = re.compile(rf"[A-Za-z0-9_.:\-]{{1,{MAX_REQUEST_ID_CHARS}}}")


PARTITION_SEP = "#"
"""Between the model name and the partition number in a partition's hash tag
(``{model#3}``); no name may hold it, so no tag of one model is another model's."""
MAX_PARTITIONS = 1024
"""Most partitions a model may have."""


def partition_of(request_id: str, partitions: int) -> int:
    """The partition of a request id among ``partitions``: CRC-32 (IEEE, as zlib and
    PROTOCOL.md "Partitions") of its ASCII bytes, mod ``partitions``."""
    return zlib.crc32(request_id.encode("ascii")) % partitions


class Lane(StrEnum):
    """Which stream of a model a job goes to; workers serve interactive first."""

    INTERACTIVE = "interactive"
    BULK = "bulk"


# --------------------------------------------------------------------------- names


def validate_name(name: str, what: str = "model") -> str:
    """Return ``name`` if it is a safe model or prefix name, else raise ValueError.

    Names end up inside Redis keys and are never resolved to files or code, but
    keeping them to a small alphabet stops slashes, braces (hash tags) and
    whitespace from making keys ambiguous.
    """
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(f"invalid {what} name {name!r:.100}: use 1-{MAX_NAME_CHARS} of "
                         "[A-Za-z0-9_.-], starting with a letter or digit")
    return name


def valid_request_id(request_id: object) -> bool:
    """True for a str of 1-MAX_REQUEST_ID_CHARS characters of ``A-Z a-z 0-9 _ . : -``."""
    return isinstance(request_id, str) and bool(_REQUEST_ID_RE.fullmatch(request_id))


def new_request_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True, slots=True)
class Keys:
    """Every Redis key of one model.

    All keys carry the model name as a Redis Cluster hash tag (``{model}``) so
    one model's streams and results live in one slot, which lets the worker
    write a result and acknowledge its job in one MULTI/EXEC. Partition p > 0 of the
    model (PROTOCOL.md "Partitions") has the same keys under the tag ``{model#p}``.
    """

    model: str
    prefix: str = DEFAULT_PREFIX
    #: Which partition's keys (PROTOCOL.md "Partitions"); 0's are the model's plain keys.
    partition: int = 0

    def __post_init__(self) -> None:
        validate_name(self.model, "model")
        validate_name(self.prefix, "prefix")
        if not 0 <= self.partition < MAX_PARTITIONS:
            raise ValueError(f"partition {self.partition!r} out of 0-{MAX_PARTITIONS - 1}")

    @property
    def tag(self) -> str:
        """The hash tag's text: the model name, or ``model#p`` for partition p > 0."""
        return self.model if self.partition == 0 else f"{self.model}{PARTITION_SEP}{self.partition}"

    @property
    def _base(self) -> str:
        return f"{self.prefix}:{{{self.tag}}}"

    def part(self, partition: int) -> Keys:
        """The keys of another partition of the same model."""
        return Keys(self.model, self.prefix, partition)

    def of(self, request_id: str, partitions: int) -> Keys:
        """The keys of the partition ``request_id`` goes to among ``partitions``."""
        return self.part(partition_of(request_id, partitions))

    def parts(self, count: int) -> list[Keys]:
        """The keys of partitions 0 to ``count - 1`` of the model, partition p at index p."""
        return [self.part(p) for p in range(count)]

    def partitions(self) -> str:
        """List (model-wide, partition 0's slot) of the model's partition history: the
        counts P it had, ascending, in decimal; the last is P now."""
        return f"{self.prefix}:{{{self.model}}}:partitions"

    def stream(self, lane: Lane) -> str:
        """The job stream of one lane."""
        return f"{self._base}:jobs:{Lane(lane).value}"

    def streams(self) -> list[str]:
        """All job streams, highest priority first."""
        return [self.stream(lane) for lane in Lane]

    def result(self, request_id: str) -> str:
        """String key holding the msgpack result envelope (expires)."""
        return f"{self._base}:result:{request_id}"

    def done(self, request_id: str) -> str:
        """List key that receives one token when the result is written (BLPOP it)."""
        return f"{self._base}:done:{request_id}"

    def dlq(self) -> str:
        """The dead-letter stream: jobs that will not be run again, with the reason."""
        return f"{self._base}:dlq"

    def reply(self, name: str) -> str:
        """A client's reply list: workers push the request id of each finished job whose
        envelope names it, so a client with many jobs in flight waits on one key."""
        return f"{self._base}:reply:{validate_name(name, 'reply')}"

    def is_reply(self, key: str) -> bool:
        """True for a key :meth:`reply` can produce; workers write no other list a job names."""
        prefix = f"{self._base}:reply:"
        return key.startswith(prefix) and bool(_NAME_RE.fullmatch(key[len(prefix):]))

    def reply_name(self, key: str) -> str | None:
        """The NAME of ``key`` when it is a reply list of this model in any partition (as
        :meth:`reply` makes them), else None: a job's reply list lives in the job's own
        partition, so a list of another partition is the same NAME there."""
        m = re.fullmatch(rf"{re.escape(self.prefix)}:\{{{re.escape(self.model)}"
                         rf"(?:{PARTITION_SEP}[1-9][0-9]*)?\}}:reply:(.+)", key)
        return m.group(1) if m and _NAME_RE.fullmatch(m.group(1)) else None

    def owner(self, request_id: str) -> str:
        """String key naming the stream entry id of the job that owns ``request_id``, for
        as long as that job is queued or its result lives (see NOTE [ Request id owners ])."""
        return f"{self._base}:owner:{request_id}"

    def tokens(self, request_id: str) -> str:
        """Stream of a generation job's answer in chunks, entry ``0-n`` for chunk n
        (PROTOCOL.md "Token stream"): a second write of an index is refused by Redis."""
        return f"{self._base}:tokens:{request_id}"

    def stop(self, request_id: str) -> str:
        """String key any client sets to cancel a running generation; the worker reads
        the stop keys of its running generations once per step."""
        return f"{self._base}:stop:{request_id}"

    def limits(self) -> str:
        """Hash of queue bounds: field = lane name, value = most entries its stream may
        hold for a new job to be admitted (absent: unbounded); field ``<lane>:tokens``
        (token_bound_field), the most tokens its queued jobs may be charged. See
        ADMIT_SCRIPT."""
        return f"{self._base}:limits"

    def charges(self, lane: Lane) -> str:
        """Hash of what a lane's queued jobs are charged against its token bound: field =
        stream entry id, value = the job's charge in tokens, and the script's own fields
        ``total`` and ``recounted`` (NOTE [ Token charges ] in admission.py). Written by
        the admission script only while the lane has a token bound; workers delete an
        entry's field with the entry (PROTOCOL.md "Admission control")."""
        return f"{self._base}:charges:{Lane(lane).value}"

    def workers(self) -> str:
        """Sorted set of the model's workers: member = consumer name, score = its last
        heartbeat, Unix ms. Expires with the fleet (see WORKERS_TTL_MS)."""
        return f"{self._base}:workers"

    def worker(self, consumer: str) -> str:
        """String key holding one worker's msgpack WorkerRecord; it lives WORKER_RECORD_TTL_MS
        past the last heartbeat, so it exists only while the worker is alive."""
        return f"{self._base}:worker:{consumer}"

    def tenant(self, name: str) -> str:
        """Sorted set (partition 0's slot) of the request ids a gateway's tenant holds,
        scored by when each hold lapses, Unix ms (NOTE [ Tenant holds ] in tenants.py)."""
        return f"{self.prefix}:{{{self.model}}}:tenant:{name}"

    def recent(self) -> str:
        """List of the newest RECENT_MAX results' msgpack RecentResult records, newest first."""
        return f"{self._base}:recent"


_STREAM_TAIL_RE = re.compile(r"\{[^{}#]+(?:#([1-9][0-9]*))?\}:jobs:([a-z]+)$")


def token_bound_field(lane: Lane) -> str:
    """The limits-hash field of a lane's token bound: ``<lane>:tokens``."""
    return f"{Lane(lane).value}:tokens"


def stream_partition(key: str) -> tuple[int, Lane]:
    """``(partition, lane)`` of a job stream key :meth:`Keys.stream` made (ValueError for
    another key)."""
    m = _STREAM_TAIL_RE.search(key)
    if m is None:
        raise ValueError(f"not a job stream: {key!r:.200}")
    return int(m.group(1) or 0), Lane(m.group(2))


def job_stream_pattern(prefix: str) -> str:
    """SCAN MATCH pattern for the job streams of every model under ``prefix``."""
    return f"{validate_name(prefix, 'prefix')}:{{*}}:jobs:*"


def parse_job_stream(prefix: str, key: str) -> tuple[str, Lane] | None:
    """``(model, lane)`` of a job stream key, or None for any other key."""
    m = re.fullmatch(rf"{re.escape(prefix)}:\{{([^{{}}#]+)(?:#[1-9][0-9]*)?\}}:jobs:([a-z]+)", key)
    if m is None or not _NAME_RE.fullmatch(m.group(1)):
        return None
    try:
        return m.group(1), Lane(m.group(2))
    except ValueError:
        return None


