"""The preprocessing pool: N processes decoding into shared-memory slots, kept alive.

The worker's main thread owns the pool: it calls ``submit``, ``complete``
and ``reap``. A small pump thread only forwards finished records from the
shared results queue to the callback given to ``start``.

NOTE [ Pool crash handling ]
  Each process has its own task queue holding at most ``PREFETCH`` tasks
  (the rest wait in the pool's backlog), so the pool knows which tasks each
  one holds and a slow process does not hoard work. When ``reap`` finds a
  dead process it starts a replacement and resubmits every task the dead one
  held as a new attempt (a late record of the old attempt is then ignored).
  Only the task it was working on when it died
  is charged with the crash; once a task has been charged more than
  ``crash_retries`` times it is answered ``preprocess_crashed`` instead.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from itertools import count
from typing import Any

from redbatch.common.config import LimitSettings, PoolSettings
from redbatch.common.protocol import ErrorCode
from redbatch.preproc_worker.shm import SlotLayout, name_semaphores_after
from redbatch.preproc_worker.worker import IDLE, ChildConfig, PreprocDone, PreprocTask, run_child

logger = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = 5.0
#: Tasks queued to one process at a time: one being worked on, one ready next.
PREFETCH = 2


@dataclass(slots=True)
class _Child:
    index: int
    process: Any  # multiprocessing.Process of the chosen context
    tasks: Any  # its own task queue
    current: Any  # shared int: key of the task being worked on, or IDLE
    inflight: dict[int, PreprocTask] = field(default_factory=dict)


class PreprocPool:
    """Processes that run ``handler.preprocess`` into the slots of ``layout``."""

    def __init__(self, handler_spec: str, limits: LimitSettings, settings: PoolSettings,
                 layout: SlotLayout) -> None:
        self._spec = handler_spec
        self._limits = limits
        self._settings = settings
        self._layout = layout
        self._ctx: Any = mp.get_context(settings.start_method)
        name_semaphores_after(layout.name)  # before the queues make theirs
        self._results: Any = self._ctx.Queue()
        self._children: list[_Child] = []
        self._keys = count()
        # Two lines, each first in first out: interactive (urgent) tasks are dispatched before
        # any bulk one, and in arrival order among themselves, so none starves at saturation.
        self._urgent: deque[PreprocTask] = deque()
        self._backlog: deque[PreprocTask] = deque()
        self._strikes: dict[int, int] = {}  # task key -> crashes charged to it
        self._stop = threading.Event()
        self._pump: threading.Thread | None = None
        self.restarts = 0

    # ------------------------------------------------------------------ lifecycle

    def start(self, on_done: Callable[[PreprocDone], None]) -> None:
        """Start the processes and the pump thread that calls ``on_done`` per record."""
        self._children = [self._spawn(i) for i in range(self._settings.processes)]
        self._pump = threading.Thread(target=self._pump_loop, args=(on_done,),
                                      name="preproc-pump", daemon=True)
        self._pump.start()

    def _spawn(self, index: int) -> _Child:
        cfg = ChildConfig(index, os.getpid(), self._layout, self._spec, self._limits)
        tasks, current = self._ctx.Queue(), self._ctx.Value("q", IDLE, lock=False)
        proc = self._ctx.Process(target=run_child, args=(cfg, tasks, self._results, current),
                                 name=f"redbatch-preproc-{index}", daemon=True)
        proc.start()
        return _Child(index, proc, tasks, current)

    def _pump_loop(self, on_done: Callable[[PreprocDone], None]) -> None:
        while not self._stop.is_set():
            try:
                record = self._results.get(timeout=0.2)
            except queue.Empty:
                continue
            except (EOFError, OSError):
                return  # queue closed at shutdown
            on_done(record)

    def close(self) -> None:
        """Stop the processes (sentinel, then terminate, then kill) and the pump."""
        self._stop.set()
        for child in self._children:
            _put_quietly(child.tasks, None)
        for child in self._children:
            _stop_process(child.process)
            child.tasks.close()
            child.tasks.join_thread()
        if self._pump is not None:
            self._pump.join(timeout=_JOIN_TIMEOUT_S)
        self._results.close()
        # Dropping the queues lets their named semaphores be unlinked now, not at exit.
        self._results = None
        self._children = []

    # ------------------------------------------------------------------ tasks

    @property
    def inflight(self) -> int:
        return len(self._urgent) + len(self._backlog) + sum(len(c.inflight)
                                                             for c in self._children)

    @property
    def busy(self) -> int:
        """Processes working on a task right now (each says so in its shared ``current``)."""
        return sum(c.current.value != IDLE for c in self._children)

    def submit(self, slot: int, payload: bytes, content_type: str,
               params: dict[str, Any], urgent: bool = False) -> int:
        """Queue a task on the least busy process; returns its key. ``urgent`` tasks
        (interactive jobs) go ahead of the backlog."""
        task = PreprocTask(next(self._keys), slot, payload, content_type, params)
        self._assign(task, urgent)
        return task.key

    def _assign(self, task: PreprocTask, urgent: bool = False) -> None:
        (self._urgent if urgent else self._backlog).append(task)
        self._dispatch()

    def _dispatch(self) -> None:
        """Move waiting tasks, urgent ones first, to the least busy processes with room."""
        while self._urgent or self._backlog:
            child = min(self._children, key=lambda c: len(c.inflight))
            if len(child.inflight) >= PREFETCH:
                return
            task = (self._urgent or self._backlog).popleft()
            child.inflight[task.key] = task
            child.tasks.put(task)

    def complete(self, record: PreprocDone) -> bool:
        """Accept a finished record; False for a stale one (task was resubmitted)."""
        for child in self._children:
            task = child.inflight.get(record.key)
            if task is not None and task.attempt == record.attempt:
                del child.inflight[record.key]
                self._strikes.pop(record.key, None)
                self._dispatch()
                return True
        return False

    def reap(self) -> list[PreprocDone]:
        """Replace dead processes and resubmit their tasks; returns give-up records."""
        given_up: list[PreprocDone] = []
        for i, child in enumerate(self._children):
            if child.process.is_alive() or self._stop.is_set():
                continue
            logger.warning("preprocessing process %s died (exit code %s); restarting it",
                           child.process.name, child.process.exitcode)
            self.restarts += 1
            _discard_task_queue(child.tasks)  # its unread tasks are resubmitted below
            self._children[i] = self._spawn(child.index)
            given_up += self._resubmit(child)
        return given_up

    def _resubmit(self, dead: _Child) -> list[PreprocDone]:
        given_up = []
        suspect = dead.current.value
        for task in dead.inflight.values():
            if task.key == suspect:
                strikes = self._strikes.get(task.key, 0) + 1
                self._strikes[task.key] = strikes
                if strikes > self._settings.crash_retries:
                    del self._strikes[task.key]
                    given_up.append(PreprocDone(task.key, task.slot, ErrorCode.PREPROCESS_CRASHED,
                                                f"preprocessing process died {strikes} times "
                                                "on this input", attempt=task.attempt))
                    continue
            self._assign(replace(task, attempt=task.attempt + 1), urgent=True)
        return given_up

    def pids(self) -> list[int]:
        return [c.process.pid for c in self._children]


def _put_quietly(q: Any, item: Any) -> None:
    try:
        q.put(item)
    except (ValueError, OSError):
        pass


def _discard_task_queue(q: Any) -> None:
    """Close the task queue of a dead process without leaking its feeder thread.

    The queue's feeder thread may be blocked writing into a full pipe that
    nobody reads any more; reading the pipe here lets it reach the close
    sentinel and exit, which releases the queue's semaphores.
    """
    q.cancel_join_thread()
    q.close()
    feeder, reader = getattr(q, "_thread", None), getattr(q, "_reader", None)
    deadline = time.monotonic() + _JOIN_TIMEOUT_S
    while feeder is not None and feeder.is_alive() and time.monotonic() < deadline:
        try:
            if reader is not None and reader.poll(0.01):
                reader.recv_bytes()
        except (OSError, EOFError, TypeError, ValueError):
            # The feeder reached the sentinel and closed the reader under us: done.
            break


def _stop_process(proc: Any) -> None:
    proc.join(timeout=_JOIN_TIMEOUT_S)
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout=_JOIN_TIMEOUT_S)
    if proc.is_alive():
        proc.kill()
        proc.join()
