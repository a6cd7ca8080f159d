"""The result writer: write results and acknowledge their jobs, atomically.

For a group of answered entries (one flush of the writer thread) one
MULTI/EXEC sets each result key (with its TTL), wakes the waiting clients (a
token on each ``done`` list of a job that names no reply list, one RPUSH of
the ids per reply list), and only then acknowledges and deletes the stream
entries, many ids per XACK and XDEL. If the transaction fails nothing is
acknowledged, so a job never leaves its stream without its result written.

NOTE [ Write failures ]
  A MULTI is applied whole or not at all when Redis refuses it: out of memory
  under ``noeviction`` (OOM), a replica (READONLY), an ACL (NOPERM), a dropped
  connection. Then nothing was written or acknowledged, and the caller retries
  the same answers with back-off (``RedisUnavailable`` / ``RedisRefused``).
  Redis runs every other command of an EXEC even when one fails on its key
  (WRONGTYPE: someone planted a key of another type where an answer writes), so
  such a failure never fails the batch: the other answers are written, and the
  answer whose own key failed is *undeliverable*: its entry is acknowledged with
  the rest, what could be written stays (the result, when only its wake-up
  token failed), and the job goes to the dead-letter stream with the reason.
  Dead letters are never acknowledged unless their record can be written: when
  the dead-letter stream key holds another type, the dead-letter answers are
  held (returned to the caller, retried later) and their entries stay pending.
  WATCH makes that check and the EXEC one unit. A record that still fails (the
  key replaced in between, or an undeliverable answer's own record) is kept in
  memory and written on a later flush.

NOTE [ Replicas ]
  Redis replicates asynchronously: a master that acknowledged a transaction and dies
  before its replicas copied it loses the whole transaction on failover, results and
  acknowledgements together (MULTI/EXEC replicates as one unit), so the promoted replica
  still holds those jobs pending, and they are taken over and run again: answered late,
  never lost. With ``wait`` (--result-replicas) each transaction is followed by one WAIT
  (transaction.py NOTE [ WAIT after the write ]); a WAIT that timed out or failed is a
  warning (at most one a minute) and ``redbatch_result_waits_total{outcome="short"}``,
  never a failed write. RELIABILITY.md "What a failover can lose".

The module runs past 400 lines because an answer and the transaction that writes it change
together: every field of Answer is there for one command or one failure case of the write,
and the envelopes are built here so that their bytes are ready for the transaction.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, cast

import redis
from redbatch.common.logs import Throttle
from redbatch.common.protocol import (
    DLQ_ENTRY,
    FIELD_REQUEST_ID,
    GROUP,
    RECENT_MAX,
    RECENT_TTL_MS,
    AnswerKeys,
    DeadLetter,
    DeadLetters,
    ErrorCode,
    JobEnvelope,
    Keys,
    Lane,
    RecentResult,
    ReplyList,
    ResultEnvelope,
    Status,
    dead_letter,
    own_fields,
    stream_partition,
)
from redbatch.common.redis_io import REDIS_ERRORS, RedisRefused, RedisUnavailable, error_code
from redbatch.gpu_worker.streams.intake import BadEntry, Job
from redbatch.gpu_worker.streams.transaction import (
    Commands,
    Replication,
    ReplicaWait,
    exec_transaction,
    run_pipeline,
)

logger = logging.getLogger(__name__)

#: Dead-letter records kept in memory while the dead-letter stream cannot take them; past
#: this the oldest are dropped (and logged): memory stays bounded whatever Redis holds.
RECORDS_KEPT = 10_000


class RunOutcome(Protocol):
    """What the model thread says of one job of a batch (gpu_worker/device/runner.py
    ``Outcome``)."""

    @property
    def output(self) -> Any: ...
    @property
    def error(self) -> ErrorCode | None: ...
    @property
    def message(self) -> str: ...


@dataclass(slots=True)
class Answer:
    """One stream entry to acknowledge, with the encoded result to write first (if answerable)."""

    stream: str
    entry_id: bytes
    request_id: str | None
    encoded: bytes = b""
    slot: int = -1
    reply_to: str | None = None
    lane: Lane = Lane.INTERACTIVE
    dead_letter: DeadLetter | None = None
    """Fields of a dead-letter entry to add to the DLQ in the same transaction."""
    outcome: str = ""
    """``ok`` or the error code, for the fleet's recent-results list (Keys.recent) and the
    worker's metrics."""
    total_ms: float | None = None
    """The result's end-to-end time, ms; None when the entry was rejected unread."""
    timings: Mapping[str, float] | None = None
    """The result's stage timings, ms, for the worker's latency metrics."""
    envelope: JobEnvelope | None = None
    """The job, for its dead letter should the answer prove undeliverable."""
    deliveries: int = 1


@dataclass(frozen=True, slots=True)
class Flushed:
    """What a write left undone."""

    held: list[Answer] = field(default_factory=list)
    """Answers not written and not acknowledged (dead letters while the dead-letter stream
    cannot take them); retry them later."""
    undeliverable: int = 0
    """Answers acknowledged whose own keys failed; each went to the dead-letter stream."""
    failed: list[Answer] = field(default_factory=list)
    """Answers of the partitions whose write failed (nothing of theirs written or
    acknowledged), the other partitions' written: retry these alone."""
    error: Exception | None = None
    """Why the first of those partitions failed (RedisUnavailable, RedisRefused)."""


@dataclass(frozen=True, slots=True)
class _Op:
    """One queued command of the transaction: whose it is, for reading its reply."""

    answers: tuple[int, ...]
    """Indexes of the answers it belongs to (a reply list's RPUSH carries several); empty
    for the flush's shared commands."""
    what: str
    """Command and key, for messages."""
    record: bool = False
    """The dead-letter XADD of its answer."""
    recent: bool = False
    """The LPUSHX of the recent list: 0 means the list is gone and must be made again."""


#: How often the recent list is trimmed and its TTL renewed, s; the flushes in between
#: only push onto it (one command, not three), so it holds at most RECENT_MAX plus this
#: long's results, and expires RECENT_TTL_MS after its last upkeep.
RECENT_UPKEEP_S = 1.0


def _answer(entry: Job | BadEntry, result: ResultEnvelope, slot: int = -1) -> Answer:
    job = entry if isinstance(entry, Job) else None
    return Answer(entry.stream, entry.entry_id, result.request_id, result.encode(), slot,
                  job.envelope.reply_to if job else cast(BadEntry, entry).reply_to,
                  job.envelope.lane if job else Lane.INTERACTIVE, outcome=_outcome(result),
                  total_ms=result.timings.get("total_ms"), timings=result.timings,
                  envelope=job.envelope if job else None,
                  deliveries=job.deliveries if job else entry.deliveries)


def _outcome(result: ResultEnvelope) -> str:
    return result.error_code.value if result.error_code is not None else result.status.value


class ResultWriter:
    """Builds result envelopes and writes them with their acknowledgements."""

    def __init__(self, r: redis.Redis, keys: Keys, worker: str, ttl_s: int,
                 wait: ReplicaWait | None = None,
                 waited: Callable[[Replication], None] | None = None,
                 charges: bool = False) -> None:
        self._redis = r
        #: Whether the transaction also deletes each entry's charge (a generation model's
        #: lanes may have token bounds: PROTOCOL.md "Admission control"), one HDEL a lane.
        self._charges = charges
        #: The WAIT after each transaction, and who counts what it said (NOTE [ Replicas ]).
        self._wait = wait
        self._waited = waited
        self.keys = keys
        self._answers = AnswerKeys(keys)
        self._dead = DeadLetters(keys)
        self.worker = worker
        self._ttl_ms = ttl_s * 1000
        #: Dead-letter records of acknowledged entries, not yet in the dead-letter stream.
        self._records: deque[DeadLetter] = deque()
        self._warn = Throttle(logger, 60.0)
        #: Monotonic time from which the next flush pushes onto the recent list in full
        #: (LPUSH, LTRIM, PEXPIRE); before it, an LPUSHX alone.
        self._recent_upkeep_at = 0.0
        #: The writers of the model's other partitions, made as their answers come.
        self._siblings: dict[int, ResultWriter] = {keys.partition: self}

    # ------------------------------------------------------------------ envelopes

    @staticmethod
    def _timings(job: Job, inference_ms: float = 0.0, batch_wait_ms: float = 0.0,
                 now_s: float | None = None) -> dict[str, float]:
        now_s = time.monotonic() if now_s is None else now_s
        total = job.queue_ms + (now_s - job.arrival_s) * 1000
        return {"queue_ms": round(job.queue_ms, 3), "preprocess_ms": round(job.preprocess_ms, 3),
                "batch_wait_ms": round(batch_wait_ms, 3), "inference_ms": round(inference_ms, 3),
                "total_ms": round(total, 3)}

    def ran(self, batch: Sequence[Job], outcomes: Sequence[RunOutcome],
            batch_wait_ms: Sequence[float], inference_ms: float) -> list[Answer]:
        """The answers to one batch the model ran, in order: ok, or the outcome's error.
        The clocks are read once for the batch, and ok envelopes are encoded directly, the
        fields the batch's answers share packed once (``ResultEnvelope.ok_encoder``), with
        no envelope object per job."""
        n = len(batch)
        now_s, now_ms = time.monotonic(), int(time.time() * 1000)
        encode = ResultEnvelope.ok_encoder(n, self.worker, self.keys.model, now_ms)
        inference = round(inference_ms, 3)
        answers = []
        for job, outcome, wait_ms in zip(batch, outcomes, batch_wait_ms, strict=True):
            if outcome.error is not None:
                answers.append(self.failed(job, outcome.error, outcome.message, n))
            else:
                answers.append(self._ok(job, outcome.output, n, encode, {
                    "queue_ms": round(job.queue_ms, 3),
                    "preprocess_ms": round(job.preprocess_ms, 3),
                    "batch_wait_ms": round(wait_ms, 3), "inference_ms": inference,
                    "total_ms": round(job.queue_ms + (now_s - job.arrival_s) * 1000, 3)}))
        return answers

    def _ok(self, job: Job, output: Any, batch_size: int,
            encode: Callable[[str, Any, dict[str, float]], bytes],
            timings: dict[str, float]) -> Answer:
        """An ok result (``timings`` as ``_timings`` makes them); an output msgpack cannot
        carry becomes an ``internal`` error result."""
        envelope = job.envelope
        try:
            encoded = encode(envelope.request_id, output, timings)
        except (TypeError, ValueError, OverflowError) as e:
            return self.failed(job, ErrorCode.INTERNAL,
                               f"model output cannot be encoded as msgpack: {e}", batch_size)
        return Answer(job.stream, job.entry_id, envelope.request_id, encoded, job.slot,
                      envelope.reply_to, envelope.lane, outcome=Status.OK.value,
                      total_ms=timings["total_ms"], timings=timings, envelope=envelope,
                      deliveries=job.deliveries)

    def failed(self, job: Job, code: ErrorCode, message: str, batch_size: int = 0) -> Answer:
        result = ResultEnvelope.error(job.request_id, code, message, timings=self._timings(job),
                                      batch_size=batch_size, worker=self.worker,
                                      model=self.keys.model, finished_ms=int(time.time() * 1000))
        return _answer(job, result, job.slot)

    def rejected(self, entry: BadEntry) -> Answer:
        """An entry that cannot run: answered if it has an id, dead-lettered if it is
        marked so, acknowledged either way."""
        dead = _dead_letter_fields(entry) if entry.dead_letter else None
        if entry.request_id is None:
            return Answer(entry.stream, entry.entry_id, None, dead_letter=dead,
                          outcome=entry.code.value, deliveries=entry.deliveries)
        result = ResultEnvelope.error(entry.request_id, entry.code, entry.message,
                                      worker=self.worker, model=self.keys.model,
                                      finished_ms=int(time.time() * 1000))
        answer = _answer(entry, result)
        return replace(answer, dead_letter=dead)

    # ------------------------------------------------------------------ writing

    def write_and_ack(self, answers: Sequence[Answer]) -> Flushed:
        """Write every result, then XACK and XDEL every entry, in one transaction per
        partition (its keys share one slot; PROTOCOL.md "Partitions"). Each partition
        fails alone: one whose write fails (its master away, or refusing) has its answers
        in ``Flushed.failed``, the others are written (issue 28), so a retry of the failed
        ones never writes another partition's answers twice. Raises as _write_and_ack
        when every partition failed (nothing written)."""
        by_part: dict[int, list[Answer]] = {}
        for answer in answers:
            by_part.setdefault(stream_partition(answer.stream)[0], []).append(answer)
        if len(by_part) == 1:
            return self._sibling(next(iter(by_part)))._write_and_ack(answers)
        held: list[Answer] = []
        failed: list[Answer] = []
        errors: list[Exception] = []
        undeliverable = 0
        for part, group in by_part.items():
            try:
                flushed = self._sibling(part)._write_and_ack(group)
            except (RedisUnavailable, RedisRefused) as e:
                failed += group
                errors.append(e)
                continue
            held += flushed.held
            undeliverable += flushed.undeliverable
        if len(errors) == len(by_part):
            raise errors[0]
        return Flushed(held, undeliverable, failed, errors[0] if errors else None)

    def _sibling(self, partition: int) -> ResultWriter:
        """The writer of one partition of the model (this one for its own), with the same
        replica wait: each partition's transaction has its own WAIT."""
        writer = self._siblings.get(partition)
        if writer is None:
            writer = ResultWriter(self._redis, self.keys.part(partition), self.worker,
                                  self._ttl_ms // 1000, self._wait, self._waited,
                                  self._charges)
            self._siblings[partition] = writer
        return writer

    def _write_and_ack(self, answers: Sequence[Answer]) -> Flushed:
        """Write every result of one partition, then XACK and XDEL every entry, in one
        transaction (see NOTE [ Write failures ]).

        Raises RedisUnavailable or RedisRefused; then nothing was written or acknowledged
        and the caller may retry the same answers. Returns the answers it held back.
        """
        held: list[Answer] = []
        pipe = None
        replication = None
        try:
            if any(a.dead_letter is not None for a in answers):
                pipe = self._redis.pipeline(transaction=True)
                answers, held = self._guard_dead_letters(pipe, answers)
                ops = self._queue(pipe, answers)
                replies, replication = run_pipeline(pipe, self._wait) if ops else ([], None)
            else:  # the hot path, nothing to WATCH: one packed MULTI/EXEC (transaction.py)
                commands = Commands()
                ops = self._queue(commands, answers)
                replies, replication = (exec_transaction(self._redis, commands, self._wait)
                                        if ops else ([], None))
        except redis.WatchError as e:
            raise RedisRefused("the dead-letter stream changed during the write") from e
        except REDIS_ERRORS as e:
            raise RedisUnavailable(f"writing {len(answers)} results failed: {e}") from e
        except redis.ResponseError as e:  # refused whole at queue time: nothing applied
            raise RedisRefused(f"Redis refused {len(answers)} results "
                               f"({error_code(e)}): {e}") from e
        finally:
            if pipe is not None:
                pipe.reset()
        undeliverable = self._read_replies(answers, ops, replies)
        if replication is not None:
            self._replicated(replication, len(answers))
        self._write_records()
        return Flushed(held, undeliverable)

    def _replicated(self, replication: Replication, n: int) -> None:
        """Count what the WAIT said; warn (at most once a minute) when it fell short."""
        if self._waited is not None:
            self._waited(replication)
        if replication.short:
            self._warn.warning("replicas", "%d results written on the master, confirmed by "
                               "%d of %d replicas within %d ms%s; a failover now could lose "
                               "them (their jobs would run again)", n, replication.acked,
                               replication.asked, self._wait.timeout_ms if self._wait else 0,
                               f" (WAIT failed: {replication.error})" if replication.error
                               else "")

    def _guard_dead_letters(self, pipe: Any,
                            answers: Sequence[Answer]) -> tuple[list[Answer], list[Answer]]:
        """Start the transaction; dead-letter answers are held back (not acknowledged) while
        the dead-letter stream key holds another type. WATCH ties the check to the EXEC."""
        dead = [a for a in answers if a.dead_letter is not None]
        if dead:
            kind = self._dead.guard(pipe)
            if kind is not None:
                self._warn.error("dlq-type", "the dead-letter stream %s holds a %s, not a "
                                 "stream: %d dead letters stay pending until it is deleted",
                                 self._dead.key, kind, len(dead))
                pipe.multi()
                return [a for a in answers if a.dead_letter is None], dead
        pipe.multi()
        return list(answers), []

    def _queue(self, pipe: Any, answers: Sequence[Answer]) -> list[_Op]:
        """Queue the transaction's commands; one _Op per command, in order."""
        ops: list[_Op] = []
        replies: dict[str, list[int]] = {}  # reply list -> its answers, in order
        for i, answer in enumerate(answers):
            if answer.dead_letter is not None:
                ops.append(_Op((i,), self._dead.add(pipe, answer.dead_letter), record=True))
            if answer.request_id is not None:
                token = answer.reply_to is None  # a reply list's client waits on the list
                keep = not (token and answer.envelope is not None and answer.envelope.done_only)
                ops += [_Op((i,), what) for what in
                        self._answers.write(pipe, answer.request_id, answer.encoded,
                                            self._ttl_ms, token, keep)]
                if answer.reply_to is not None:
                    replies.setdefault(answer.reply_to, []).append(i)
        ops += self._announce(pipe, answers, replies)
        ops += self._push_recent(pipe, answers)
        for stream, ids in _by_stream(answers).items():
            pipe.xack(stream, GROUP, *ids)
            pipe.xdel(stream, *ids)
            ops += [_Op((), f"XACK {stream}"), _Op((), f"XDEL {stream}")]
            if self._charges:
                charges = self.keys.charges(stream_partition(stream)[1])
                pipe.hdel(charges, *ids)
                ops.append(_Op((), f"HDEL {charges}"))
        return ops

    def _announce(self, pipe: Any, answers: Sequence[Answer],
                  replies: dict[str, list[int]]) -> list[_Op]:
        """Queue one RPUSH (and PEXPIRE) per reply list for all the answers that name it,
        after their results."""
        ops: list[_Op] = []
        for key, indexes in replies.items():
            ids = [answers[i].request_id or "" for i in indexes]
            ops += [_Op(tuple(indexes), what)
                    for what in ReplyList(key).announce(pipe, ids, self._ttl_ms)]
        return ops

    def _push_recent(self, pipe: Any, answers: Sequence[Answer]) -> list[_Op]:
        """Queue the answered results onto the capped recent list `redbatch status` reads."""
        now = int(time.time() * 1000)
        bulk = self.keys.stream(Lane.BULK)
        # The lane from the stream, not the envelope: rejected entries have no envelope.
        interactive, bulk_lane = Lane.INTERACTIVE.value, Lane.BULK.value
        records = RecentResult.pack_many(now, [
            (bulk_lane if a.stream == bulk else interactive, a.outcome, a.total_ms)
            for a in answers if a.request_id is not None])
        if not records:
            return []
        recent = self.keys.recent()
        now_s = time.monotonic()
        if now_s < self._recent_upkeep_at:
            # LPUSHX: only onto the list a full push made (so it has its TTL); when it is
            # gone (expired, deleted) this group's records are dropped and the next
            # flush makes it again. Statistics only.
            pipe.lpushx(recent, *records)
            return [_Op((), f"LPUSHX {recent}", recent=True)]
        self._recent_upkeep_at = now_s + RECENT_UPKEEP_S
        pipe.lpush(recent, *records)
        pipe.ltrim(recent, 0, RECENT_MAX - 1)
        pipe.pexpire(recent, RECENT_TTL_MS)
        return [_Op((), f"{verb} {recent}") for verb in ("LPUSH", "LTRIM", "PEXPIRE")]

    # ------------------------------------------------------------------ failures

    def _read_replies(self, answers: Sequence[Answer], ops: list[_Op],
                      replies: list[Any]) -> int:
        """Sort out the commands that failed on their own key; returns how many answers
        proved undeliverable (each now has a dead-letter record on its way)."""
        failed: dict[int, str] = {}
        for op, reply in zip(ops, replies, strict=True):
            if op.recent and reply == 0:
                self._recent_upkeep_at = 0.0
            if not isinstance(reply, Exception):
                continue
            if op.record:
                self._keep_record(answers[op.answers[0]].dead_letter)
                self._warn.warning("record", "%s failed (%s); the dead letter is kept and "
                                   "written later", op.what, reply)
            elif op.answers:
                for i in op.answers:
                    failed.setdefault(i, f"{op.what}: {reply}")
            else:  # the recent list, or the stream's acks (stream or group gone)
                key = op.what.split(" ", 1)[1]  # one line per key, not per command
                self._warn.warning(key, "%s failed: %s", op.what, reply)
        for i, reason in failed.items():
            self._keep_record(_undeliverable(answers[i], reason))
            self._warn.warning("undeliverable", "request %s is undeliverable (%s); it goes "
                               "to the dead-letter stream", answers[i].request_id, reason)
        return len(failed)

    def _keep_record(self, record: DeadLetter | None) -> None:
        if record is None:
            return
        if len(self._records) >= RECORDS_KEPT:
            dropped = self._records.popleft()
            logger.error("dropped the dead-letter record of entry %s: %d records wait for "
                         "the dead-letter stream already", dropped.get(DLQ_ENTRY), RECORDS_KEPT)
        self._records.append(record)

    def _write_records(self) -> None:
        """Add the kept dead-letter records to the stream; those that fail stay kept."""
        if not self._records:
            return
        records = list(self._records)
        pipe = self._redis.pipeline(transaction=False)
        for record in records:
            self._dead.add(pipe, record)
        try:
            replies = pipe.execute(raise_on_error=False)
        except redis.RedisError as e:
            self._warn.warning("records", "writing %d dead letters failed (%s); retrying "
                               "later", len(records), e)
            return
        self._records = deque(rec for rec, reply in zip(records, replies, strict=True)
                              if isinstance(reply, Exception))


def _undeliverable(answer: Answer, reason: str) -> DeadLetter:
    """The dead letter of an acknowledged answer whose own keys failed."""
    record: DeadLetter = {}
    if answer.envelope is not None:
        record = {name: value for name, value in answer.envelope.encode().items()}
    elif answer.request_id is not None:
        record[FIELD_REQUEST_ID] = answer.request_id
    return dead_letter(record, answer.stream, answer.entry_id, ErrorCode.UNDELIVERABLE, reason,
                       answer.deliveries)


def _dead_letter_fields(entry: BadEntry) -> DeadLetter:
    """The entry's own ``rid`` and ``job`` fields, byte for byte and only those it had,
    with where it came from and why."""
    return dead_letter(own_fields(entry.fields or {}), entry.stream, entry.entry_id, entry.code,
                       entry.message, entry.deliveries)


def _by_stream(answers: Sequence[Answer]) -> dict[str, list[bytes]]:
    grouped: dict[str, list[bytes]] = {}
    for answer in answers:
        grouped.setdefault(answer.stream, []).append(answer.entry_id)
    return grouped
