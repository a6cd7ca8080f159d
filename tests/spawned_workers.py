"""Real workers on a Redis of the test's own (a password, TLS, an ACL user), with logs.

The ``start_worker`` fixture serves the session's Redis only; these tests start their
own servers and give the workers URLs with credentials.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from conftest import TEST_MODEL
from redbatch.cli.local_stack import spawn_worker, stop_worker, wait_worker_ready
from redbatch.common.protocol import Keys

Start = Callable[..., tuple[subprocess.Popen[bytes], Path]]


@contextmanager
def spawned_workers(log_dir: Path) -> Iterator[Start]:
    """``start(url, *args, model=..., ready_url=None)`` starts a worker on ``url`` and waits
    until it joined its group (looked up through ``ready_url``, default ``url``; None
    with ``ready=False``); returns (process, log path). All are stopped on exit."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(url: str, *args: str, model: str = TEST_MODEL, ready: bool = True,
              ready_url: str | None = None) -> tuple[subprocess.Popen[bytes], Path]:
        log = log_dir / f"worker-{len(procs)}.log"
        with open(log, "wb") as out:
            proc = spawn_worker(url, ["--model", model, "--metrics-port", "0",
                                      "--calibrate", "off", "--max-wait-ms", "5", *args],
                                stdout=out, stderr=subprocess.STDOUT)
        procs.append(proc)
        if ready:
            try:
                wait_worker_ready(ready_url or url, Keys(model), proc, timeout_s=180)
            except BaseException:
                print(log.read_text(errors="replace")[-4000:])
                raise
        return proc, log

    try:
        yield start
    finally:
        for proc in procs:
            stop_worker(proc, timeout_s=20)
