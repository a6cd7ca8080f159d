"""Choosing each sequence's next token from its logits: greedy, or temperature and top-p
with the request's own seeded generator (so a seeded answer does not depend on which other
sequences share its steps)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Largest max_new_tokens, temperature a request may ask for.
MAX_NEW_TOKENS = 4096
MAX_TEMPERATURE = 4.0


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """``temperature`` 0 is greedy; ``top_p`` keeps the smallest set of likeliest tokens
    whose probability reaches it; ``seed`` makes sampling repeatable; ``stop``: strings that
    end the answer (not included in it)."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise ValueError(f"max_new_tokens must be 1 to {MAX_NEW_TOKENS}")
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be 0 to {MAX_TEMPERATURE}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be over 0 and at most 1")


def generator_for(params: SamplingParams) -> torch.Generator | None:
    """The request's generator (None when greedy): seeded by ``seed``, else at random."""
    if params.temperature == 0.0:
        return None
    g = torch.Generator()
    if params.seed is None:
        g.seed()
    else:
        g.manual_seed(params.seed)
    return g


def sample(logits: torch.Tensor, params: SamplingParams, g: torch.Generator | None) -> int:
    """The next token from one sequence's logits ``[vocab]``."""
    if g is None:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # probability of the likelier ones
        sorted_probs[before >= params.top_p] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=g))
