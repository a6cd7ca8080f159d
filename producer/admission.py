"""The admission function's calls and replies (PROTOCOL.md "Admission control"), for the
client core: which jobs go in one call, the call's keys and arguments (each job's charge
against a token bound included), and what the replies mean: the request ids admitted, or
QueueFull / DuplicateRequestId naming the refused ones. Pure: no Redis I/O here.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis
from redbatch.common.protocol import (
    DUPLICATE_REPLY,
    FIELD_JOB,
    IDEMPOTENCY_WINDOW_MS,
    MAX_ADMIT_JOBS,
    QUEUE_FULL_REPLY,
    TOKENS_FULL_REPLY,
    JobEnvelope,
    Keys,
    Lane,
    error_reply_code,
    owner_ttl_ms,
    parse_queue_bound,
)
from redbatch.common.protocol.generation import job_charge
from redbatch.producer.calls import Arg, Script
from redbatch.producer.errors import DuplicateRequestId, QueueFull


def admission_groups(jobs: Sequence[JobEnvelope], parts: Sequence[int]) -> list[list[int]]:
    """Indexes of ``jobs`` by admission call: one per model, partition (``parts``, by
    job) and lane, in order, with MAX_ADMIT_JOBS jobs at most."""
    by_lane: dict[tuple[str, int, Lane], list[int]] = {}
    for i, (job, part) in enumerate(zip(jobs, parts, strict=True)):
        by_lane.setdefault((job.model, part, Lane(job.lane)), []).append(i)
    return [group[start:start + MAX_ADMIT_JOBS] for group in by_lane.values()
            for start in range(0, len(group), MAX_ADMIT_JOBS)]


def admission_call(keys: Keys, jobs: Sequence[JobEnvelope],
                   window_ms: int = IDEMPOTENCY_WINDOW_MS,
                   earlier: Sequence[str] = ()) -> Script:
    """The admission function's call for jobs of one lane: its stream, the limits hash,
    the lane's charges hash, each id's owner key and the ``earlier`` owner keys of the ids
    in other partitions; the lane, then each job's owner TTL (the idempotency window
    ``window_ms`` for a job without a deadline), request id, charge (``job_charge``: 0
    but for a generation job) and envelope."""
    lane = Lane(jobs[0].lane)
    args: list[Arg] = [lane.value]
    for job in jobs:
        args += [owner_ttl_ms(job.budget_ms, window_ms), job.request_id,
                 job_charge(job.payload, job.content_type), job.encode()[FIELD_JOB]]
    return Script([keys.stream(lane), keys.limits(), keys.charges(lane),
                   *(keys.owner(j.request_id) for j in jobs), *earlier], args)


def replies_per_job(groups: Sequence[Sequence[int]], replies: Sequence[object],
                    count: int) -> list[object]:
    """Each job's reply, in the jobs' order, from the admission calls' replies: an entry
    id or an error element, or the call's own error reply for every job of the call."""
    out: list[object] = [None] * count
    for group, reply in zip(groups, replies, strict=True):
        each = [reply] * len(group) if isinstance(reply, Exception) else _items(reply)
        for i, job_reply in zip(group, each, strict=True):
            out[i] = job_reply
    return out


def _items(reply: object) -> list[object]:
    """The elements of an admission call's array reply; TypeError for any other reply."""
    if not isinstance(reply, list):
        raise TypeError(f"the admission script replied {reply!r:.100}, not an array")
    return reply


def _reply_code(reply: object) -> str | None:
    """The code (first word) of an admission error reply, None for any other reply."""
    return error_reply_code(str(reply)) if isinstance(reply, redis.ResponseError) else None


def _refused_bound(reply: object) -> tuple[int, bool] | None:
    """The bound named by the admission script's ``QUEUE_FULL <bound>`` or ``TOKENS_FULL
    <bound>`` reply, and whether it is in tokens; else None."""
    code = _reply_code(reply)
    if code not in (QUEUE_FULL_REPLY, TOKENS_FULL_REPLY):
        return None
    words = str(reply).split()
    return (parse_queue_bound(words[1]) if len(words) > 1 else None) or 0, \
        code == TOKENS_FULL_REPLY


def admitted_ids(jobs: Sequence[JobEnvelope], replies: Sequence[object]) -> list[str]:
    """Request ids of the admitted jobs; raises QueueFull naming the refused ones (its
    ``duplicates`` lists ids refused as in use), DuplicateRequestId when only ids in
    use were refused, or the first other error a reply holds."""
    accepted, refused, duplicates = [], [], []
    first: tuple[JobEnvelope, tuple[int, bool]] | None = None
    for job, reply in zip(jobs, replies, strict=True):
        refusal = _refused_bound(reply)
        if refusal is not None:
            refused.append(job.request_id)
            first = first or (job, refusal)
        elif _reply_code(reply) == DUPLICATE_REPLY:
            duplicates.append(job.request_id)
        elif isinstance(reply, BaseException):
            raise reply
        else:
            accepted.append(job.request_id)
    if first is not None:
        job, (limit, tokens) = first
        full = QueueFull(job.model, Lane(job.lane), limit, refused, accepted, tokens=tokens)
        full.duplicates = duplicates
        raise full
    if duplicates:
        raise DuplicateRequestId(duplicates, accepted)
    return accepted
