"""The KV cache's blocks: who holds which, and the prefix cache. Pure: no torch, no I/O.

The cache is ``blocks`` blocks of ``block_size`` tokens (gpu_worker/generation/model.py
holds the tensors); a sequence's *block table* lists its blocks in position order.

* **No eviction by default**: a request is admitted only when every block it could ever
  need (prompt + max new tokens) can be given to it at once (:meth:`BlockPool.reserve`),
  so a running sequence never waits for memory and is never preempted.
* **Prefix cache**: a full block is keyed by the hash of its tokens chained to the hash of
  the blocks before it, so equal keys mean equal prefixes. A new request starts from the
  longest run of cached blocks its prompt begins with, shared (reference counted), and
  computes only the rest. A block nobody holds stays cached, on the free list in the order
  it was freed, and is reused for new tokens (its key dropped) least recently freed first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


def block_keys(tokens: Sequence[int], block_size: int) -> list[int]:
    """The prefix-cache key of each *full* block of ``tokens``: a hash chained over all
    tokens up to the block's end."""
    keys, parent = [], 0
    for end in range(block_size, len(tokens) + 1, block_size):
        parent = hash((parent, tuple(tokens[end - block_size:end])))
        keys.append(parent)
    return keys


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold ``tokens`` tokens."""
    return -(-tokens // block_size)


def blocks_for_memory(memory_bytes: int, bytes_per_token: int, block_size: int) -> int:
    """How many blocks fit in ``memory_bytes`` (at least one)."""
    return max(1, memory_bytes // (bytes_per_token * block_size))


@dataclass(slots=True)
class Reservation:
    """A sequence's blocks: ``table`` in position order, the first ``cached_tokens``
    tokens' K/V already there (prefix-cache hits), and the keys registered so far."""

    table: list[int]
    cached_tokens: int
    keys: list[int] = field(default_factory=list)


class BlockPool:
    """Blocks handed to sequences, reference counted, with a prefix cache.

    Not thread-safe: one engine step uses it at a time.
    """

    def __init__(self, blocks: int, block_size: int, prefix_cache: bool = True) -> None:
        if blocks < 1 or block_size < 1:
            raise ValueError("a block pool needs at least one block of at least one token")
        self.blocks, self.block_size, self.prefix_cache = blocks, block_size, prefix_cache
        self._refs = [0] * blocks
        #: Blocks nobody holds, least recently freed first (cached ones keep their key).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(blocks))
        self._cached: dict[int, int] = {}      # key -> block
        self._key_of: dict[int, int] = {}      # block -> key
        self.hits = self.queries = 0

    @property
    def free(self) -> int:
        """Blocks a new reservation may take (cached blocks nobody holds included)."""
        return len(self._free)

    @property
    def used(self) -> int:
        return self.blocks - len(self._free)

    def reserve(self, prompt: Sequence[int], total_tokens: int) -> Reservation | None:
        """Blocks for a sequence of ``total_tokens`` whose first tokens are ``prompt``, the
        longest cached prefix of it shared; None (nothing taken) when they do not fit.
        At least the prompt's last token is left to compute: its logits start the answer."""
        hits = self._prefix_hits(prompt)
        need = blocks_for(total_tokens, self.block_size) - len(hits)
        held = sum(1 for b in hits if self._refs[b] == 0)
        if need > len(self._free) - held:
            return None
        for b in hits:
            self._hold(b)
        table = hits + [self._take() for _ in range(need)]
        self.queries += 1
        self.hits += bool(hits)
        keys = block_keys(prompt, self.block_size)[:len(hits)]
        return Reservation(table, len(hits) * self.block_size, keys)

    def _prefix_hits(self, prompt: Sequence[int]) -> list[int]:
        if not self.prefix_cache:
            return []
        usable = (len(prompt) - 1) // self.block_size
        hits = []
        for key in block_keys(prompt[:usable * self.block_size], self.block_size):
            block = self._cached.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def register(self, reservation: Reservation, tokens: Sequence[int]) -> None:
        """Key the reservation's blocks that ``tokens`` (its computed tokens) fill."""
        if not self.prefix_cache:
            return
        full = len(tokens) // self.block_size
        if full <= len(reservation.keys):
            return
        keys = block_keys(tokens[:full * self.block_size], self.block_size)
        for i in range(len(reservation.keys), full):
            block, key = reservation.table[i], keys[i]
            reservation.keys.append(key)
            if key not in self._cached:
                self._cached[key] = block
                self._key_of[block] = key

    def release(self, reservation: Reservation) -> None:
        """Give the blocks back; cached ones stay findable until reused."""
        for block in reversed(reservation.table):  # the tail is reused first
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None
        reservation.table = []

    def _hold(self, block: int) -> None:
        if self._refs[block] == 0:
            del self._free[block]
        self._refs[block] += 1

    def _take(self) -> int:
        block, _ = self._free.popitem(last=False)
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._cached[key]
        self._refs[block] = 1
        return block
