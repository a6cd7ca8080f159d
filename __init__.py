"""redbatch: dynamic-batching inference over Redis streams.

The sub-packages, in data-path order (imports only run down this list, never up it;
tests/test_layout.py checks it)::

    cli             the `redbatch` command: the top floor, imports every package below
    producer        submits jobs to a model's Redis stream, waits for results by request id
    gpu_worker      intake (XREADGROUP) -> batcher -> model -> result writer -> ack
    preproc_worker  process pool that decodes payloads into shared-memory slots
    handlers        what a model provides (preprocess, load, postprocess): the neutral
                    floor the pool and the worker share
    common          only what every side needs: the wire protocol, settings, the Redis
                    connection factory, logging

See PROTOCOL.md for the wire format.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from redbatch.common.protocol import ErrorCode, Lane
    from redbatch.producer.client import (
        AsyncClient,
        AsyncJobHandle,
        Client,
        DuplicateRequestId,
        FunctionsMissing,
        JobCancelled,
        JobFailed,
        JobHandle,
        JobState,
        JobStatus,
        ProtocolError,
        QueueFull,
        RedbatchError,
        RedisRefusedCall,
        RedisUnreachable,
        Result,
        ResultTimeout,
        ResultUnreadable,
    )

#: The package's own face, as users of Celery or arq expect (``from redbatch import
#: Client``), imported on first use so that ``import redbatch`` stays light (a worker or
#: the CLI does not load the client).
__all__ = ["AsyncClient", "AsyncJobHandle", "Client", "DuplicateRequestId", "ErrorCode",
           "FunctionsMissing", "JobCancelled", "JobFailed", "JobHandle", "JobState",
           "JobStatus", "Lane", "ProtocolError", "QueueFull", "RedbatchError",
           "RedisRefusedCall", "RedisUnreachable", "Result", "ResultTimeout",
           "ResultUnreadable"]
#: Where each comes from: the protocol's two, the client module the rest.
_EXPORTS = {name: "redbatch.common.protocol" if name in ("ErrorCode", "Lane")
            else "redbatch.producer.client" for name in __all__}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'redbatch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
