"""Server processes of the peers: start with a log file, wait until they answer, stop them.

Each server runs in its own session (process group), so stopping it reaches the helpers it
started (Celery's pool children, Ray's raylet and workers, tritonserver) and nothing else:
SIGTERM to the server first, so it shuts down in order, then SIGKILL to its group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from .load import Caller

BENCH = Path(__file__).resolve().parent.parent
ROOT = BENCH.parent
OUT = BENCH / "out"


class StartError(RuntimeError):
    """A system could not be started; the message says why (and ends with its log)."""


def bench_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment (malloc settings included) with bench/ importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(BENCH), env.get("PYTHONPATH")) if p)
    env.update(extra or {})
    return env


class ServerProcess:
    """One server command whose output goes to bench/out/peers-<name>.log."""

    def __init__(self, name: str, cmd: list[str], env: Mapping[str, str]) -> None:
        OUT.mkdir(parents=True, exist_ok=True)
        self.log_path = OUT / f"peers-{name}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, env=dict(env), cwd=ROOT, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)

    def log_tail(self, chars: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_answering(self, call: Caller, payload: bytes, timeout_s: float) -> None:
        """Retry ``call(payload)`` until it succeeds; StartError if the process exits or the
        time runs out."""
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise StartError(f"exited with code {self.proc.returncode}: {self.log_tail()}")
            try:
                call(payload)
                return
            except Exception as e:  # noqa: BLE001 - not up yet; keep the reason for the report
                last = f"{type(e).__name__}: {e}"[:300]
                time.sleep(0.5)
        raise StartError(f"no answer after {timeout_s:.0f}s (last: {last}): {self.log_tail()}")

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group we created, and only it
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)


def python_cmd(*args: str) -> list[str]:
    return [sys.executable, *args]
