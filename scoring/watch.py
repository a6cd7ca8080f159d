"""Say so when no worker serves the model: a wait that would otherwise sit silent.

A daemon thread reads the model's live workers from their heartbeats (``Client.workers``:
a ZRANGE and an MGET every few seconds, whatever the number of jobs) and logs a warning
when none is alive, again every ``repeat_s`` while none is, and once more when one comes
back. ``redbatch submit --wait`` and ``redbatch score`` run inside it.
"""

from __future__ import annotations

import logging
import threading
from types import TracebackType

from redbatch.producer.client import Client, RedbatchError

logger = logging.getLogger(__name__)

#: First look, s after the watch starts: a worker started with the command has joined.
FIRST_LOOK_S = 3.0
#: Between looks, s.
LOOK_EVERY_S = 5.0
#: While none is alive, the warning is said again this often, s.
REPEAT_S = 60.0


class WorkerWatch:
    """``with WorkerWatch(client, model): ...`` warns while no worker of ``model`` lives."""

    def __init__(self, client: Client, model: str, first_s: float = FIRST_LOOK_S,
                 every_s: float = LOOK_EVERY_S, repeat_s: float = REPEAT_S) -> None:
        self._client = client
        self._model = model
        self._first_s, self._every_s, self._repeat_s = first_s, every_s, repeat_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worker-watch", daemon=True)
        #: Warnings said so far (for tests and the summary).
        self.warnings = 0

    def __enter__(self) -> WorkerWatch:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        missing_since_warning = None  # seconds of looks since the last warning, or None
        wait_s = self._first_s
        while not self._stop.wait(wait_s):
            wait_s = self._every_s
            try:
                alive = self._client.is_ready(model=self._model)
            except RedbatchError:  # the client's own, Redis down or refusing
                continue  # the command itself says what Redis does
            if alive:
                if missing_since_warning is not None:
                    logger.warning("a worker of model %r is alive now", self._model)
                missing_since_warning = None
            elif missing_since_warning is None or missing_since_warning >= self._repeat_s:
                self.warnings += 1
                missing_since_warning = 0.0
                logger.warning("no worker of model %r is alive (no heartbeat in Redis): the "
                               "jobs wait in the queue until one starts (redbatch worker "
                               "--model ...)", self._model)
            else:
                missing_since_warning += self._every_s
