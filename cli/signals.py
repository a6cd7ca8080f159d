"""What SIGINT and SIGTERM do while a command runs: stop gracefully, or unwind like Ctrl-C.

Both helpers put the previous handlers back on exit, so a command run in-process
(tests with ``CliRunner``) leaves the interpreter as it found it.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

logger = logging.getLogger(__name__)


@contextmanager
def signals_stop(stop: Callable[[], None],
                 abort: Callable[[], None]) -> Iterator[list[int]]:
    """First SIGINT/SIGTERM: ``stop()`` (graceful); second: ``abort()``. Yields the list of
    the signals received so far (so that a stop by Ctrl-C can exit 130)."""
    seen: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        seen.append(signum)
        logger.info("signal %s: %s", signum, "stopping" if len(seen) == 1 else "aborting")
        (stop if len(seen) == 1 else abort)()

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield seen
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@contextmanager
def signals_raise() -> Iterator[None]:
    """SIGTERM behaves like Ctrl-C (KeyboardInterrupt), so what the command started (a
    private stack, a live view's terminal state) is torn down on both."""
    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
