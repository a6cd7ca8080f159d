"""The loop of one preprocessing process: take a chunk of tasks, decode each into its slot,
report the chunk's records in one message.

Modelled on PyTorch's DataLoader worker loop: every blocking get has a
timeout, the parent is checked on each pass, ``None`` means stop, and a bad
input becomes an error record, never an exception that kills the process.
:func:`preprocess_group` is the same work without a process, for handlers whose
preprocessing is trivial (see ``preprocesses_inline`` in handlers/base.py).
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from multiprocessing.connection import Connection
from multiprocessing.queues import Queue
from multiprocessing.sharedctypes import Synchronized
from operator import attrgetter
from typing import Any, TypeVar

from redbatch.common.config import LimitSettings
from redbatch.common.protocol import ErrorCode
from redbatch.handlers.decode import InputError
from redbatch.preproc_worker.heap import HeapTrim
from redbatch.preproc_worker.shm import SlotArray, SlotLayout

#: Seconds between checks that the parent is still alive.
STATUS_CHECK_INTERVAL_S = 0.5
#: A process sends the records it has once the oldest has waited this long, seconds, even
#: mid-chunk: so a record waits at most this plus one task for the rest of its chunk.
FLUSH_AFTER_S = 0.002
IDLE = -1

_C = TypeVar("_C", bound=type)


def _pickled_as_fields(cls: _C) -> _C:
    """Pickle a slotted dataclass as its class and its field values: every task and record
    crosses a process boundary, and this takes a fifth of the default's time (which runs
    Python ``__getstate__``/``__setstate__`` per object) to pickle, half to unpickle."""
    values: Callable[[Any], tuple[Any, ...]] = attrgetter(*(f.name for f in fields(cls)))

    def __reduce__(self: Any) -> tuple[type, tuple[Any, ...]]:
        return cls, values(self)

    cls.__reduce__ = __reduce__  # type: ignore[method-assign,assignment]
    return cls


@dataclass(frozen=True, slots=True)
class Task:
    """One job's input as the worker hands it over: decode ``payload`` into ``slot`` of
    model ``model`` (its index in the pool's models). ``urgent`` (an interactive job) puts
    it ahead of the pool's bulk backlog."""

    slot: int
    payload: bytes
    content_type: str
    params: dict[str, Any] = field(default_factory=dict)
    urgent: bool = False
    model: int = 0


@_pickled_as_fields
@dataclass(frozen=True, slots=True)
class PreprocTask:
    """One payload to decode into one slot, as the pool tracks it.

    ``key`` names the task for its whole life; ``attempt`` grows each time it
    is resubmitted after a crash, so a late record of an old attempt is told apart.
    """

    key: int
    slot: int
    payload: bytes
    content_type: str
    params: dict[str, Any] = field(default_factory=dict)
    attempt: int = 0
    #: Which of the pool's models (handler and slots) it is for.
    model: int = 0


@_pickled_as_fields
@dataclass(frozen=True, slots=True)
class PreprocDone:
    """The outcome of a task: the slot is filled, or ``error_code`` says why not."""

    key: int
    slot: int
    error_code: ErrorCode | None = None
    message: str = ""
    preprocess_ms: float = 0.0
    attempt: int = 0
    #: What the input costs the model, as its handler's ``preprocess`` returned it (tokens,
    #: for a text model: its longest text's), or 0: the batcher bounds a batch's padded
    #: cost with it.
    cost: int = 0
    #: Rows of the model's batch the input fills (a list of texts: one per text).
    rows: int = 1
    #: ``time.monotonic()`` when the process finished it (one clock for every process on
    #: the host): the pool measures how long a record takes to come back and be refilled.
    finished_s: float = 0.0


@dataclass(frozen=True, slots=True)
class ChildConfig:
    """Everything a pool process is started with (picklable; no sockets, no clients)."""

    index: int
    parent_pid: int
    #: Each model's handler spec and slots, in the worker's order of models.
    models: tuple[tuple[str, SlotLayout], ...]
    limits: LimitSettings


def _preprocess(handler: Any, out: Any, payload: bytes, content_type: str,
                params: Mapping[str, Any]) -> Outcome:
    """Run the handler's preprocess into ``out``: (error code or None, message, wall ms,
    cost, rows: what preprocess returned, an int cost or a (cost, rows) pair, else 0, 1)."""
    start = time.perf_counter()
    cost, rows = 0, 1
    try:
        returned = handler.preprocess(payload, content_type, params, out)
        code, message = None, ""
        if isinstance(returned, tuple):
            cost, rows = returned
        elif isinstance(returned, int):
            cost = returned
    except InputError as e:
        code, message = e.code, e.message
    except Exception as e:  # a handler bug must not take the process down with it
        code, message = ErrorCode.BAD_INPUT, f"preprocess failed: {type(e).__name__}: {e}"
    return code, message, (time.perf_counter() - start) * 1000, cost, rows


def preprocess_one(handler: Any, slots: SlotArray, task: PreprocTask) -> PreprocDone:
    """Run the handler's preprocess into the task's slot; bad input becomes an error record."""
    code, message, ms, cost, rows = _preprocess(handler, slots.array[task.slot], task.payload,
                                                task.content_type, task.params)
    return PreprocDone(task.key, task.slot, code, message, ms, task.attempt, cost, rows,
                       time.monotonic())


#: One input of ``preprocess_group``: slot, payload, content type, params.
Inline = tuple[int, bytes, str, Mapping[str, Any]]
#: One outcome of ``preprocess_group``: error code (None: the slot is filled), message, ms,
#: cost and rows (see ``PreprocDone``).
Outcome = tuple[ErrorCode | None, str, float, int, int]


def preprocess_group(handler: Any, slots: SlotArray, inputs: Iterable[Inline]) -> list[Outcome]:
    """Preprocess ``inputs`` into their slots right here, in the caller's thread: the path of
    a handler whose preprocessing is trivial (``preprocesses_inline`` in handlers/base.py),
    with no pool hop, no task and no record objects: plain tuples, one outcome per input,
    in order, with the error codes a pool process gives. A handler that crashes its
    process here takes the caller down: only trivial, trusted preprocessing may run inline."""
    array = slots.array
    return [_preprocess(handler, array[slot], payload, content_type, params)
            for slot, payload, content_type, params in inputs]


def _exit_when_orphaned(parent_pid: int) -> None:
    """Watchdog thread: leave at once when the worker is gone.

    The loop below checks too, but its main thread can be stuck for good in a
    read of a task the worker died while writing (this process holds the
    queue's write end as well, so no end-of-file ever comes).
    """
    while os.getppid() == parent_pid:
        time.sleep(STATUS_CHECK_INTERVAL_S)
    os._exit(0)


def run_child(cfg: ChildConfig, tasks: Queue[list[PreprocTask] | None],
              results: Connection, current: Synchronized[int]) -> None:
    """Process entry point. ``results`` is the write end of this process's own pipe (see
    NOTE [ One result pipe per process ] in pool.py). ``current`` tells the parent which
    task is being worked on, so that if this process dies only that task is suspected of
    killing it."""
    # The worker decides when the pool stops: Ctrl-C in a terminal, or a
    # supervisor signalling the process group, must not kill pool processes
    # mid-task while the worker is still draining. If the worker dies, the
    # parent check below ends this loop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_exit_when_orphaned, args=(cfg.parent_pid,), daemon=True).start()
    from redbatch.handlers.base import load_handler

    handlers = [load_handler(spec, cfg.limits) for spec, _ in cfg.models]
    heap = HeapTrim()  # its size now, with the handlers loaded, is the one to come back to
    slots = [SlotArray.attach(layout) for _, layout in cfg.models]
    try:
        while os.getppid() == cfg.parent_pid:
            try:
                chunk = tasks.get(timeout=STATUS_CHECK_INTERVAL_S)
            except queue.Empty:
                continue
            if chunk is None:
                break
            _run_chunk(handlers, slots, chunk, results, current)
            heap.after_task()  # after the records are sent, so a trim never delays a reply
    finally:
        results.close()
        for each in slots:
            each.close()


def _run_chunk(handlers: list[Any], slots: list[SlotArray], chunk: list[PreprocTask],
               results: Connection, current: Synchronized[int]) -> None:
    """Preprocess a chunk, sending its records in one message, or in a few when it runs
    long (FLUSH_AFTER_S). See NOTE [ Pool crash handling ] in pool.py for ``current``."""
    done: list[PreprocDone] = []
    oldest = 0.0
    for task in chunk:
        current.value = task.key
        done.append(preprocess_one(handlers[task.model], slots[task.model], task))
        now = time.perf_counter()
        if len(done) == 1:
            oldest = now
        elif now - oldest >= FLUSH_AFTER_S:
            results.send(done)
            done = []
    if done:
        results.send(done)
    current.value = IDLE
