"""A model's partition count P and its history (PROTOCOL.md "Partitions").

The key ``Keys.partitions()`` (model-wide, in partition 0's slot) holds every count P the
model had, ascending and space-separated (``"1 2 6"``); the last is P now; absent: ``1``.
Counts only rise (RAISE_PARTITIONS_SCRIPT), so a result written under an older P is found
by trying the partition of its id under each count of the history."""

from __future__ import annotations

from redbatch.common.protocol.keys import MAX_PARTITIONS, partition_of

RAISE_PARTITIONS_SCRIPT = f"""\
-- redbatch raise-partitions script, protocol 1 (revision 1)
-- KEYS: P:{{M}}:partitions   ARGV: <new P>   replies the history after the call
local new = ARGV[1]
if not new:find('^[1-9]%d*$') or tonumber(new) > {MAX_PARTITIONS} then
  return redis.error_reply('BAD_CALL P must be an integer from 1 to {MAX_PARTITIONS}')
end
local history = redis.call('GET', KEYS[1]) or '1'
local now = tonumber(history:match('(%d+)$'))
if tonumber(new) < now then
  return redis.error_reply('LOWER_PARTITIONS P is ' .. now .. ': it can only rise')
end
if tonumber(new) > now then
  history = history .. ' ' .. new
  redis.call('SET', KEYS[1], history)
end
return history
"""


def parse_partition_history(raw: bytes | str | None) -> tuple[int, ...]:
    """The counts of a partitions key's value, ascending; absent or unreadable: ``(1,)``."""
    if raw is None:
        return (1,)
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    try:
        counts = tuple(int(word) for word in text.split())
    except ValueError:
        return (1,)
    if not counts or any(not 1 <= c <= MAX_PARTITIONS for c in counts) \
            or list(counts) != sorted(set(counts)):
        return (1,)
    return counts


def candidate_partitions(request_id: str, history: tuple[int, ...]) -> list[int]:
    """The partitions ``request_id`` may have gone to under a history, newest P first,
    without repeats: where a client that has only the id looks for its job or result."""
    seen: list[int] = []
    for count in reversed(history):
        p = partition_of(request_id, count)
        if p not in seen:
            seen.append(p)
    return seen
