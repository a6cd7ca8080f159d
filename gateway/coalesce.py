"""The submits of concurrent requests, sent together: work moves in groups.

Every request adds its jobs to the tenant's pending list. With fewer than ``in_flight``
admission calls out, the first pending request schedules a send for the end of the event
loop's turn (so the requests that one turn reads go together, and a lone request waits for
nothing but its own turn). With ``in_flight`` calls out, the pending requests wait for the
first of them to come back and go in the next call together: group commit. Under an open
load the calls then follow Redis's round trip instead of the arrivals, so the calls per
request fall as the load rises, where one call each would have queued behind one another
on the event loop (BENCHMARKS.md, issue 32). Each call is ``submit_jobs`` (one admission
call per lane, pipelined: one round trip).

Each request learns its own outcome: admitted, or the QueueFull or DuplicateRequestId of its
own jobs (the others' jobs of the same call are unaffected); any other error is every
request's of that call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from redbatch.common.config import GatewaySettings, default_of
from redbatch.common.protocol import JobEnvelope
from redbatch.producer.client import AsyncClient
from redbatch.producer.errors import DuplicateRequestId, QueueFull

Pending = tuple[Sequence[JobEnvelope], "asyncio.Future[None]"]


class Coalescer:
    """One tenant's submits, grouped per event-loop turn and behind the calls in flight."""

    def __init__(self, client: AsyncClient, in_flight: int | None = None) -> None:
        if in_flight is None:
            in_flight = int(default_of(GatewaySettings, "submit_calls_in_flight"))
        if in_flight < 1:
            raise ValueError("in_flight must be >= 1")
        self.client = client
        self.in_flight = in_flight
        self.calls = 0
        """Admission calls made (what the grouping saves: requests per call)."""
        self._pending: list[Pending] = []
        self._scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()

    async def submit(self, jobs: Sequence[JobEnvelope]) -> None:
        """Queue ``jobs`` with those of the other requests pending; raises as
        ``submit_jobs`` would have for these jobs alone."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._pending.append((jobs, done))
        self._schedule(loop)
        await done

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        """A send at the end of this turn, unless one is scheduled or the calls are out
        (then the first call back sends what is pending)."""
        if self._pending and not self._scheduled and len(self._tasks) < self.in_flight:
            self._scheduled = True
            loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        batch, self._pending = self._pending, []
        if not batch:
            return
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._send(batch))
        self._tasks.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._schedule(asyncio.get_running_loop())

    async def _send(self, batch: list[Pending]) -> None:
        self.calls += 1
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
                                     accepted, tokens=first.tokens))
    elif mine_duplicates:
        done.set_exception(DuplicateRequestId(mine_duplicates, accepted))
    else:
        done.set_result(None)
