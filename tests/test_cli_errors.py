"""Ordinary mistakes get one line, not a traceback: each runs ``redbatch`` as a user would,
in a subprocess, and checks stderr's last line, the exit code, and that nothing was
started for inputs that cannot work (checked before a private stack would start)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SAMPLES, settings_free_env

CAT = str(SAMPLES / "cat.jpg")
#: Inputs checked before anything starts are refused within this (Python's start and the
#: imports included); a private redis-server and worker would take 5-8 s more here.
QUICK_S = 9.0


def redbatch(*args: str, timeout_s: float = 120) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run the CLI with no REDBATCH_* settings; the result and how long it took, s."""
    env = settings_free_env()
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "redbatch.cli", *args], env=env,
                          capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          timeout=timeout_s)
    return proc, time.monotonic() - started


def said(proc: subprocess.CompletedProcess[str] | subprocess.Popen[str], stderr: str,
         rc: int, starts: str) -> None:
    """Exit code ``rc``, no traceback, and stderr's last line starts with ``starts``."""
    assert proc.returncode == rc, (proc.returncode, stderr[-2000:])
    assert "Traceback" not in stderr, stderr[-2000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(starts), stderr[-2000:]


@pytest.fixture
def dead_redis() -> str:
    """The URL of a loopback port nothing listens on (bound and closed: connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"


@pytest.mark.parametrize("command", [("submit", CAT), ("status",), ("limit",),
                                     ("dlq", "list"), ("job", "some-id")])
def test_an_unreachable_redis_is_one_line(dead_redis: str, command: tuple[str, ...]) -> None:
    args = [command[0], "--redis", dead_redis, *command[1:]] if command[0] != "dlq" else \
        ["dlq", command[1], "--redis", dead_redis]
    proc, _ = redbatch(*args)
    said(proc, proc.stderr, 1, "Error: cannot reach Redis: ")


def signalled_while_waiting(dead_redis: str, signum: int, *args: str
                            ) -> tuple[subprocess.Popen[str], list[str], str]:
    """A worker on ``dead_redis`` (worker ``args`` added) sent ``signum`` once it logs that
    it waits for Redis: the process, the log lines before the signal and the rest."""
    proc = subprocess.Popen([sys.executable, "-m", "redbatch.cli", "worker", "--redis",
                             dead_redis, "--calibrate", "off", "--metrics-port", "0", *args],
                            env=settings_free_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    seen = []
    try:
        deadline = time.monotonic() + 120
        assert proc.stderr is not None
        for line in proc.stderr:  # wait until it is waiting for Redis
            seen.append(line)
            if "Redis not reachable" in line or time.monotonic() > deadline:
                break
        proc.send_signal(signum)
        _, rest = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return proc, seen, rest


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_a_worker_stopped_while_it_waits_for_redis_says_so_in_one_line(
        dead_redis: str, log_format: str) -> None:
    """Its log says why it waits, one line per retry; with --log-format json every log
    line is a JSON object (the command's own closing error stays click's one line)."""
    proc, seen, rest = signalled_while_waiting(dead_redis, signal.SIGINT, "--model", "null",
                                               "--log-format", log_format)
    # Ctrl-C: 130, as in every other command (the worker said 1 before).
    said(proc, rest, 130, "Error: interrupted while waiting for Redis")
    if log_format == "json":
        logged = [json.loads(line) for line in [*seen, *rest.splitlines()[:-1]] if line.strip()]
        assert logged and all(set(x) >= {"ts", "level", "process", "logger", "message"}
                              for x in logged), logged
        assert any("Redis not reachable" in x["message"] for x in logged)


@pytest.mark.parametrize("model", ["null", "smollm2_135m"])
def test_a_worker_sigtermed_while_it_waits_for_redis_stops_cleanly(dead_redis: str,
                                                                   model: str) -> None:
    """SIGTERM is a supervisor's orderly stop: before Redis ever answered, nothing was
    read, so the worker (an image one, a generation one) says so and exits 0 (it said
    "cannot reach Redis" and exited 1)."""
    proc, _, rest = signalled_while_waiting(dead_redis, signal.SIGTERM, "--model", model)
    assert proc.returncode == 0, rest
    assert "stopped while waiting for Redis" in rest and "Traceback" not in rest
    assert "Error:" not in rest


@pytest.mark.parametrize("case", ["no scheme", "missing output folder", "empty folder",
                                  "empty folder (submit)", "unreadable file",
                                  "not a request id", "unknown model (private stack)",
                                  "unknown model (submit)"])
def test_inputs_that_cannot_work_are_refused_before_anything_starts(
        case: str, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    args, starts = {
        "no scheme": (["submit", "--redis", "localhost:6379", CAT], "Error: Invalid value"),
        "missing output folder": (["score", CAT, "-o", str(tmp_path / "nope" / "x.jsonl")],
                                  "Error: the folder of -o "),
        "empty folder": (["score", str(empty), "-o", str(tmp_path / "x.jsonl")],
                         "Error: nothing to score"),
        "empty folder (submit)": (["submit", str(empty)], "Error: nothing to submit"),
        "unreadable file": (["submit", str(tmp_path / "nope.jpg")],
                            "Error: cannot read any of the files"),
        "not a request id": (["job", "has spaces"], "Error: 'has spaces' is not a request id"),
        # Without --redis: refused before a private stack starts (its worker said it, 20 s
        # later, and a traceback followed).
        "unknown model (private stack)": (["score", CAT, "-o", str(tmp_path / "x.jsonl"),
                                           "--model", "no_such_model"],
                                          "Error: unknown model 'no_such_model'"),
        "unknown model (submit)": (["submit", "--model", "no_such_model", CAT],
                                   "Error: unknown model 'no_such_model'"),
    }[case]
    proc, took = redbatch(*args)
    said(proc, proc.stderr, 2, starts)
    assert took < QUICK_S, f"took {took:.1f} s: something started"
    assert "private redis-server" not in proc.stderr, "nothing may start"
    assert not (tmp_path / "x.jsonl").exists()


def test_a_wait_with_no_worker_alive_says_so_within_seconds(redis_url: str) -> None:
    """No worker serves the model: ``submit --wait`` warns within seconds (from the
    heartbeats in Redis), not only when its timeout ends."""
    proc, took = redbatch("submit", "--wait", "--redis", redis_url, "--model-name",
                          "nobody_serves_this", "--timeout-s", "8", CAT)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "no worker of model 'nobody_serves_this' is alive" in proc.stderr, proc.stderr
    assert '"code": "timeout"' in proc.stdout
