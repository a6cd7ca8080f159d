"""The client's logic, once for both faces: envelopes, admission, queue bounds, the wait.

:class:`ClientCore` builds and validates job envelopes, and writes each operation as a
generator of steps (see ``calls.py``): the face sends the calls and hands back their
replies, the core turns them into request ids, a :class:`QueueState`, a result, or the
errors of ``errors.py``. Jobs sent by ``submit`` and ``submit_many`` name the client's
reply list of their model, on which all their waits are served together (``replies.py``);
the admission calls themselves, and what their replies mean, are ``admission.py``'s.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import redis
from redbatch.common.protocol import (
    CANCELLED_REPLY,
    DUPLICATE_REPLY,
    FIELD_JOB,
    IDEMPOTENCY_WINDOW_MS,
    MAX_CONTENT_TYPE_BYTES,
    UNKNOWN_REPLY,
    JobEnvelope,
    JobState,
    JobStatus,
    Keys,
    Lane,
    ProtocolError,
    WorkerRecord,
    candidate_partitions,
    idempotency_window_ms,
    job_status,
    new_request_id,
    parse_partition_history,
    parse_queue_bound,
    token_bound_field,
    valid_request_id,
)
from redbatch.common.protocol.functions import CANCEL_FUNCTION, STATUS_FUNCTION
from redbatch.common.protocol.generation import STOP_TTL_MS, STOP_VALUE
from redbatch.common.protocol.payloads import encode_payload
from redbatch.common.redis_io import error_code
from redbatch.producer.admission import (
    admission_call,
    admission_groups,
    admitted_ids,
    replies_per_job,
)
from redbatch.producer.calls import Command, Inbox, Pause, Pipelined, Script, Steps
from redbatch.producer.errors import ResultTimeout, ResultUnreadable
from redbatch.producer.replies import Gathering, ReplyWaits
from redbatch.producer.wait import RECONNECT_PAUSE_S, DoneMoves, reply_by

PARTITIONS_REFRESH_S = 5.0
"""How long the client trusts the partition count it read (PROTOCOL.md "Partitions")."""

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class QueueState:
    """One lane's queue: entries in its streams (queued or in progress) and its bound. A
    bound holds per partition (PROTOCOL.md "Partitions"): ``queued`` counts every
    partition's stream, ``bound`` is partition 0's (``set_queue_limit`` sets them all),
    and ``partitions`` holds each partition's own figures."""

    lane: Lane
    queued: int
    #: Most entries admitted (per partition); None: unbounded.
    bound: int | None
    #: Each partition's ``(queued, bound)``, partition p at index p; empty: one partition.
    partitions: tuple[tuple[int, int | None], ...] = ()
    #: Most tokens the queued generation jobs may be charged (per partition); None: none.
    token_bound: int | None = None
    #: The charges the lane's jobs hold against the token bound, summed over partitions
    #: (recorded only while a token bound is set; may count a job just answered).
    tokens: int = 0

    @property
    def room(self) -> int | None:
        """Jobs that would be admitted now (absent other producers), summed over the
        partitions; None: a partition is unbounded."""
        parts = self.partitions or ((self.queued, self.bound),)
        if any(bound is None for _, bound in parts):
            return None
        return sum(max(0, (bound or 0) - queued) for queued, bound in parts)


class ClientCore:
    """What the sync and async clients share: settings, keys, envelopes, and each
    operation as steps (the faces run them)."""

    def __init__(self, redis_url: str, model: str, prefix: str, max_payload_bytes: int,
                 idempotency_window_s: float = IDEMPOTENCY_WINDOW_MS / 1000) -> None:
        self.redis_url = redis_url
        #: How long the id of a job without a deadline stays taken, ms (ValueError when
        #: outside the bounds of ``idempotency_window_ms``).
        self.idempotency_window_ms = idempotency_window_ms(idempotency_window_s)
        self.model = model
        self.prefix = prefix
        self.max_payload_bytes = max_payload_bytes
        #: Random per instance: the NAME of the client's reply lists (``Keys.reply``).
        self.name = f"client-{uuid.uuid4().hex[:16]}"
        #: The client's reply lists, by partition tag (``Keys.tag``: the model's name for
        #: partition 0), made at the first submit naming one.
        self.reply_waits: dict[str, ReplyWaits] = {}
        #: Whether Redis is a cluster, where one call names keys of one slot only: the
        #: admission call then names no other partition's owner keys (set by the face).
        self.one_slot_per_call = False
        #: Whether this client's user may BLMOVE a done list (its waits poll once refused).
        self.moves = DoneMoves()
        #: Each model's partition history and when it was read (monotonic s).
        self._histories: dict[str, tuple[tuple[int, ...], float]] = {}
        #: Models whose partitions key held another type (warned once each).
        self._bad_counts: set[str] = set()

    def keys(self, model: str | None = None) -> Keys:
        """The keys of ``model`` (default: the client's) under the client's prefix."""
        return Keys(model or self.model, self.prefix)

    def job(self, payload: Any, *, model: str | None = None, timeout_s: float | None = None,
            lane: Lane | str = Lane.INTERACTIVE, params: Mapping[str, Any] | None = None,
            content_type: str | None = None, request_id: str | None = None,
            reply_to: str | None = None, done_only: bool = False) -> JobEnvelope:
        """A validated job envelope (not yet sent); ``submit`` takes the same keywords.
        ``payload`` is bytes, a str, a numpy array or a JSON value, encoded with its content
        type as ``common/protocol/payloads.py`` says (``content_type`` overrides the type).
        ``done_only`` (for a job that names no reply list, awaited by a per-request waiter,
        perhaps in another language): its answer is kept in its done list only (PROTOCOL.md
        "Waiting for the result"). Raises TypeError or ValueError for what a worker would
        refuse unread."""
        payload, content_type = encode_payload(payload, content_type)
        self._check_payload(payload, content_type, params)
        request_id = request_id or new_request_id()
        _check_request_id(request_id)
        now_ms = int(time.time() * 1000)
        deadline = None if timeout_s is None else now_ms + int(timeout_s * 1000)
        return JobEnvelope(request_id=request_id, model=self.keys(model).model,
                           payload=bytes(payload), content_type=content_type,
                           submitted_ms=now_ms, deadline_ms=deadline, lane=Lane(lane),
                           params=dict(params or {}), reply_to=reply_to, done_only=done_only)

    def _check_payload(self, payload: bytes, content_type: str,
                       params: Mapping[str, Any] | None) -> None:
        """Raises TypeError or ValueError for a payload, content type or params that a
        worker would refuse unread."""
        if len(payload) > self.max_payload_bytes:
            raise ValueError(f"payload of {len(payload)} bytes exceeds {self.max_payload_bytes}")
        if len(content_type.encode()) > MAX_CONTENT_TYPE_BYTES:
            raise ValueError(f"content_type longer than {MAX_CONTENT_TYPE_BYTES} bytes")
        if any(not isinstance(key, str) for key in params or {}):
            raise TypeError("params keys must be str")

    def _jobs(self, payloads: Iterable[Any], kw: Mapping[str, Any]) -> list[JobEnvelope]:
        """Envelopes for submit_many: the keywords of submit, shared by every payload."""
        return self.jobs(payloads, **kw)

    def jobs(self, payloads: Iterable[Any], *, request_ids: Sequence[str] | None = None,
             **kw: Any) -> list[JobEnvelope]:
        """Envelopes naming this client's reply list, for ``submit_jobs``: ``submit``'s
        keywords, shared by every payload, and each job's request id from ``request_ids``
        (default: new ones). Raises TypeError or ValueError as :meth:`job` does."""
        reply_to = self._reply_to(kw.get("model"))
        payloads = list(payloads)
        ids: Sequence[str | None] = request_ids or [None] * len(payloads)
        if len(ids) != len(payloads):
            raise ValueError(f"{len(ids)} request ids for {len(payloads)} payloads")
        return [self.job(p, model=kw.get("model"), timeout_s=kw.get("timeout_s"),
                          lane=kw.get("lane", Lane.INTERACTIVE), params=kw.get("params"),
                          content_type=kw.get("content_type"),
                          request_id=rid, reply_to=reply_to)
                for p, rid in zip(payloads, ids, strict=True)]

    def _reply_to(self, model: str | None) -> str | None:
        """The reply list new jobs of ``model`` name: the client's, or None once it proved
        unusable (NOTE [ Waiting in groups ], item 3)."""
        name = self.keys(model).model
        waits = self.reply_waits.get(name)
        if waits is None:
            waits = self.reply_waits.setdefault(name, ReplyWaits(self.keys(name), self.name))
        return None if waits.polling else waits.key

    def _waits_for(self, keys: Keys) -> ReplyWaits:
        """The client's reply list of one partition of a model."""
        waits = self.reply_waits.get(keys.tag)
        if waits is None:
            waits = self.reply_waits.setdefault(keys.tag, ReplyWaits(keys, self.name))
        return waits

    def _history(self, model: str | None, due: float | None = None) -> Steps[tuple[int, ...]]:
        """The model's partition history, read again when older than PARTITIONS_REFRESH_S;
        the reply is due by ``due`` (monotonic s) when given, else the socket timeout's."""
        keys = self.keys(model)
        cached = self._histories.get(keys.model)
        if cached is not None and time.monotonic() - cached[1] < PARTITIONS_REFRESH_S:
            return cached[0]
        try:
            raw = yield Command(("LRANGE", keys.partitions(), 0, -1), due)
        except redis.ResponseError as e:
            if error_code(e) != "WRONGTYPE":
                raise
            raw = None  # unreadable: 1 (PROTOCOL.md "Partitions")
            if keys.model not in self._bad_counts:
                self._bad_counts.add(keys.model)
                logger.warning("%s is not a list (%s): it reads as 1 partition",
                               keys.partitions(), e)
        history = parse_partition_history(raw)
        self._histories[keys.model] = (history, time.monotonic())
        return history

    def _wait_history(self, model: str | None, request_ids: Sequence[str], timeout_s: float,
                      deadline: float) -> Steps[None]:
        """Read the partition history a wait needs (whose partitions its ids may be in),
        again after a lost or late connection; ResultTimeout (naming the first id) once
        ``deadline`` (monotonic s) passes, as every wait ends whatever Redis does."""
        while True:
            try:
                yield from self._history(model, reply_by(deadline))
                return
            except (redis.ConnectionError, redis.TimeoutError):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ResultTimeout(request_ids[0] if request_ids else "", timeout_s) \
                        from None
                yield Pause(min(RECONNECT_PAUSE_S, left))

    def _job_keys(self, model: str | None, request_id: str) -> Keys:
        """The keys of the partition ``request_id`` goes to under the count last read."""
        keys = self.keys(model)
        history = self._histories.get(keys.model, ((1,), 0.0))[0]
        return keys.of(request_id, history[-1])

    def _place(self, jobs: Sequence[JobEnvelope]) -> list[JobEnvelope]:
        """The jobs, each naming the client's reply list of its own partition where it
        named the client's list of partition 0 (``_reply_to``), and any other reply list
        of its model (``redbatch score``'s) in the job's own partition, the same NAME: a
        worker answers a job naming a list of another partition ``bad_envelope``."""
        placed = []
        for job in jobs:
            keys = self._job_keys(job.model, job.request_id)
            first = self.reply_waits.get(job.model)
            if first is not None and job.reply_to == first.key:
                if keys.partition:
                    waits = self._waits_for(keys)
                    job = replace(job, reply_to=None if waits.polling else waits.key)
            elif job.reply_to is not None and (name := keys.reply_name(job.reply_to)) \
                    and job.reply_to != keys.reply(name):
                job = replace(job, reply_to=keys.reply(name))
            placed.append(job)
        return placed

    def placed_keys(self, request_id: str, model: str | None = None) -> Keys:
        """The keys of the partition a job of ``request_id`` submitted by this client just
        now went to: its id's partition under the count the client read last, which its
        submit read (or trusted) before sending (PROTOCOL.md "Partitions")."""
        return self._job_keys(model, request_id)

    def _record(self, jobs: Sequence[JobEnvelope]) -> None:
        """Remember the jobs that name the client's reply list, before they are sent."""
        by_key = {waits.key: waits for waits in self.reply_waits.values()}
        for job in jobs:
            waits = by_key.get(job.reply_to or "")
            if waits is not None:
                waits.record([job.request_id])

    def _refused(self, jobs: Sequence[JobEnvelope], replies: Sequence[object]) -> None:
        """Forget the jobs an error reply says were not queued."""
        by_key = {waits.key: waits for waits in self.reply_waits.values()}
        for job, reply in zip(jobs, replies, strict=True):
            waits = by_key.get(job.reply_to or "")
            if waits is not None and isinstance(reply, redis.ResponseError):
                waits.forget([job.request_id])

    def _submit(self, job: JobEnvelope) -> Steps[str]:
        """Queue one job through the admission script; returns its request id."""
        return (yield from self._submit_jobs([job]))[0]

    def _submit_jobs(self, jobs: Sequence[JobEnvelope]) -> Steps[list[str]]:
        """Queue jobs in one round trip: one admission call per lane (and MAX_ADMIT_JOBS
        jobs), pipelined when there are several; returns the admitted request ids. On a
        cluster after a partition raise, one more round trip first (``_taken_elsewhere``)."""
        if not jobs:
            return []
        for model in dict.fromkeys(job.model for job in jobs):
            yield from self._history(model)
        jobs = self._place(jobs)
        self._record(jobs)
        keys = [self._job_keys(job.model, job.request_id) for job in jobs]
        taken = yield from self._taken_elsewhere(jobs, keys)
        groups = [kept for group in admission_groups(jobs, [k.partition for k in keys])
                  if (kept := [i for i in group if i not in taken])]
        calls = tuple(admission_call(keys[group[0]], [jobs[i] for i in group],
                                     self.idempotency_window_ms, self._earlier_owners(
                                         keys[group[0]], [jobs[i] for i in group]))
                      for group in groups)
        replies: list[object] = []
        if len(calls) > 1:
            replies = yield Pipelined(calls, errors_as_replies=True)
        elif calls:  # alone, not in a pipeline: a pipeline of one costs more
            try:
                replies = [(yield calls[0])]
            except redis.ResponseError as e:
                replies = [e]
        per_job = replies_per_job(groups, replies, len(jobs))
        for i in taken:
            per_job[i] = redis.ResponseError(f"{DUPLICATE_REPLY} ?")
        self._refused(jobs, per_job)
        return admitted_ids(jobs, per_job)

    def _elsewhere(self, keys: Keys, request_id: str) -> list[Keys]:
        """The keys of the partitions other than ``keys``' that ``request_id`` may have
        gone to under the model's history (an id taken under an older count is taken)."""
        history = self._histories.get(keys.model, ((1,), 0.0))[0]
        return [keys.part(q) for q in candidate_partitions(request_id, history)
                if q != keys.partition]

    def _earlier_owners(self, keys: Keys, jobs: Sequence[JobEnvelope]) -> list[str]:
        """The jobs' owner keys elsewhere, for the admission call in ``keys``' partition
        to check atomically; none on a cluster (other slots: see ``_taken_elsewhere``)."""
        if self.one_slot_per_call:
            return []
        return [other.owner(job.request_id) for job in jobs
                for other in self._elsewhere(keys, job.request_id)]

    def _taken_elsewhere(self, jobs: Sequence[JobEnvelope],
                         keys: Sequence[Keys]) -> Steps[set[int]]:
        """On a cluster, the indexes of the jobs whose id has an owner in another partition
        of the history: one MGET per such partition, in one pipeline, before the admission
        calls (not atomic with them: PROTOCOL.md "Partitions"). Elsewhere none."""
        if not self.one_slot_per_call:
            return set()
        asks: dict[str, tuple[Keys, list[int]]] = {}
        for i, job in enumerate(jobs):
            for other in self._elsewhere(keys[i], job.request_id):
                asks.setdefault(other.tag, (other, []))[1].append(i)
        if not asks:
            return set()
        found = yield Pipelined(tuple(Command(("MGET", *(part.owner(jobs[i].request_id)
                                                          for i in indexes)))
                                      for part, indexes in asks.values()),
                                errors_as_replies=True)
        return {i for (_, indexes), values in zip(asks.values(), found, strict=True)
                if isinstance(values, list)
                for i, value in zip(indexes, values, strict=True) if value is not None}

    def _set_queue_limit(self, lane: Lane | str, bound: int | None, model: str | None,
                         tokens: bool = False) -> Steps[None]:
        """Set (or, for None, remove) the lane's bound, in jobs or (``tokens``) in tokens,
        in the limits hash of every partition of the model (a bound holds per partition:
        PROTOCOL.md "Partitions")."""
        what = "max_tokens" if tokens else "max_jobs"
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int)
                                  or bound < 0):
            raise ValueError(f"{what} must be a non-negative int or None, not {bound!r}")
        count = (yield from self._history(model))[-1]
        field = token_bound_field(Lane(lane)) if tokens else Lane(lane).value
        calls = tuple(Command(("HDEL", key, field) if bound is None
                              else ("HSET", key, field, bound))
                      for key in (self.keys(model).part(p).limits() for p in range(count)))
        if len(calls) == 1:
            yield calls[0]
        else:
            yield Pipelined(calls)

    def _queue_state(self, lane: Lane | str, model: str | None) -> Steps[QueueState]:
        """The lane's backlog (XLEN of its stream), bound, token bound and the charges its
        jobs hold, in every partition, in one round trip (and one for the partition count,
        when due)."""
        count = (yield from self._history(model))[-1]
        parts, lane = self.keys(model).parts(count), Lane(lane)
        replies = yield Pipelined(tuple(call for keys in parts for call in (
            Command(("XLEN", keys.stream(lane))), Command(("HGET", keys.limits(), lane.value)),
            Command(("HGET", keys.limits(), token_bound_field(lane))),
            Command(("HVALS", keys.charges(lane))))))
        each = [(int(replies[4 * p]), parse_queue_bound(replies[4 * p + 1]))
                for p in range(count)]
        held = sum(int(v) for p in range(count) for v in replies[4 * p + 3]
                   if v.isdigit())
        return QueueState(lane, sum(queued for queued, _ in each), each[0][1],
                          tuple(each) if count > 1 else (),
                          parse_queue_bound(replies[2]), held)

    def _workers(self, model: str | None) -> Steps[list[WorkerRecord]]:
        """The live workers of the model: the members of its workers set whose heartbeat
        record still exists (a record outlives three missed heartbeats, about 6 s), in two
        round trips (ZRANGE, then MGET). A record that does not decode is left out."""
        keys = self.keys(model)
        names = yield Command(("ZRANGE", keys.workers(), 0, -1))
        if not names:
            return []
        records = yield Command(("MGET", *(keys.worker(n.decode()) for n in names)))
        live = []
        for data in records:
            if data is None:
                continue  # gone: its record expired since the ZRANGE, or it stopped
            try:
                live.append(WorkerRecord.decode(data))
            except ProtocolError:
                continue
        return live

    def _status(self, request_id: str, model: str | None) -> Steps[JobStatus]:
        """Where the job is, from what Redis holds: one run of the status script (see
        NOTE [ Status and cancel ] in common/protocol/lifecycle.py), in each partition the
        id may have gone to under the model's partition history, until one knows it."""
        status = None
        for keys in (yield from self._candidates(model, request_id)):
            status = yield from self._status_in(keys, request_id)
            if status.state is not JobState.UNKNOWN:
                break
        assert status is not None
        return status

    def _candidates(self, model: str | None, request_id: str) -> Steps[list[Keys]]:
        """The keys of each partition ``request_id`` may be in, newest count first."""
        keys = _checked(self.keys(model), request_id)
        history = yield from self._history(model)
        return [keys.part(p) for p in candidate_partitions(request_id, history)]

    def _status_in(self, keys: Keys, request_id: str) -> Steps[JobStatus]:
        """The status script's answer in one partition."""
        call = Script([keys.result(request_id), keys.owner(request_id),
                       *(keys.stream(lane) for lane in Lane), keys.done(request_id)], [],
                      STATUS_FUNCTION, read_only=True)
        try:
            reply = yield call
            return job_status(request_id, reply)
        except (ProtocolError, redis.ResponseError) as e:
            if isinstance(e, redis.ResponseError) and not str(e).startswith("WRONGTYPE"):
                raise
            raise ResultUnreadable(request_id, keys.result(request_id), str(e)) from None

    def _cancel(self, request_id: str, model: str | None) -> Steps[bool]:
        """Cancel the job if no worker has taken it yet: one run of the cancel script.
        True when it was queued (it will never run, and a worker answers it
        ``cancelled``); False when a worker has taken it, or Redis knows no queued job of
        that id. The cancel entry names this client's reply list when the client submitted
        the job, so that its waits hear of it at once. Tried in each partition the id may
        be in (``_candidates``) until one knows it."""
        word = ""
        for keys in (yield from self._candidates(model, request_id)):
            word = yield from self._cancel_in(keys, request_id)
            if word != UNKNOWN_REPLY:
                break
        return word == CANCELLED_REPLY

    def _stop(self, request_id: str, model: str | None) -> Steps[bool]:
        """Stop a generation job wherever it is (PROTOCOL.md "Cancelling a running
        generation"): its stop key in each partition it may be in, which a worker running
        it reads at its next step, then the cancel script for a job still queued. True
        when it was queued (it will never run)."""
        for keys in (yield from self._candidates(model, request_id)):
            yield Command(("SET", keys.stop(request_id), STOP_VALUE, "PX", STOP_TTL_MS))
        return (yield from self._cancel(request_id, model))

    def _token_keys(self, request_id: str, model: str | None) -> Steps[Keys]:
        """The keys of the partition a job of ``request_id`` is in under the newest count:
        where its token stream is, whoever submitted it."""
        return (yield from self._candidates(model, request_id))[0]

    def _cancel_in(self, keys: Keys, request_id: str) -> Steps[str]:
        """The cancel script's first reply word in one partition."""
        waits = self.reply_waits.get(keys.tag)
        reply_to = waits.key if waits is not None and waits.submitted(request_id) else None
        marker = JobEnvelope(request_id=request_id, model=keys.model, payload=b"",
                             submitted_ms=int(time.time() * 1000), reply_to=reply_to)
        reply = yield Script([*(keys.stream(lane) for lane in Lane), keys.owner(request_id)],
                             [request_id, marker.encode()[FIELD_JOB]], CANCEL_FUNCTION)
        return (reply.decode() if isinstance(reply, bytes) else str(reply)).split(" ", 1)[0]

    def _gathering(self, request_ids: Sequence[str], timeout_s: float, model: str | None,
                   inbox: Inbox, deadline: float | None = None) -> Gathering:
        """The wait for ``request_ids`` of ``model``, through ``inbox`` (see replies.py),
        ending ``timeout_s`` from now or at ``deadline`` (monotonic s) when given."""
        name = self.keys(model).model
        waits = [w for w in self.reply_waits.values() if w.keys.model == name]
        history = self._histories.get(name, ((1,), 0.0))[0]
        keys = self.keys(name)
        gathering = Gathering(waits, lambda rid: [keys.part(p) for p in
                                                  candidate_partitions(rid, history)],
                              request_ids, timeout_s, inbox, deadline)
        gathering.moves = self.moves
        return gathering


def admitted_jobs(jobs: Sequence[JobEnvelope], admitted: Sequence[str]) -> list[JobEnvelope]:
    """The envelopes of the ``admitted`` request ids, in their order (for the handles)."""
    by_id = {job.request_id: job for job in jobs}
    return [by_id[rid] for rid in admitted]


def _check_request_id(request_id: str) -> None:
    """ValueError unless ``request_id`` is one (PROTOCOL.md "Names")."""
    if not valid_request_id(request_id):
        raise ValueError(f"invalid request id {request_id!r:.140}")


def _checked(keys: Keys, request_id: str) -> Keys:
    """``keys``, once ``request_id`` is one (ValueError otherwise)."""
    _check_request_id(request_id)
    return keys
