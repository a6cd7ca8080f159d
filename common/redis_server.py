"""Start and stop a private ``redis-server``.

Used by the tests, and by the CLI when no Redis is configured.

The server listens on a free loopback port, keeps no data on disk, and lives
in a temporary directory that is removed on stop.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

HOW_TO_INSTALL = (
    "redis-server was not found on PATH. Install it with your package manager, e.g. "
    "'sudo apt-get install -y redis-server' (Debian/Ubuntu) or 'brew install redis' (macOS), "
    "or point redbatch at an existing server with --redis URL / REDBATCH_REDIS_URL."
)


class RedisServerError(RuntimeError):
    pass


def find_redis_server() -> str:
    """Path of the redis-server binary; raises RedisServerError saying how to get one."""
    path = shutil.which("redis-server")
    if path is None:
        raise RedisServerError(HOW_TO_INSTALL)
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A throw-away redis-server process; use as a context manager.

    ``appendonly=True`` turns on AOF with fsync always, for tests that restart
    the server and expect acknowledged writes to survive.
    """

    def __init__(self, port: int | None = None, appendonly: bool = False) -> None:
        self.port = port or free_port()
        self.appendonly = appendonly
        self._dir = Path(tempfile.mkdtemp(prefix="redbatch-redis-"))
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _args(self) -> list[str]:
        args = [find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self._dir), "--save", "", "--daemonize", "no",
                "--maxmemory-policy", "noeviction", "--loglevel", "warning"]
        if self.appendonly:
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            args += ["--appendonly", "no"]
        return args

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        log = open(self._dir / "redis.log", "ab")  # noqa: SIM115 - owned by the child
        # Its own session: a terminal's Ctrl-C must not kill it while the command that owns
        # it is still collecting results; the owner stops it last.
        self._proc = subprocess.Popen(self._args(), stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise RedisServerError(f"redis-server exited: {self.log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.02)
        raise RedisServerError(f"redis-server not ready after {timeout_s}s: {self.log_tail()}")

    def log_tail(self) -> str:
        try:
            return (self._dir / "redis.log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the server (fault injection); the data dir stays for a restart."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def restart(self) -> None:
        """Kill and start again on the same port and directory."""
        self.kill()
        self.start()

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
