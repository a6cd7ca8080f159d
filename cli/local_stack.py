"""Worker processes started from Python, and a private Redis plus one local worker.

The private stack is what commands use when no Redis is configured; the
worker-process helpers are shared with the tests. Everything started here is
stopped on exit, also on Ctrl-C: the worker gets SIGTERM (it drains and
unlinks its shared memory), then SIGKILL if it hangs; the Redis server and
its temporary directory go last.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from types import TracebackType
from typing import cast

import redis
from redbatch.cli.redis_server import RedisServer
from redbatch.common.protocol import GROUP, Keys, Lane, ProtocolError, WorkerRecord
from redbatch.common.redis_io import connect

logger = logging.getLogger(__name__)

WORKER_STOP_TIMEOUT_S = 30.0


def spawn_worker(redis_url: str, args: list[str], env: Mapping[str, str] | None = None,
                 **popen: object) -> subprocess.Popen[bytes]:
    """Start ``redbatch worker`` as a child process in its own process group.

    The URL goes in REDBATCH_REDIS_URL, not on the command line, which any user of the
    machine can read (ps) and which would show the password it may hold.
    """
    cmd = [sys.executable, "-m", "redbatch.cli", "worker", *args]
    full_env = {**os.environ, **(env or {}), "REDBATCH_REDIS_URL": redis_url}
    # Its own session, so a terminal's Ctrl-C reaches only us and we stop it in order.
    proc: subprocess.Popen[bytes] = subprocess.Popen(  # type: ignore[call-overload]
        cmd, env=full_env, stdin=subprocess.DEVNULL, start_new_session=True, **popen)
    return proc


class WorkerExited(RuntimeError):
    """The worker process ended before it was ready (its own error is in its stderr)."""


def wait_worker_ready(redis_url: str, keys: Keys, proc: subprocess.Popen[bytes],
                      timeout_s: float = 120.0, *, consumers_before: int = 0) -> None:
    """Block until ``proc`` reads jobs: the group has more consumers than
    ``consumers_before`` (a worker joins it with its first read, once ready), or ``proc``'s
    heartbeat is there (a worker restarted under a consumer name the group already has).
    Give ``consumers_before`` (:func:`count_consumers` before starting ``proc``) when other
    workers of the model may be running: their consumers must not pass for this one."""
    r = connect(redis_url)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise WorkerExited(f"exited with code {proc.returncode} before it was ready")
            if count_consumers(r, keys) > consumers_before or _beats(r, keys, proc.pid):
                return
            time.sleep(0.1)
    finally:
        r.close()
    raise TimeoutError(f"worker not ready after {timeout_s}s")


def _beats(r: redis.Redis, keys: Keys, pid: int) -> bool:
    """Whether a heartbeat record of the model's workers names process ``pid``."""
    try:
        names = [n.decode() for n in cast(list[bytes], r.zrange(keys.workers(), 0, -1))]
        records = cast(list[bytes | None], r.mget([keys.worker(n) for n in names])) \
            if names else []
        return any(WorkerRecord.decode(data).pid == pid for data in records if data)
    except (redis.RedisError, ProtocolError):
        return False


def stop_worker(proc: subprocess.Popen[bytes], timeout_s: float = WORKER_STOP_TIMEOUT_S) -> int:
    """SIGTERM, wait, then SIGKILL; returns the exit code.

    Only the worker is killed, not its process group: its pool processes see it gone
    and exit, and its resource tracker then unlinks its shared memory.
    """
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def count_consumers(r: redis.Redis, keys: Keys) -> int:
    """Consumers that have joined the model's group (on its interactive stream)."""
    try:
        groups = r.xinfo_groups(keys.stream(Lane.INTERACTIVE))
    except redis.ResponseError:
        return 0
    return sum(int(g["consumers"]) for g in groups if g["name"] in (GROUP, GROUP.encode()))


class LocalStack:
    """Context manager: ``with LocalStack(spec, name, prefix) as stack: stack.url ...``."""

    def __init__(self, model_spec: str, model_name: str, prefix: str,
                 worker_args: list[str] | None = None, calibrate: str = "load") -> None:
        self.keys = Keys(model_name, prefix)
        # No metrics port: a private worker is nobody's scrape target, and a fleet worker on
        # this host may hold the default port.
        # The machine's calibration profile when there is one (``load``: the tuned path,
        # measured once); ``auto`` (score --tune) measures and stores one when missing.
        self.worker_args = ["--model", model_spec, "--model-name", model_name,
                            "--prefix", prefix, "--metrics-port", "0", "--calibrate", calibrate,
                            *(worker_args or [])]
        self.server = RedisServer()
        self.worker: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return self.server.url

    def __enter__(self) -> LocalStack:
        self.server.start()
        try:
            logger.info("started a private redis-server at %s; starting a local worker", self.url)
            self.worker = spawn_worker(self.url, self.worker_args)
        except BaseException:
            self.close()
            raise
        return self

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        assert self.worker is not None
        wait_worker_ready(self.url, self.keys, self.worker, timeout_s)

    def close(self) -> None:
        if self.worker is not None:
            stop_worker(self.worker)
        self.server.stop()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
