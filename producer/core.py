"""The client's logic, once for both faces: envelopes, admission, queue bounds, the wait.

:class:`ClientCore` builds and validates job envelopes, and writes each operation as a
generator of steps (see ``calls.py``): the face sends the calls and hands back their
replies, the core turns them into request ids, a :class:`QueueState`, a result, or the
errors of ``errors.py``.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redbatch.common.protocol import (
    DUPLICATE_REPLY,
    MAX_CONTENT_TYPE_BYTES,
    QUEUE_FULL_REPLY,
    JobEnvelope,
    Keys,
    Lane,
    ResultEnvelope,
    error_reply_code,
    new_request_id,
    owner_ttl_ms,
    parse_queue_bound,
    valid_request_id,
)
from redbatch.producer.calls import Admit, Command, Pipelined, Steps
from redbatch.producer.errors import DuplicateRequestId, QueueFull
from redbatch.producer.wait import wait_for_result


@dataclass(frozen=True, slots=True)
class QueueState:
    """One lane's queue: entries in its stream (queued or in progress) and its bound."""

    lane: Lane
    queued: int
    #: Most entries admitted; None: unbounded.
    bound: int | None

    @property
    def room(self) -> int | None:
        """Jobs that would be admitted now (absent other producers); None: unbounded."""
        return None if self.bound is None else max(0, self.bound - self.queued)


class ClientCore:
    """What the sync and async clients share: settings, keys, envelopes, and each
    operation as steps (the faces run them)."""

    def __init__(self, redis_url: str, model: str, prefix: str, max_payload_bytes: int) -> None:
        self.redis_url = redis_url
        self.model = model
        self.prefix = prefix
        self.max_payload_bytes = max_payload_bytes

    def keys(self, model: str | None = None) -> Keys:
        """The keys of ``model`` (default: the client's) under the client's prefix."""
        return Keys(model or self.model, self.prefix)

    def job(self, payload: bytes, *, model: str | None = None, timeout_s: float | None = None,
            lane: Lane | str = Lane.INTERACTIVE, params: Mapping[str, Any] | None = None,
            content_type: str = "application/octet-stream", request_id: str | None = None,
            reply_to: str | None = None) -> JobEnvelope:
        """A validated job envelope (not yet sent); ``submit`` takes the same keywords.
        Raises TypeError or ValueError for what a worker would refuse unread."""
        self._check_payload(payload, content_type, params)
        request_id = request_id or new_request_id()
        if not valid_request_id(request_id):
            raise ValueError(f"invalid request id {request_id!r}")
        now_ms = int(time.time() * 1000)
        deadline = None if timeout_s is None else now_ms + int(timeout_s * 1000)
        return JobEnvelope(request_id=request_id, model=self.keys(model).model,
                           payload=bytes(payload), content_type=content_type,
                           submitted_ms=now_ms, deadline_ms=deadline, lane=Lane(lane),
                           params=dict(params or {}), reply_to=reply_to)

    def _check_payload(self, payload: bytes, content_type: str,
                       params: Mapping[str, Any] | None) -> None:
        """Raises TypeError or ValueError for a payload, content type or params that a
        worker would refuse unread."""
        if not isinstance(payload, bytes | bytearray | memoryview):
            raise TypeError("payload must be bytes")
        if len(payload) > self.max_payload_bytes:
            raise ValueError(f"payload of {len(payload)} bytes exceeds {self.max_payload_bytes}")
        if len(content_type.encode()) > MAX_CONTENT_TYPE_BYTES:
            raise ValueError(f"content_type longer than {MAX_CONTENT_TYPE_BYTES} bytes")
        if any(not isinstance(key, str) for key in params or {}):
            raise TypeError("params keys must be str")

    def _jobs(self, payloads: Iterable[bytes], kw: Mapping[str, Any]) -> list[JobEnvelope]:
        """Envelopes for submit_many: the keywords of submit, shared by every payload."""
        return [self.job(p, model=kw.get("model"), timeout_s=kw.get("timeout_s"),
                          lane=kw.get("lane", Lane.INTERACTIVE), params=kw.get("params"),
                          content_type=kw.get("content_type", "application/octet-stream"),
                          request_id=None) for p in payloads]

    def _submit(self, job: JobEnvelope) -> Steps[str]:
        """Queue one job through the admission script; returns its request id."""
        try:
            yield _admit(self.keys(job.model), job)
        except redis.ResponseError as e:
            _admitted([job], [e])
            raise
        return job.request_id

    def _submit_jobs(self, jobs: Sequence[JobEnvelope]) -> Steps[list[str]]:
        """Queue jobs in one pipelined round trip; returns the admitted request ids."""
        if not jobs:
            return []
        calls = tuple(_admit(self.keys(job.model), job) for job in jobs)
        replies = yield Pipelined(calls, errors_as_replies=True)
        return _admitted(jobs, replies)

    def _set_queue_limit(self, lane: Lane | str, max_jobs: int | None,
                         model: str | None) -> Steps[None]:
        """Set (or, for None, remove) the lane's bound in the model's limits hash."""
        if max_jobs is not None and (isinstance(max_jobs, bool) or max_jobs < 0):
            raise ValueError(f"max_jobs must be a non-negative int or None, not {max_jobs!r}")
        key, field = self.keys(model).limits(), Lane(lane).value
        yield Command(("HDEL", key, field) if max_jobs is None else ("HSET", key, field, max_jobs))

    def _queue_state(self, lane: Lane | str, model: str | None) -> Steps[QueueState]:
        """The lane's backlog (XLEN of its stream) and bound, in one round trip."""
        keys, lane = self.keys(model), Lane(lane)
        queued, raw = yield Pipelined((Command(("XLEN", keys.stream(lane))),
                                       Command(("HGET", keys.limits(), lane.value))))
        return QueueState(lane, int(queued), parse_queue_bound(raw))

    def _result(self, request_id: str, timeout_s: float,
                model: str | None) -> Steps[ResultEnvelope]:
        """Wait for the result of ``request_id`` (see ``wait.py``)."""
        return wait_for_result(request_id, self.keys(model), timeout_s)


def _admit(keys: Keys, job: JobEnvelope) -> Admit:
    """The admission script's call for one job: its stream, the limits hash and the id's
    owner key; the lane, the owner key's TTL and the envelope's fields."""
    fields = [x for name, value in job.encode().items() for x in (name, value)]
    return Admit([keys.stream(job.lane), keys.limits(), keys.owner(job.request_id)],
                 [Lane(job.lane).value, owner_ttl_ms(job.budget_ms), *fields])


def _reply_code(reply: object) -> str | None:
    """The code (first word) of an admission error reply, None for any other reply."""
    return error_reply_code(str(reply)) if isinstance(reply, redis.ResponseError) else None


def _refused_bound(reply: object) -> int | None:
    """The bound named by the admission script's ``QUEUE_FULL <bound>`` reply, else None."""
    if _reply_code(reply) != QUEUE_FULL_REPLY:
        return None
    words = str(reply).split()
    return (parse_queue_bound(words[1]) if len(words) > 1 else None) or 0


def _admitted(jobs: Sequence[JobEnvelope], replies: Sequence[object]) -> list[str]:
    """Request ids of the admitted jobs; raises QueueFull naming the refused ones (its
    ``duplicates`` lists ids refused as in use), DuplicateRequestId when only ids in
    use were refused, or the first other error a reply holds."""
    accepted, refused, duplicates = [], [], []
    first: tuple[JobEnvelope, int] | None = None
    for job, reply in zip(jobs, replies, strict=True):
        bound = _refused_bound(reply)
        if bound is not None:
            refused.append(job.request_id)
            first = first or (job, bound)
        elif _reply_code(reply) == DUPLICATE_REPLY:
            duplicates.append(job.request_id)
        elif isinstance(reply, BaseException):
            raise reply
        else:
            accepted.append(job.request_id)
    if first is not None:
        job, bound = first
        full = QueueFull(job.model, Lane(job.lane), bound, refused, accepted)
        full.duplicates = duplicates
        raise full
    if duplicates:
        raise DuplicateRequestId(duplicates, accepted)
    return accepted
