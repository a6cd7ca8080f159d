"""Reading a generation job's token stream (PROTOCOL.md "Token stream"), written once
without I/O like the rest of the client's logic (``calls.py``): ``Client.stream`` runs it
blocking, ``AsyncClient.stream`` awaits it.

The reader keeps the last entry id it saw and reads on from it (``XREAD ... STREAMS key
<last id>``), so a dropped connection costs nothing: the next read, on a new connection,
starts where the last one ended, with no gap and no duplicate. While no chunk comes it
looks at the job's result key: a job refused as it was read (``bad_input``, ...) has no
stream, only its error result, which is raised as JobFailed; a stream that stopped short of
its last chunk (its worker stopped past the point of recovery) ends with a chunk made from
the job's ok result, which is written after every chunk.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import redis
from redbatch.common.protocol import ErrorCode, Keys, ProtocolError, ResultEnvelope, Status
from redbatch.common.protocol.generation import Chunk, GenerationRequest
from redbatch.producer.calls import Command, Pause, Steps
from redbatch.producer.errors import REDIS_PY_ERRORS, ResultTimeout, client_error

#: Longest single XREAD block, ms (below every client's socket timeout).
BLOCK_MS = 1_000
#: Chunks one XREAD reads at most.
READ_COUNT = 512
#: Pause before reading again after a dropped connection, s.
RECONNECT_PAUSE_S = 0.2


def generation_payload(prompt: str | None, messages: Any, max_new_tokens: int,
                       temperature: float, top_p: float, seed: int | None,
                       stop: Any) -> bytes:
    """The JSON payload of a generation job (PROTOCOL.md "Generation payload"); the worker
    checks the values (``bad_input``), the client only builds it."""
    if (prompt is None) == (messages is None):
        raise ProtocolError(ErrorCode.BAD_INPUT, "give a prompt or messages, not both")
    return GenerationRequest(None if messages is None else tuple(messages), prompt,
                             max_new_tokens, temperature, top_p, seed,
                             tuple(stop or ())).to_json()


@dataclass(slots=True)
class TokenReader:
    """One job's token stream, read on from ``after`` until its last chunk."""

    keys: Keys
    request_id: str
    timeout_s: float
    deadline: float = 0.0
    after: str = "0-0"
    done: bool = False
    #: How much of the answer the chunks read so far held: tokens and characters.
    tokens_read: int = 0
    chars_read: int = 0
    #: Where the reader began: the chunks up to it were read by someone else.
    start: str = ""

    def __post_init__(self) -> None:
        self.deadline = self.deadline or time.monotonic() + self.timeout_s
        self.start = self.start or self.after

    def next(self) -> Steps[list[Chunk]]:
        """The next chunks (at least one, the last when ``done``). Raises ResultTimeout past
        the deadline, JobFailed for a job answered with an error and no stream."""
        key = self.keys.tokens(self.request_id)
        while True:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise ResultTimeout(self.request_id, self.timeout_s)
            block = max(1, int(min(BLOCK_MS, left * 1000)))
            try:
                reply = yield Command(("XREAD", "COUNT", READ_COUNT, "BLOCK", block,
                                       "STREAMS", key, self.after),
                                      due=time.monotonic() + block / 1000 + 5.0)
                chunks = _chunks(reply)
                if not chunks:
                    raw = yield Command(("GET", self.keys.result(self.request_id)))
                    result = _answered(raw)
                    if result is None:
                        continue
                    # Written once every chunk was: what the stream lacks, it never gets.
                    reply = yield Command(("XREAD", "COUNT", READ_COUNT, "STREAMS", key,
                                           self.after))
                    chunks = _chunks(reply) or [(yield from self._rest(result))]
            except (redis.ConnectionError, redis.TimeoutError):
                yield Pause(RECONNECT_PAUSE_S)  # a new connection reads on from `after`
                continue
            except REDIS_PY_ERRORS as e:
                raise client_error(e) from e
            self.after = f"0-{chunks[-1].index}"
            self.done = chunks[-1].finish is not None
            self._tally(chunks)
            return chunks

    def _tally(self, chunks: list[Chunk]) -> None:
        self.tokens_read += sum(len(c.token_ids) for c in chunks)
        self.chars_read += sum(len(c.text) for c in chunks)

    def _rest(self, result: ResultEnvelope) -> Steps[Chunk]:
        """The last chunk of a stream that stopped short (PROTOCOL.md "Token stream": a
        worker stopped past the point of recovery), made from the job's ok result: what
        the chunks up to ``after`` did not hold, and why the answer ended. A reader that
        began past the start counts the chunks before it first (one XRANGE)."""
        if self.start != "0-0":
            before = yield Command(("XRANGE", self.keys.tokens(self.request_id), "-",
                                    self.start))
            self._tally(_entries(before or []))
            self.start = "0-0"
        out = result.output
        return Chunk(int(self.after.split("-")[1]) + 1, list(out["token_ids"][self.tokens_read:]),
                     str(out["text"])[self.chars_read:], str(out["finish_reason"]),
                     int(out.get("prompt_tokens") or 0), int(out.get("completion_tokens") or 0),
                     int(out.get("cached_tokens") or 0), out.get("ttft_ms"))


def _chunks(reply: Any) -> list[Chunk]:
    """The chunks of an XREAD reply of one stream, parsed by redis-py or raw (a RESP2
    list, a RESP3 map; each entry ``(id, fields)``, fields a map or a flat list)."""
    if not reply:
        return []
    return _entries(next(iter(reply.values())) if isinstance(reply, dict) else reply[0][1])


def _entries(entries: Any) -> list[Chunk]:
    """The chunks of stream entries (an XRANGE reply, or one stream's of an XREAD), each
    ``(id, fields)``, fields a map or a flat list."""
    return [Chunk.read(entry_id, fields if isinstance(fields, dict) else
                       dict(zip(fields[::2], fields[1::2], strict=True)))
            for entry_id, fields in entries]


def _answered(raw: Any) -> ResultEnvelope | None:
    """The job's ok result, if it has one; raise the error of a job answered with an
    error (refused as it was read: no stream)."""
    if not isinstance(raw, bytes):
        return None
    result = ResultEnvelope.decode(raw)
    if result.status is not Status.OK:
        result.raise_for_error()
    return result
