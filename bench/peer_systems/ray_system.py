"""Ray Serve with ``@serve.batch``, called over its HTTP proxy."""

from __future__ import annotations

import http.client
import json

from redbatch.cli.redis_server import free_port

from .load import Caller
from .procs import BENCH, ServerProcess, bench_env, python_cmd


class RaySystem:
    """One Serve deployment (one replica, torch on all cores) behind Serve's HTTP proxy;
    clients POST the photo, one keep-alive HTTP connection per client thread."""

    name = "ray-serve"

    def __init__(self, max_batch_size: int, batch_wait_s: float) -> None:
        import ray.serve  # noqa: F401 - skip early, with the reason, when it is not installed

        self.max_batch_size, self.batch_wait_s = max_batch_size, batch_wait_s
        self.config = (f"@serve.batch max_batch_size={max_batch_size} "
                       f"batch_wait_timeout_s={batch_wait_s:g}")
        self.port = free_port()
        self.proc: ServerProcess | None = None

    def start(self, payload: bytes) -> None:
        cmd = python_cmd(str(BENCH / "peer_systems" / "ray_app.py"), "--port", str(self.port),
                         "--max-batch-size", str(self.max_batch_size),
                         "--batch-wait-s", str(self.batch_wait_s))
        env = bench_env({"RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0"})
        self.proc = ServerProcess(self.name, cmd, env)
        self.proc.wait_answering(self.make_caller(), payload, timeout_s=240)

    def make_caller(self) -> Caller:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)

        def call(data: bytes) -> object:
            try:
                conn.request("POST", "/", body=data,
                             headers={"Content-Type": "application/octet-stream"})
                response = conn.getresponse()
                body = response.read()
            except (OSError, http.client.HTTPException):
                conn.close()  # reconnects on the next request
                raise
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {body[:200]!r}")
            return json.loads(body)

        return call

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(timeout_s=60)
