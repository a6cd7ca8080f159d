"""The per-step generation scheduler: which tokens of which sequences the next step computes.

Pure: no torch, no I/O, and the clock is injected (``schedule(now)``, ``update(.., now)``).
Called by the engine's busy loop once a step (gpu_worker/generation/engine.py):

1. **Deadlines**: a sequence, waiting or running, whose deadline has come is finished
   (``deadline``) and never computed again.
2. **Decodes first**: every running sequence past its prompt gets its one next token, so a
   long prompt arriving never stalls the running answers.
3. **Chunked prefill**: sequences still reading their prompt get what is left of the
   step's token budget (``max_step_tokens``), the interactive lane first, a chunk a step.
4. **Admission**: waiting sequences, the interactive lane first and in arrival order within
   a lane, start while the budget, ``max_running`` and the KV blocks allow. A sequence is
   admitted only with blocks for its prompt plus ``max_new_tokens`` (gpu_worker/generation/
   blocks.py: never evicts), starting after its prompt's longest cached prefix. A head that
   does not fit waits, and nothing behind it jumps it (FIFO, no starvation of long prompts).

A step's budget is at least ``max_running`` tokens, so the decodes always fit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from redbatch.gpu_worker.generation.blocks import BlockPool, Reservation


class Finish(StrEnum):
    """Why a sequence ended (the last entry of its token stream says it)."""

    STOP = "stop"            # EOS or a stop string
    LENGTH = "length"        # max_new_tokens reached
    CANCELLED = "cancelled"
    DEADLINE = "deadline"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """``max_step_tokens``: tokens one step computes, at most (decodes and prefill chunks
    together); ``max_running``: sequences in the running batch, at most."""

    max_step_tokens: int = 256
    max_running: int = 32

    def __post_init__(self) -> None:
        if self.max_running < 1 or self.max_step_tokens < self.max_running:
            raise ValueError("need max_running >= 1 and max_step_tokens >= max_running, so "
                             "that every running decode fits in a step")


@dataclass(slots=True, eq=False)
class SeqState:
    """One request's generation state. ``computed``: its tokens whose K/V is cached."""

    id: str
    prompt: list[int]
    max_new_tokens: int
    interactive: bool = True
    arrival_s: float = 0.0
    deadline_s: float | None = None
    output: list[int] = field(default_factory=list)
    computed: int = 0
    reservation: Reservation | None = None
    first_token_s: float | None = None
    finish: Finish | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def decoding(self) -> bool:
        return self.computed >= len(self.prompt)


@dataclass(frozen=True, slots=True)
class Scheduled:
    """``seq``'s tokens ``start .. start + count`` are computed this step; ``samples``:
    the step ends at its last known token, so its next token is sampled."""

    seq: SeqState
    start: int
    count: int
    samples: bool


@dataclass(frozen=True, slots=True)
class StepPlan:
    scheduled: list[Scheduled]
    finished: list[SeqState]     # ended before computing (deadline)

    @property
    def tokens(self) -> int:
        return sum(s.count for s in self.scheduled)


class Scheduler:
    """Waiting and running sequences, and the plan of each step (module docstring)."""

    def __init__(self, config: SchedulerConfig, pool: BlockPool, eos_id: int) -> None:
        self.config, self.pool, self.eos_id = config, pool, eos_id
        self.waiting: list[SeqState] = []
        self.running: list[SeqState] = []

    def add(self, seq: SeqState) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, now: float) -> StepPlan:
        """The next step's work (module docstring, rules 1-4)."""
        finished = [self._finish(s, Finish.DEADLINE) for s in self.waiting + self.running
                    if s.deadline_s is not None and now >= s.deadline_s]
        budget = self.config.max_step_tokens
        plan = [Scheduled(s, s.length - 1, 1, True) for s in self.running if s.decoding]
        budget -= len(plan)
        for s in _by_lane(s for s in self.running if not s.decoding):
            if budget <= 0:
                break
            plan.append(self._chunk(s, budget))
            budget -= plan[-1].count
        for s in _by_lane(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_running:
                break
            if not self._admit(s):
                break
            plan.append(self._chunk(s, budget))
            budget -= plan[-1].count
        return StepPlan(plan, finished)

    def _admit(self, seq: SeqState) -> bool:
        reservation = self.pool.reserve(seq.prompt, len(seq.prompt) + seq.max_new_tokens)
        if reservation is None:
            return False
        seq.reservation, seq.computed = reservation, reservation.cached_tokens
        self.waiting.remove(seq)
        self.running.append(seq)
        return True

    @staticmethod
    def _chunk(seq: SeqState, budget: int) -> Scheduled:
        count = min(len(seq.prompt) - seq.computed, budget)
        return Scheduled(seq, seq.computed, count, seq.computed + count == len(seq.prompt))

    def update(self, plan: StepPlan, sampled: Mapping[str, int], now: float) -> list[SeqState]:
        """Record a computed step: each sampled token appended to its sequence. Returns the
        sequences that ended (``length``, or ``stop`` at EOS), their blocks released."""
        ended = []
        for item in plan.scheduled:
            seq = item.seq
            if seq.finish is not None:  # cancelled while the step ran
                continue
            seq.computed = item.start + item.count
            assert seq.reservation is not None
            self.pool.register(seq.reservation, seq.tokens[:seq.computed])
            if not item.samples:
                continue
            token = sampled[seq.id]
            seq.output.append(token)
            if seq.first_token_s is None:
                seq.first_token_s = now
            if token == self.eos_id:
                ended.append(self._finish(seq, Finish.STOP))
            elif len(seq.output) >= seq.max_new_tokens:
                ended.append(self._finish(seq, Finish.LENGTH))
        return ended

    def finish(self, seq_id: str, reason: Finish) -> SeqState | None:
        """End a sequence now (cancel, a stop string, an error); None if it is unknown or
        already ended."""
        for seq in self.waiting + self.running:
            if seq.id == seq_id:
                return self._finish(seq, reason)
        return None

    def _finish(self, seq: SeqState, reason: Finish) -> SeqState:
        seq.finish = reason
        if seq in self.waiting:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
        if seq.reservation is not None:
            self.pool.release(seq.reservation)
        return seq


def _by_lane(seqs: Iterable[SeqState]) -> Sequence[SeqState]:
    """Interactive first, arrival order within a lane (a stable sort keeps it)."""
    return sorted(seqs, key=lambda s: (not s.interactive, s.arrival_s))
