"""Partitions (PROTOCOL.md "Partitions"): the key layout of partition p, the hash that
picks it, the partition history key and its raise script, the scripts on partition keys,
against a real redis-server."""

from __future__ import annotations

import zlib

import pytest
import redis
from redbatch.common import protocol as p
from redbatch.common.protocol import JobEnvelope, Keys, Lane
from redbatch.producer.core import _admit


def test_partition_zero_is_todays_layout_and_others_carry_their_number() -> None:
    k = Keys("m")
    assert k.part(0) == k and k.stream(Lane.BULK) == "redbatch:{m}:jobs:bulk"
    k3 = k.part(3)
    assert k3.stream(Lane.INTERACTIVE) == "redbatch:{m#3}:jobs:interactive"
    assert k3.result("a") == "redbatch:{m#3}:result:a"
    assert k3.owner("a") == "redbatch:{m#3}:owner:a"
    assert k3.reply("c") == "redbatch:{m#3}:reply:c"
    assert k3.partitions() == k.partitions() == "redbatch:{m}:partitions"
    assert p.parse_job_stream("redbatch", k3.stream(Lane.BULK)) == ("m", Lane.BULK)
    with pytest.raises(ValueError):
        Keys("m#3")  # no model name holds the separator
    with pytest.raises(ValueError):
        k.part(p.MAX_PARTITIONS)


def test_partition_of_is_crc32_of_the_id_mod_p() -> None:
    assert zlib.crc32(b"abc") == 0x352441C2
    assert p.partition_of("abc", 1) == 0
    assert p.partition_of("abc", 7) == 0x352441C2 % 7 == 5
    assert Keys("m").of("abc", 7) == Keys("m", partition=5)
    spread = {p.partition_of(p.new_request_id(), 3) for _ in range(200)}
    assert spread == {0, 1, 2}


def test_history_parses_and_candidates_cover_every_count() -> None:
    assert p.parse_partition_history(None) == (1,)
    assert p.parse_partition_history(b"1 2 6") == (1, 2, 6)
    assert p.parse_partition_history(b"2 1") == (1,)
    assert p.parse_partition_history(b"x") == (1,)
    # crc32("a") = 0xE8B7BE43: mod 1, 2, 6 = 0, 1, 3; newest P first.
    assert p.candidate_partitions("a", (1, 2, 6)) == [3, 1, 0]
    assert p.candidate_partitions("abc", (1, 2, 6)) == [0]  # 0 under every count


def test_raise_script_only_raises_and_keeps_the_history(r: redis.Redis) -> None:
    key = Keys("m").partitions()
    raise_to = r.register_script(p.RAISE_PARTITIONS_SCRIPT)
    assert raise_to([key], [1]) == b"1"
    assert r.get(key) is None  # raising to today's P writes nothing
    assert raise_to([key], [2]) == b"1 2"
    assert raise_to([key], [6]) == b"1 2 6"
    with pytest.raises(redis.ResponseError, match="LOWER_PARTITIONS P is 6"):
        raise_to([key], [3])
    with pytest.raises(redis.ResponseError, match="BAD_CALL"):
        raise_to([key], [p.MAX_PARTITIONS + 1])
    assert p.parse_partition_history(r.get(key)) == (1, 2, 6)


def _job(rid: str) -> JobEnvelope:
    return JobEnvelope(request_id=rid, model="m", payload=b"x", content_type="a/b",
                       submitted_ms=0, deadline_ms=None, lane=Lane.BULK, params={})


def test_admission_status_and_cancel_take_a_partitions_keys(r: redis.Redis) -> None:
    k3 = Keys("m", partition=3)
    call = _admit(k3, [_job("j1")])
    replies = r.eval(p.ADMIT_SCRIPT, len(call.keys), *call.keys, *call.args)
    assert isinstance(replies[0], bytes) and r.xlen(k3.stream(Lane.BULK)) == 1
    assert r.get(k3.owner("j1")).endswith(b" bulk")
    status = r.eval(p.STATUS_SCRIPT, 4, k3.result("j1"), k3.owner("j1"),
                    k3.stream(Lane.INTERACTIVE), k3.stream(Lane.BULK))
    assert p.job_status("j1", status).state is p.JobState.QUEUED
    # Keys of two partitions (or an odd tag) do not belong together.
    mixed = _admit(k3, [_job("j2")])
    mixed_keys = [mixed.keys[0], Keys("m").limits(), *mixed.keys[2:]]
    with pytest.raises(redis.ResponseError, match="BAD_CALL"):
        r.eval(p.ADMIT_SCRIPT, len(mixed_keys), *mixed_keys, *mixed.args)
    odd = [key.replace("{m#3}", "{m#03}") for key in mixed.keys]
    with pytest.raises(redis.ResponseError, match="BAD_CALL"):
        r.eval(p.ADMIT_SCRIPT, len(odd), *odd, *mixed.args)
