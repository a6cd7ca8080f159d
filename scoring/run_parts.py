"""The partitions a scoring run's jobs went to (NOTE [ Scoring a partitioned model ] in
bulk.py): in each, the run's reply list and the owners and answers of its ids, and the
run's calls on them, one per partition at most, grouped in one pipeline."""

from __future__ import annotations

import redis
from redbatch.common.protocol import AnswerKeys, Keys, OwnerKeys, ReplyList
from redbatch.common.redis_io import is_cluster
from redbatch.scoring.pacing import MIN_WAIT_S


class Part:
    """One partition the run's jobs went to: its keys, the run's reply list there, and the
    owners and answers of its request ids."""

    __slots__ = ("answers", "keys", "owners", "reply")

    def __init__(self, keys: Keys, name: str) -> None:
        self.keys = keys
        self.reply = ReplyList(keys.reply(name))
        self.owners, self.answers = OwnerKeys(keys), AnswerKeys(keys)


class RunParts:
    """The run's partitions, by number; partition 0's from the start (its reply list is
    the one every job names before the client points it at its own partition's)."""

    def __init__(self, r: redis.Redis, keys: Keys, name: str) -> None:
        self._redis = r
        self._name = name
        self._cluster = is_cluster(r)
        self._turn = 0
        self.first = Part(keys.part(0), name)
        self._parts = {0: self.first}

    def of(self, keys: Keys) -> Part:
        """The run's side of the partition of ``keys``, made the first time."""
        part = self._parts.get(keys.partition)
        if part is None:
            part = self._parts[keys.partition] = Part(keys, self._name)
        return part

    def pop(self, wait_s: float, most: int) -> list[str]:
        """Up to ``most`` finished ids from the run's reply lists: one BLMPOP of them all on
        one Redis (or with one list); on a cluster, where they lie in different slots, of
        one list a call, in turn, each for its share of ``wait_s``."""
        lists = [part.reply for part in self._parts.values()]
        if len(lists) == 1:
            return lists[0].pop(self._redis, wait_s, most)
        if not self._cluster:
            return ReplyList.pop_any(self._redis, lists, wait_s, most)
        self._turn = (self._turn + 1) % len(lists)
        return lists[self._turn].pop(self._redis, max(MIN_WAIT_S, wait_s / len(lists)), most)

    def read(self, groups: dict[int, list[str]]) -> list[bytes | None]:
        """The results of ``groups`` (ids by partition), in their order: one MGET, or one
        per partition in a pipeline."""
        if len(groups) == 1:
            ((p, group),) = groups.items()
            return self._parts[p].answers.read(self._redis, group)
        pipe = self._redis.pipeline(transaction=False)
        for p, group in groups.items():
            self._parts[p].answers.queue_read(pipe, group)
        return [data for found in pipe.execute() for data in found]

    def free(self, groups: dict[int, list[str]]) -> None:
        """Delete the read answers and owners of ``groups``: one DEL per partition."""
        if len(groups) == 1:
            ((p, group),) = groups.items()
            self._parts[p].owners.free(self._redis, group)
            return
        pipe = self._redis.pipeline(transaction=False)
        for p, group in groups.items():
            self._parts[p].owners.free(pipe, group)
        pipe.execute()

    def delete(self) -> None:
        """Delete the run's reply lists: one DEL, or one per partition in a pipeline."""
        if len(self._parts) == 1:
            self.first.reply.delete(self._redis)
            return
        pipe = self._redis.pipeline(transaction=False)
        for part in self._parts.values():
            part.reply.delete(pipe)
        pipe.execute()
