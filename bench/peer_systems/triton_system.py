"""NVIDIA Triton's dynamic batcher through PyTriton, called with pytriton's ModelClient."""

from __future__ import annotations

import json
import warnings
from typing import Any

import numpy as np
from redbatch.cli.redis_server import free_port

from . import pytriton_env
from .load import Caller
from .procs import BENCH, ServerProcess, bench_env


class TritonSystem:
    """The PyTriton server (Triton on CPU, one model instance, torch on all cores) started
    from the numpy-1 side environment; one ModelClient (HTTP) per client thread."""

    name = "triton"

    def __init__(self, max_batch_size: int, delay_us: int) -> None:
        from pytriton.client.warnings import NotSupportedTimeoutWarning

        # Said once per client while waiting for the model: "connection timeout is smaller
        # than the requested timeout"; harmless here, and 32 clients repeat it.
        warnings.filterwarnings("ignore", category=NotSupportedTimeoutWarning)

        self.max_batch_size, self.delay_us = max_batch_size, delay_us
        self.config = (f"PyTriton dynamic batcher max_batch_size={max_batch_size} "
                       f"max_queue_delay={delay_us / 1000:g} ms")
        self.ports = [free_port() for _ in range(3)]
        self.proc: ServerProcess | None = None

    def start(self, payload: bytes) -> None:
        http, grpc, metrics = (str(p) for p in self.ports)
        cmd = [str(pytriton_env.python()), str(BENCH / "peer_systems" / "triton_app.py"),
               "--http-port", http, "--grpc-port", grpc, "--metrics-port", metrics,
               "--max-batch-size", str(self.max_batch_size), "--delay-us", str(self.delay_us)]
        env = bench_env({"LD_LIBRARY_PATH": pytriton_env.library_path()})
        self.proc = ServerProcess(self.name, cmd, env)
        self.proc.wait_answering(self._probe, payload, timeout_s=240)

    def _client(self, init_timeout_s: float) -> Any:
        from pytriton.client import ModelClient

        return ModelClient(f"http://127.0.0.1:{self.ports[0]}", "classify",
                           init_timeout_s=init_timeout_s, inference_timeout_s=60)

    def _probe(self, data: bytes) -> object:
        # A fresh client each try: ModelClient waits for the model when first used, and
        # stays failed if the server was not listening yet.
        with self._client(init_timeout_s=5) as client:
            return _infer(client, data)

    def make_caller(self) -> Caller:
        client = self._client(init_timeout_s=60)
        return lambda data: _infer(client, data)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(timeout_s=60)


def _infer(client: Any, data: bytes) -> object:
    out = client.infer_sample(image=np.array([data], dtype=object))
    return json.loads(bytes(out["result"][0]))
