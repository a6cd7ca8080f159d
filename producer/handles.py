"""Job handles: what ``submit`` returns. A handle *is* its request id (a ``str``), so code
that stores, prints, serialises or passes the id to ``result()`` keeps working, and it
also knows its client, model and lane, so that the job can be asked about directly:

>>> job = client.submit(b"...")
>>> job.status().state          # JobState.QUEUED, RUNNING, DONE, ...
>>> job.result(timeout_s=10)    # the ResultEnvelope
>>> job.cancel()                # True if no worker had taken it: it never runs

The asyncio client's handles have the same methods as coroutines, and are awaitable:
``result = await job``. A handle pickles, copies and compares as the plain id.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Any, Self

from redbatch.common.protocol import JobStatus, Lane, ResultEnvelope

if TYPE_CHECKING:
    from redbatch.producer.client import AsyncClient, Client


class _Handle(str):
    """What both kinds of handle are: the request id, with the client, model and lane of the
    job; it pickles and copies as the plain id."""

    _client: Any
    model: str
    lane: Lane

    def __new__(cls, request_id: str, client: Any, model: str, lane: Lane) -> Self:
        handle = super().__new__(cls, request_id)
        handle._client, handle.model, handle.lane = client, model, lane
        return handle

    @property
    def request_id(self) -> str:
        """The request id, as a plain ``str``."""
        return str.__str__(self)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.request_id!r}, model={self.model!r}, "
                f"lane={self.lane.value!r})")

    def __reduce__(self) -> tuple[type[str], tuple[str]]:
        return str, (self.request_id,)


class JobHandle(_Handle):
    """A submitted job of a :class:`~redbatch.producer.client.Client`: its request id, with
    ``result``, ``status`` and ``cancel``."""

    _client: Client

    def result(self, timeout_s: float = 30.0) -> ResultEnvelope:
        """As :meth:`Client.result` for this job."""
        return self._client.result(self, timeout_s, model=self.model)

    def status(self) -> JobStatus:
        """As :meth:`Client.status` for this job."""
        return self._client.status(self, model=self.model)

    def cancel(self) -> bool:
        """As :meth:`Client.cancel` for this job."""
        return self._client.cancel(self, model=self.model)


class AsyncJobHandle(_Handle):
    """A submitted job of an :class:`~redbatch.producer.client.AsyncClient`: as
    :class:`JobHandle`, with coroutines, and ``await job`` for its result."""

    _client: AsyncClient

    async def result(self, timeout_s: float = 30.0) -> ResultEnvelope:
        """As :meth:`AsyncClient.result` for this job."""
        return await self._client.result(self, timeout_s, model=self.model)

    async def status(self) -> JobStatus:
        """As :meth:`AsyncClient.status` for this job."""
        return await self._client.status(self, model=self.model)

    async def cancel(self) -> bool:
        """As :meth:`AsyncClient.cancel` for this job."""
        return await self._client.cancel(self, model=self.model)

    def __await__(self) -> Generator[Any, None, ResultEnvelope]:
        """``await job``: its result, with ``result``'s default timeout."""
        return self.result().__await__()
