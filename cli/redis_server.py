"""Start and stop a private ``redis-server``.

Used by the tests, and by the CLI when no Redis is configured.

The server listens on a free loopback port, keeps no data on disk, and lives
in a temporary directory that is removed on stop. It is ready only once the
server answering on its port says it is this child process (``process_id`` of
INFO server): a redis-server that failed to bind must never adopt another's.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from urllib.parse import quote, urlencode

import redis
from redbatch.common.config import RedisSettings
from redbatch.common.redis_io import connect

HOW_TO_INSTALL = (
    "redis-server was not found on PATH. Install it with your package manager, e.g. "
    "'sudo apt-get install -y redis-server' (Debian/Ubuntu) or 'brew install redis' (macOS), "
    "or point redbatch at an existing server with --redis URL / REDBATCH_REDIS_URL."
)


class RedisServerError(RuntimeError):
    pass


class PortTaken(RedisServerError):
    """Another process holds the port: another redis-server answers on it, or the child
    could not bind it."""


#: Attempts with a fresh free port when the one picked was taken meanwhile.
PORT_ATTEMPTS = 3


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files of a TLS set-up: the CA that signed both sides, the server's certificate
    and key, and a client's (the server requires a client certificate)."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


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
    the server and expect acknowledged writes to survive. ``password`` sets
    ``requirepass``; ``tls`` serves only TLS on the port (client certificates
    required); ``extra_args`` are more redis-server options. Without ``port``, a
    free one is picked, and another if it is taken before the server binds it.
    """

    def __init__(self, port: int | None = None, appendonly: bool = False, *,
                 password: str | None = None, tls: TlsFiles | None = None,
                 extra_args: Sequence[str] = ()) -> None:
        self.port = port or free_port()
        self.appendonly = appendonly
        self.password = password
        self.tls = tls
        self.extra_args = list(extra_args)
        self._pick_port = port is None
        self._dir = Path(tempfile.mkdtemp(prefix="redbatch-redis-"))
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The URL to reach it: with the password (percent-encoded) when it has one, and
        with the CA and client certificate files when it serves TLS."""
        auth = "" if self.password is None else f":{quote(self.password, safe='')}@"
        if self.tls is None:
            return f"redis://{auth}127.0.0.1:{self.port}/0"
        query = urlencode({"ssl_ca_certs": self.tls.ca, "ssl_certfile": self.tls.client_cert,
                           "ssl_keyfile": self.tls.client_key})
        return f"rediss://{auth}127.0.0.1:{self.port}/0?{query}"

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return None if self._proc is None else self._proc.pid

    def _args(self) -> list[str]:
        port = ["--port", str(self.port)]
        if self.tls is not None:
            port = ["--port", "0", "--tls-port", str(self.port),
                    "--tls-cert-file", str(self.tls.server_cert),
                    "--tls-key-file", str(self.tls.server_key),
                    "--tls-ca-cert-file", str(self.tls.ca), "--tls-auth-clients", "yes"]
        args = [find_redis_server(), *port, "--bind", "127.0.0.1",
                "--dir", str(self._dir), "--save", "", "--daemonize", "no",
                "--maxmemory-policy", "noeviction", "--loglevel", "warning"]
        if self.appendonly:
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            args += ["--appendonly", "no"]
        if self.password is not None:
            args += ["--requirepass", self.password]
        return args + self.extra_args

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        """Start it and wait until it answers as itself; RedisServerError (PortTaken when
        the port is held by another process and was given, or restarting) otherwise."""
        attempts_left = PORT_ATTEMPTS if self._pick_port else 1
        self._pick_port = False  # a restart keeps the port its clients know
        while True:
            attempts_left -= 1
            try:
                self._launch()
                self._wait_ready(timeout_s)
                return self
            except PortTaken:
                self.kill()
                if attempts_left == 0:
                    raise
                self.port = free_port()
            except BaseException:
                self.kill()
                raise

    def _launch(self) -> None:
        log = open(self._dir / "redis.log", "ab")  # noqa: SIM115 - owned by the child
        # Its own session: a terminal's Ctrl-C must not kill it while the command that owns
        # it is still collecting results; the owner stops it last.
        self._proc = subprocess.Popen(self._args(), stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()

    def _wait_ready(self, timeout_s: float) -> None:
        """Until the server on the port says it is our child (INFO server process_id)."""
        assert self._proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                tail = self.log_tail()
                if "Address already in use" in tail:
                    raise PortTaken(f"port {self.port} is taken: {tail}")
                raise RedisServerError(f"redis-server exited: {tail}")
            answering = self._answering_pid()
            if answering == self._proc.pid:
                return
            if answering is not None:
                who = f"pid {answering}" if answering > 0 else "one that refuses us"
                raise PortTaken(f"port {self.port} is held by another Redis ({who}), not the "
                                f"redis-server started here (pid {self._proc.pid})")
            time.sleep(0.02)
        raise RedisServerError(f"redis-server not ready after {timeout_s}s: {self.log_tail()}")

    def _answering_pid(self) -> int | None:
        """process_id of the Redis answering on the port; None while none answers (or it
        loads its data); -1 for one that refuses us, which our own server never does."""
        # Short timeouts: this runs every 20 ms while the server starts.
        client = connect(RedisSettings(url=self.url, socket_timeout_s=0.5))
        try:
            return int(client.info("server")["process_id"])
        except redis.AuthenticationError:
            return -1
        except (redis.ConnectionError, redis.TimeoutError):
            return None
        except redis.RedisError:
            return -1
        finally:
            client.close()

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
        try:
            return self.start()
        except BaseException:
            self.stop()  # its temporary directory too
            raise

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
