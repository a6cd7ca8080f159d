"""The reply readers of each face, on a client of their own: a daemon thread a reply list
for :class:`~redbatch.producer.client.Client`, a task for
:class:`~redbatch.producer.client.AsyncClient`. Their logic is
:meth:`ReplyWaits.read_round` (``replies.py``, NOTE [ Waiting in groups ]); here it is
only repeated, and stopped.

A client of their own: a reader's BLMPOP never takes the connection a caller's own call
would reuse, so a caller never has to open one to a hung Redis (see Client.result). One
for all the readers of a face: a model of P partitions has P reply lists, and a cluster
client costs a slot map and a command table to make.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import redis
import redis.asyncio as aioredis
from redbatch.common.config import RedisSettings
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


class ReaderThreads:
    """The reader threads of one Client, one a reply list (one per model and partition),
    each repeating ``waits.read_round()`` on a daemon thread. They share one Redis client
    of their own (made at the first start), not the caller's: each blocked call holds a
    connection of that client's pool (of the node its list lives on, on a cluster), and a
    client with many partitions opens one client, not one a partition."""

    def __init__(self, settings: RedisSettings | str) -> None:
        self.redis_settings = settings
        self._redis: redis.Redis | None = None
        self._threads: dict[str, threading.Thread] = {}
        self._stopping = threading.Event()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._threads)

    def start(self, tag: str, waits: ReplyWaits) -> None:
        """Start the reader of ``waits`` (known by ``tag``) unless it runs or all stopped."""
        with self._lock:
            if tag in self._threads or self._stopping.is_set():
                return
            if self._redis is None:
                self._redis = connect(self.redis_settings)
            run = BlockingRunner(self._redis).run
            thread = threading.Thread(target=self._loop, args=(waits, run), daemon=True,
                                      name=f"redbatch-replies-{tag}")
            self._threads[tag] = thread
            thread.start()

    def _loop(self, waits: ReplyWaits, run: Any) -> None:
        while not self._stopping.is_set():
            try:
                run(waits.read_round())
            except Exception:
                if self._stopping.is_set():
                    return  # stop() cut its connection
                logger.exception("reading reply list %s failed; retrying", waits.key)
                self._stopping.wait(_FAILED_PAUSE_S)

    def stop(self) -> None:
        """End every thread: their blocked calls are cut short by closing the client;
        waits _JOIN_S at most for each to notice."""
        with self._lock:
            self._stopping.set()
            threads, client = list(self._threads.values()), self._redis
        if client is None:
            return
        client.close()
        for thread in threads:
            thread.join(_JOIN_S)
        client.close()  # and any connection they opened meanwhile


class ReaderTasks:
    """The asyncio twin of :class:`ReaderThreads`: a task a reply list on the running event
    loop, sharing one client of their own on that loop. A loop that ended leaves tasks
    and a client behind: tasks started on another loop get a new client."""

    def __init__(self, settings: RedisSettings | str) -> None:
        self.redis_settings = settings
        self._redis: aioredis.Redis | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def start(self, tag: str, waits: ReplyWaits) -> None:
        """Start the reader task of ``waits`` unless one runs on this loop."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._redis, self._loop, self._tasks = connect_async(self.redis_settings), loop, {}
        task = self._tasks.get(tag)
        if task is None or task.done():
            assert self._redis is not None
            self._tasks[tag] = loop.create_task(self._run(waits, AsyncRunner(self._redis)),
                                                name=f"redbatch-replies-{tag}")

    @staticmethod
    async def _run(waits: ReplyWaits, runner: AsyncRunner) -> None:
        task = asyncio.current_task()
        while True:
            if task is not None and task.cancelling():
                # A cancellation redis-py lost (seen: a BLPOP cancelled mid-read went on
                # to its reply, the task still "cancelling"): honoured between passes, so
                # even asyncio.run's single cancel at its end stops the reader.
                raise asyncio.CancelledError
            try:
                await runner.run(waits.read_round())
            except Exception:
                logger.exception("reading reply list %s failed; retrying", waits.key)
                await asyncio.sleep(_FAILED_PAUSE_S)

    async def stop(self) -> None:
        """Cancel the tasks of this loop, again until they end (see _run), and close their
        client."""
        if self._loop is not asyncio.get_running_loop():
            return
        tasks, self._tasks = list(self._tasks.values()), {}
        for task in tasks:
            while not task.done():
                task.cancel()
                await asyncio.wait([task], timeout=_CANCEL_AGAIN_S)
        if self._redis is not None:
            await self._redis.aclose()
        self._redis, self._loop = None, None
