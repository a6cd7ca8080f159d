"""The loop of one preprocessing process: take a task, decode into its slot, report.

Modelled on PyTorch's DataLoader worker loop: every blocking get has a
timeout, the parent is checked on each pass, ``None`` means stop, and a bad
input becomes an error record, never an exception that kills the process.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.queues import Queue
from multiprocessing.sharedctypes import Synchronized
from typing import Any

from redbatch.common.config import LimitSettings
from redbatch.common.protocol import ErrorCode
from redbatch.handlers.decode import InputError
from redbatch.preproc_worker.heap import HeapTrim
from redbatch.preproc_worker.shm import SlotArray, SlotLayout

#: Seconds between checks that the parent is still alive.
STATUS_CHECK_INTERVAL_S = 0.5
IDLE = -1


@dataclass(frozen=True, slots=True)
class PreprocTask:
    """One payload to decode into one slot.

    ``key`` names the task for its whole life; ``attempt`` grows each time it
    is resubmitted after a crash, so a late record of an old attempt is told apart.
    """

    key: int
    slot: int
    payload: bytes
    content_type: str
    params: dict[str, Any] = field(default_factory=dict)
    attempt: int = 0


@dataclass(frozen=True, slots=True)
class PreprocDone:
    """The outcome of a task: the slot is filled, or ``error_code`` says why not."""

    key: int
    slot: int
    error_code: ErrorCode | None = None
    message: str = ""
    preprocess_ms: float = 0.0
    attempt: int = 0


@dataclass(frozen=True, slots=True)
class ChildConfig:
    """Everything a pool process is started with (picklable; no sockets, no clients)."""

    index: int
    parent_pid: int
    layout: SlotLayout
    handler_spec: str
    limits: LimitSettings


def preprocess_one(handler: Any, slots: SlotArray, task: PreprocTask) -> PreprocDone:
    """Run the handler's preprocess into the task's slot; bad input becomes an error record."""
    start = time.perf_counter()
    try:
        handler.preprocess(task.payload, task.content_type, task.params, slots.array[task.slot])
        code, message = None, ""
    except InputError as e:
        code, message = e.code, e.message
    except Exception as e:  # a handler bug must not take the process down with it
        code, message = ErrorCode.BAD_INPUT, f"preprocess failed: {type(e).__name__}: {e}"
    elapsed_ms = (time.perf_counter() - start) * 1000
    return PreprocDone(task.key, task.slot, code, message, elapsed_ms, task.attempt)


def _exit_when_orphaned(parent_pid: int) -> None:
    """Watchdog thread: leave at once when the worker is gone.

    The loop below checks too, but its main thread can be stuck for good in a
    read of a task the worker died while writing (this process holds the
    queue's write end as well, so no end-of-file ever comes).
    """
    while os.getppid() == parent_pid:
        time.sleep(STATUS_CHECK_INTERVAL_S)
    os._exit(0)


def run_child(cfg: ChildConfig, tasks: Queue[PreprocTask | None], results: Queue[PreprocDone],
              current: Synchronized[int]) -> None:
    """Process entry point. ``current`` tells the parent which task is being worked on,
    so that if this process dies only that task is suspected of killing it."""
    # The worker decides when the pool stops: Ctrl-C in a terminal, or a
    # supervisor signalling the process group, must not kill pool processes
    # mid-task while the worker is still draining. If the worker dies, the
    # parent check below ends this loop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_exit_when_orphaned, args=(cfg.parent_pid,), daemon=True).start()
    from redbatch.handlers.base import load_handler

    handler = load_handler(cfg.handler_spec, cfg.limits)
    heap = HeapTrim()  # its size now, with the handler loaded, is the one to come back to
    slots = SlotArray.attach(cfg.layout)
    try:
        while os.getppid() == cfg.parent_pid:
            try:
                task = tasks.get(timeout=STATUS_CHECK_INTERVAL_S)
            except queue.Empty:
                continue
            if task is None:
                break
            current.value = task.key
            results.put(preprocess_one(handler, slots, task))
            current.value = IDLE
            heap.after_task()  # after the record is queued, so a trim never delays a reply
    finally:
        slots.close()
