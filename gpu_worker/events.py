"""What the worker's helper threads hand its main loop: one typed event per source.

The intake thread puts :class:`Read` (or :class:`Idle`), the collect thread :class:`Ran` (or
:class:`DeviceLost`), the writer thread :class:`Written`, and the pool's pump thread the
:class:`PreprocDone` records of one pool message as a list. The main loop is the only
reader (NOTE [ Worker threads ] in loop.py).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any

from redbatch.gpu_worker.device.runner import Outcome
from redbatch.gpu_worker.metrics import Health
from redbatch.gpu_worker.streams.intake import BadEntry, Job
from redbatch.gpu_worker.streams.results import Answer, Flushed
from redbatch.preproc_worker.worker import PreprocDone


@dataclass(frozen=True, slots=True)
class Read:
    """One intake read: the valid jobs and the entries that cannot run."""

    jobs: list[Job]
    bad: list[BadEntry]
    #: Whose streams were read: the model's index (Served.index).
    model: int = 0


@dataclass(frozen=True, slots=True)
class Ran:
    """A batch came back from the model, one outcome per job."""

    batch: list[Job]
    outcomes: list[Outcome]
    inference_ms: float
    batch_wait_ms: list[float]
    #: The size it ran at (padded up to a preferred size), for the latency estimator.
    run_size: int = 0
    #: Which model ran it (Served.index).
    model: int = 0
    #: Its forward pass alone, ms (on CPU lanes ``inference_ms`` also holds the wait for
    #: the batches launched before it to be collected): what it cost the device.
    device_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class DeviceLost:
    """The device failed or hung: the worker exits (code 3) for a restart."""

    message: str


@dataclass(frozen=True, slots=True)
class Idle:
    """Intake found a model's streams empty (used by burst mode)."""

    model: int = 0


@dataclass(frozen=True, slots=True)
class Written:
    """A write of answers came back: ``flushed`` when it went through, else the error
    (RedisUnavailable, RedisRefused) that left all of them unwritten and unacknowledged."""

    answers: list[Answer]
    flushed: Flushed | None = None
    error: Exception | None = None
    #: Whose answers: the model's index (Served.index).
    model: int = 0


Event = Read | Ran | DeviceLost | Idle | Written | list[PreprocDone]
"""``list[PreprocDone]``: the records of one message of the pool (one or more tasks)."""


#: A batch for the model thread: its model's index, its jobs, their batch-wait times (ms),
#: the size to run at, and whether it is a taken-over job whose delivery must be counted
#: before it runs.
Launch = tuple[int, list[Job], list[float], int, bool]


@dataclass(slots=True)
class Channels:
    """The queues between the main loop and its threads (NOTE [ Worker threads ] in
    loop.py). Unbounded: the main loop launches at most the device's depth of batches, and
    ships one write at a time per model (each model's writer has its queue: Served.outgoing)."""

    events: queue.Queue[Event] = field(default_factory=queue.Queue)
    batches: queue.SimpleQueue[Launch | None] = field(default_factory=queue.SimpleQueue)
    #: Batches submitted to the model, for the collect thread: (model, jobs, waits, runner
    #: job).
    collecting: queue.SimpleQueue[Any] = field(default_factory=queue.SimpleQueue)


@dataclass(slots=True)
class Control:
    """How the worker is told to stop: by a signal handler (from the first moment, while it
    still starts), or by its main loop (burst mode drained, a device lost)."""

    health: Health
    stopping: threading.Event = field(default_factory=threading.Event)
    aborting: threading.Event = field(default_factory=threading.Event)
    #: Set when the device broke; the worker command then exits with code 3.
    device_failed: bool = False

    def stop(self) -> None:
        """Graceful: stop reading, finish in-flight work, exit. Safe from a signal handler."""
        self.health.stopping = True
        self.stopping.set()

    def abort(self) -> None:
        """Leave at once; unanswered jobs stay pending in Redis."""
        self.stop()
        self.aborting.set()
