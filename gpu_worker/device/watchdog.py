"""A watchdog for device calls that Python cannot interrupt: past its bound, the process ends.

NOTE [ Device watchdog ]
  A forward pass or a compile stuck inside torch or the device (a hung kernel, a deadlock
  between threads) cannot be cancelled: the thread waiting for it waits for ever, and so
  would a worker warming up or ``redbatch calibrate``. Each such wait runs inside
  ``Watchdog.watch(stage)``; the watchdog's own thread wakes while anything is watched,
  and once the oldest watched call has run past ``timeout_s`` it calls
  ``on_hang(stage, timeout_s)``, by default ``exit_hung``: log the stage and end the
  process at once with DEVICE_EXIT_CODE, since only a new process gets a working device
  back. What is not torn down then is reclaimed: pool processes exit when orphaned, and
  the next worker with the same shm prefix removes the segment. While serving, the main
  loop times each batch itself (``Settings.batch_timeout_s``) and ends the worker the
  same way (``exit_now``).
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from types import TracebackType
from typing import NoReturn

logger = logging.getLogger(__name__)

#: A worker's exit status when its device failed or hung: its supervisor restarts it.
DEVICE_EXIT_CODE = 3

#: A context manager bounding the device calls inside it, named by their stage.
Watch = Callable[[str], AbstractContextManager[None]]


def unwatched(stage: str) -> AbstractContextManager[None]:
    """A Watch that bounds nothing (library callers that bring no watchdog)."""
    return nullcontext()


def overdue(watched: Mapping[int, tuple[str, float]], now: float,
            timeout_s: float) -> str | None:
    """The stage of the oldest watched call (``(stage, started)`` by token) that has run
    for ``timeout_s`` or longer at ``now``, or None. Pure."""
    oldest = min(watched.values(), key=lambda entry: entry[1], default=None)
    if oldest is None or now - oldest[1] < timeout_s:
        return None
    return oldest[0]


def exit_now(code: int) -> NoReturn:
    """Flush the logs and standard streams, then end the process with ``code`` without
    joining threads: a thread stuck in a device call would block a normal exit."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def exit_hung(stage: str, timeout_s: float) -> NoReturn:
    """``on_hang`` for a worker: one log line naming the stage, then DEVICE_EXIT_CODE."""
    logger.critical("device hung: %s did not return within %g s; exiting (code %d) for a "
                    "restart", stage, timeout_s, DEVICE_EXIT_CODE)
    exit_now(DEVICE_EXIT_CODE)


class Watchdog:
    """Calls ``on_hang(stage, timeout_s)`` once, from its own thread, when a call watched
    with ``watch`` has run ``timeout_s`` seconds (NOTE [ Device watchdog ]). A context
    manager: leaving it stops the thread. ``clock`` is injectable for tests."""

    def __init__(self, timeout_s: float,
                 on_hang: Callable[[str, float], None] = exit_hung,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if timeout_s <= 0:
            raise ValueError("a watchdog's timeout must be > 0 seconds")
        self.timeout_s = timeout_s
        self._on_hang = on_hang
        self._clock = clock
        self._watched: dict[int, tuple[str, float]] = {}
        self._tokens = itertools.count()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        #: How often the thread looks, s: a small share of the bound, at most a second.
        self._poll_s = min(1.0, max(0.02, timeout_s / 20))
        self._thread = threading.Thread(target=self._run, name="redbatch-device-watchdog",
                                        daemon=True)
        self._thread.start()

    @contextmanager
    def watch(self, stage: str) -> Iterator[None]:
        """Bound what runs inside to ``timeout_s``; ``stage`` names it in the error."""
        token = next(self._tokens)
        with self._lock:
            self._watched[token] = (stage, self._clock())
        try:
            yield
        finally:
            with self._lock:
                del self._watched[token]

    def _run(self) -> None:
        while not self._closed.wait(self._poll_s):
            with self._lock:
                stage = overdue(self._watched, self._clock(), self.timeout_s)
            if stage is not None:
                self._on_hang(stage, self.timeout_s)
                return

    def close(self) -> None:
        """Stop watching; what is still inside ``watch`` is bounded no more."""
        self._closed.set()
        self._thread.join(timeout=self._poll_s * 2 + 1)

    def __enter__(self) -> Watchdog:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
