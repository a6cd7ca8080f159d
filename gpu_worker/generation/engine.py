"""The generation engine: one ``step()`` = schedule, execute, update (vLLM v1's shape).

    add(request) -> scheduler.waiting
    step():  plan = scheduler.schedule(now)           which tokens of which sequences
             logits = model.forward(chunks, cache)    one forward pass for all of them
             tokens = sample(...)                     per sequence, its own generator
             ended = scheduler.update(plan, tokens)   append, EOS / length, free blocks
             -> one StepOutput per sequence that got a token or ended

Single-threaded: the caller's loop calls ``add``, ``cancel`` and ``step`` in turn, so a
cancel takes effect before the next step computes anything (within one step). No Redis
here: token streams are written by the caller from the outputs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from redbatch.common.protocol import ErrorCode
from redbatch.gpu_worker.generation.blocks import BlockPool, blocks_for, blocks_for_memory
from redbatch.gpu_worker.generation.model import Chunk, KVCache, Llama, kv_bytes_per_token
from redbatch.gpu_worker.generation.sampling import SamplingParams, generator_for, sample
from redbatch.gpu_worker.generation.scheduler import (
    Finish,
    Scheduled,
    Scheduler,
    SchedulerConfig,
    SeqState,
)
from redbatch.gpu_worker.generation.text import TextStream


class GenerationError(ValueError):
    """A request the engine cannot take, with a stable error code."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """``kv_memory_bytes``: the KV cache's size (its blocks follow from it); ``block_size``:
    tokens a block; ``prefix_cache``: share cached prompt prefixes."""

    kv_memory_bytes: int = 256 * 2**20
    block_size: int = 16
    prefix_cache: bool = True
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one step did for one request: the new tokens and the text they complete (may
    be empty while a character or a possible stop string is incomplete); ``finish`` once it
    ended. ``cached_tokens``: prompt tokens found in the prefix cache."""

    request_id: str
    token_ids: list[int]
    text: str
    finish: Finish | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float | None = None


@dataclass(slots=True, eq=False)
class _Request:
    seq: SeqState
    params: SamplingParams
    stream: TextStream
    generator: torch.Generator | None


class Engine:
    """Continuous batching over one model and one KV cache (module docstring)."""

    def __init__(self, model: Llama, decode: Callable[[Sequence[int]], str],
                 config: EngineConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.model, self._decode, self.clock = model, decode, clock
        self.config = config = config or EngineConfig()
        cfg = model.cfg
        blocks = blocks_for_memory(config.kv_memory_bytes, kv_bytes_per_token(cfg),
                                   config.block_size)
        self.pool = BlockPool(blocks, config.block_size, config.prefix_cache)
        self.cache = KVCache(cfg, blocks, config.block_size)
        self.scheduler = Scheduler(config.scheduler, self.pool, cfg.eos_id)
        self._requests: dict[str, _Request] = {}
        self._pending: list[StepOutput] = []

    def add(self, request_id: str, prompt: Sequence[int], params: SamplingParams, *,
            interactive: bool = True, deadline_s: float | None = None,
            replay: Sequence[int] = ()) -> None:
        """Queue a request (``deadline_s`` on the engine's clock). GenerationError for a
        duplicate id, an empty prompt, or one that with ``max_new_tokens`` passes the
        model's context or the whole KV cache. ``replay``: answer tokens another worker
        already sent (a takeover): computed again with the prompt, counted against
        ``max_new_tokens``, their text not sent again."""
        total = len(prompt) + params.max_new_tokens
        if len(replay) >= params.max_new_tokens:
            raise GenerationError(ErrorCode.BAD_INPUT, "nothing left to generate")
        if request_id in self._requests:
            raise GenerationError(ErrorCode.BAD_INPUT, f"request {request_id!r} is running")
        if not prompt:
            raise GenerationError(ErrorCode.BAD_INPUT, "the prompt is empty")
        if total > self.model.cfg.context:
            raise GenerationError(ErrorCode.TOO_MANY_TOKENS, f"prompt + max_new_tokens = "
                                  f"{total} tokens, over the context of "
                                  f"{self.model.cfg.context}")
        if blocks_for(total, self.pool.block_size) > self.pool.blocks:
            raise GenerationError(ErrorCode.TOO_MANY_TOKENS, f"{total} tokens do not fit "
                                  f"the KV cache ({self.pool.blocks * self.pool.block_size} "
                                  "tokens)")
        seq = SeqState(request_id, [*prompt, *replay], params.max_new_tokens - len(replay),
                       interactive, self.clock(), deadline_s)
        stream = TextStream(self._decode, params.stop)
        for token in replay:
            stream.push(token)
        self._requests[request_id] = _Request(seq, params, stream, generator_for(params))
        self.scheduler.add(seq)

    def cancel(self, request_id: str) -> bool:
        """Stop a request now, its blocks freed; the next ``step`` reports it ``cancelled``.
        False when it is unknown or already ended."""
        seq = self.scheduler.finish(request_id, Finish.CANCELLED)
        if seq is not None:
            self._pending.append(self._ended(seq))
        return seq is not None

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending)

    def step(self) -> list[StepOutput]:
        """Schedule, execute and update once; the outputs of every request it touched."""
        outputs, self._pending = self._pending, []
        plan = self.scheduler.schedule(self.clock())
        outputs += [self._ended(seq) for seq in plan.finished]
        if not plan.scheduled:
            return outputs
        logits = self.model.forward([self._chunk(item) for item in plan.scheduled], self.cache)
        sampled = {item.seq.id: sample(logits[row], self._requests[item.seq.id].params,
                                       self._requests[item.seq.id].generator)
                   for row, item in enumerate(plan.scheduled) if item.samples}
        ended = set(self.scheduler.update(plan, sampled, self.clock()))
        for item in plan.scheduled:
            if item.samples:
                outputs.append(self._emit(item.seq, sampled[item.seq.id], item.seq in ended))
        return outputs

    def _chunk(self, item: Scheduled) -> Chunk:
        seq, bs = item.seq, self.pool.block_size
        assert seq.reservation is not None
        table, end = seq.reservation.table, item.start + item.count
        return Chunk(seq.tokens[item.start:end], item.start,
                     [table[p // bs] * bs + p % bs for p in range(end)])

    def _emit(self, seq: SeqState, token: int, ended: bool) -> StepOutput:
        request = self._requests[seq.id]
        text = request.stream.push(token) if token != self.model.cfg.eos_id else ""
        if request.stream.stopped and not ended:
            self.scheduler.finish(seq.id, Finish.STOP)
            ended = True
        if not ended:
            return StepOutput(seq.id, [token], text)
        out = self._ended(seq)
        return StepOutput(seq.id, [token], text + out.text, out.finish, out.prompt_tokens,
                          out.output_tokens, out.cached_tokens, out.ttft_s)

    def _ended(self, seq: SeqState) -> StepOutput:
        request = self._requests.pop(seq.id)
        ttft = None if seq.first_token_s is None else seq.first_token_s - seq.arrival_s
        cached = seq.reservation.cached_tokens if seq.reservation is not None else 0
        return StepOutput(seq.id, [], request.stream.flush(), seq.finish, len(seq.prompt),
                          len(seq.output), cached, ttft)
