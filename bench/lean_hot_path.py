"""The worker's per-group hot path without per-job Python objects: a measured prototype.

    .venv/bin/python bench/lean_hot_path.py [--rounds 7] [--groups 100] [--keep DIR]
                                            [--compiler cython|mypyc]

Issue 13 asks what would close the gap between the worker's per-job Python (about 21 µs of
CPU per job in bench/compiled_hot_path.py) and its library floor (5.7 µs), "measured on a
prototype, not guessed". Compiling the product's code as it is saves 8%; this measures the
other candidate that page names: one columnar pass per group, from the XREADGROUP reply to
the bytes of the write transaction, with no Job, Answer, envelope or command objects per job,
interpreted and compiled.

The same input for every variant, groups of 64 jobs (bench/compiled_hot_path.py's
``HotPath``): 64 stream entries as redis-py returns them from XREADGROUP (``rid``, ``adm``
and a ``job`` field written by ``JobEnvelope.encode``: an 800-byte payload, a deadline, a
reply list), and per job an ImageNet-style top-5 output (a dict with a list of five dicts).
The output of each variant: the bytes of the write transaction (MULTI ... EXEC) that would go
to Redis. Variants, each in a fresh process:

1. **product**: the shipped code, as bench/compiled_hot_path.py runs it (its ``HotPath``
   parts, imported): **decode** is ``Intake._decode`` of the 64 entries (the intake part),
   **answers** ``ResultWriter.ran`` on the group, **transaction** ``ResultWriter._queue`` on a
   redis-py MULTI pipeline *plus* the packing that ``Pipeline.execute`` does before it sends
   (``Connection.pack_commands`` of MULTI, the queued commands and EXEC; redis-py packs with
   hiredis here). compiled_hot_path.py's queue part stops before the packing; both halves are
   shown (``queue``, ``pack``).
2. **lean python**: the prototype below (between the ``lean prototype`` markers), plain
   Python. Per group, columns (lists) instead of objects:

   * ``lean_decode``: per entry, the checks the product makes on the accepted path, with the
     same limits taken from the product's constants: entry not empty (not deleted while
     pending); deliveries at most the worker's maximum; ``adm`` field present (else the
     product would claim the request id: a Redis call this prototype leaves to the product);
     ``rid`` present and matching the product's request id pattern (applied to the bytes:
     the pattern is ASCII, so this is the same test as decoding then matching); ``job``
     present and at most max payload + envelope overhead bytes; ``msgpack.unpackb`` with the
     product's exact options (raw=False, strict_map_key, the ext_hook that refuses extension
     types, max_str_len, max_bin_len, max_array_len, max_map_len); the body a map; every
     required field present with the product's type (``type() is`` for int, so a bool is
     refused as the product refuses it; deadline_ms an int or nil, and present); version 1;
     model equal to the worker's model (which the product validated as a name); payload bytes
     of at most max payload bytes; lane the lane of the stream the entry came on;
     content_type at most 4096 UTF-8 bytes (encoded only when it has over 1024 characters);
     params a map of at most 32 str keys to scalars; reply_to nil or a reply key of this
     model (the product's test, memoised per group); and the deadline: queue time from the
     entry id's milliseconds, the budget ``deadline_ms - submitted_ms`` turned into a
     monotonic deadline, and expired jobs set apart as the batcher's ``pop_expired`` would.
     An entry that fails any test is not judged here: its index goes to ``cold``, for the
     product's ``Intake._decode`` to answer with its exact code and message (the faithfulness
     check below makes sure lean and product reject the same entries).
   * ``lean_answers``: each result envelope from msgpack fragments made once per group (the
     map header, keys, status, nil error, batch size, worker, model, finished_ms, the two
     per-batch timings), with per job only the request id (its str header from a table),
     ``msgpack.packb`` of the output and three doubles (queue, preprocess and total ms,
     rounded to 3 places as the product does) packed with ``struct``. One ``time.monotonic``
     and one ``time.time`` per group where the product reads both clocks per job; finished_ms
     is therefore the group's. An output msgpack cannot pack raises ``LeanFallback`` (the
     product answers it ``internal``).
   * ``lean_transaction``: the RESP bytes of the whole MULTI/EXEC, written by hand into one
     list and joined once: per job ``SET result:<id> <envelope> NX GET PX ttl`` (and, for a
     job with no reply list, ``RPUSH done:<id> <envelope>`` and ``PEXPIRE``), per reply list one
     ``RPUSH`` of its ids and ``PEXPIRE``, the recent list's records (msgpack from a
     template: ``LPUSHX``, or ``LPUSH``, ``LTRIM``, ``PEXPIRE`` at its upkeep once a second
     as the product does), per stream ``XACK`` and ``XDEL`` of the entry ids.

   What it leaves out, as the benchmarked product path does too: the Redis calls, the
   batcher and the capacity and outbox bookkeeping (0.5 µs per job in compiled_hot_path.py),
   dead letters and rejected entries (the cold path), reading the transaction's replies.
3. **lean compiled**: the same lines, copied alone into a temporary directory as
   ``lean_core.py`` and compiled by Cython (``cythonize``, annotation typing on, infer_types;
   the code is written for it: annotated locals, no dataclasses, plain classes read once per
   group) or with ``--compiler mypyc`` by mypyc; imported in a fresh process from that
   directory, refused unless it is the built ``.so``. Cython is not a dependency of redbatch:
   ``.venv/bin/pip install cython`` for this variant; without it the variant is skipped with
   a note. Nothing is written into the repository (``--keep DIR``: built in DIR and kept).

**Faithfulness check**, before any timing, in this process and again in the compiled one
(exit status 1 when it fails): on the same group, the lean transaction must hold the same
commands, in the same order, with the same keys and arguments, as the product's (its
pipeline's ``command_stack``, packed by redis-py, both parsed back with hiredis), except the
SET values and the recent list's records, which must decode with the product's decoders
(``ResultEnvelope.decode``, ``RecentResult.decode``) to the same fields; only the clock's
fields may differ: ``finished_ms`` and the ``total_ms`` timing (their presence is checked).
The lean columns must match the product's Jobs (ids, payloads, content types, params, reply
lists, queue times). And on a group of 30 entries, 26 of them each breaking one rule (bad or
missing request ids, not msgpack, trailing bytes, an extension type, wrong version, model,
lane, types, sizes, params, reply lists, a deleted entry, ...), one whose budget is spent and
three valid (one without a deadline, one stored after "now"), the lean decode must send to
``cold`` exactly the entries the product's ``Intake._decode`` rejects, set apart as expired
exactly the one the batcher would, and match the product's Jobs on the three valid ones.

Timing: each part and the whole group (the parts in one loop), one warm-up group, then
``--rounds`` rounds of ``--groups`` groups; CPU time (``time.process_time``) of the best round
over its jobs, µs per job, the garbage collector on. Prints the table and the ratios last;
writes bench/out/lean_hot_path.csv and .png.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from itertools import chain
from pathlib import Path
from types import ModuleType
from typing import Any

import hiredis
import msgpack
from compiled_hot_path import GROUP, PAYLOAD_BYTES, HotPath, best_us_per_job
from harness import ROOT, machine_load, plot, write_csv
from redbatch.common.protocol import (
    FIELD_ADMITTED,
    FIELD_JOB,
    FIELD_REQUEST_ID,
    MAX_ARRAY_LEN,
    MAX_CONTENT_TYPE_BYTES,
    MAX_ENVELOPE_OVERHEAD_BYTES,
    MAX_MAP_LEN,
    MAX_PARAMS,
    MAX_STR_BYTES,
    RECENT_MAX,
    RECENT_TTL_MS,
    JobEnvelope,
    Lane,
    ProtocolError,
    RecentResult,
    ResultEnvelope,
)
from redbatch.common.protocol import GROUP as CONSUMER_GROUP
from redbatch.common.protocol.envelopes import _refuse_ext
from redbatch.common.protocol.keys import _NAME_RE, _REQUEST_ID_RE
from redbatch.gpu_worker.streams.intake import Job
from redbatch.gpu_worker.streams.results import RECENT_UPKEEP_S
from redis.client import EMPTY_RESPONSE

PARTS = ("decode", "answers", "transaction")
VARIANTS = ("product", "lean python", "lean compiled")
#: The product's answers: the batch's size and its two per-batch timings (as compiled_hot_path).
BATCH_SIZE, INFERENCE_MS, BATCH_WAIT_MS = GROUP, 12.5, 3.0
#: What the compiled module starts with: the imports the lean block uses, nothing of bench/.
LEAN_HEADER = """\
# cython: language_level=3
from __future__ import annotations

import math
import re
import struct
import time
from collections.abc import Callable
from typing import Any

import msgpack

"""
BEGIN, END = "# ==== lean prototype: begin", "# ==== lean prototype: end"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7, help="rounds per part (the best counts)")
    p.add_argument("--groups", type=int, default=100, help="groups of 64 jobs per round")
    p.add_argument("--keep", type=Path, default=None, metavar="DIR",
                   help="build in DIR and keep it (default: a temporary directory, removed)")
    p.add_argument("--compiler", choices=("cython", "mypyc"), default="cython",
                   help="what compiles the lean prototype (default cython)")
    p.add_argument("--child", choices=("product", "lean", "compiled"), default=None,
                   help=argparse.SUPPRESS)
    return p.parse_args()


# ==== lean prototype: begin
# Everything up to the end marker is copied alone into lean_core.py and compiled: it uses only
# the imports in LEAN_HEADER, and the product's values come in through LeanConfig.

CRLF = b"\r\n"
_DOUBLE = struct.Struct(">d").pack


def _resp_len(n: int) -> bytes:
    """RESP's ``$<n>\\r\\n`` header of a bulk string."""
    return b"$%d\r\n" % n


def _resp_array(n: int) -> bytes:
    return b"*%d\r\n" % n


def _resp_command(*args: bytes) -> bytes:
    """A whole RESP command of ready bytes (for the per-group constants)."""
    return _resp_array(len(args)) + b"".join(_resp_len(len(a)) + a + CRLF for a in args)


def _pk(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


class LeanFallback(Exception):
    """The group needs the product's path (an output msgpack cannot pack)."""


class LeanConfig:
    """One worker's constants, as bytes and msgpack fragments, made once."""

    def __init__(self, model: str, worker: str, group: str, streams: dict[str, str],
                 bulk_stream: str, result_prefix: str, done_prefix: str, reply_prefix: str,
                 recent: str, max_payload: int, max_deliveries: int, ttl_ms: int,
                 request_id_pattern: str, name_pattern: str, limits: dict[str, int],
                 ext_hook: Callable[[int, bytes], Any], recent_max: int, recent_ttl_ms: int,
                 recent_upkeep_s: float) -> None:
        self.model = model
        self.streams = streams
        self.bulk_stream = bulk_stream
        self.max_payload = max_payload
        self.max_body = max_payload + limits["envelope_overhead"]
        self.max_deliveries = max_deliveries
        self.max_str = limits["str"]
        self.max_array = limits["array"]
        self.max_map = limits["map"]
        self.max_params = limits["params"]
        self.max_content_type = limits["content_type"]
        self.ext_hook = ext_hook
        # The request id pattern is ASCII: matching the bytes is matching the decoded str.
        self.rid_match = re.compile(request_id_pattern.encode()).fullmatch
        self.name_match = re.compile(name_pattern).fullmatch
        self.reply_prefix = reply_prefix
        self.recent_upkeep_s = recent_upkeep_s
        ttl = str(ttl_ms).encode()
        result_b, done_b = result_prefix.encode(), done_prefix.encode()
        # RESP, per request id length: the command up to the id, then what follows the id.
        self.set_head = [_resp_array(7) + _resp_len(3) + b"SET" + CRLF
                         + _resp_len(len(result_b) + n) + result_b for n in range(256)]
        self.set_tail = CRLF + _resp_len(2) + b"NX" + CRLF + _resp_len(3) + b"GET" + CRLF \
            + _resp_len(2) + b"PX" + CRLF + _resp_len(len(ttl)) + ttl + CRLF
        self.done_head = [_resp_array(3) + _resp_len(5) + b"RPUSH" + CRLF
                          + _resp_len(len(done_b) + n) + done_b for n in range(256)]
        # The done token is the envelope itself: RPUSH done:<id> <envelope>, then PEXPIRE.
        self.done_mid = CRLF
        self.done_expire = _resp_array(3) + _resp_len(7) + b"PEXPIRE" + CRLF
        self.done_prefix = done_b
        self.ttl_tail = _resp_len(len(ttl)) + ttl + CRLF
        self.ttl = ttl
        self.lens = [_resp_len(n) for n in range(4096)]
        self.recent = recent.encode()
        self.recent_trim = _resp_command(b"LTRIM", self.recent, b"0", b"%d" % (recent_max - 1))
        self.recent_expire = _resp_command(b"PEXPIRE", self.recent, b"%d" % recent_ttl_ms)
        self.group = group.encode()
        # msgpack: a str header per length (request ids are ASCII, at most 128 characters).
        self.str_heads = [_pk("x" * n)[:-n or None] for n in range(256)]
        self.env_head = b"\x8a" + _pk("v") + _pk(1) + _pk("id")
        self.env_mid = _pk("status") + _pk("ok") + _pk("output")
        self.env_queue = _pk("error") + _pk(None) + _pk("timings") + b"\x85" + _pk("queue_ms") \
            + b"\xcb"
        self.env_pre = _pk("preprocess_ms") + b"\xcb"
        self.env_tail = _pk("worker") + _pk(worker) + _pk("model") + _pk(model) \
            + _pk("finished_ms")


class LeanState:
    """What persists between groups: when the recent list next needs its upkeep."""

    def __init__(self) -> None:
        self.recent_upkeep_at = 0.0


class LeanGroup:
    """One group's valid, unexpired jobs, column by column, in entry order."""

    def __init__(self) -> None:
        self.streams: list[str] = []
        self.entry_ids: list[bytes] = []
        self.rids: list[bytes] = []
        self.payloads: list[bytes] = []
        self.content_types: list[str] = []
        self.params: list[dict[str, Any]] = []
        self.reply_tos: list[str | None] = []
        self.queue_ms: list[float] = []
        self.deadline_s: list[float] = []
        self.arrival_s = 0.0
        self.cold: list[int] = []
        """Indexes of the entries the product's Intake._decode must judge."""
        self.expired: list[int] = []
        """Indexes of valid entries whose budget is already spent."""


def _params_ok(params: dict[Any, Any], most: int) -> bool:
    if len(params) > most:
        return False
    for key, value in params.items():
        if type(key) is not str or not (value is None or isinstance(value, (str, int, float))):
            return False
    return True


def lean_decode(  # noqa: C901 - one flat loop on purpose: a call per check costs per job
        entries: list[tuple[str, tuple[bytes, dict[bytes, bytes]]]], cfg: LeanConfig,
        now_ms: float, deliveries: int) -> LeanGroup:
    """Validate a group of XREADGROUP entries into columns (see the module's docstring)."""
    g = LeanGroup()
    g.arrival_s = mono = time.monotonic()
    cold, expired = g.cold, g.expired
    unpackb = msgpack.unpackb
    rid_match, name_match = cfg.rid_match, cfg.name_match
    model, streams, ext_hook = cfg.model, cfg.streams, cfg.ext_hook
    max_body: int = cfg.max_body
    max_payload: int = cfg.max_payload
    max_str: int = cfg.max_str
    max_array: int = cfg.max_array
    max_map: int = cfg.max_map
    max_params: int = cfg.max_params
    max_ct: int = cfg.max_content_type
    reply_prefix: str = cfg.reply_prefix
    replies_ok: dict[str, bool] = {}
    too_often: bool = deliveries > cfg.max_deliveries
    i: int = -1
    for stream, (entry_id, fields) in entries:
        i += 1
        if too_often or not fields or b"adm" not in fields:
            cold.append(i)
            continue
        rid = fields.get(b"rid")
        raw = fields.get(b"job")
        if rid is None or raw is None or len(raw) > max_body or rid_match(rid) is None:
            cold.append(i)
            continue
        try:
            body = unpackb(raw, raw=False, strict_map_key=True, ext_hook=ext_hook,
                           max_str_len=max_str, max_bin_len=max_body,
                           max_array_len=max_array, max_map_len=max_map)
        except Exception:
            cold.append(i)
            continue
        if type(body) is not dict:
            cold.append(i)
            continue
        v = body.get("v")
        payload = body.get("payload")
        content_type = body.get("content_type")
        submitted = body.get("submitted_ms")
        deadline = body.get("deadline_ms")
        params = body.get("params")
        reply_to = body.get("reply_to")
        if (type(v) is not int or v != 1 or body.get("model") != model
                or type(payload) is not bytes or len(payload) > max_payload
                or type(content_type) is not str or type(submitted) is not int
                or streams.get(stream) != body.get("lane") or type(params) is not dict
                or (deadline is None and "deadline_ms" not in body)
                or (deadline is not None and type(deadline) is not int)):
            cold.append(i)
            continue
        if len(content_type) > max_ct // 4 and \
                len(content_type.encode(errors="surrogatepass")) > max_ct:
            cold.append(i)
            continue
        if params and not _params_ok(params, max_params):
            cold.append(i)
            continue
        if reply_to is not None:
            if type(reply_to) is not str:
                cold.append(i)
                continue
            known = replies_ok.get(reply_to)
            if known is None:
                known = reply_to.startswith(reply_prefix) and \
                    name_match(reply_to[len(reply_prefix):]) is not None
                replies_ok[reply_to] = known
            if not known:
                cold.append(i)
                continue
        queue_ms: float = now_ms - int(entry_id.partition(b"-")[0])
        if queue_ms < 0.0:
            queue_ms = 0.0
        deadline_s: float = math.inf
        if deadline is not None:
            deadline_s = mono + ((deadline - submitted) - queue_ms) / 1000
            if deadline_s <= mono:
                expired.append(i)
                continue
        g.streams.append(stream)
        g.entry_ids.append(entry_id)
        g.rids.append(rid)
        g.payloads.append(payload)
        g.content_types.append(content_type)
        g.params.append(params)
        g.reply_tos.append(reply_to)
        g.queue_ms.append(queue_ms)
        g.deadline_s.append(deadline_s)
    return g


def lean_answers(g: LeanGroup, outputs: list[Any], preprocess_ms: list[float], cfg: LeanConfig,
                 batch_size: int, inference_ms: float,
                 batch_wait_ms: float) -> tuple[list[bytes], list[float]]:
    """The ok result envelope of each job of ``g`` (msgpack), and its rounded total_ms."""
    now = time.monotonic()
    since_ms: float = (now - g.arrival_s) * 1000
    packb = msgpack.packb
    double = _DOUBLE
    str_heads = cfg.str_heads
    head, mid, queue_key, pre_key = cfg.env_head, cfg.env_mid, cfg.env_queue, cfg.env_pre
    total_key = _pk("batch_wait_ms") + _pk(round(batch_wait_ms, 3)) + _pk("inference_ms") \
        + _pk(round(inference_ms, 3)) + _pk("total_ms") + b"\xcb"
    tail = _pk("batch_size") + _pk(batch_size) + cfg.env_tail + _pk(int(time.time() * 1000))
    envs: list[bytes] = []
    totals: list[float] = []
    rids = g.rids
    queue = g.queue_ms
    for i in range(len(rids)):
        rid = rids[i]
        q: float = queue[i]
        total = round(q + since_ms, 3)
        try:
            out = packb(outputs[i], use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as e:
            raise LeanFallback(f"output {i}: {e}") from e
        envs.append(b"".join((head, str_heads[len(rid)], rid, mid, out, queue_key,
                              double(round(q, 3)), pre_key, double(round(preprocess_ms[i], 3)),
                              total_key, double(total), tail)))
        totals.append(total)
    return envs, totals


def lean_transaction(g: LeanGroup, envs: list[bytes], totals: list[float], cfg: LeanConfig,
                     state: LeanState) -> bytes:
    """The RESP bytes of the group's MULTI ... EXEC (see the module's docstring)."""
    out: list[bytes] = [b"*1\r\n$5\r\nMULTI\r\n"]
    lens = cfg.lens
    set_head, set_tail = cfg.set_head, cfg.set_tail
    done_head, done_mid, done_prefix, ttl_tail = (cfg.done_head, cfg.done_mid, cfg.done_prefix,
                                                  cfg.ttl_tail)
    done_expire = cfg.done_expire
    replies: dict[str, list[bytes]] = {}
    rids, reply_tos = g.rids, g.reply_tos
    n: int = len(rids)
    for i in range(n):
        rid = rids[i]
        env = envs[i]
        size: int = len(env)
        env_len = lens[size] if size < 4096 else _resp_len(size)
        out += (set_head[len(rid)], rid, CRLF, env_len, env, set_tail)
        reply_to = reply_tos[i]
        if reply_to is None:
            key_len = lens[len(done_prefix) + len(rid)]
            out += (done_head[len(rid)], rid, done_mid, env_len, env, CRLF, done_expire,
                    key_len, done_prefix, rid, CRLF, ttl_tail)
        else:
            ids = replies.get(reply_to)
            if ids is None:
                replies[reply_to] = [rid]
            else:
                ids.append(rid)
    for key, ids in replies.items():
        key_b = key.encode()
        key_resp = lens[len(key_b)] + key_b + CRLF
        out += (_resp_array(2 + len(ids)), b"$5\r\nRPUSH\r\n", key_resp)
        for rid in ids:
            out += (lens[len(rid)], rid, CRLF)
        out += (b"*3\r\n$7\r\nPEXPIRE\r\n", key_resp, cfg.ttl_tail)
    if n:
        _recent(out, g, totals, cfg, state)
    by_stream: dict[str, list[bytes]] = {}
    for stream, entry_id in zip(g.streams, g.entry_ids, strict=True):
        ids = by_stream.get(stream)
        if ids is None:
            by_stream[stream] = [entry_id]
        else:
            ids.append(entry_id)
    for stream, ids in by_stream.items():
        stream_b = stream.encode()
        stream_resp = lens[len(stream_b)] + stream_b + CRLF
        id_resp: list[bytes] = []
        for entry_id in ids:
            id_resp += (lens[len(entry_id)], entry_id, CRLF)
        out += (_resp_array(3 + len(ids)), b"$4\r\nXACK\r\n", stream_resp,
                lens[len(cfg.group)], cfg.group, CRLF, *id_resp,
                _resp_array(2 + len(ids)), b"$4\r\nXDEL\r\n", stream_resp, *id_resp)
    out.append(b"*1\r\n$4\r\nEXEC\r\n")
    return b"".join(out)


def _recent(out: list[bytes], g: LeanGroup, totals: list[float], cfg: LeanConfig,
            state: LeanState) -> None:
    """The recent list's records (RecentResult's msgpack from a template per lane)."""
    now = _pk("finished_ms") + _pk(int(time.time() * 1000))
    heads = {lane: b"\x84" + now + _pk("lane") + _pk(lane) + _pk("outcome") + _pk("ok")
             + _pk("total_ms") + b"\xcb" for lane in ("interactive", "bulk")}
    bulk = cfg.bulk_stream
    lens = cfg.lens
    records: list[bytes] = []
    streams = g.streams
    double = _DOUBLE
    for i in range(len(totals)):
        # The lane from the stream, as the product takes it.
        head = heads["bulk"] if streams[i] == bulk else heads["interactive"]
        records += (lens[len(head) + 8], head, double(totals[i]), CRLF)
    mono = time.monotonic()
    full = mono >= state.recent_upkeep_at
    verb = b"$5\r\nLPUSH\r\n" if full else b"$6\r\nLPUSHX\r\n"
    out += (_resp_array(2 + len(totals)), verb, lens[len(cfg.recent)], cfg.recent, CRLF)
    out += records
    if full:
        state.recent_upkeep_at = mono + cfg.recent_upkeep_s
        out += (cfg.recent_trim, cfg.recent_expire)

# ==== lean prototype: end


# ---------------------------------------------------------------------------- set-up


def lean_config(core: ModuleType, path: HotPath) -> Any:
    """The lean path's LeanConfig (of ``core``: this module or the compiled one), from the
    product's own keys, limits and patterns."""
    keys = path.keys
    limits = {"envelope_overhead": MAX_ENVELOPE_OVERHEAD_BYTES, "str": MAX_STR_BYTES,
              "array": MAX_ARRAY_LEN, "map": MAX_MAP_LEN, "params": MAX_PARAMS,
              "content_type": MAX_CONTENT_TYPE_BYTES}
    return core.LeanConfig(
        model=keys.model, worker=path.writer.worker, group=CONSUMER_GROUP,
        streams={keys.stream(lane): lane.value for lane in Lane},
        bulk_stream=keys.stream(Lane.BULK), result_prefix=keys.result(""),
        done_prefix=keys.done(""), reply_prefix=keys.reply("x")[:-1], recent=keys.recent(),
        max_payload=path.intake._max_payload, max_deliveries=path.intake._max_deliveries,
        ttl_ms=path.writer._ttl_ms, request_id_pattern=_REQUEST_ID_RE.pattern,
        name_pattern=_NAME_RE.pattern, limits=limits, ext_hook=_refuse_ext,
        recent_max=RECENT_MAX, recent_ttl_ms=RECENT_TTL_MS, recent_upkeep_s=RECENT_UPKEEP_S)


class Lean:
    """One group's trip through the lean prototype (``core``'s functions), part by part."""

    def __init__(self, core: ModuleType, path: HotPath) -> None:
        self.core, self.path = core, path
        self.cfg = lean_config(core, path)
        self.state = core.LeanState()
        self.entries = path.entries
        self.outputs = path.outputs
        self.preprocess_ms = [0.0] * GROUP

    def decode(self) -> Any:
        g = self.core.lean_decode(self.entries, self.cfg, self.path.now_ms, 1)
        assert len(g.rids) == GROUP
        return g

    def answers(self, g: Any) -> tuple[list[bytes], list[float]]:
        envs, totals = self.core.lean_answers(g, self.outputs, self.preprocess_ms, self.cfg,
                                              BATCH_SIZE, INFERENCE_MS, BATCH_WAIT_MS)
        return envs, totals

    def transaction(self, g: Any, envs: list[bytes], totals: list[float]) -> bytes:
        data: bytes = self.core.lean_transaction(g, envs, totals, self.cfg, self.state)
        return data

    def total(self) -> bytes:
        g = self.decode()
        envs, totals = self.answers(g)
        return self.transaction(g, envs, totals)

    def measure(self, groups: int, rounds: int) -> dict[str, float]:
        g = self.decode()
        envs, totals = self.answers(g)
        runs: dict[str, Callable[[], object]] = {
            "decode": self.decode,
            "answers": lambda: self.answers(g),
            "transaction": lambda: self.transaction(g, envs, totals),
            "total": self.total,
        }
        return {part: best_us_per_job(run, groups, rounds) for part, run in runs.items()}


class Product:
    """The shipped path: compiled_hot_path's HotPath parts, and the pack execute() does."""

    def __init__(self, path: HotPath) -> None:
        self.path = path
        self.conn = path.client.connection_pool.make_connection()

    def queue(self, answers: list[Any]) -> list[tuple[Any, ...]]:
        """The transaction's commands, as ResultWriter._queue puts them on the pipeline."""
        pipe = self.path.pipe
        pipe.multi()
        self.path.writer._queue(pipe, answers)
        stack: list[tuple[Any, ...]] = list(pipe.command_stack)
        pipe.reset()
        return stack

    def pack(self, stack: Sequence[tuple[Any, ...]]) -> list[bytes]:
        """What Pipeline._execute_transaction packs before it sends (redis-py 8)."""
        cmds = chain([(("MULTI",), {})], stack, [(("EXEC",), {})])
        return self.conn.pack_commands(  # type: ignore[no-any-return]
            [args for args, options in cmds if EMPTY_RESPONSE not in options])

    def transaction(self, answers: list[Any]) -> list[bytes]:
        return self.pack(self.queue(answers))

    def total(self) -> list[bytes]:
        return self.transaction(self.path.answers_part(self.path.intake_part()))

    def measure(self, groups: int, rounds: int) -> dict[str, float]:
        path = self.path
        jobs = path.intake_part()
        answers = path.answers_part(jobs)
        stack = self.queue(answers)
        runs: dict[str, Callable[[], object]] = {
            "decode": path.intake_part,
            "answers": lambda: path.answers_part(jobs),
            "transaction": lambda: self.transaction(answers),
            "queue": lambda: self.queue(answers),
            "pack": lambda: self.pack(stack),
            "total": self.total,
        }
        return {part: best_us_per_job(run, groups, rounds) for part, run in runs.items()}


# ---------------------------------------------------------------------------- faithfulness


def parse_resp(data: bytes) -> list[list[bytes]]:
    """The commands in a RESP request stream (each an array of bulk strings)."""
    reader = hiredis.Reader()
    reader.feed(data)
    commands: list[list[bytes]] = []
    while (cmd := reader.gets()) is not False:
        commands.append(cmd)
    return commands


def _compare_result(ours: bytes, theirs: bytes) -> str | None:
    a, b = ResultEnvelope.decode(ours), ResultEnvelope.decode(theirs)
    for name in ("request_id", "status", "output", "error_code", "error_message", "batch_size",
                 "worker", "model", "version"):
        if getattr(a, name) != getattr(b, name):
            return f"result field {name}: {getattr(a, name)!r} != {getattr(b, name)!r}"
    if list(a.timings) != list(b.timings):
        return f"timings keys {list(a.timings)} != {list(b.timings)}"
    clock = {"total_ms"}
    same = {k: a.timings[k] for k in a.timings if k not in clock}
    if same != {k: b.timings[k] for k in b.timings if k not in clock}:
        return f"timings {a.timings} != {b.timings}"
    if not (a.finished_ms > 0 and b.finished_ms > 0):
        return "finished_ms missing"
    return None


def _compare_record(ours: bytes, theirs: bytes) -> str | None:
    a, b = RecentResult.decode(ours), RecentResult.decode(theirs)
    if (a.lane, a.outcome) != (b.lane, b.outcome):
        return f"recent record {a} != {b}"
    if type(a.total_ms) is not type(b.total_ms) or not a.finished_ms or not b.finished_ms:
        return f"recent record fields {a} != {b}"
    return None


def compare_transactions(lean: bytes, product: bytes) -> list[str]:
    """What differs between the two transactions, beyond the clock (see the docstring)."""
    ours, theirs = parse_resp(lean), parse_resp(product)
    if len(ours) != len(theirs):
        return [f"{len(ours)} commands != the product's {len(theirs)}"]
    problems: list[str] = []
    for n, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        verb = b[0].upper()
        try:
            if verb == b"SET" and a[:2] == b[:2] and a[3:] == b[3:]:
                if (why := _compare_result(a[2], b[2])) is not None:
                    problems.append(f"command {n}: {why}")
                continue
            if verb == b"RPUSH" and b":done:" in b[1] and a[:2] == b[:2] and len(b) == 3:
                if (why := _compare_result(a[2], b[2])) is not None:  # the envelope as token
                    problems.append(f"command {n}: {why}")
                continue
            if verb in (b"LPUSHX", b"LPUSH") and a[:2] == b[:2] and len(a) == len(b):
                problems += [f"command {n}: {why}" for x, y in zip(a[2:], b[2:], strict=True)
                             if (why := _compare_record(x, y)) is not None]
                continue
        except ProtocolError as e:  # the product's decoder refuses the lean bytes
            problems.append(f"command {n}: {e}")
            continue
        if a != b:
            problems.append(f"command {n}: {[x[:60] for x in a][:6]} != "
                            f"{[x[:60] for x in b][:6]}")
    return problems


def compare_columns(g: Any, jobs: list[Job]) -> list[str]:
    """The lean columns against the product's Jobs."""
    theirs = {
        "rids": [j.request_id.encode() for j in jobs],
        "entry_ids": [j.entry_id for j in jobs],
        "streams": [j.stream for j in jobs],
        "payloads": [j.envelope.payload for j in jobs],
        "content_types": [j.envelope.content_type for j in jobs],
        "params": [dict(j.envelope.params) for j in jobs],
        "reply_tos": [j.envelope.reply_to for j in jobs],
        "queue_ms": [j.queue_ms for j in jobs],
    }
    return [f"column {name} differs from the product's Jobs" for name, values in theirs.items()
            if list(getattr(g, name)) != values]


def corrupted_entries(path: HotPath) -> list[tuple[str, tuple[bytes, dict[bytes, bytes]]]]:
    """Entries each breaking one rule (and two that are valid but expired), for both paths."""
    keys, now = path.keys, int(path.now_ms)
    good = JobEnvelope("req-ok", keys.model, b"x" * PAYLOAD_BYTES, "image/jpeg", now,
                       now + 30_000, Lane.INTERACTIVE, {"top": 5}, keys.reply("client-1"))
    body = msgpack.unpackb(good.encode()[FIELD_JOB])
    max_payload = path.intake._max_payload

    def job(**change: Any) -> bytes:
        b = {k: v for k, v in {**body, **change}.items() if v is not ...}
        return msgpack.packb(b, use_bin_type=True)  # type: ignore[no-any-return]

    rid, adm, jf = FIELD_REQUEST_ID.encode(), FIELD_ADMITTED.encode(), FIELD_JOB.encode()
    ok = {rid: b"req-ok", adm: b"1", jf: job()}
    variants: list[dict[bytes, bytes]] = [
        dict(ok),
        {**ok, rid: b"bad id!"},
        {adm: b"1", jf: job()},
        {**ok, rid: b"\xff\xfe"},
        {**ok, jf: b"\xc1"},
        {**ok, jf: job() + b"\x00"},
        {**ok, jf: msgpack.packb({**body, "params": msgpack.ExtType(1, b"x")})},
        {**ok, jf: msgpack.packb([1, 2])},
        {**ok, jf: job(v=2)},
        {**ok, jf: job(v=True)},
        {**ok, jf: job(model="other")},
        {**ok, jf: job(model="bad/name")},
        {**ok, jf: job(model=...)},
        {**ok, jf: job(payload="text")},
        {**ok, jf: job(payload=b"x" * (max_payload + 1))},
        {**ok, jf: job(lane="bulk")},
        {**ok, jf: job(lane="nope")},
        {**ok, jf: job(reply_to="elsewhere")},
        {**ok, jf: job(reply_to=5)},
        {**ok, jf: job(deadline_ms=...)},
        {**ok, jf: job(deadline_ms=True)},
        {**ok, jf: job(submitted_ms=1.5)},
        {**ok, jf: job(params={f"p{i}": i for i in range(33)})},
        {**ok, jf: job(params={"p": [1]})},
        {**ok, jf: job(params=[1])},
        {**ok, jf: job(content_type="x" * 5000)},
        {},
        {**ok, jf: job(deadline_ms=now - 60_000, submitted_ms=now - 60_001)},
        {**ok, jf: job(deadline_ms=None, submitted_ms=0)},
        dict(ok),  # stored "in the future" by Redis's clock: queue time 0
    ]
    stored = [now - 5] * (len(variants) - 1) + [now + 1]
    return [(path.stream, (f"{ms}-{i}".encode(), fields))
            for i, (ms, fields) in enumerate(zip(stored, variants, strict=True))]


def check(core: ModuleType, path: HotPath) -> list[str]:
    """The faithfulness check: [] when the lean path matches the product."""
    try:
        return _check(core, path)
    except Exception as e:  # a lean path that breaks on the check's input fails it
        return [f"the lean path raised {type(e).__name__}: {e}"]


def _check(core: ModuleType, path: HotPath) -> list[str]:
    lean, product = Lean(core, path), Product(path)
    jobs = path.intake_part()
    answers = path.answers_part(jobs)
    product.transaction(answers)  # the first write of each does the recent list's upkeep
    product_bytes = b"".join(product.transaction(answers))
    lean.total()
    g = lean.decode()
    envs, totals = lean.answers(g)
    problems = compare_columns(g, jobs)
    problems += compare_transactions(lean.transaction(g, envs, totals), product_bytes)
    # Both again from a fresh state: the recent list's upkeep form (LPUSH, LTRIM, PEXPIRE).
    path.writer._recent_upkeep_at = 0.0
    problems += compare_transactions(Lean(core, path).total(),
                                     b"".join(product.transaction(answers)))
    # A group where every third job names no reply list: its done token is its envelope.
    mixed = HotPath(no_reply_every=3)
    lean_m, product_m = Lean(core, mixed), Product(mixed)
    answers_m = mixed.answers_part(mixed.intake_part())
    product_m.transaction(answers_m)
    lean_m.total()
    problems += [f"no reply list: {p}" for p in compare_transactions(
        lean_m.total(), b"".join(product_m.transaction(answers_m)))]
    bad = corrupted_entries(path)
    g = core.lean_decode(bad, lean.cfg, path.now_ms, 1)
    rejected, spent, accepted = [], [], []
    for i, (stream, entry) in enumerate(bad):
        item = path.intake._decode(stream, entry, path.now_ms, time.monotonic(), 1)
        if not isinstance(item, Job):
            rejected.append(i)
        elif item.deadline_s is not None and item.deadline_s <= item.arrival_s:
            spent.append(i)
        else:
            accepted.append(item)
    problems += compare_columns(g, accepted)
    if list(g.cold) != rejected:
        problems.append(f"lean sends entries {list(g.cold)} to the product; "
                        f"the product rejects {rejected}")
    if list(g.expired) != spent:
        problems.append(f"lean finds entries {list(g.expired)} expired; the product {spent}")
    if (len(rejected), len(spent), len(accepted)) != (len(bad) - 4, 1, 3):
        problems.append(f"the corrupted group: {len(rejected)} rejected, {len(spent)} expired, "
                        f"{len(accepted)} valid of {len(bad)}; expected all but 4, 1, 3")
    return problems


# ---------------------------------------------------------------------------- build


def lean_source() -> str:
    """The lean block of this file, as a module of its own."""
    text = Path(__file__).read_text()
    start = text.index(f"\n{BEGIN}\n")  # at a line's start: not the constant's own text
    return LEAN_HEADER + text[start + 1:text.index(f"\n{END}\n", start)] + "\n"


def build(compiler: str, build_dir: Path) -> tuple[Path | None, str]:
    """Compile lean_core.py in ``build_dir``; (the .so, or None, and a note)."""
    source = build_dir / "lean_core.py"
    source.write_text(lean_source())
    start = time.perf_counter()
    if compiler == "cython":
        script = ("from setuptools import setup; from Cython.Build import cythonize; "
                  "setup(ext_modules=cythonize(['lean_core.py'], quiet=True, "
                  "compiler_directives={'language_level': 3, 'infer_types': True, "
                  "'annotation_typing': True}), script_args=['build_ext', '--inplace'])")
        cmd = [sys.executable, "-c", script]
    else:
        (build_dir / "mypy.ini").write_text("[mypy]\nignore_missing_imports = True\n")
        cmd = [str(Path(sys.executable).with_name("mypyc")), "--config-file", "mypy.ini",
               "lean_core.py"]
    done = subprocess.run(cmd, cwd=build_dir, capture_output=True, text=True)
    built = sorted(build_dir.glob("lean_core.*.so"))
    seconds = time.perf_counter() - start
    if done.returncode != 0 or not built:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        return None, f"{compiler} build failed in {seconds:.0f} s:\n{tail}"
    source.unlink()  # the child must import the .so, not the .py beside it
    return built[0], f"{compiler} build in {build_dir}: {seconds:.0f} s, {built[0].name}"


def have_cython() -> bool:
    try:
        importlib.import_module("Cython.Build")
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------------------- runs


def child(kind: str, groups: int, rounds: int) -> None:
    """Check (lean kinds), measure, print one JSON line."""
    path = HotPath()
    core = sys.modules[__name__]
    if kind == "compiled":
        core = importlib.import_module("lean_core")
        if not str(core.__file__).endswith(".so"):
            raise SystemExit(f"lean_core came from {core.__file__}, not the build")
    if kind != "product":
        problems = check(core, path)
        if problems:
            print("FAITHFULNESS CHECK FAILED:\n  " + "\n  ".join(problems[:20]))
            sys.exit(1)
        result = Lean(core, path).measure(groups, rounds)
    else:
        result = Product(path).measure(groups, rounds)
    print("RESULT " + json.dumps({"us_per_job": result, "file": str(core.__file__)}))


def run_child(kind: str, args: argparse.Namespace, build_dir: Path | None) -> dict[str, Any]:
    env = dict(os.environ)
    if kind == "compiled" and build_dir is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            [str(build_dir)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    cmd = [sys.executable, __file__, "--child", kind, "--rounds", str(args.rounds),
           "--groups", str(args.groups)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        print(f"the {kind} run failed:\n{done.stdout}{done.stderr}")
        sys.exit(1)
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    return result


# ---------------------------------------------------------------------------- report


def print_table(runs: dict[str, dict[str, float]]) -> None:
    names = list(runs)
    print(f"\n{'part':14s}" + "".join(f" {n + ' us/job':>20s}" for n in names)
          + "".join(f" {n + ' / product':>26s}" for n in names[1:]))
    for part in (*PARTS, "total"):
        line = f"{part:14s}" + "".join(f" {runs[n][part]:20.2f}" for n in names)
        line += "".join(f" {runs[n][part] / runs['product'][part]:26.2f}" for n in names[1:])
        print(line)
    p = runs["product"]
    print(f"product transaction = queue {p['queue']:.2f} (compiled_hot_path.py's queue part) "
          f"+ pack {p['pack']:.2f} (redis-py's pack_commands, as execute() does) us/job")
    print("total: the three parts in one loop; batcher and bookkeeping (0.5 us/job in "
          "compiled_hot_path.py) are in none of the variants")


def print_ratios(runs: dict[str, dict[str, float]]) -> None:
    print()
    product = runs["product"]["total"]
    for name in VARIANTS[1:]:
        if name in runs:
            ours = runs[name]["total"]
            print(f"RATIO {name} / product = {ours:.2f} / {product:.2f} = {ours / product:.2f}")
        else:
            print(f"RATIO {name} / product = n/a (not built)")


def save(runs: dict[str, dict[str, float]], note: str) -> list[Path]:
    names = list(VARIANTS)
    rows: list[tuple[Any, ...]] = [
        (part, *[round(runs[n][part], 3) if n in runs else "" for n in names])
        for part in (*PARTS, "total")]
    rows += [(part, round(runs["product"][part], 3), "", "") for part in ("queue", "pack")]
    rows.append(("note", note, "", ""))
    header = ("part", *[n.replace(" ", "_") + "_us_per_job" for n in names])
    csv_path = write_csv("lean_hot_path.csv", header, rows)
    return [csv_path, plot("lean_hot_path.png", lambda plt: _figure(plt, runs))]


def _figure(plt: Any, runs: dict[str, dict[str, float]]) -> None:
    parts = [*PARTS, "total"]
    names = list(runs)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(names)
    colours = {"product": "gray", "lean python": "tab:orange", "lean compiled": "tab:blue"}
    for k, name in enumerate(names):
        ys = [i + (k - (len(names) - 1) / 2) * width for i in range(len(parts))]
        bars = ax.barh(ys, [runs[name][p] for p in parts], width, label=name,
                       color=colours[name])
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
    ax.set_yticks(range(len(parts)), parts)
    ax.invert_yaxis()
    ax.set_xlabel(f"CPU µs per job (groups of {GROUP}, best round; lower is better)")
    ax.legend()
    fig.suptitle("the worker's per-group hot path: product objects vs a columnar lean "
                 f"prototype; {machine_load()}", fontsize=9)


def main() -> None:
    args = parse_args()
    if args.child:
        child(args.child, args.groups, args.rounds)
        return
    print(f"bench/lean_hot_path.py: {machine_load()}")
    problems = check(sys.modules[__name__], HotPath())
    if problems:
        print("FAITHFULNESS CHECK FAILED:\n  " + "\n  ".join(problems[:20]))
        sys.exit(1)
    print("faithfulness check: passed (lean python; the compiled run checks again)")
    build_dir = args.keep.resolve() if args.keep else \
        Path(tempfile.mkdtemp(prefix="redbatch-lean-"))
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        built: Path | None = None
        if args.compiler == "cython" and not have_cython():
            note = ("Cython is not installed (.venv/bin/pip install cython): "
                    "lean compiled skipped")
        else:
            built, note = build(args.compiler, build_dir)
        print(note)
        runs = {"product": run_child("product", args, None)["us_per_job"],
                "lean python": run_child("lean", args, None)["us_per_job"]}
        if built is not None:
            runs["lean compiled"] = run_child("compiled", args, build_dir)["us_per_job"]
    finally:
        if args.keep is None:
            shutil.rmtree(build_dir, ignore_errors=True)
    print_table(runs)
    print(f"\nwrote {', '.join(str(p) for p in save(runs, note.splitlines()[0]))}")
    print_ratios(runs)


if __name__ == "__main__":
    main()
