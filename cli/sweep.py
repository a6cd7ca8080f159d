"""``redbatch sweep``: take back the memory a producer credential can pin.

NOTE [ What a producer can pin, and why a sweep ]
  The admission function sets owner keys, and the clients set stop keys, with the caller's
  own rights (Redis checks a function's commands against the caller's ACL), so a producer
  user holds ``SET`` on both patterns. Redis ACLs bind a command to key patterns, never to
  its arguments: nothing stops ``SET P:{M}:owner:x <10 MB>`` with no TTL (issue 28, item
  4; PROTOCOL.md "Trust model"). No value the protocol writes there is long, and every one
  expires, so an admin's sweep can tell the planted keys from real ones:

  - an owner key whose value is not an owner value (``<entry id> <lane>``, at most 64
    bytes) names no job: deleted;
  - an owner key without a TTL is given the longest idempotency window (a week);
  - a stop key longer than 64 bytes is set back to ``1`` (the generation stays stopped);
  - a stop key without a TTL is given the stop key's TTL (600 s).

  Each change is made by a short script that first checks the key still holds what was
  read (its length and first 64 bytes), so a key rewritten meanwhile is left alone. It runs
  as the admin (EVAL, SCAN): producers and workers have neither. ``--every`` repeats it, so
  a planted key lives at most that long.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import click
import redis
from redbatch.cli import options as o
from redbatch.cli.redis_target import connect_to
from redbatch.cli.signals import signals_stop
from redbatch.common.logs import setup_logging
from redbatch.common.protocol import parse_owner
from redbatch.common.protocol.admission import MAX_IDEMPOTENCY_WINDOW_MS
from redbatch.common.protocol.generation import STOP_TTL_MS, STOP_VALUE
from redbatch.common.protocol.keys import PARTITION_SEP, validate_name
from redbatch.common.redis_io import REDIS_ERRORS

logger = logging.getLogger(__name__)

Kind = Literal["owner", "stop"]
Action = Literal["delete", "expire", "shrink"]

#: Longest value the protocol writes into an owner or stop key, bytes (an owner value is
#: under 50: a 20-digit entry id, a lane and ``cancel``).
MAX_VALUE_BYTES = 64
#: The TTL a key of each kind gets when it has none, ms.
TTL_MS: dict[Kind, int] = {"owner": MAX_IDEMPOTENCY_WINDOW_MS, "stop": STOP_TTL_MS}
#: Keys read and mended per round trip.
BATCH = 500

# KEYS[1]: the key; ARGV: action, length read, first bytes read, TTL ms, stop value.
# The key is changed only while it still holds what the sweep read.
MEND_SCRIPT = f"""\
if redis.call('TYPE', KEYS[1])['ok'] ~= 'string'
   or redis.call('STRLEN', KEYS[1]) ~= tonumber(ARGV[2])
   or redis.call('GETRANGE', KEYS[1], 0, {MAX_VALUE_BYTES - 1}) ~= ARGV[3] then
  return 0
end
if ARGV[1] == 'delete' then return redis.call('DEL', KEYS[1]) end
if ARGV[1] == 'shrink' then
  local left = redis.call('PTTL', KEYS[1])
  if left < 1 or left > tonumber(ARGV[4]) then left = tonumber(ARGV[4]) end
  redis.call('SET', KEYS[1], ARGV[5], 'PX', left)
  return 1
end
return redis.call('PEXPIRE', KEYS[1], ARGV[4], 'NX')
"""


def decide(kind: Kind, length: int, head: bytes, ttl_ms: int) -> Action | None:
    """What the sweep does to a key of ``kind`` holding ``length`` bytes that begin with
    ``head``, whose PTTL is ``ttl_ms`` (-1: none); None: it is left as it is."""
    if kind == "owner" and (length > MAX_VALUE_BYTES or parse_owner(head) is None):
        return "delete"
    if kind == "stop" and length > MAX_VALUE_BYTES:
        return "shrink"
    return "expire" if ttl_ms == -1 else None


@dataclass
class Tally:
    """What one pass found and did, by kind of key."""

    scanned: dict[str, int] = field(default_factory=lambda: {"owner": 0, "stop": 0})
    deleted: dict[str, int] = field(default_factory=lambda: {"owner": 0})
    shrunk: dict[str, int] = field(default_factory=lambda: {"stop": 0})
    expiry_set: dict[str, int] = field(default_factory=lambda: {"owner": 0, "stop": 0})

    def count(self, kind: Kind, action: Action) -> None:
        """Count one key mended."""
        {"delete": self.deleted, "shrink": self.shrunk,
         "expire": self.expiry_set}[action][kind] += 1


def patterns(prefix: str, models: Sequence[str]) -> Iterator[tuple[Kind, str]]:
    """SCAN patterns of the owner and stop keys of ``models`` (every model when empty), in
    every partition (``P:{M}:...`` and ``P:{M#p}:...``)."""
    tags = [f"{{{m}}}" for m in models] + [f"{{{m}{PARTITION_SEP}[1-9]*}}" for m in models]
    kinds: tuple[Kind, ...] = ("owner", "stop")
    for kind in kinds:
        for tag in tags or ["{*}"]:
            yield kind, f"{prefix}:{tag}:{kind}:*"


def sweep(r: redis.Redis, prefix: str, models: Sequence[str], dry_run: bool = False) -> Tally:
    """One pass over the owner and stop keys of ``models``; what it found and mended."""
    tally = Tally()
    for kind, pattern in patterns(prefix, models):
        batch: list[bytes] = []
        for key in r.scan_iter(match=pattern, count=1000, _type="string"):
            batch.append(key)
            if len(batch) >= BATCH:
                _mend(r, kind, batch, tally, dry_run)
                batch = []
        if batch:
            _mend(r, kind, batch, tally, dry_run)
    return tally


def _mend(r: redis.Redis, kind: Kind, keys: list[bytes], tally: Tally, dry_run: bool) -> None:
    """Read ``keys`` (one round trip), then mend those that need it (one more)."""
    pipe = r.pipeline(transaction=False)
    for key in keys:
        pipe.strlen(key)
        pipe.getrange(key, 0, MAX_VALUE_BYTES - 1)
        pipe.pttl(key)
    read = pipe.execute(raise_on_error=False)
    mends, sent = r.pipeline(transaction=False), []
    for i, key in enumerate(keys):
        length, head, ttl_ms = read[3 * i:3 * i + 3]
        if not (isinstance(length, int) and isinstance(head, bytes) and isinstance(ttl_ms, int))\
                or ttl_ms == -2:
            continue  # gone or retyped since the scan
        tally.scanned[kind] += 1
        action = decide(kind, length, head, ttl_ms)
        if action is not None and dry_run:
            tally.count(kind, action)
        elif action is not None:
            mends.execute_command(  # type: ignore[no-untyped-call]
                "EVAL", MEND_SCRIPT, 1, key, action, length, head, TTL_MS[kind], STOP_VALUE)
            sent.append(action)
    if sent:
        for action, changed in zip(sent, mends.execute(raise_on_error=False), strict=True):
            if changed == 1:
                tally.count(kind, action)


@click.command()
@o.together(o.REDIS(), o.PREFIX(), o.LOG_LEVEL())
@click.option("--model", "models", multiple=True, callback=lambda c, p, v: [
    _model(m) for m in v], help="A model whose keys to sweep (again for more) [default: every "
                                "model under the prefix].")
@click.option("--every", type=click.FloatRange(min=1), default=None, metavar="SECONDS",
              help="Sweep again every SECONDS until stopped (SIGINT, SIGTERM); a pass "
                   "Redis fails is logged and tried again then.")
@click.option("--dry-run", is_flag=True, default=False,
              help="Count what would be mended, change nothing.")
def sweep_command(models: list[str], every: float | None, dry_run: bool,
                  **options: Any) -> None:
    """Mend the owner and stop keys a producer may have planted (run as the Redis admin).

    Owner keys that hold no owner value are deleted, stop keys over 64 bytes set back to 1,
    and keys of both kinds without a TTL given one (a week, 600 s). Prints one JSON line a
    pass: the keys scanned and mended, by kind. See PROTOCOL.md "Trust model".
    """
    setup_logging(options["log_level"])
    r = connect_to(o.url_or_default(options), options["prefix"])
    stopped = threading.Event()
    with signals_stop(stopped.set, stopped.set):
        while True:
            try:
                tally = sweep(r, options["prefix"], models, dry_run)
                click.echo(json.dumps({"dry_run": dry_run, **asdict(tally)}))
            except REDIS_ERRORS as e:
                if every is None:
                    raise  # one pass: the group's one line, exit 1
                logger.warning("sweep: Redis not reachable (%s); again in %g s",
                               type(e).__name__, every)
            if every is None or stopped.wait(every):
                return


def _model(name: str) -> str:
    """A --model value checked as a model name (one line if it is not one)."""
    try:
        return validate_name(name)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


sweep_command.name = "sweep"
