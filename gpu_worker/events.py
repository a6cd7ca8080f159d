"""What the worker's helper threads hand its main loop: one typed event per source.

The intake thread puts :class:`Read` (or :class:`Idle`), the collect thread :class:`Ran` (or
:class:`DeviceLost`), and the pool's pump thread :class:`PreprocDone` records. The main loop
is the only reader (NOTE [ Worker threads ] in loop.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from redbatch.gpu_worker.intake import BadEntry, Job
from redbatch.gpu_worker.model import Outcome
from redbatch.preproc_worker.worker import PreprocDone


@dataclass(frozen=True, slots=True)
class Read:
    """One intake read: the valid jobs and the entries that cannot run."""

    jobs: list[Job]
    bad: list[BadEntry]


@dataclass(frozen=True, slots=True)
class Ran:
    """A batch came back from the model, one outcome per job."""

    batch: list[Job]
    outcomes: list[Outcome]
    inference_ms: float
    batch_wait_ms: list[float]
    #: The size it ran at (padded up to a preferred size), for the latency estimator.
    run_size: int = 0


@dataclass(frozen=True, slots=True)
class DeviceLost:
    """The device failed or hung: the worker exits (code 3) for a restart."""

    message: str


class Idle:
    """Intake found the streams empty (used by burst mode)."""


Event = Read | Ran | DeviceLost | Idle | PreprocDone
