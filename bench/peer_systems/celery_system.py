"""Celery with a Redis broker and result backend, one task per image."""

from __future__ import annotations

import base64

from redbatch.cli.redis_server import RedisServer

from .load import Caller
from .model import THREADS_ENV
from .procs import ServerProcess, bench_env, python_cmd


class CelerySystem:
    """A Celery worker (``--pool solo`` or ``prefork``) on a private redis-server; clients
    ``send_task(...).get()``, one Celery app (own connections) per client thread."""

    def __init__(self, pool: str, processes: int, torch_threads: int | None) -> None:
        import celery  # noqa: F401 - skip early, with the reason, when it is not installed

        self.pool, self.processes, self.torch_threads = pool, processes, torch_threads
        self.name = f"celery-{pool}" + (f"-{processes}" if pool != "solo" else "")
        threads = f"{torch_threads} torch thread(s) each" if torch_threads else "torch: all cores"
        self.config = f"--pool {pool} --concurrency {processes}, {threads}"
        self.server: RedisServer | None = None
        self.proc: ServerProcess | None = None

    def start(self, payload: bytes) -> None:
        self.server = RedisServer().start()
        env = {"PEER_REDIS_URL": self.server.url}
        if self.torch_threads:
            env[THREADS_ENV] = str(self.torch_threads)
        cmd = python_cmd("-m", "celery", "-A", "peer_systems.celery_app", "worker",
                         "--pool", self.pool, "--concurrency", str(self.processes),
                         "--loglevel", "WARNING", "--without-gossip", "--without-mingle")
        self.proc = ServerProcess(self.name, cmd, bench_env(env))
        self.proc.wait_answering(self.make_caller(), payload, timeout_s=180)

    def make_caller(self) -> Caller:
        from peer_systems.celery_app import TASK, make_app

        assert self.server is not None
        app = make_app(self.server.url)

        def call(data: bytes) -> object:
            b64 = base64.b64encode(data).decode("ascii")
            return app.send_task(TASK, args=[b64]).get(timeout=60)

        return call

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
        if self.server is not None:
            self.server.stop()
