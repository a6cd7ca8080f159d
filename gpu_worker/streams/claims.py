"""Whose request id each entry read holds (NOTE [ Request id owners ] in
common/protocol/admission.py): the entry's own, or another entry's (a duplicate).

The field FIELD_ADMITTED (``adm``) says an entry came through the admission function, which
made it its id's owner; but anyone who may XADD can write that field too. So it only
saves the claim: an admitted entry is checked against its owner key, one MGET for all the
entries of a read in one partition, and only an entry with no owner left (expired, or
freed by a reader) claims its id as any other entry does (SET NX GET, one per entry).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import redis
from redbatch.common.protocol import Keys, Lane, OwnerKeys
from redbatch.gpu_worker.streams.transaction import Commands, pipelined


class Claim(NamedTuple):
    """One entry read: its request id, entry id, partition's keys and lane, its budget (for
    the owner's TTL when it claims), and whether it carries FIELD_ADMITTED. A tuple: one is
    made for every job read, and a frozen dataclass costs twice as much to make."""

    request_id: str
    entry_id: bytes
    keys: Keys
    lane: Lane
    budget_ms: int | None
    admitted: bool


def rivals(r: redis.Redis, claims: Sequence[Claim]) -> list[bytes | None]:
    """For each claim, the entry id that owns its request id instead (a duplicate), or None
    when the id is its entry's. One round trip (the other entries' claims, then the
    admitted entries' MGETs, one pipeline, on a cluster one write to each master), and a
    second only for admitted entries whose owner is gone. Raises redis-py's errors of the
    pipeline as a whole (a lost connection)."""
    if not claims:
        return []
    others = [i for i, claim in enumerate(claims) if not claim.admitted]
    by_part: dict[str, list[int]] = {}
    for i, claim in enumerate(claims):
        if claim.admitted:
            by_part.setdefault(claim.keys.tag, []).append(i)
    commands = [_claim(claims[i]) for i in others]
    for indexes in by_part.values():
        base = claims[indexes[0]].keys.owner("")  # every owner key of the partition: + id
        owners = [base + claims[i].request_id for i in indexes]
        commands.append((owners[0], ("MGET", *owners)))
    replies = pipelined(r, commands)
    out: list[bytes | None] = [None] * len(claims)
    for i, reply in zip(others, replies, strict=False):
        out[i] = OwnerKeys.rival(reply, claims[i].entry_id)
    unowned = _read_owners(claims, by_part, replies[len(others):], out)
    if unowned:
        again = pipelined(r, [_claim(claims[i]) for i in unowned])
        for i, reply in zip(unowned, again, strict=True):
            out[i] = OwnerKeys.rival(reply, claims[i].entry_id)
    return out


def _claim(claim: Claim) -> tuple[str, tuple[Any, ...]]:
    """The claim's SET NX GET (``OwnerKeys.claim``), as ``(key, command)``."""
    recorded = Commands()
    OwnerKeys(claim.keys).claim(cast(Any, recorded), claim.request_id, claim.entry_id,
                                claim.lane, claim.budget_ms)
    return claim.keys.owner(claim.request_id), recorded.args[0]


def _read_owners(claims: Sequence[Claim], by_part: dict[str, list[int]],
                 replies: list[Any], out: list[bytes | None]) -> list[int]:
    """Fill ``out`` from the MGETs' replies (one per partition, in ``by_part``'s order);
    returns the admitted entries whose owner is absent or unreadable: they claim their id."""
    unowned = []
    for indexes, values in zip(by_part.values(), replies, strict=True):
        if not isinstance(values, list):
            values = [None] * len(indexes)
        for i, value in zip(indexes, values, strict=True):
            if value is None:
                unowned.append(i)
            else:
                out[i] = OwnerKeys.rival(value, claims[i].entry_id)
    return unowned
