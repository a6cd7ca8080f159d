"""/metrics (consumer names, depths, error counts; no authentication) listens on loopback
unless an operator says otherwise; compose.yaml says 0.0.0.0 (tests/test_compose.py)."""

from __future__ import annotations

import time
import urllib.request

import psutil
from conftest import WorkerFactory
from redbatch.cli.redis_server import free_port
from redbatch.cli.worker import worker
from redbatch.common.config import Settings


def test_the_default_is_loopback_and_has_one_home() -> None:
    assert Settings().metrics_host == "127.0.0.1"
    option = next(p for p in worker.params if p.name == "metrics_host")
    assert option.default == Settings().metrics_host


def listening(pid: int) -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("tcp")
            if c.status == psutil.CONN_LISTEN}


def test_a_worker_serves_metrics_on_loopback_only(start_worker: WorkerFactory) -> None:
    port = free_port()
    proc = start_worker("--metrics-port", str(port), model="null")
    deadline = time.monotonic() + 60
    while not listening(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert listening(proc.pid) == {("127.0.0.1", port)}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert b"redbatch_worker_info" in reply.read()
