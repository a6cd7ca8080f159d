"""The submits of concurrent requests, sent together: work moves in groups.

Every request the event loop runs in one turn adds its jobs to the tenant's pending list;
the first one schedules a flush for the end of that turn, which sends them all in one
``submit_jobs`` (one admission call per lane, pipelined: one round trip). Each request then
learns its own outcome: admitted, or the QueueFull or DuplicateRequestId of its own jobs
(the others' jobs of the same call are unaffected); any other error is every request's.
Nothing waits for more jobs to come: a lone request is sent at the end of its own turn.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from redbatch.common.protocol import JobEnvelope
from redbatch.producer.client import AsyncClient
from redbatch.producer.errors import DuplicateRequestId, QueueFull

Pending = tuple[Sequence[JobEnvelope], "asyncio.Future[None]"]


class Coalescer:
    """One tenant's submits, grouped per event-loop turn."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client
        self._pending: list[Pending] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def submit(self, jobs: Sequence[JobEnvelope]) -> None:
        """Queue ``jobs`` with those of the other requests of this turn; raises as
        ``submit_jobs`` would have for these jobs alone."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.append((jobs, done))
        await done

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        task = asyncio.get_running_loop().create_task(self._send(batch))
        self._tasks.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._tasks.discard)

    async def _send(self, batch: list[Pending]) -> None:
        refused: set[str] = set()
        duplicates: set[str] = set()
        first: QueueFull | None = None
        try:
            await self.client.submit_jobs([job for jobs, _ in batch for job in jobs])
        except QueueFull as e:
            first, refused, duplicates = e, set(e.refused), set(e.duplicates)
        except DuplicateRequestId as e:
            duplicates = set(e.duplicates)
        except BaseException as e:  # noqa: BLE001 - every request of the call gets it
            for _, done in batch:
                if not done.done():
                    done.set_exception(e)
            return
        for jobs, done in batch:
            if not done.done():
                _settle(done, [j.request_id for j in jobs], refused, duplicates, first)


def _settle(done: asyncio.Future[None], ids: list[str], refused: set[str],
            duplicates: set[str], first: QueueFull | None) -> None:
    """One request's outcome of a call whose ``refused`` and ``duplicates`` ids are known."""
    mine_refused = [i for i in ids if i in refused]
    mine_duplicates = [i for i in ids if i in duplicates]
    accepted = [i for i in ids if i not in refused and i not in duplicates]
    if mine_refused and first is not None:
        done.set_exception(QueueFull(first.model, first.lane, first.bound, mine_refused,
                                     accepted))
    elif mine_duplicates:
        done.set_exception(DuplicateRequestId(mine_duplicates, accepted))
    else:
        done.set_result(None)
