"""A private redis-server is ready only when the server on its port is its own child.

A redis-server that cannot bind its port exits, but for a moment the port answers
PONG from whoever holds it: a private stack must never adopt someone else's Redis
(and FLUSHALL it, or serve its jobs).
"""

from __future__ import annotations

import psutil
import pytest
import redis
from redbatch.cli import redis_server
from redbatch.cli.redis_server import PortTaken, RedisServer, RedisServerError


def own_pid(url: str) -> int:
    return int(redis.Redis.from_url(url).info("server")["process_id"])


def test_a_port_held_by_another_redis_is_refused_not_adopted() -> None:
    with RedisServer() as other:
        other_client = redis.Redis.from_url(other.url)
        other_client.set("theirs", "1")
        mine = RedisServer(port=other.port)
        with pytest.raises(PortTaken, match=f"port {other.port} is (held|taken)") as e:
            mine.start(timeout_s=10)
        assert isinstance(e.value, RedisServerError)
        assert mine.pid is None, "the child that could not bind is not left running"
        mine.stop()
        assert own_pid(other.url) == other.pid and other_client.get("theirs") == b"1"


def test_a_held_port_that_refuses_us_is_not_adopted_either() -> None:
    with RedisServer(password="not-yours") as other:
        with pytest.raises(PortTaken):
            RedisServer(port=other.port).start(timeout_s=10)


def test_a_picked_port_taken_meanwhile_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    with RedisServer() as other:
        # The race free_port() cannot close: another process takes the port before the
        # child binds it. Forced here by handing out the held port first.
        ports = iter([other.port])
        real_free_port = redis_server.free_port
        monkeypatch.setattr(redis_server, "free_port", lambda: next(ports, None) or
                            real_free_port())
        with RedisServer() as mine:
            assert mine.port != other.port
            assert own_pid(mine.url) == mine.pid != other.pid
            assert psutil.Process(mine.pid).name() == "redis-server"


def test_a_restart_answers_as_the_new_process() -> None:
    with RedisServer(appendonly=True) as server:
        first = server.pid
        server.restart()
        assert server.pid != first and own_pid(server.url) == server.pid
