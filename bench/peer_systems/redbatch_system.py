"""redbatch itself: a private redis-server and one ``redbatch worker`` with its defaults."""

from __future__ import annotations

import subprocess

from redbatch.cli.local_stack import spawn_worker, stop_worker, wait_worker_ready
from redbatch.cli.redis_server import RedisServer
from redbatch.common.protocol import Keys
from redbatch.producer.client import Client

from .load import Caller
from .procs import OUT, StartError

KEYS = Keys("efficientnet_lite0")


class RedbatchSystem:
    """``redbatch worker`` (pool, torch threads and batching as it chooses them); clients
    call ``Client.predict``, one Client (one Redis connection) per client thread."""

    name = "redbatch"

    def __init__(self, max_batch_size: int | None, worker_args: list[str]) -> None:
        chosen = [*(["--max-batch-size", str(max_batch_size)] if max_batch_size else []),
                  *worker_args]
        self.args = ["--log-level", "WARNING", "--metrics-port", "0", *chosen]
        self.config = "redbatch worker " + (" ".join(chosen) or "with its defaults")
        self.server: RedisServer | None = None
        self.worker: subprocess.Popen[bytes] | None = None

    def start(self, payload: bytes) -> None:
        self.server = RedisServer().start()
        OUT.mkdir(parents=True, exist_ok=True)
        log = open(OUT / "peers-redbatch.log", "wb")  # noqa: SIM115 - the worker's stdout
        self.worker = spawn_worker(self.server.url, self.args, stdout=log, stderr=log)
        log.close()
        try:
            wait_worker_ready(self.server.url, KEYS, self.worker, timeout_s=300)
            self.make_caller()(payload)
        except Exception as e:
            raise StartError(f"{e}: {(OUT / 'peers-redbatch.log').read_text()[-1500:]}") from e

    def make_caller(self) -> Caller:
        assert self.server is not None
        client = Client(self.server.url)

        def call(data: bytes) -> object:
            result = client.predict(data, timeout_s=60)
            if not result.ok:
                raise RuntimeError(f"redbatch error {result.error_code}: {result.error_message}")
            return result.output

        return call

    def stop(self) -> None:
        if self.worker is not None:
            stop_worker(self.worker)
        if self.server is not None:
            self.server.stop()
