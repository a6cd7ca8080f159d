"""Fixed-size slots in one shared-memory segment, seen as a numpy array (n_slots, *shape).

The worker process creates the segment and owns its name; pool processes
attach to it and write one decoded input per slot. Only the slot index
crosses the process boundary, never the pixels.

NOTE [ Shared-memory lifetime ]
  Names say whose an entry is. A segment is ``<prefix>-<pid>-<6 hex>``
  (``--shm-prefix``, ``redbatch`` by default; the creating process's pid; a
  random part), at most 28 characters with POSIX's leading '/'. On Linux the
  pool's multiprocessing semaphores are named after it
  (``/dev/shm/sem.<segment>-<random>``, see :func:`name_semaphores_after`).

  * The creator holds an flock on ``/dev/shm/<segment>`` for the segment's
    whole life, and unlinks it in ``SlotArray.close`` (called from the
    worker's teardown in a ``finally``) on every normal and signalled exit;
    the semaphores go with the pool's queues.
  * If only the creator is SIGKILLed, Python's resource tracker process
    (started with the first segment) unlinks the segment and the semaphores
    once every process holding the tracker's pipe has exited: the creator,
    and the pool processes, which notice their parent is gone within a
    second and exit.
  * If the tracker dies too (a SIGKILL of the whole process group, the OOM
    killer, a container's cgroup kill), the entries stay, and the kernel
    drops only the flock. The next worker with the same prefix removes them
    at start (:func:`sweep_orphans`, one log line per orphan). A segment
    whose lock it can take has no live creator, whatever became of the pid
    in its name; the pid only guards the instant between the segment's
    creation and its lock (an unlocked segment is left alone while a process
    with that pid lives and it is younger than ``CREATION_GRACE_S``). A live
    worker's entries are never touched.
  * Pool processes started by ``multiprocessing`` share the creator's
    tracker, so their attach adds nothing to it, and they only ``close``.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import math
import multiprocessing as mp
import os
import re
import secrets
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
from redbatch.common.config import DEFAULT_SHM_PREFIX

logger = logging.getLogger(__name__)

#: Where Linux keeps POSIX shared memory and named semaphores; elsewhere nothing is swept.
SHM_DIR = Path("/dev/shm")
#: An unlocked segment whose creator's pid is alive is left alone this long after it was
#: made, seconds: its creator locks it just after creating it.
CREATION_GRACE_S = 10.0
#: How long a new segment's creator waits for a sweeper that is looking at it, seconds.
_LOCK_WAIT_S = 2.0
_PREFIX = re.compile(r"[A-Za-z0-9_]{1,12}")


def validate_prefix(prefix: str) -> str:
    """``prefix`` if it can start a segment name; ValueError otherwise. No '-': it ends
    the prefix, so one prefix's names never match another's."""
    if not _PREFIX.fullmatch(prefix):
        raise ValueError(f"invalid shared-memory prefix {prefix!r:.40}: use 1-12 of "
                         "[A-Za-z0-9_]")
    return prefix


def segment_name(prefix: str) -> str:
    """A new segment name for this process: ``<prefix>-<pid>-<6 random hex>``."""
    return f"{validate_prefix(prefix)}-{os.getpid()}-{secrets.token_hex(3)}"


def name_semaphores_after(segment: str) -> None:
    """Name the multiprocessing semaphores this process makes from now on after
    ``segment`` (``/dev/shm/sem.<segment>-<random>``), so that their owner can be told and
    a sweep reclaims them with the segment.

    It sets multiprocessing's ``semprefix`` (a private setting, there since Python 3.4);
    a no-op where it is missing, and off Linux (macOS allows 31 characters a name).
    """
    config = getattr(mp.current_process(), "_config", None)
    if sys.platform.startswith("linux") and isinstance(config, dict) and "semprefix" in config:
        config["semprefix"] = "/" + segment


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

    def __init__(self, shm: shared_memory.SharedMemory, layout: SlotLayout, owner: bool,
                 lock_fd: int | None = None) -> None:
        self._shm = shm
        self.layout = layout
        self._owner = owner
        self._lock_fd = lock_fd
        self.array: np.ndarray = np.ndarray((layout.n_slots, *layout.shape),
                                            dtype=layout.dtype, buffer=shm.buf)

    @classmethod
    def create(cls, n_slots: int, shape: tuple[int, ...], dtype: str,
               prefix: str = DEFAULT_SHM_PREFIX) -> SlotArray:
        """A new segment named :func:`segment_name` (``prefix`` validated: ValueError),
        locked for its life; OSError when the system refuses one."""
        size = max(1, n_slots * math.prod(shape) * np.dtype(dtype).itemsize)
        for _ in range(16):  # a random part already taken: draw again
            try:
                shm = shared_memory.SharedMemory(segment_name(prefix), create=True, size=size)
                break
            except FileExistsError:
                continue
        else:
            raise FileExistsError(f"no free shared-memory name for prefix {prefix!r}")
        try:
            lock_fd = _hold_lock(shm.name)
        except BaseException:
            shm.close()
            shm.unlink()
            raise
        layout = SlotLayout(shm.name, n_slots, tuple(shape), dtype)
        return cls(shm, layout, owner=True, lock_fd=lock_fd)

    @classmethod
    def attach(cls, layout: SlotLayout) -> SlotArray:
        shm = shared_memory.SharedMemory(name=layout.name)
        return cls(shm, layout, owner=False)

    def close(self) -> None:
        """Detach; the creator also unlinks the segment and drops its lock. Safe to call
        twice."""
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
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # only after the unlink: a sweeper never sees it unlocked
            self._lock_fd = None


def _hold_lock(name: str) -> int | None:
    """An open descriptor holding an flock on /dev/shm/``name``, which says "its creator is
    alive" until this process closes it or dies; None where there is no /dev/shm.

    A sweeper may hold the lock for an instant while it looks at the new segment (it
    leaves it: the pid in the name is ours); OSError if it is still held after
    ``_LOCK_WAIT_S``.
    """
    path = SHM_DIR / name
    if not path.exists():
        return None
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    deadline = time.monotonic() + _LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise OSError(errno.EWOULDBLOCK, f"cannot lock {path}") from None
            time.sleep(0.01)


class SlotAllocator:
    """Free list of slot indices; owned by the worker's main thread."""

    def __init__(self, n_slots: int) -> None:
        self._free = list(range(n_slots - 1, -1, -1))
        self._is_free = bytearray(b"\x01" * n_slots)  # O(1) double-release check
        self.n_slots = n_slots

    def acquire(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self._is_free[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        self.release_many((slot,))

    def release_many(self, slots: Iterable[int]) -> None:
        """Free each slot; ValueError (after freeing those before it) for one out of range
        or already free."""
        for slot in slots:
            if not 0 <= slot < self.n_slots or self._is_free[slot]:
                raise ValueError(f"slot {slot} released twice or out of range")
            self._is_free[slot] = 1
            self._free.append(slot)

    @property
    def in_use(self) -> int:
        return self.n_slots - len(self._free)


# ---------------------------------------------------------------------------- orphans

@dataclass(slots=True)
class _Owner:
    """The /dev/shm entries of one segment name: the segment and its semaphores."""

    segment: str
    pid: int
    has_segment: bool = False
    semaphores: list[str] = field(default_factory=list)


def _owners(prefix: str) -> list[_Owner]:
    """The entries named with ``prefix`` in /dev/shm, grouped by segment name."""
    pattern = re.compile(rf"(sem\.)?({re.escape(prefix)}-([0-9]{{1,10}})-[0-9a-f]{{6}})"
                         r"(-[A-Za-z0-9_]{1,32})?")
    try:
        names = os.listdir(SHM_DIR)
    except OSError:  # no /dev/shm (not Linux), or not readable: nothing to sweep
        return []
    owners: dict[str, _Owner] = {}
    for name in names:
        m = pattern.fullmatch(name)
        if m is None or bool(m[1]) != bool(m[4]):
            continue  # a segment has no suffix, a semaphore has one
        owner = owners.setdefault(m[2], _Owner(m[2], int(m[3])))
        if m[1]:
            owner.semaphores.append(name)
        else:
            owner.has_segment = True
    return list(owners.values())


def sweep_orphans(prefix: str) -> list[str]:
    """Remove the /dev/shm entries named with ``prefix`` whose creator is dead; returns the
    segment names reclaimed, and logs one line for each.

    Reclaimed: a segment whose flock nobody holds (see NOTE [ Shared-memory lifetime ]),
    with its semaphores; and semaphores whose segment is gone and whose creator's pid runs
    no process. A live worker's entries are never touched. ValueError for a bad prefix;
    an entry that cannot be read or removed is left, with a debug line.
    """
    validate_prefix(prefix)
    reclaimed = []
    for owner in _owners(prefix):
        try:
            size = _reclaim(owner)
        except OSError as e:
            logger.debug("left shared memory %s: %s", owner.segment, e)
            continue
        if size is not None:
            reclaimed.append(owner.segment)
            logger.warning("reclaimed shared memory whose creator is gone (pid %d): %s (%s) "
                           "and %d semaphores", owner.pid, owner.segment,
                           f"{size / 2**20:.1f} MiB" if owner.has_segment else "gone already",
                           len(owner.semaphores))
    return reclaimed


def _reclaim(owner: _Owner) -> int | None:
    """Unlink ``owner``'s entries if its creator is gone: the segment's size in bytes
    (0 without one), or None when it may be alive."""
    if not owner.has_segment:
        if owner.pid == os.getpid() or _pid_running(owner.pid):
            return None
        _unlink_all(owner.semaphores)
        return 0
    path = SHM_DIR / owner.segment
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None  # closed by its creator, or taken by another sweeper, meanwhile
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # its creator holds the lock: alive
        st = os.fstat(fd)
        if not _creator_gone(owner.pid, st.st_mtime):
            return None
        os.unlink(path)
        _unlink_all(owner.semaphores)
        return st.st_size
    finally:
        os.close(fd)


def _creator_gone(pid: int, made_at: float) -> bool:
    """For an unlocked segment: False only while it may be between creation and lock
    (its creator's pid runs a process other than this one, and it is young)."""
    return (pid == os.getpid() or not _pid_running(pid)
            or time.time() - made_at >= CREATION_GRACE_S)


def _pid_running(pid: int) -> bool:
    """True if some process has this pid (possibly another than the one that made a name)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _unlink_all(names: list[str]) -> None:
    for name in names:
        try:
            os.unlink(SHM_DIR / name)
        except FileNotFoundError:
            pass
