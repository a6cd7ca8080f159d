"""The result writer's packed MULTI/EXEC with and without hiredis (redis-py works without it,
and an offline machine may have redis-py alone)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import hiredis
import pytest
from redbatch.gpu_worker.streams.transaction import pack_in_python

COMMANDS: list[tuple[Any, ...]] = [
    ("MULTI",),
    ("SET", "k", b"v\r\n\x00"),
    ("XADD", "redbatch:s", "MAXLEN", "~", 1000, "*", "f", 1.5, "g", 10**20, -3),
    ("RPUSH", "ключ", "ü" * 3, b"\xff"),
    ("EVALSHA", "ab", 0, 0.1, 1e300, float("inf"), -0.0),
]


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: str(a[0]))
def test_python_packing_is_byte_for_byte_hiredis(args: tuple[Any, ...]) -> None:
    assert pack_in_python(args) == hiredis.pack_command(args)


def test_python_packing_refuses_what_redis_cannot_take() -> None:
    for bad in (None, True, [1]):
        with pytest.raises(TypeError):
            pack_in_python(("SET", "k", bad))


def test_the_writer_runs_a_transaction_without_hiredis(redis_url: str) -> None:
    # A fresh interpreter in which `import hiredis` fails, as where it is not installed.
    script = textwrap.dedent(f"""
        import sys
        sys.modules["hiredis"] = None
        from redbatch.common.redis_io import connect
        from redbatch.gpu_worker.streams import transaction as t
        assert t.pack_command is t.pack_in_python
        r = connect({redis_url!r})
        cmds = t.Commands()
        cmds.set("nohiredis:a", "1")
        cmds.incrby("nohiredis:a", 41)
        cmds.rpush("nohiredis:l", b"x", "y")
        replies, _ = t.exec_transaction(r, cmds)
        print(replies, r.get("nohiredis:a"), r.lrange("nohiredis:l", 0, -1))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[b'OK', 42, 2] b'42' [b'x', b'y']"
