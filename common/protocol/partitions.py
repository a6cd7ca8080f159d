"""A model's partition count P and its history (PROTOCOL.md "Partitions").

The list ``Keys.partitions()`` (model-wide, in partition 0's slot) holds every count P the
model had, ascending, in decimal (``1 2 6``); the last is P now; absent: ``1``.
Counts only rise (RAISE_PARTITIONS_SCRIPT), so a result written under an older P is found
by trying the partition of its id under each count of the history."""

from __future__ import annotations

from collections.abc import Sequence

import redis
from redbatch.common.protocol.keys import MAX_PARTITIONS, Keys, partition_of

RAISE_PARTITIONS_SCRIPT = f"""\
-- redbatch raise-partitions script, protocol 1 (revision 1)
-- KEYS: P:{{M}}:partitions   ARGV: <new P>   replies the history after the call
local new = ARGV[1]
if not new:find('^[1-9]%d*$') or tonumber(new) > {MAX_PARTITIONS} then
  return redis.error_reply('BAD_CALL P must be an integer from 1 to {MAX_PARTITIONS}')
end
local now = tonumber(redis.call('LINDEX', KEYS[1], -1) or '1')
if tonumber(new) < now then
  return redis.error_reply('LOWER_PARTITIONS P is ' .. now .. ': it can only rise')
end
if tonumber(new) > now then
  if now == 1 and redis.call('EXISTS', KEYS[1]) == 0 then redis.call('RPUSH', KEYS[1], '1') end
  redis.call('RPUSH', KEYS[1], new)
end
return redis.call('LRANGE', KEYS[1], 0, -1)
"""


DEFAULT_PARTITIONS_SCRIPT = f"""\
-- redbatch default-partitions script, protocol 1 (revision 1)
-- KEYS: P:{{M}}:partitions   ARGV: <P>   sets P once, where no count was ever set;
-- replies the history after the call
local new = ARGV[1]
if not new:find('^[1-9]%d*$') or tonumber(new) > {MAX_PARTITIONS} then
  return redis.error_reply('BAD_CALL P must be an integer from 1 to {MAX_PARTITIONS}')
end
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('RPUSH', KEYS[1], '1')
  if new ~= '1' then redis.call('RPUSH', KEYS[1], new) end
end
return redis.call('LRANGE', KEYS[1], 0, -1)
"""
"""A worker meeting a model with no count on a cluster of N masters sets P = N with it
(PROTOCOL.md "Partitions"); ``redbatch partitions --set 1`` records 1 with it, which keeps
a model on one master. The history starts with 1: ids submitted before went there."""


def parse_partition_history(raw: Sequence[bytes | str] | None) -> tuple[int, ...]:
    """The counts of the partitions list (``LRANGE 0 -1``), ascending; empty, absent or
    unreadable: ``(1,)``."""
    try:
        counts = tuple(int(c) for c in raw or ())
    except (TypeError, ValueError):
        return (1,)
    if not counts or any(not 1 <= c <= MAX_PARTITIONS for c in counts) \
            or list(counts) != sorted(set(counts)):
        return (1,)
    return counts


def read_partitions(r: redis.Redis, keys: Keys) -> tuple[int, ...]:
    """The model's partition history, read now (one LRANGE); the last is its count."""
    return parse_partition_history(r.lrange(keys.partitions(), 0, -1))


def candidate_partitions(request_id: str, history: tuple[int, ...]) -> list[int]:
    """The partitions ``request_id`` may have gone to under a history, newest P first,
    without repeats: where a client that has only the id looks for its job or result."""
    seen: list[int] = []
    for count in reversed(history):
        p = partition_of(request_id, count)
        if p not in seen:
            seen.append(p)
    return seen
