"""The preprocessing pool: N processes decoding into shared-memory slots, kept alive.

The worker's main thread owns the pool: it calls ``submit_many``, ``complete``
and ``reap``. A small pump thread only forwards finished records from the
processes' result pipes to the callback given to ``start``, one list per message.

NOTE [ Pool crash handling ]
  Work crosses in chunks: one task-queue message carries a list of tasks, and a
  process answers with one message carrying the list of their records (a chunk
  that runs long is answered in a few, see FLUSH_AFTER_S in worker.py). Each
  process holds at most ``_Pace.bound`` tasks (the rest wait in the pool's two
  lines, urgent first), so the pool knows which tasks each one holds and a slow
  process does not hoard work. While it works, a process keeps the key of the
  task in hand (not the chunk) in its shared ``current``.
  When ``reap`` finds a dead process it starts a replacement and resubmits every
  task the dead one held and was not answered for, as a new attempt, ahead of
  the backlog. Records of its chunk that it had sent before dying are accepted
  as usual if ``complete`` sees them before ``reap``; those still unsent die with
  it and their tasks simply run again; a record that arrives after ``reap`` is of
  an old attempt and is ignored. So every task is answered exactly once.
  Only the task named in ``current`` when it died is charged with the crash;
  once a task has been charged more than ``crash_retries`` times it is answered
  ``preprocess_crashed`` instead.

NOTE [ Models' turns in the pool ]
  A worker serving several models has one pool for all of them. Its waiting tasks are in
  lines per model (urgent and backlog each), and a chunk takes them a model at a time in
  turn: urgent ones of every model before any bulk one, and among the models' urgent
  tasks (or bulk ones), one of each in rotation. So a model of cheap inputs (texts, a
  fraction of a millisecond each) never queues behind a long line of another's expensive
  ones (photos, milliseconds each): it waits for about one of them per task, while the
  expensive model keeps the processes busy.

NOTE [ One result pipe per process ]
  Each process answers through a pipe of its own, of which it holds the only write end.
  A process killed mid-write (a segfault in a decoder, the OOM killer) then leaves at most
  a torn message in its own pipe: the pump reads it as end of file and drops that pipe,
  and ``reap`` resubmits what the process held. A queue shared by all processes cannot
  survive that: its write lock, held by the dead process's feeder thread, is never
  released, and every other process blocks on it for good.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import multiprocessing.connection
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from itertools import count
from typing import Any

from redbatch.common.config import LimitSettings, PoolSettings
from redbatch.common.protocol import ErrorCode
from redbatch.preproc_worker.shm import SlotLayout, name_semaphores_after
from redbatch.preproc_worker.worker import (
    IDLE,
    ChildConfig,
    PreprocDone,
    PreprocTask,
    Task,
    run_child,
)

logger = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = 5.0
#: Tasks queued to one process at a time, whatever their cost: at least one being worked on
#: and one ready next; at most this many.
MIN_PREFETCH, MAX_PREFETCH = 2, 64
#: Records the pace looks back on, and how often it looks again.
_PACE_WINDOW, _PACE_EVERY = 32, 8
#: What a process holds after sending its records must last this many times the
#: trip of a record back to the refill, at its 90th percentile (see _Pace).
REFILL_MARGIN = 2.0


@dataclass(slots=True)
class _Child:
    index: int
    process: Any  # multiprocessing.Process of the chosen context
    tasks: Any  # its own task queue
    current: Any  # shared int: key of the task being worked on, or IDLE
    results: Any  # read end of its own result pipe (the pump's; see NOTE above)
    inflight: dict[int, PreprocTask] = field(default_factory=dict)


class _Pace:
    """How many tasks a process may hold: about ``prefetch_ms`` of work
    (``PoolSettings.prefetch_ms``) at the median preprocessing time of recent records (one
    huge photo, or the first task's warm-up, moves it little), within [MIN_PREFETCH,
    MAX_PREFETCH]. Chunks are at most half of it, so that one is ready while the other is
    worked on. Until records come back, tasks count as heavy.

    It also holds enough to outlast the refill: a record's trip back (pipe, pump, the
    worker's main thread) until the pool sends that process more. After sending, a process
    still holds what is past a chunk, about half the bound; that must last REFILL_MARGIN
    times the 90th percentile trip, or the process idles with work waiting in the pool
    (on the first H200 run, 15 processes at 2.2 ms a photo were about a sixth busy)."""

    def __init__(self, prefetch_ms: float) -> None:
        self.prefetch_ms = prefetch_ms
        self.bound = MIN_PREFETCH
        self._recent: deque[float] = deque(maxlen=_PACE_WINDOW)
        self._trips: deque[float] = deque(maxlen=_PACE_WINDOW)
        self._unseen = 0

    def observe(self, records: Sequence[PreprocDone], now_s: float | None = None) -> None:
        now_s = time.monotonic() if now_s is None else now_s
        self._recent.extend(r.preprocess_ms for r in records)
        self._trips.extend((now_s - r.finished_s) * 1000 for r in records if r.finished_s)
        self._unseen += len(records)
        if self._unseen < _PACE_EVERY:
            return
        self._unseen = 0
        typical_ms = statistics.median(self._recent)
        if typical_ms <= 0:
            self.bound = MAX_PREFETCH
            return
        trip_ms = _p90(self._trips)
        fit = int(self.prefetch_ms / typical_ms)
        refill = math.ceil(2 * REFILL_MARGIN * trip_ms / typical_ms)
        self.bound = max(MIN_PREFETCH, min(MAX_PREFETCH, max(fit, refill)))

    @property
    def chunk(self) -> int:
        return self.bound // 2


def _p90(values: Sequence[float]) -> float:
    """The 90th percentile of ``values`` (0 when empty): a trip that long is common enough
    to idle a process several times a second."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))] if ordered else 0.0


class PreprocPool:
    """Processes that run ``handler.preprocess`` into the slots of ``layout``; with
    ``more`` models, each process loads every model's handler and attaches every model's
    slots, and a task says which model it is for (``Task.model``: 0 is the first)."""

    def __init__(self, handler_spec: str, limits: LimitSettings, settings: PoolSettings,
                 layout: SlotLayout, more: Sequence[tuple[str, SlotLayout]] = ()) -> None:
        self._models = ((handler_spec, layout), *more)
        self._limits = limits
        self._settings = settings
        self._ctx: Any = mp.get_context(settings.start_method)
        name_semaphores_after(layout.name)  # before the queues make theirs
        self._children: list[_Child] = []
        self._keys = count()
        # Two lines per model, each first in first out: interactive (urgent) tasks are
        # dispatched before any bulk one, and in arrival order among themselves, so none
        # starves at saturation; the models take turns, a task each (NOTE [ Models' turns
        # in the pool ]).
        self._urgent: list[deque[PreprocTask]] = [deque() for _ in self._models]
        self._backlog: list[deque[PreprocTask]] = [deque() for _ in self._models]
        self._waiting = 0
        self._turn = 0  # the model whose lines are looked at first for the next task
        self._pace = _Pace(settings.prefetch_ms)
        self._strikes: dict[int, int] = {}  # task key -> crashes charged to it
        self._stop = threading.Event()
        self._pump: threading.Thread | None = None
        self._retired: list[Any] = []  # pipes of replaced processes, for the pump to drain
        self._draining: dict[Any, None] = {}  # the pump's pipes, in the order first seen
        self.restarts = 0

    # ------------------------------------------------------------------ lifecycle

    def start(self, on_records: Callable[[list[PreprocDone]], None]) -> None:
        """Start the processes and the pump thread, which calls ``on_records`` once per
        message with its list of records."""
        self._children = [self._spawn(i) for i in range(self._settings.processes)]
        if not self._children:
            return  # no processes (every task is preprocessed inline): nothing to pump
        self._pump = threading.Thread(target=self._pump_loop, args=(on_records,),
                                      name="preproc-pump", daemon=True)
        self._pump.start()

    def _spawn(self, index: int) -> _Child:
        cfg = ChildConfig(index, os.getpid(), self._models, self._limits)
        tasks, current = self._ctx.Queue(), self._ctx.Value("q", IDLE, lock=False)
        reader, writer = self._ctx.Pipe(duplex=False)
        proc = self._ctx.Process(target=run_child, args=(cfg, tasks, writer, current),
                                 name=f"redbatch-preproc-{index}", daemon=True)
        proc.start()
        writer.close()  # the process holds the only write end: its death is end of file
        return _Child(index, proc, tasks, current, reader)

    def _pump_loop(self, on_records: Callable[[list[PreprocDone]], None]) -> None:
        """Forward each message from any process's pipe. A pipe at end of file (its process
        died, maybe mid-message) is closed and dropped; a replacement's pipe is picked up
        from ``_children`` on the next pass."""
        open_ = self._draining
        while not self._stop.is_set():
            while self._retired:
                open_[self._retired.pop()] = None
            open_.update((c.results, None) for c in list(self._children))
            for gone in [r for r in open_ if r.closed]:
                del open_[gone]  # dropped at end of file below, before reap retired it
            try:
                ready = multiprocessing.connection.wait(list(open_), timeout=0.2)
            except (OSError, ValueError):
                return  # a pipe closed under us: only close() does that
            for ready_one in ready:
                reader: Any = ready_one  # one of ours: a Connection
                try:
                    records = reader.recv()
                except (EOFError, OSError):
                    reader.close()
                    continue
                on_records(records)

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
        for reader in [*self._draining, *self._retired, *(c.results for c in self._children)]:
            reader.close()
        self._draining, self._retired = {}, []
        # Dropping the queues lets their named semaphores be unlinked now, not at exit.
        self._children = []

    # ------------------------------------------------------------------ tasks

    @property
    def inflight(self) -> int:
        return self._waiting + sum(len(c.inflight)
                                                             for c in self._children)

    @property
    def busy(self) -> int:
        """Processes working on a task right now (each says so in its shared ``current``)."""
        return sum(c.current.value != IDLE for c in self._children)

    def submit_many(self, tasks: Iterable[Task]) -> list[int]:
        """Queue tasks, urgent ones (interactive jobs) ahead of the backlog, and send what
        fits to the least busy processes in chunks; returns their keys, in order."""
        keys = []
        for t in tasks:
            key = next(self._keys)
            keys.append(key)
            lines = self._urgent if t.urgent else self._backlog
            lines[t.model].append(PreprocTask(key, t.slot, t.payload, t.content_type,
                                              t.params, model=t.model))
            self._waiting += 1
        self._dispatch()
        return keys

    def submit(self, slot: int, payload: bytes, content_type: str,
               params: dict[str, Any], urgent: bool = False) -> int:
        """``submit_many`` of one task; returns its key."""
        return self.submit_many([Task(slot, payload, content_type, params, urgent)])[0]

    def _dispatch(self) -> None:
        """Move waiting tasks, urgent ones first, to the least busy processes with room for a
        chunk, in chunks that share what waits among them. (Topping a process up with what
        just came back would shrink the chunks to the size of the records' messages.)"""
        size, most = self._pace.chunk, self._pace.bound - self._pace.chunk
        while self._waiting:
            open_ = [c for c in self._children if len(c.inflight) <= most]
            if not open_:
                return
            child = min(open_, key=lambda c: len(c.inflight))
            n = min(size, math.ceil(self._waiting / len(open_)))
            chunk = [self._next_task() for _ in range(n)]
            child.inflight.update((task.key, task) for task in chunk)
            child.tasks.put(chunk)

    def _next_task(self) -> PreprocTask:
        """The next waiting task: urgent ones first, the models taking turns, a task each."""
        self._waiting -= 1
        if len(self._models) == 1:
            return (self._urgent[0] or self._backlog[0]).popleft()
        n = len(self._models)
        for lines in (self._urgent, self._backlog):
            for k in range(n):
                model = (self._turn + k) % n
                if lines[model]:
                    self._turn = (model + 1) % n
                    return lines[model].popleft()
        raise AssertionError("a task was counted waiting that no line holds")

    def complete(self, records: Sequence[PreprocDone]) -> list[PreprocDone]:
        """Accept finished records; returns those accepted, in order, leaving out stale
        ones (their task was resubmitted after a crash). Sends waiting work on."""
        accepted = [r for r in records if self._accept(r)]
        self._pace.observe(accepted)
        self._dispatch()
        return accepted

    def _accept(self, record: PreprocDone) -> bool:
        for child in self._children:
            task = child.inflight.get(record.key)
            if task is not None and task.attempt == record.attempt:
                del child.inflight[record.key]
                self._strikes.pop(record.key, None)
                return True
        return False

    def reap(self) -> list[PreprocDone]:
        """Replace dead processes and resubmit their tasks; returns give-up records."""
        given_up: list[PreprocDone] = []
        restarts = self.restarts
        for i, child in enumerate(self._children):
            if child.process.is_alive() or self._stop.is_set():
                continue
            logger.warning("preprocessing process %s died (exit code %s); restarting it",
                           child.process.name, child.process.exitcode)
            self.restarts += 1
            _discard_task_queue(child.tasks)  # its unread tasks are resubmitted below
            self._retired.append(child.results)  # the pump reads what it sent, then drops it
            self._children[i] = self._spawn(child.index)
            given_up += self._resubmit(child)
        if self.restarts != restarts:
            self._dispatch()  # to the new processes
        return given_up

    def _resubmit(self, dead: _Child) -> list[PreprocDone]:
        """Its unanswered tasks go ahead of the backlog as new attempts, but for the one it
        died on once that one has used up its retries. See NOTE [ Pool crash handling ]."""
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
            self._urgent[task.model].append(replace(task, attempt=task.attempt + 1))
            self._waiting += 1
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
