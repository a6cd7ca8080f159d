"""The keys of a request id once admitted, and every command that writes them (PROTOCOL.md
"Request ids are unique", "Results"): who owns the id (OwnerKeys), its answer (AnswerKeys:
the result key and its done list) and the reply lists answers are announced on (ReplyList).

As in rq's registries, each key family has one owning class, and this module is the only
one that writes those keys. The classes do not run commands themselves: each verb queues its
commands on the pipeline the caller gives (or runs them at once on a client), so a caller's
transaction and round trips stay as they are. Key names come from :class:`Keys`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import redis
from redbatch.common.protocol.admission import OWNER_TTL_PAD_MS, owner_ttl_ms
from redbatch.common.protocol.keys import Keys, Lane
from redbatch.common.protocol.lifecycle import owner_entry, owner_value


class OwnerKeys:
    """The owner keys of one model's request ids (``Keys.owner``), each naming the stream
    entry of the job that owns the id; see NOTE [ Request id owners ] in admission.py.

    Lifecycle: set at admission with its TTL (``owner_ttl_ms``: the job's budget plus
    OWNER_TTL_PAD_MS, at least as long as a result written within the budget lives), claimed
    when a worker reads an entry that did not come through the admission script
    (:meth:`claim`), freed once the result was read (:meth:`free`) and retaken by a retried
    dead letter (:meth:`retake`); else it expires. Writing the result does not touch it: one
    command per job less. The admission script
    sets it too, beside the checks it makes atomic with the XADD: that script is the
    protocol's text, which clients in any language send as it is, so it stays in admission.py.
    """

    def __init__(self, keys: Keys) -> None:
        self.keys = keys

    def claim(self, pipe: redis.Redis, request_id: str, entry_id: bytes, lane: Lane,
              budget_ms: int | None) -> None:
        """Queue a worker's claim of the id for the entry it read on ``lane``: SET NX GET
        of ``<entry id> <lane>`` (``owner_value``), with the admission TTL
        (``owner_ttl_ms(budget_ms)``). An owner already there is kept, and the reply names
        it; read the reply with :meth:`rival`."""
        pipe.set(self.keys.owner(request_id), owner_value(entry_id, lane), nx=True, get=True,
                 px=owner_ttl_ms(budget_ms))

    @staticmethod
    def rival(reply: object, entry_id: bytes) -> bytes | None:
        """The entry that owns the id instead of ``entry_id``, from :meth:`claim`'s reply;
        None when the claim holds: the id was free or already this entry's (a job taken
        over from a dead worker is the same entry; its owner value may or may not name the
        lane, as older writers left it). An owner key of another type (written by hand)
        replies with an error, and then the id counts as free rather than letting one odd
        key wedge the job."""
        if not isinstance(reply, bytes):
            return None
        owner = owner_entry(reply)
        return owner if owner != entry_id else None

    def free(self, pipe: redis.Redis, request_ids: Sequence[str]) -> None:
        """Queue one DEL of the ids' owner keys together with their answers (result key
        and done list): after the results were read, or before their dead letters are
        requeued. One command, so no id is ever free while its old result is readable.
        Queues nothing for no ids."""
        answers = AnswerKeys(self.keys)
        names = [name for rid in request_ids
                 for name in (*answers.names(rid), self.keys.owner(rid))]
        if names:
            pipe.delete(*names)

    def retake(self, pipe: redis.Redis, request_id: str, entry_id: bytes | str,
               lane: Lane) -> None:
        """Queue SET NX PX OWNER_TTL_PAD_MS naming a requeued entry (of ``lane``) as the
        id's owner. NX: a worker that read the entry first has claimed the id for it the
        same way."""
        pipe.set(self.keys.owner(request_id), owner_value(entry_id, lane), nx=True,
                 px=OWNER_TTL_PAD_MS)


class AnswerKeys:
    """The answer to one model's request ids: the result key (``Keys.result``, the msgpack
    ResultEnvelope) and the done list (``Keys.done``, a copy of that envelope pushed once
    the result is written, for one client to BLPOP: its wait is then one call; for a
    ``done_only`` job, the envelope's only copy, read without popping it). Written once
    by a worker (:meth:`write`); read by clients; deleted by a client that read it, with the
    id's owner (:meth:`OwnerKeys.free`), or expired."""

    def __init__(self, keys: Keys) -> None:
        self.keys = keys

    def names(self, request_id: str) -> tuple[str, str]:
        """The result key and the done list of ``request_id``."""
        return self.keys.result(request_id), self.keys.done(request_id)

    def write(self, pipe: redis.Redis, request_id: str, encoded: bytes, ttl_ms: int,
              token: bool = True, result_key: bool = True) -> list[str]:
        """Queue the result (SET NX GET PX) and, with ``token``, its done token (RPUSH of the
        same envelope, PEXPIRE), all living ``ttl_ms``. A job that names a reply list gets
        no token: its client waits on that list (PROTOCOL.md "Waiting for the result").
        Without ``result_key`` (a ``done_only`` job) the done list is the answer's only home:
        no SET. Returns ``"<command> <key>"`` per command queued, in order.

        NX: a job run twice (taken over from a stuck worker) keeps its first result, so a
        late write never changes what a client already read (a done-only job's readers take
        the list's first element, which a second run's push does not change). GET makes a
        key of another type planted there fail (WRONGTYPE) instead of passing for a first
        result. The token of a second run carries that run's envelope (a transaction cannot
        make the push depend on the SET); both answer the same entry."""
        result, done = self.names(request_id)
        # execute_command rather than set(): the same command, without redis-py's checks of
        # eleven keyword options on every job (``get`` tells its reply parser about GET).
        command = cast(Any, pipe).execute_command  # untyped in redis-py
        queued = []
        if result_key or not token:
            command("SET", result, encoded, "NX", "GET", "PX", ttl_ms, get=True)
            queued.append(f"SET {result}")
        if token:
            command("RPUSH", done, encoded)
            command("PEXPIRE", done, ttl_ms)
            queued += [f"RPUSH {done}", f"PEXPIRE {done}"]
        return queued

    def exists(self, pipe: redis.Redis, request_id: str) -> None:
        """Queue EXISTS of the id's result key (1 once it is written, 0 before)."""
        pipe.exists(self.keys.result(request_id))

    def read(self, r: redis.Redis, request_ids: Sequence[str]) -> list[bytes | None]:
        """The encoded results of ``request_ids``, in order (None: not written, or expired),
        in one MGET. Raises Redis errors as they come."""
        return cast(list[bytes | None], r.mget([self.keys.result(rid) for rid in request_ids]))

    def queue_read(self, pipe: redis.Redis, request_ids: Sequence[str]) -> None:
        """Queue the MGET of :meth:`read` on a pipeline (its reply: the same list)."""
        pipe.mget([self.keys.result(rid) for rid in request_ids])


class ReplyList:
    """A client's reply list (``Keys.reply``): workers push the request id of each answered
    job whose envelope names the list (:meth:`announce`); its client pops the ids
    (:meth:`pop`) and deletes the list when it is done (:meth:`delete`), or it expires."""

    def __init__(self, key: str) -> None:
        #: The list's key, as a job's ``reply_to`` names it.
        self.key = key

    def announce(self, pipe: redis.Redis, request_ids: Sequence[str],
                 ttl_ms: int) -> list[str]:
        """Queue one RPUSH of ``request_ids`` (in order) and PEXPIRE ``ttl_ms`` of the list.
        Returns ``"<command> <key>"`` per command queued, in order."""
        pipe.rpush(self.key, *request_ids)
        pipe.pexpire(self.key, ttl_ms)
        return [f"RPUSH {self.key}", f"PEXPIRE {self.key}"]

    def pop(self, r: redis.Redis, wait_s: float, most: int) -> list[str]:
        """Up to ``most`` ids in one BLMPOP, which waits up to ``wait_s`` only while the
        list is empty; [] when none came. Raises Redis errors as they come: a BLMPOP whose
        reply was lost has still taken its ids."""
        got = r.blmpop(wait_s, 1, self.key, direction="LEFT", count=most)
        if got is None:
            return []
        return [rid.decode() for rid in cast(list[Any], got)[1]]

    @staticmethod
    def pop_any(r: redis.Redis, lists: Sequence[ReplyList], wait_s: float,
                most: int) -> list[str]:
        """As :meth:`pop`, from the first of ``lists`` that holds ids, in one BLMPOP of them
        all (on a cluster, lists of one slot only)."""
        got = r.blmpop(wait_s, len(lists), *(each.key for each in lists), direction="LEFT",
                       count=most)
        if got is None:
            return []
        return [rid.decode() for rid in cast(list[Any], got)[1]]

    def delete(self, r: redis.Redis) -> None:
        """Delete the list (DEL)."""
        r.delete(self.key)
