"""The reply reader of each face, each on a connection of its own: a daemon thread for
:class:`~redbatch.producer.client.Client`, a task for
:class:`~redbatch.producer.client.AsyncClient`. Its logic is :meth:`ReplyWaits.read_round`
(``replies.py``, NOTE [ Waiting in groups ]); here it is only repeated, and stopped.

Its own connection: the reader's BLPOP never takes the connection a caller's own call
would reuse, so a caller never has to open one to a hung Redis (see Client.result).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading

from redbatch.common.redis_io import connect, connect_async
from redbatch.producer.replies import ReplyWaits
from redbatch.producer.runners import AsyncRunner, BlockingRunner

logger = logging.getLogger(__name__)

#: Pause after a reader's pass failed unexpectedly, s.
_FAILED_PAUSE_S = 1.0
#: How long stopping waits for a sync reader to notice, s (it is a daemon thread anyway).
_JOIN_S = 1.0
#: How often stopping cancels an async reader until it ends, s.
_CANCEL_AGAIN_S = 0.1


class ReaderThread:
    """Repeats ``waits.read_round()`` on a daemon thread, over its own connection to
    ``redis_url``, until :meth:`stop`."""

    def __init__(self, waits: ReplyWaits, redis_url: str) -> None:
        self.waits = waits
        self.redis = connect(redis_url)
        self._run = BlockingRunner(self.redis).run
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"redbatch-replies-{waits.keys.model}")
        self._thread.start()

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                self._run(self.waits.read_round())
            except Exception:
                if self._stopping.is_set():
                    return  # stop() cut its connection
                logger.exception("reading reply list %s failed; retrying", self.waits.key)
                self._stopping.wait(_FAILED_PAUSE_S)

    def stop(self) -> None:
        """End the thread: its blocked call is cut short by closing its connection; waits
        _JOIN_S at most for it to notice."""
        self._stopping.set()
        self.redis.close()
        self._thread.join(_JOIN_S)
        self.redis.close()  # and any connection it opened meanwhile


class ReaderTask:
    """Repeats ``waits.read_round()`` on a task of the running event loop, over its own
    connection to ``redis_url``, until :meth:`stop` (or the loop's end cancels it)."""

    def __init__(self, waits: ReplyWaits, redis_url: str) -> None:
        self.waits = waits
        self.redis = connect_async(redis_url)
        self.task = asyncio.get_running_loop().create_task(
            self._loop(AsyncRunner(self.redis)), name=f"redbatch-replies-{waits.keys.model}")

    def running_here(self) -> bool:
        """True while the task runs, on the event loop running now."""
        return not self.task.done() and self.task.get_loop() is asyncio.get_running_loop()

    async def _loop(self, runner: AsyncRunner) -> None:
        task = asyncio.current_task()
        while True:
            if task is not None and sys.version_info >= (3, 11) and task.cancelling():
                # A cancellation redis-py lost (seen: a BLPOP cancelled mid-read went on
                # to its reply, the task still "cancelling"): honoured between passes, so
                # even asyncio.run's single cancel at its end stops the reader.
                raise asyncio.CancelledError
            try:
                await runner.run(self.waits.read_round())
            except Exception:
                logger.exception("reading reply list %s failed; retrying", self.waits.key)
                await asyncio.sleep(_FAILED_PAUSE_S)

    async def stop(self) -> None:
        """Cancel the task, again until it ends (see _loop), and close its connection."""
        while self.running_here():
            self.task.cancel()
            await asyncio.wait([self.task], timeout=_CANCEL_AGAIN_S)
        if self.task.get_loop() is asyncio.get_running_loop():
            await self.redis.aclose()
