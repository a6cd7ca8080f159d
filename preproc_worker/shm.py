"""Fixed-size slots in one shared-memory segment, seen as a numpy array (n_slots, *shape).

The worker process creates the segment and owns its name; pool processes
attach to it and write one decoded input per slot. Only the slot index
crosses the process boundary, never the pixels.

NOTE [ Shared-memory lifetime ]
  * The creator unlinks the segment in ``SlotArray.close`` (called from the
    pool's ``close`` in a ``finally``), on every normal and signalled exit.
  * If the creator is SIGKILLed, Python's resource tracker process (started
    with the first segment) unlinks it once every process holding the
    tracker's pipe has exited: the creator, and the pool processes, which
    notice their parent is gone within a second and exit.
  * Pool processes started by ``multiprocessing`` share the creator's
    tracker, so their attach adds nothing to it, and they only ``close``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np


@dataclass(frozen=True, slots=True)
class SlotLayout:
    """What a pool process needs to attach: segment name, count, item shape and dtype."""

    name: str
    n_slots: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return self.n_slots * math.prod(self.shape) * np.dtype(self.dtype).itemsize


class SlotArray:
    """One shared-memory segment of slots; ``array[i]`` is slot i."""

    def __init__(self, shm: shared_memory.SharedMemory, layout: SlotLayout, owner: bool) -> None:
        self._shm = shm
        self.layout = layout
        self._owner = owner
        self.array: np.ndarray = np.ndarray((layout.n_slots, *layout.shape),
                                            dtype=layout.dtype, buffer=shm.buf)

    @classmethod
    def create(cls, n_slots: int, shape: tuple[int, ...], dtype: str) -> SlotArray:
        size = max(1, n_slots * math.prod(shape) * np.dtype(dtype).itemsize)
        shm = shared_memory.SharedMemory(create=True, size=size)
        return cls(shm, SlotLayout(shm.name, n_slots, tuple(shape), dtype), owner=True)

    @classmethod
    def attach(cls, layout: SlotLayout) -> SlotArray:
        shm = shared_memory.SharedMemory(name=layout.name)
        return cls(shm, layout, owner=False)

    def close(self) -> None:
        """Detach; the creator also unlinks the segment. Safe to call twice."""
        self.array = np.empty((0,))
        try:
            self._shm.close()
        except BufferError:
            pass  # a view is still alive somewhere; the unlink below still frees the name
        if self._owner:
            self._owner = False
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass


class SlotAllocator:
    """Free list of slot indices; owned by the worker's main thread."""

    def __init__(self, n_slots: int) -> None:
        self._free = list(range(n_slots - 1, -1, -1))
        self.n_slots = n_slots

    def acquire(self) -> int | None:
        return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        if slot < 0 or slot >= self.n_slots or slot in self._free:
            raise ValueError(f"slot {slot} released twice or out of range")
        self._free.append(slot)

    @property
    def in_use(self) -> int:
        return self.n_slots - len(self._free)
