"""No Redis password reaches a log line, an error message or the command line.

Unit tests of ``redact_url`` and ``check_redis_url`` over every form a password takes in a
Redis URL, and one end to end: a real redis-server with ``requirepass`` (a password
holding '/', '@', ':' and '?'), real workers given it in the userinfo and in the query of
a ``unix://`` URL, a real photo served, and not a 4-character piece of it in their logs.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote, quote_plus

import psutil
import pytest
import redis
from click.testing import CliRunner
from conftest import SAMPLES, TEST_MODEL
from hypothesis import given
from hypothesis import strategies as st
from redbatch.cli import main
from redbatch.cli.local_stack import count_consumers
from redbatch.cli.redis_server import RedisServer
from redbatch.common.config import (
    RedisSettings,
    check_redis_url,
    cluster_nodes,
    is_cluster_url,
    redact_url,
)
from redbatch.common.protocol import Keys
from redbatch.producer.client import Client
from redis.connection import parse_url
from spawned_workers import spawned_workers

SECRET = "Jq9/Xv@Kz3Wp:R?t"
"""Distinctive: none of its 4-character pieces occurs in a worker's log by chance."""
RAW_CHARS = ["/", "@", ":", "?", "#", "&", "=", ";", "+", " ", "%"]


def pieces(secret: str, n: int = 4) -> set[str]:
    """Every n-character piece of the secret, of its percent-encoded and plus-encoded forms."""
    forms = {secret, quote(secret, safe=""), quote_plus(secret)}
    return {form[i:i + n] for form in forms for i in range(len(form) - n + 1)}


def leaked(text: str, secret: str) -> set[str]:
    return {piece for piece in pieces(secret) if piece in text}


def url_forms(pw: str) -> list[str]:
    """The password ``pw`` (as written, raw or encoded) in every place a Redis URL holds one."""
    return [f"redis://user:{pw}@redis-host:6379/0", f"redis://:{pw}@redis-host:6379/0",
            f"rediss://user:{pw}@redis-host:6380/0?ssl_ca_certs=/etc/ca.pem",
            f"redis://user:{pw}@redis-host/0?ssl_password={pw}",
            f"unix:///run/redis.sock?password={pw}",
            f"unix:///run/redis.sock?db=1&password={pw}&socket_timeout=5",
            f"unix://app@/run/redis.sock?PASSWORD={pw}",
            f"redis://redis-host:6379/0?db=0&password={pw}",
            f"rediss://redis-host:6380/0?ssl_certfile=/c.pem&pass%77ord={pw}",
            f"redis+cluster://user:{pw}@node-a:7000,node-b:7001,node-c:7002",
            f"rediss+cluster://:{pw}@node-a:7000,node-b:7001/0?ssl_ca_certs=/ca.pem",
            f"redis+cluster://node-a:7000,node-b:7001?password={pw}"]


PASSWORDS = ["Wq7vXz9Kplain", *(f"Wq7v{c}Xz9K" for c in RAW_CHARS), SECRET,
             "Wq7v/Xz@9K:m?n#o&p", quote("Wq7v/Xz@9K:m?n#o", safe="")]


@pytest.mark.parametrize("pw", PASSWORDS)
def test_no_piece_of_a_password_survives_redaction(pw: str) -> None:
    for url in url_forms(pw):
        shown = redact_url(url)
        assert not leaked(shown, pw), (url, shown)
        assert "***" in shown


def test_redaction_keeps_what_an_operator_needs() -> None:
    assert redact_url("redis://user:pa/ss@redis-host:6379/0") == \
        "redis://user:***@redis-host:6379/0"
    assert redact_url("rediss://:p@ss@h:6380/0?ssl_ca_certs=/ca.pem") == \
        "rediss://:***@h:6380/0?ssl_ca_certs=/ca.pem"
    assert redact_url("unix:///run/redis.sock?db=2&password=p/w@x") == \
        "unix:///run/redis.sock?db=2&password=***"
    assert redact_url("redis://localhost:6379/0") == "redis://localhost:6379/0"
    assert redact_url("unix:///run/redis.sock") == "unix:///run/redis.sock"


def test_settings_repr_and_errors_show_the_url_redacted() -> None:
    for url in url_forms(SECRET):
        assert not leaked(repr(RedisSettings(url=url)), SECRET), url
        try:
            RedisSettings.from_dsn(url)
        except ValueError as e:
            assert not leaked(str(e), SECRET) and "***" in str(e), url
    with pytest.raises(ValueError, match="unsupported Redis URL scheme") as raised:
        RedisSettings.from_dsn(f"http://user:{SECRET}@h/0")
    assert not leaked(str(raised.value), SECRET)


@pytest.mark.parametrize("pw", ["Wq7v/Xz9K", "Wq7v?Xz9K", "Wq7v#Xz9K", "Wq/7@v?X#z9K",
                                "1?b=c@", "12/34"])
def test_a_password_redis_py_would_misread_is_refused(pw: str) -> None:
    # Unrefused, redis-py would connect to another host or port, or quote a piece of the
    # password in its own "Port could not be cast" error.
    with pytest.raises(ValueError, match="percent-encode") as e:
        check_redis_url(f"redis://user:{pw}@redis-host:6379/0")
    assert "***" in str(e.value) and (len(pw) < 4 or not leaked(str(e.value), pw))
    encoded = f"redis://user:{quote(pw, safe='')}@redis-host:6379/0"
    assert check_redis_url(encoded) == encoded and parse_url(encoded)["password"] == pw


def test_a_cluster_url_lists_its_nodes() -> None:
    url = f"rediss+cluster://app:{quote(SECRET, safe='')}@node-a:7000, node-b:7001,[::1]:7002/0" \
          "?ssl_ca_certs=/ca.pem"
    assert check_redis_url(url) == url
    first, nodes = cluster_nodes(url)
    assert nodes == [("node-a", 7000), ("node-b", 7001), ("::1", 7002)]
    assert parse_url(first)["password"] == SECRET and first.startswith("rediss://app:")
    assert parse_url(first)["ssl_ca_certs"] == "/ca.pem"
    assert cluster_nodes("redis+cluster://node-a")[1] == [("node-a", 6379)]
    assert redact_url(url) == "rediss+cluster://app:***@node-a:7000, node-b:7001,[::1]:7002/0" \
                              "?ssl_ca_certs=/ca.pem"
    assert is_cluster_url(url) and not is_cluster_url("redis://node-a:7000/0")


@pytest.mark.parametrize("url", [
    "redis+cluster://node-a:7000,node-b:70x1", "redis+cluster://node-a:7000,,node-b:7001",
    "redis+cluster://node-a:7000/1", "redis+cluster://node-a:7000?db=2",
    f"redis+cluster://user:{SECRET}@node-a:7000,node-b:7001", "redis+clusters://node-a:7000"])
def test_a_bad_cluster_url_is_refused_in_one_line(url: str) -> None:
    with pytest.raises(ValueError) as e:
        check_redis_url(url)
    assert "\n" not in str(e.value) and not leaked(str(e.value), SECRET)


_USERINFO_CHARS = st.characters(codec="ascii", categories=["L", "N", "P", "S", "Zs"],
                                exclude_characters="%\\")


@given(st.text(_USERINFO_CHARS, min_size=1, max_size=24))
def test_an_accepted_url_is_read_as_written(pw: str) -> None:
    """Whatever the password (raw '%' aside: it is an escape), the URL is either refused,
    or redis-py reads exactly that password, host and port; and redaction hides it."""
    url = f"redis://user:{pw}@redis-host:6379/0"
    shown = redact_url(url)
    assert shown == "redis://user:***@redis-host:6379/0" or shown.startswith("redis://***")
    try:
        check_redis_url(url)
    except ValueError:
        return
    read = parse_url(url)
    assert (read["password"], read["host"], read["port"]) == (pw, "redis-host", 6379)


@pytest.mark.parametrize("command", [["worker"], ["status"], ["submit", "x.jpg"],
                                     ["score", ".", "-o", "out.jsonl"]])
def test_a_bad_url_is_one_line_without_the_password(command: list[str]) -> None:
    url = f"redis://user:{SECRET}@redis-host:6379/0"
    result = CliRunner().invoke(main, [*command, "--redis", url])
    assert result.exit_code == 2 and "percent-encode" in result.output
    assert "Traceback" not in result.output and not leaked(result.output, SECRET)


def test_a_worker_never_logs_the_password(tmp_path: Path) -> None:
    sock = tmp_path / "redis.sock"
    photo = (SAMPLES / "cat.jpg").read_bytes()
    with RedisServer(password=SECRET, extra_args=["--unixsocket", str(sock),
                                                  "--unixsocketperm", "700"]) as server:
        assert SECRET not in server.url  # percent-encoded in the userinfo
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port).ping()
        raw_query = f"unix://{sock}?password={SECRET}"  # '/', '@', ':', '?' read as written
        with spawned_workers(tmp_path) as start:
            first, log1 = start(server.url, "--log-level", "DEBUG")
            second, log2 = start(raw_query, "--log-level", "DEBUG")
            # The first worker's consumer already counts as "ready": wait for the second
            # one's own, or a slow start could be stopped before it logged anything.
            admin = redis.Redis.from_url(server.url)
            deadline = time.monotonic() + 120
            while count_consumers(admin, Keys(TEST_MODEL)) < 2:
                assert time.monotonic() < deadline and second.poll() is None, \
                    log2.read_text(errors="replace")[-2000:]
                time.sleep(0.1)
            admin.close()
            for proc in (first, second):  # the URL travels in the environment, not argv
                assert not leaked(" ".join(psutil.Process(proc.pid).cmdline()), SECRET)
            with Client(raw_query) as client:
                results = [client.predict(photo, timeout_s=120) for _ in range(4)]
            assert all(r.ok for r in results), results
        bad = subprocess.run([sys.executable, "-m", "redbatch.cli", "worker", "--redis",
                              f"redis://:{SECRET}@127.0.0.1:{server.port}/0"],
                             capture_output=True, text=True, timeout=60)
    for log in (log1, log2):
        text = log.read_text(errors="replace")
        assert "starting worker" in text and "redis='" in text
        assert not leaked(text, SECRET), (log.name, leaked(text, SECRET))
    assert "redis='unix://" + str(sock) + "?password=***'" in log2.read_text()
    assert bad.returncode == 2 and bad.stderr.count("Error:") == 1  # click's usage error
    assert "Traceback" not in bad.stderr
    assert "percent-encode" in bad.stderr and not leaked(bad.stderr, SECRET)
