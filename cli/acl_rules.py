"""Least-privilege Redis ACL users for the two roles that use redbatch's keys.

NOTE [ ACL roles ]
  Redis 7 selectors bind commands to key patterns: ``(+blpop ~K)`` allows BLPOP on K
  and nothing else there. Every pattern comes from :class:`Keys` (a key built with a
  placeholder id whose tail becomes ``*``), so the rules follow the protocol, and one
  user may serve several models (each model adds its own patterns). A key that lives in
  each partition (PROTOCOL.md "Partitions") has two patterns: partition 0's (tag ``{M}``)
  and every other's (tag ``{M#[1-9]*}``), so the users hold for any partition count,
  raised later too; no other model's tag starts with ``M#`` (no name holds ``#``). The
  model-wide keys (partition count, workers) are partition 0's only.

  producer: call the protocol's functions (FCALL, FCALL_RO: no EVAL, no SCRIPT, no
    FUNCTION, so no Lua of its own; NOTE [ Functions, not scripts ] in
    common/protocol/functions.py). Redis checks a function's commands against the caller's
    rules, so it also holds what they run: admission (HMGET of the limits hash, XLEN, GET/SET
    of the id's owner key, XADD to the lane stream and XDEL of a duplicate's entry; for a
    token bound HVALS, HGET, HGETALL, HSET and HDEL of the lane's charges, and TIME, XINFO
    GROUPS and XPENDING of its stream to recount them), status
    (GET of its result and owner, LINDEX of its done list, XINFO GROUPS and XPENDING of the
    lanes) and cancel (XADD of a cancel entry, XDEL of the job, SET of its owner). Besides:
    read a lane's backlog and bound (XLEN, HGET) and whether a worker serves it (XINFO
    GROUPS); wait for and read results (GET, MGET, EXISTS of result keys, BLPOP and LINDEX
    of a done list, BLPOP, LPOP and BLMPOP of a reply list) and delete what it has read
    (DEL of result, done, owner and reply keys, as ``redbatch score`` does); read which
    workers are alive (ZRANGE of the workers set, GET/MGET of their heartbeat records:
    ``Client.workers``, ``is_ready``). Generation (PROTOCOL.md "Token stream"): read token
    streams (XREAD, with BLOCK and COUNT, and XRANGE: ``Client.stream``, a resumed read),
    SET a stop key (``SET ... PX 600000``: cancel a running generation) and GET it. It may
    not write a result or a done token (no SET, RPUSH or BLMOVE there: a list moved onto
    another id's done or result key would plant an answer), write, trim, expire or delete a
    token stream (a forged token), change a bound, touch another model, or run any admin
    command.
  worker: everything ``redbatch worker`` sends: the consumer group (XGROUP CREATE,
    XREADGROUP, XCLAIM, XPENDING, XRANGE, XACK, XDEL, XINFO, the departed-consumer
    script), results in MULTI/EXEC (SET, RPUSH, PEXPIRE; WATCH and TYPE for the keys
    it checks first), the owner keys, dead letters (XADD), the fleet status keys
    (SET, ZADD, ZREM, ZREMRANGEBYSCORE, LPUSH, LPUSHX, LTRIM, DEL) and TIME; a generation
    worker's token streams (XADD of each chunk, PEXPIRE of its TTL, XRANGE of what a job
    taken over streamed already), its running jobs' stop keys, read only (MGET), and
    the charges of the entries it answers (HDEL). It may
    not set a stop key, change a bound, touch another model, or run any admin command.
  Both: what redis-py sends on connecting (HELLO, CLIENT SETINFO, SELECT for a
  database other than 0) and PING, no Pub/Sub channels. The worker also loads the
  function library (FUNCTION LOAD) and its own script (SCRIPT LOAD, SCRIPT EXISTS).

  Within its models a producer is trusted with every request: request ids are not
  bound to users, so it can read, await or delete another producer's result, read any
  token stream, stop any running generation, or take an id (SET of its owner key) first.
  PROTOCOL.md "Trust model" says so. A tenant (Role.TENANT) is a producer whose owner,
  result, done, token and stop keys are those of ids ``<tenant>:*`` only.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from urllib.parse import quote, urlsplit, urlunsplit

import redis
from redbatch.common.config import DEFAULT_REDIS_URL
from redbatch.common.protocol import PARTITION_SEP, Keys, Lane
from redbatch.common.protocol.functions import load_library
from redbatch.common.protocol.tenants import load_tenants_library, tenant_name, tenant_request_id
from redbatch.common.redis_io import is_cluster
from redis.cluster import RedisCluster

_ANY = "ANY0"
"""A valid request id, reply name and consumer name: the tail that becomes ``*``."""
_ANY_PART = 1
"""The partition whose number in a key's tag becomes ``[1-9]*``: any partition but 0."""

#: Keyless commands both roles send: redis-py's connection set-up. The last three are what
#: a Redis Cluster client reads on connecting: the slot map and the command table (where
#: each command's keys are); a plain client never sends them.
CONNECTION = ("hello", "ping", "select", "cluster|slots", "cluster|shards", "command")
#: Keyless commands of the worker alone: loading the function library and its own script.
LOADING = ("function|load", "script|load", "script|exists")
#: redis-py names itself with CLIENT SETINFO on connecting (it ignores a refusal); Redis
#: 7.2 added the subcommand, and 7.0 refuses a rule that names it.
SETINFO = "client|setinfo"
SETINFO_SINCE = (7, 2)
SELECTORS_SINCE = (7, 0)
_USER_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")


class Role(StrEnum):
    PRODUCER = "producer"
    WORKER = "worker"
    TENANT = "tenant"
    """A gateway's producer for one tenant (docs/gateway.md): a producer whose request ids,
    owner, result and done keys begin with ``<tenant>:``, with its holds set."""


@dataclass(frozen=True, slots=True)
class AclUser:
    """One user to create: its name, role, SHA-256 of its password, and its rules."""

    name: str
    role: Role
    password_sha256: str
    rules: tuple[str, ...]

    def setuser_args(self) -> list[str]:
        """Arguments of ``ACL SETUSER name ...``: the user starts from nothing (reset)."""
        return ["reset", "on", f"#{self.password_sha256}", "resetchannels", *self.rules]

    def setuser_line(self) -> str:
        """One ``ACL SETUSER`` command, as redis-cli reads it from its standard input."""
        return " ".join(["ACL", "SETUSER", self.name, *self.setuser_args()])

    def aclfile_line(self) -> str:
        """The same user as a line of an ACL file (``aclfile`` in redis.conf)."""
        return " ".join(["user", self.name, *self.setuser_args()])


def password_sha256(password: str) -> str:
    """Hex SHA-256 of the password: what ``#<hash>`` in an ACL rule stores."""
    return hashlib.sha256(password.encode()).hexdigest()


def user_name(name: str) -> str:
    """``name`` if it is a usable ACL user name (1-64 of [A-Za-z0-9_.-]), else ValueError."""
    if not _USER_RE.fullmatch(name):
        raise ValueError(f"invalid ACL user name {name!r:.80}: use 1-64 of [A-Za-z0-9_.-]")
    return name


def _glob(key: str) -> str:
    """``key`` as a literal Redis glob pattern, its placeholder tail made ``*`` and its
    placeholder partition (tag ``{M#1}``) any partition but 0 (``{M#[1-9]*}``)."""
    literal = re.sub(r"([*?\[\]\\])", r"\\\1", key)
    literal = literal.replace(f"{PARTITION_SEP}{_ANY_PART}}}", f"{PARTITION_SEP}[1-9]*}}", 1)
    return literal[:-len(_ANY)] + "*" if key.endswith(_ANY) else literal


def _partitions(models: Sequence[Keys]) -> list[Keys]:
    """Keys whose patterns cover every partition of ``models``: partition 0's and the
    placeholder partition's of each."""
    return [k.part(p) for k in models for p in (0, _ANY_PART)]


def _keys(*keys: str, mode: str = "~") -> list[str]:
    return [f"{mode}{_glob(k)}" for k in keys]


def _selector(commands: Iterable[str], patterns: Iterable[str]) -> str:
    return "(" + " ".join([*(f"+{c}" for c in commands), *patterns]) + ")"


def _connection(version: tuple[int, int]) -> list[str]:
    return [f"+{c}" for c in (*CONNECTION, *((SETINFO,) if version >= SETINFO_SINCE else ()))]


def producer_rules(models: Sequence[Keys], version: tuple[int, int],
                   ids: str = "") -> tuple[str, ...]:
    """Rules of a producer of ``models`` on Redis ``version`` (see NOTE [ ACL roles ]),
    its owner, result and done keys those of request ids that begin with ``ids``."""
    parts = _partitions(models)
    streams = [k.stream(lane) for k in parts for lane in Lane]
    limits = [k.limits() for k in parts]
    charges = [k.charges(lane) for k in parts for lane in Lane]
    owners = [k.owner(ids + _ANY) for k in parts]
    results = [k.result(ids + _ANY) for k in parts]
    dones = [k.done(ids + _ANY) for k in parts]
    replies = [k.reply(_ANY) for k in parts]
    tokens = [k.tokens(ids + _ANY) for k in parts]
    stops = [k.stop(ids + _ANY) for k in parts]
    fleets = [k.workers() for k in models]
    records = [k.worker(_ANY) for k in models]
    return (
        "-@all", *_connection(version), "+fcall", "+fcall_ro",
        "+time",  # the admission function's clock (a token bound's recount)
        # FCALL declares its keys read-write, so the functions' keys are the root's; what
        # a function may do with them is decided command by command by the selectors.
        *_keys(*streams, *limits, *charges, *owners, *results, *dones),
        _selector(("xadd", "xdel", "xlen", "xinfo|groups", "xpending"), _keys(*streams)),
        _selector(("hget", "hmget"), _keys(*limits, mode="%R~")),
        # Token bounds: admission sums, records and recounts the lanes' charges.
        _selector(("hvals", "hget", "hgetall", "hset", "hdel"), _keys(*charges)),
        _selector(("exists", "get", "set"), _keys(*owners)),
        # Read and delete what was read: one DEL frees an id's result, done list and owner.
        _selector(("get", "mget", "exists", "del"), _keys(*results, *dones, *owners, *replies)),
        _selector(("blpop", "lindex"), _keys(*dones)),
        _selector(("blpop", "lpop", "blmpop"), _keys(*replies)),
        # Generation: read token streams (never write one: no forged tokens), set and read
        # stop keys (cancel a running generation).
        _selector(("xread", "xrange"), _keys(*tokens, mode="%R~")),
        _selector(("set", "get"), _keys(*stops)),
        # Which workers are alive (Client.workers, is_ready): read only.
        _selector(("zrange",), _keys(*fleets, mode="%R~")),
        _selector(("mget", "get"), _keys(*records, mode="%R~")),
        _partitions_read(models),
    )


def tenant_rules(models: Sequence[Keys], version: tuple[int, int],
                 tenant: str) -> tuple[str, ...]:
    """Rules of the gateway's producer for ``tenant`` (Role.TENANT): a producer of request
    ids ``<tenant>:...`` only, which also calls the holds function on its own holds set
    (NOTE [ Tenant holds ] in common/protocol/tenants.py; its clock is TIME, which every
    producer holds)."""
    holds = [k.tenant(tenant_name(tenant)) for k in models]
    return (
        *producer_rules(models, version, tenant_request_id(tenant, "")),
        *_keys(*holds),
        _selector(("zadd", "zrem", "zremrangebyscore", "zcard", "pttl", "pexpire"),
                  _keys(*holds)),
    )


def _partitions_read(models: Sequence[Keys]) -> str:
    """Both roles read each model's partition count (PROTOCOL.md "Partitions"), read only."""
    return _selector(("lrange",), _keys(*(k.partitions() for k in models), mode="%R~"))


_STREAM_COMMANDS = ("xgroup|create", "xgroup|delconsumer", "xreadgroup", "xclaim", "xpending",
                    "xrange", "xack", "xdel", "xlen", "xinfo|groups", "xinfo|consumers",
                    "eval", "evalsha")
#: MGET: the owners of the admitted entries a read took (gpu_worker/streams/claims.py).
_ANSWER_COMMANDS = ("set", "get", "mget", "rpush", "pexpire")
_FLEET_COMMANDS = ("set", "del", "zadd", "zrem", "zremrangebyscore", "lpush", "lpushx", "ltrim",
                   "pexpire")
#: A generation worker's token streams: chunks, their TTL, and what a takeover reads.
_TOKEN_COMMANDS = ("xadd", "pexpire", "xrange")
#: Every key-bound command a worker may also use to check a key before it writes it.
_CHECKS = ("type", "watch", "exists", "pttl")


def worker_rules(models: Sequence[Keys], version: tuple[int, int]) -> tuple[str, ...]:
    """Rules of a worker of ``models`` on Redis ``version`` (see NOTE [ ACL roles ])."""
    parts = _partitions(models)
    streams = [k.stream(lane) for k in parts for lane in Lane]
    answers = [key for k in parts
               for key in (k.result(_ANY), k.done(_ANY), k.owner(_ANY), k.reply(_ANY))]
    tokens = [k.tokens(_ANY) for k in parts]
    stops = [k.stop(_ANY) for k in parts]
    charges = [k.charges(lane) for k in parts for lane in Lane]
    fleet = [*(key for k in models for key in (k.workers(), k.worker(_ANY))),
             *(k.recent() for k in parts)]
    return (
        "-@all", *_connection(version), *(f"+{c}" for c in LOADING),
        *(f"+{c}" for c in ("time", "multi", "exec", "discard", "unwatch")),
        _selector((*_STREAM_COMMANDS, *_CHECKS), _keys(*streams)),
        _selector(("xadd", "xlen", *_CHECKS), _keys(*(k.dlq() for k in parts))),
        _selector((*_ANSWER_COMMANDS, *_CHECKS), _keys(*answers)),
        _selector((*_FLEET_COMMANDS, *_CHECKS), _keys(*fleet)),
        _selector(_TOKEN_COMMANDS, _keys(*tokens)),
        _selector(("mget",), _keys(*stops, mode="%R~")),
        # A generation worker deletes each answered entry's charge (token bounds).
        _selector(("hdel",), _keys(*charges)),
        _partitions_read(models),
    )


def build_user(name: str, role: Role, password: str, models: Sequence[Keys],
               version: tuple[int, int] = SETINFO_SINCE, tenant: str | None = None) -> AclUser:
    """The user ``name`` of ``role`` for ``models`` on Redis ``version`` (major, minor), of
    ``tenant`` for Role.TENANT; ValueError for a bad name, no model, no tenant for a tenant's
    user, or a Redis without selectors (before 7.0)."""
    if not models:
        raise ValueError("name at least one model")
    if version < SELECTORS_SINCE:
        raise ValueError(f"Redis {version[0]}.{version[1]} has no ACL selectors: redbatch's "
                         "ACL users need Redis 7.0 or later")
    if role is Role.TENANT:
        if tenant is None:
            raise ValueError("a tenant's user needs --tenant")
        rules = tenant_rules(models, version, tenant)
    else:
        rules = (producer_rules if role is Role.PRODUCER else worker_rules)(models, version)
    return AclUser(user_name(name), role, password_sha256(password), rules)


def user_url(base_url: str | None, user: str, password: str | None) -> str:
    """``base_url`` (default: the default Redis URL) with ``user`` and ``password`` as its
    credentials, percent-encoded, and any other credentials dropped; ``***`` stands for
    a password that is None (one the caller must not show)."""
    parts = urlsplit(base_url or DEFAULT_REDIS_URL)
    host = parts.netloc.rpartition("@")[2]
    secret = "***" if password is None else quote(password, safe="")
    query = "&".join(p for p in parts.query.split("&")
                     if p and not p.split("=", 1)[0].lower().endswith(("password", "username")))
    return urlunsplit((parts.scheme, f"{quote(user, safe='')}:{secret}@{host}", parts.path,
                       query, ""))


def server_version(r: redis.Redis) -> tuple[int, int]:
    """(major, minor) of the Redis server ``r`` talks to (INFO server)."""
    major, minor, *_ = str(r.info("server")["redis_version"]).split(".")
    return int(major), int(minor)


def load_functions(r: redis.Redis) -> None:
    """Load the function library the producer calls (on a cluster, on every master), so
    that producers can submit before any worker has started. Needs an admin connection."""
    load_library(r)
    load_tenants_library(r)


def apply(r: redis.Redis, user: AclUser) -> None:
    """Create or replace ``user`` on the server (ACL SETUSER); needs an admin connection.
    Raises redis-py's errors (NoPermissionError for a connection that is not admin)."""
    # acl_setuser cannot express a selector with several commands and keys.
    args = ("ACL", "SETUSER", user.name, *user.setuser_args())
    if is_cluster(r):  # each node of a cluster keeps its own users: masters and replicas
        r.execute_command(*args, target_nodes=RedisCluster.ALL_NODES)  # type: ignore[no-untyped-call]
    else:
        r.execute_command(*args)  # type: ignore[no-untyped-call]
