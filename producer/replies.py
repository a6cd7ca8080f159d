"""Waiting in groups: one reply list per client and model (and partition), and one reader
for every wait. Past 400 lines: the reply lists' bookkeeping and the gathering wait that
reads them follow one NOTE, with partitions (several lists per model) in both.

NOTE [ Waiting in groups ]
  Every job a client submits names the client's reply list, ``Keys.reply(<client name>)``,
  in its ``reply_to``; the worker pushes the job's request id there once the result is
  written (PROTOCOL.md "Waiting for the result"). One reader per list, a daemon thread in
  Client and a task in AsyncClient, takes the ids in groups (BLMPOP with a count: it
  blocks only while the list is empty) and reads the results of the ids that someone
  waits for in one MGET per group. So N waits in one process hold one connection and
  cost two calls per group of finished jobs (about one group per worker flush), not one
  BLPOP and one GET each.

      submit ──> record the ids (before sending: an announcement can come back first)
      worker ──> RPUSH reply <id>
      reader ──> BLMPOP ids ─────┬─> waited for: MGET ──> each waiter's inbox
                                 └─> not (yet) waited for: marked finished
      wait   ──> finished: read at once; ours: an inbox, on the reply list; else wait.py

  Checking "finished" and registering an inbox happen under one lock with the reader's
  sorting of the ids it popped, so an id is either marked finished or handed to its
  waiter: never missed. The bookkeeping is bounded: the ids submitted naming the list
  (dropped once handed over or read, or SUBMITTED_KEPT_S after submitting, when their
  result has expired anyway), the ids finished that nobody waited for yet (as long), and
  the waits in progress. A client that only submits keeps ``rate x SUBMITTED_KEPT_S``
  ids. A wait for an id past that, or one the client did not submit, takes the
  per-request path (``wait.py``), which also serves ids of other clients.

  Failures:
  1. A wait's own clock: a waiter waits on its inbox, never on Redis, so its timeout
     holds whatever Redis does; the reader waits out lost connections (a short pause,
     then again).
  2. A BLMPOP whose reply a cut connection lost has still popped its ids; and a
     worker answers some jobs without announcing them (those it refuses as it reads them,
     dead letters). Every SWEEP_EVERY_S the reader also reads the result keys of the waits
     older than that and hands over the results found (as the scorer does: NOTE [ Redis
     going away ] in bulk.py); a wait for an id submitted that long ago or more reads its
     result key at once, as the per-request wait GETs first.
  3. A reply list of another type (planted): BLMPOP answers an error. From then on the
     reader polls the result keys of the waits every POLL_S (MGET), says so once in the
     log, and the client's new jobs name no reply list (a worker would dead-letter them
     ``undeliverable``); their waits take the per-request path.
  4. An announced id whose result key MGET finds empty is read with GET, so a result key
     of another type (planted) raises ResultUnreadable as in the per-request path.
  5. close(): the sync reader is a daemon thread, woken by closing the client's pool and
     joined; the async one is a task, cancelled. Neither keeps a process alive.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import redis
from redbatch.common.config import Settings, default_of
from redbatch.common.protocol import Keys, ResultEnvelope
from redbatch.producer.calls import Command, Inbox, Outcome, Pause, Pipelined, Receive, Steps
from redbatch.producer.errors import ResultTimeout, ResultUnreadable
from redbatch.producer.wait import (
    MIN_BLOCK_S,
    POLL_S,
    RECONNECT_PAUSE_S,
    WAIT_SLICE_S,
    DoneMoves,
    decode_result,
    reply_by,
    unreadable,
    wait_for_result,
)

logger = logging.getLogger(__name__)

#: Most ids taken from the reply list per BLMPOP.
POP_CHUNK = 256
#: Result keys per MGET.
READ_CHUNK = 256
#: How often, and past what age, waits are looked up by their result key, s (see the NOTE).
SWEEP_EVERY_S = 5.0
#: How long the ids a client submitted are remembered: the workers' default result TTL.
SUBMITTED_KEPT_S: float = default_of(Settings, "result_ttl_s")

_LOST = (redis.ConnectionError, redis.TimeoutError)


@dataclass(slots=True)
class _Waits:
    """The inboxes waiting for one request id, and since when (monotonic s)."""

    since: float
    inboxes: list[Inbox] = field(default_factory=list)


class ReplyWaits:
    """One client's reply list of one model: what was submitted naming it, what finished,
    who waits, and the reader's pass (:meth:`read_round`). Thread-safe; see the NOTE."""

    def __init__(self, keys: Keys, client_name: str) -> None:
        self.keys = keys
        #: The list's key, as the client's jobs name it in ``reply_to``.
        self.key = keys.reply(client_name)
        #: True once the list proved unusable (another type): the reader polls instead.
        self.polling = False
        self._lock = threading.Lock()
        self._mine: OrderedDict[str, float] = OrderedDict()  # id -> submitted, monotonic s
        self._finished: set[str] = set()
        self._waiting: dict[str, _Waits] = {}
        self._next_sweep = time.monotonic() + SWEEP_EVERY_S

    @property
    def remembered(self) -> int:
        """Ids remembered as submitted naming this list (finished or not)."""
        return len(self._mine)

    @property
    def finished(self) -> int:
        """Ids popped off the list that nobody has waited for yet."""
        return len(self._finished)

    @property
    def waiting(self) -> int:
        """Ids someone waits for on this list now."""
        return len(self._waiting)

    # ------------------------------------------------------------------ callers' side

    def record(self, ids: Iterable[str]) -> None:
        """Remember ids about to be submitted naming this list (before they are sent)."""
        now = time.monotonic()
        with self._lock:
            for rid in ids:
                self._mine[rid] = now
                self._mine.move_to_end(rid)  # oldest first, for _prune
            self._prune(now)

    def submitted(self, request_id: str) -> bool:
        """Whether ``request_id`` was submitted naming this list (and not forgotten yet)."""
        with self._lock:
            return request_id in self._mine

    def forget(self, ids: Iterable[str]) -> None:
        """Drop ids that were not queued after all (refused at submit)."""
        with self._lock:
            for rid in ids:
                self._mine.pop(rid, None)

    def enter(self, ids: Sequence[str], inbox: Inbox) -> tuple[list[str], list[str], list[str]]:
        """Register ``inbox`` for the ids awaited on this list. Returns those; the ids to
        read now: the finished ones (dropped from the bookkeeping) and those awaited that
        were submitted SWEEP_EVERY_S ago or more (item 2 of the NOTE); and the others (not
        submitted naming this list, or forgotten: to wait for per request)."""
        now = time.monotonic()
        waiting: list[str] = []
        read: list[str] = []
        other: list[str] = []
        with self._lock:
            for rid in ids:
                if rid in self._finished:
                    self._finished.discard(rid)
                    self._mine.pop(rid, None)
                    read.append(rid)
                elif rid in self._mine:
                    self._waiting.setdefault(rid, _Waits(now)).inboxes.append(inbox)
                    waiting.append(rid)
                    if now - self._mine[rid] >= SWEEP_EVERY_S:
                        read.append(rid)
                else:
                    other.append(rid)
        return waiting, read, other

    def leave(self, ids: Iterable[str], inbox: Inbox, forget: bool = False) -> None:
        """Unregister ``inbox`` from ``ids`` (its wait ended, whatever the outcome);
        ``forget``: the ids' results were read, drop them from the bookkeeping too."""
        with self._lock:
            for rid in ids:
                if forget:
                    self._mine.pop(rid, None)
                    self._finished.discard(rid)
                waits = self._waiting.get(rid)
                if waits is not None and inbox in waits.inboxes:
                    waits.inboxes.remove(inbox)
                    if not waits.inboxes:
                        del self._waiting[rid]

    def _prune(self, now: float) -> None:
        """Forget the ids submitted longer than SUBMITTED_KEPT_S ago (oldest first)."""
        oldest = now - SUBMITTED_KEPT_S
        while self._mine:
            rid, at = next(iter(self._mine.items()))
            if at > oldest:
                return
            self._mine.popitem(last=False)
            self._finished.discard(rid)

    # ------------------------------------------------------------------ the reader

    def read_round(self) -> Steps[None]:
        """One pass of the reader: take the ids announced (or, polling, look up every wait),
        hand over their results, and sweep (see the NOTE). A lost or late connection ends
        the pass after a short pause; other Redis errors reach the waits concerned."""
        try:
            if self.polling:
                yield Pause(POLL_S)
                yield from self._look(self._waited(0.0))
            else:
                yield from self._resolve((yield from self._pop()))
            yield from self._sweep()
        except _LOST:
            yield Pause(RECONNECT_PAUSE_S)

    def _pop(self) -> Steps[list[str]]:
        """Ids off the list: up to POP_CHUNK in one BLMPOP, which blocks up to a slice only
        while the list is empty."""
        # The reader's calls have no due time: a late reply dropped would lose its ids,
        # and no caller waits on the reader's clock (item 1 of the NOTE).
        try:
            got = yield Command(("BLMPOP", round(self._slice_s(), 3), 1, self.key, "LEFT",
                                 "COUNT", POP_CHUNK))
        except redis.ResponseError as e:
            self._no_list(e)
            return []
        return [] if got is None else [rid.decode() for rid in got[1]]

    def _slice_s(self) -> float:
        """How long the next BLMPOP blocks: up to the next sweep while anyone waits."""
        if not self._waiting:
            return WAIT_SLICE_S
        return max(MIN_BLOCK_S, min(WAIT_SLICE_S, self._next_sweep - time.monotonic()))

    def _no_list(self, e: redis.ResponseError) -> None:
        """The list cannot be popped (it holds another type): poll from now on."""
        logger.warning("cannot pop reply list %s (%s); polling the result keys of the "
                       "waiting requests every %g s instead, and new jobs name no reply "
                       "list", self.key, str(e)[:100], POLL_S)
        self.polling = True

    def _resolve(self, ids: list[str]) -> Steps[None]:
        """Hand over the results of the popped ids someone waits for; the rest are marked
        finished. An announced id whose key MGET finds empty is read with GET (item 4)."""
        wanted = self._sort_popped(ids)
        found = yield from self._read(wanted)
        self._hand_over(found)
        missing = [rid for rid in wanted if rid not in found]
        if missing:
            calls = tuple(Command(("GET", self.keys.result(rid))) for rid in missing)
            replies = yield Pipelined(calls, errors_as_replies=True)
            self._hand_over({rid: reply for rid, reply in zip(missing, replies, strict=True)
                             if reply is not None})

    def _sort_popped(self, ids: list[str]) -> list[str]:
        """The popped ids someone waits for; the others of this client's become finished."""
        with self._lock:
            wanted = [rid for rid in ids if rid in self._waiting]
            self._finished.update(rid for rid in ids
                                  if rid in self._mine and rid not in self._waiting)
        return wanted

    def _read(self, ids: Sequence[str]) -> Steps[dict[str, object]]:
        """The result keys of ``ids`` that hold something, by id, in one round trip of
        MGETs; an MGET refused (NOPERM...) is the outcome of its ids."""
        chunks = [ids[i:i + READ_CHUNK] for i in range(0, len(ids), READ_CHUNK)]
        if not chunks:
            return {}
        calls = tuple(Command(("MGET", *map(self.keys.result, chunk))) for chunk in chunks)
        replies = yield Pipelined(calls, errors_as_replies=True)
        found: dict[str, object] = {}
        for chunk, reply in zip(chunks, replies, strict=True):
            if isinstance(reply, redis.ResponseError):
                found.update(dict.fromkeys(chunk, reply))
            else:
                found.update((rid, raw) for rid, raw in zip(chunk, reply, strict=True)
                             if raw is not None)
        return found

    def _look(self, ids: Sequence[str]) -> Steps[None]:
        """Hand over the results of ``ids`` that are there (a sweep, or polling)."""
        self._hand_over((yield from self._read(ids)))

    def _sweep(self) -> Steps[None]:
        """Every SWEEP_EVERY_S, look up the waits older than that (item 2 of the NOTE)."""
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_EVERY_S
        yield from self._look(self._waited(SWEEP_EVERY_S))

    def _waited(self, age_s: float) -> list[str]:
        """The ids waited for at least ``age_s``."""
        since = time.monotonic() - age_s
        with self._lock:
            return [rid for rid, waits in self._waiting.items() if waits.since <= since]

    def _hand_over(self, found: dict[str, object]) -> None:
        """Give each waiter of an id found its outcome; the id is then forgotten (a later
        wait for it reads it per request). One whose waiters left meanwhile is finished."""
        with self._lock:
            handed = [(rid, self._waiting.pop(rid).inboxes, raw) for rid, raw in found.items()
                      if rid in self._waiting]
            for rid, _, _ in handed:
                self._mine.pop(rid, None)
            self._finished.update(rid for rid in found
                                  if rid in self._mine and rid not in self._waiting)
        for rid, inboxes, raw in handed:
            outcome = _outcome(rid, self.keys.result(rid), raw)
            for inbox in inboxes:
                inbox.deliver(rid, outcome)


def _outcome(request_id: str, key: str, raw: object) -> Outcome:
    """The outcome of a wait from what its result key gave: a result or an error."""
    if isinstance(raw, redis.ResponseError):
        return unreadable(request_id, key, raw) or raw
    if isinstance(raw, Exception):
        return raw
    try:
        return decode_result(request_id, key, raw)
    except ResultUnreadable as e:  # raised to the waiter, not here
        return e


class Gathering:
    """The wait of one ``as_completed`` call (``result`` and ``results`` are built on it):
    first one MGET reads the ids finished already and looks up those to await on the reply
    list that were submitted a while ago (see ReplyWaits.enter); then the others awaited
    there come as the reader hands them over, in the order they finish; then the ids not
    submitted naming the list are awaited one by one per request (``wait.py``). All within
    ``timeout_s``; :meth:`close` when done. With partitions (PROTOCOL.md "Partitions") the
    client has a reply list per partition (``waits``): each takes the ids submitted naming
    it; the others are read at the keys ``keys_of`` gives: those of each partition the id
    may be in, newest partition count first."""

    def __init__(self, waits: Sequence[ReplyWaits], keys_of: Callable[[str], list[Keys]],
                 ids: Sequence[str], timeout_s: float, inbox: Inbox,
                 deadline: float | None = None) -> None:
        self.timeout_s = timeout_s
        #: When the wait ends (monotonic s): ``timeout_s`` from now, or from when the
        #: caller began (``deadline``, given).
        self.deadline = time.monotonic() + timeout_s if deadline is None else deadline
        self._inbox = inbox
        #: The client's: whether its user may BLMOVE (set by the face, see wait.py).
        self.moves = DoneMoves()
        #: The reply list each id awaited or read first was submitted naming.
        self._waits_of: dict[str, ReplyWaits] = {}
        pending: list[str] = []
        read: list[str] = []
        other = list(dict.fromkeys(ids))
        for one in waits:
            if not other:
                break
            entered, first, other = one.enter(other, inbox)
            pending += entered
            read += first
            self._waits_of.update(dict.fromkeys(entered + first, one))
        self._keys_of = keys_of
        self._pending = dict.fromkeys(pending)
        self._unread = read
        self._ready: deque[tuple[str, Outcome]] = deque()
        self._other = deque(other)

    def next(self) -> Steps[tuple[str, ResultEnvelope] | None]:
        """The next ``(request_id, result)``; None when every id was returned. Raises
        ResultTimeout by the deadline, ResultUnreadable for a result key that holds no
        result envelope, and Redis errors other than a lost or late connection."""
        if self._unread:
            yield from self._read_first()
        if self._ready:
            return _unwrap(*self._ready.popleft())
        while self._pending:
            got = yield Receive(self._inbox, self.deadline)
            if got is None:
                raise ResultTimeout(next(iter(self._pending)), self.timeout_s)
            if got[0] in self._pending:
                del self._pending[got[0]]
                return _unwrap(*got)
        if self._other:
            rid = self._other.popleft()
            keys = yield from self._locate(rid)
            result = yield from wait_for_result(rid, keys, self.timeout_s, self.deadline,
                                                self.moves)
            return rid, result
        return None

    def keys(self, request_id: str) -> Keys:
        """The keys of the partition the id's job is in (as far as the client knows)."""
        waits = self._waits_of.get(request_id)
        return waits.keys if waits is not None else self._keys_of(request_id)[0]

    def _locate(self, request_id: str) -> Steps[Keys]:
        """The partition of an id this client did not submit: when the partition count
        changed, the first candidate whose owner key exists (PROTOCOL.md "Partitions"),
        else the newest count's; one round trip then, none otherwise."""
        candidates = ([self._waits_of[request_id].keys] if request_id in self._waits_of
                      else self._keys_of(request_id))
        if len(candidates) == 1:
            return candidates[0]
        calls = tuple(Command(("EXISTS", keys.owner(request_id))) for keys in candidates)
        try:
            found = yield Pipelined(calls, errors_as_replies=True)
        except _LOST:
            return candidates[0]
        return next((k for k, n in zip(candidates, found, strict=True) if n == 1),
                    candidates[0])

    def _read_first(self) -> Steps[None]:
        """Read the ids to read first in one MGET per partition. A finished one not found
        is waited for per request; an awaited one found is taken off the reply list's
        waits."""
        ids, self._unread = self._unread, []
        by_part: dict[Keys, list[str]] = {}
        for rid in ids:
            by_part.setdefault(self.keys(rid), []).append(rid)
        for keys, group in by_part.items():
            try:
                raws = yield Command(("MGET", *map(keys.result, group)), reply_by(self.deadline))
            except _LOST:
                raws = [None] * len(group)
            self._take_first(keys, group, raws)

    def _take_first(self, keys: Keys, ids: list[str], raws: Sequence[object]) -> None:
        taken = []
        for rid, raw in zip(ids, raws, strict=True):
            if raw is not None:
                self._ready.append((rid, _outcome(rid, keys.result(rid), raw)))
                if rid in self._pending:
                    del self._pending[rid]
                    taken.append(rid)
            elif rid not in self._pending:
                self._other.appendleft(rid)
        self._leave(taken, forget=True)

    def _leave(self, ids: list[str], forget: bool = False) -> None:
        """Unregister the inbox from ``ids`` on the reply list each was awaited on."""
        for waits in {self._waits_of[rid] for rid in ids}:
            waits.leave([rid for rid in ids if self._waits_of[rid] is waits], self._inbox,
                        forget)

    def close(self) -> None:
        """Unregister the ids still awaited (the caller stopped waiting)."""
        if self._pending:
            self._leave(list(self._pending))
            self._pending.clear()


def _unwrap(request_id: str, outcome: Outcome) -> tuple[str, ResultEnvelope]:
    if isinstance(outcome, Exception):
        raise outcome
    return request_id, outcome

