"""What the generation writer holds: each job's tokens and the chunks numbered from them,
the jobs that ended, the answers to write; and the result of a finished job.

Pure bookkeeping: nothing here talks to Redis (the writer thread in worker.py sends what
this builds, through gpu_worker/streams/tokens.py and the result writer).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from redbatch.common.protocol import ErrorCode, Keys
from redbatch.common.protocol.generation import Chunk
from redbatch.gpu_worker.generation.engine import StepOutput
from redbatch.gpu_worker.generation.sampling import SamplingParams
from redbatch.gpu_worker.generation.scheduler import Finish
from redbatch.gpu_worker.streams.intake import Job
from redbatch.gpu_worker.streams.results import Answer, ResultWriter


@dataclass(slots=True, eq=False)
class Gen:
    """One generation job in the worker: its job, its tokens, what was sent of them."""

    job: Job
    keys: Keys
    prompt: list[int]
    params: SamplingParams
    replay: list[int] = field(default_factory=list)
    next_index: int = 1
    tokens: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    pending_tokens: list[int] = field(default_factory=list)
    pending_text: list[str] = field(default_factory=list)
    last: StepOutput | Chunk | None = None
    """Its last output once it ended (a Chunk: the stream already held its end)."""
    unsent: list[Chunk] = field(default_factory=list)
    """Chunks numbered and not yet in Redis: sent again as they are until they are."""
    closed: bool = False
    """Its last chunk is made."""
    cancel_sent: bool = False
    started_s: float = field(default_factory=time.monotonic)

    @property
    def rid(self) -> str:
        return self.job.request_id

    @property
    def token_key(self) -> str:
        return self.keys.tokens(self.rid)


@dataclass(frozen=True, slots=True)
class _Outcome:
    output: Any
    error: ErrorCode | None = None
    message: str = ""


@dataclass(slots=True)
class WriteState:
    """The writer thread's own: running requests, those ended, answers to write."""

    gens: dict[str, Gen] = field(default_factory=dict)
    ended: list[Gen] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)
    counted: set[str] = field(default_factory=set)
    """Request ids of answers that hold an in-flight place (refused by the engine)."""

    def take(self, kind: str, item: Any, writer: ResultWriter) -> None:
        if kind == "start":
            self.gens[item.rid] = item
        elif kind == "end":
            self.gens[item.rid] = item
            self.ended.append(item)
        elif kind == "answers":
            self.answers += item
        elif kind == "refused":
            gen, e = item
            self.gens.pop(gen.rid, None)
            self.counted.add(gen.rid)
            self.answers.append(writer.failed(gen.job, e.code, str(e)))
        elif kind == "step":
            for out in item:
                gen = self.gens.get(out.request_id)
                if gen is None:
                    continue
                gen.pending_tokens += out.token_ids
                gen.pending_text.append(out.text)
                if out.finish is not None:
                    gen.last = out
                    self.ended.append(gen)


def gen_chunk(gen: Gen) -> None:
    """Move what is pending into a new chunk (the last, once it ended), numbered now."""
    out = gen.last if isinstance(gen.last, StepOutput) else None
    if not gen.pending_tokens and not gen.pending_text and (out is None or gen.closed):
        return
    text = "".join(gen.pending_text)
    gen.tokens += gen.pending_tokens
    gen.text.append(text)
    chunk = Chunk(gen.next_index, gen.pending_tokens, text)
    if out is not None:
        gen.closed = True
        chunk = Chunk(gen.next_index, gen.pending_tokens, text, str(out.finish),
                      len(gen.prompt), len(gen.tokens), out.cached_tokens, _ms(out.ttft_s),
                      ErrorCode.INTERNAL.value if out.finish == Finish.ERROR else None)
    gen.unsent.append(chunk)
    gen.next_index += 1
    gen.pending_tokens, gen.pending_text = [], []


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def result_of(gen: Gen, writer: ResultWriter) -> Answer:
    """The job's result: the whole answer (PROTOCOL.md "Generation result")."""
    last = gen.last
    if isinstance(last, StepOutput):
        finish, cached, ttft = str(last.finish), last.cached_tokens, _ms(last.ttft_s)
    else:
        assert last is not None
        finish, cached, ttft = last.finish or "length", last.cached_tokens, last.ttft_ms
    if finish == Finish.ERROR:
        return writer.failed(gen.job, ErrorCode.INTERNAL, "the generation step failed")
    output = {"text": "".join(gen.text), "finish_reason": finish, "token_ids": gen.tokens,
              "prompt_tokens": len(gen.prompt), "completion_tokens": len(gen.tokens),
              "cached_tokens": cached, "ttft_ms": ttft}
    ran_ms = (time.monotonic() - gen.started_s) * 1000
    return writer.ran([gen.job], [_Outcome(output)], [0.0], ran_ms)[0]
