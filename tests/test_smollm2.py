"""The chat model smollm2_135m against its reference, and the generation engine on it.

The reference's answers are in tests/data/smollm2_golden.json, written once by
tests/make_smollm2_golden.py with transformers on the same GGUF file; this file needs no
transformers. The model is loaded once for the module (parsing and dequantizing the file
costs seconds; handlers/smollm2.py and gpu_worker/generation/model.py cache it per process).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from redbatch.gpu_worker.generation.engine import (
    Engine,
    EngineConfig,
    GenerationError,
    StepOutput,
)
from redbatch.gpu_worker.generation.model import Chunk, KVCache, Llama, load_weights
from redbatch.gpu_worker.generation.sampling import SamplingParams
from redbatch.gpu_worker.generation.scheduler import Finish, SchedulerConfig
from redbatch.handlers import smollm2

GOLDEN = json.loads((Path(__file__).parent / "data" / "smollm2_golden.json").read_text())
CASES: list[dict[str, Any]] = GOLDEN["cases"]
LOGIT_TOLERANCE = 1e-3
SMALL_KV = 32 * 2**20      # 45 blocks of 16 tokens


@pytest.fixture(scope="module")
def model() -> Llama:
    torch.manual_seed(0)
    return Llama(load_weights())


def engine(model: Llama, clock: Any = None, kv: int = SMALL_KV, **scheduler: int) -> Engine:
    config = EngineConfig(kv_memory_bytes=kv, scheduler=SchedulerConfig(**scheduler))
    return Engine(model, smollm2.decode, config, **({"clock": clock} if clock else {}))


def drain(eng: Engine, limit: int = 400) -> dict[str, list[StepOutput]]:
    by_id: dict[str, list[StepOutput]] = {}
    for _ in range(limit):
        if not eng.has_work():
            return by_id
        for out in eng.step():
            by_id.setdefault(out.request_id, []).append(out)
    raise AssertionError("the engine did not finish")


def chat(text: str) -> list[int]:
    return smollm2.encode(smollm2.chat_prompt([{"role": "user", "content": text}]))


def test_the_tokenizer_and_chat_template_match_the_reference() -> None:
    for case in CASES:
        assert smollm2.chat_prompt(case["messages"]) == case["text"]
        assert smollm2.encode(case["text"]) == case["input_ids"], case["text"]
        assert smollm2.decode(case["output_ids"]) == case["output_text"]


def test_logits_match_the_reference(model: Llama) -> None:
    """Every case's prompt and answer in one forward pass: a prefill chunk each."""
    cache = KVCache(model.cfg, 256, 16)
    chunks, offset, rows = [], 0, []
    for case in CASES:
        tokens = case["input_ids"] + case["output_ids"]
        chunks.append(Chunk(tokens, 0, list(range(offset, offset + len(tokens)))))
        rows.append(offset)
        offset += len(tokens)
    logits = model.forward(chunks, cache, every_token=True)
    worst = 0.0
    for case, first in zip(CASES, rows, strict=True):
        for step in case["logits"]:
            row = logits[first + len(case["input_ids"]) - 1 + step["step"]]
            ours = row[step["ids"]]
            worst = max(worst, float((ours - torch.tensor(step["values"])).abs().max()))
            assert int(row.argmax()) == case["output_ids"][step["step"]]
    assert worst < LOGIT_TOLERANCE, worst


def test_greedy_answers_equal_the_reference_under_continuous_batching(model: Llama) -> None:
    """All 20 at once, a small step budget: prompts prefilled in chunks while earlier
    answers decode, the shared system prompt from the prefix cache."""
    eng = engine(model, kv=4 * SMALL_KV, max_step_tokens=96, max_running=20)
    params = SamplingParams(max_new_tokens=GOLDEN["max_new_tokens"])
    for i, case in enumerate(CASES):
        eng.add(str(i), case["input_ids"], params)
    outputs = drain(eng)
    for i, case in enumerate(CASES):
        got = outputs[str(i)]
        assert [t for o in got for t in o.token_ids] == case["output_ids"], i
        assert "".join(o.text for o in got) == case["output_text"]
        end = got[-1]
        assert end.finish is (Finish.STOP if case["output_ids"][-1] == 2 else Finish.LENGTH)
        assert end.output_tokens == len(case["output_ids"]) and end.ttft_s is not None
    assert sum(outputs[str(i)][-1].cached_tokens > 0 for i in range(len(CASES))) >= 10
    assert eng.pool.used == 0


def test_seeded_sampling_repeats_whoever_shares_the_steps(model: Llama) -> None:
    params = SamplingParams(max_new_tokens=4, temperature=0.9, top_p=0.9, seed=1234)
    alone = engine(model)
    alone.add("a", chat("Tell me a story."), params)
    crowd = engine(model)
    crowd.add("x", chat("What is 2 + 2?"), SamplingParams(max_new_tokens=2))
    crowd.add("a", chat("Tell me a story."), params)
    crowd.add("y", chat("Hi"), SamplingParams(max_new_tokens=4, temperature=1.0, seed=7))

    def tokens(eng: Engine) -> list[int]:
        return [t for o in drain(eng)["a"] for t in o.token_ids]

    assert tokens(alone) == tokens(crowd)


def test_a_stop_string_ends_the_answer_before_it(model: Llama) -> None:
    eng = engine(model)
    eng.add("a", chat("What is the capital of France?"), SamplingParams(
        max_new_tokens=16, stop=(" Paris",)))
    outs = drain(eng)["a"]
    assert "".join(o.text for o in outs) == "The capital of France is"
    assert outs[-1].finish is Finish.STOP


def test_cancel_stops_within_a_step_and_frees_its_blocks(model: Llama) -> None:
    eng = engine(model)
    eng.add("keep", chat("Count from 1 to 10."), SamplingParams(max_new_tokens=4))
    eng.add("stop", chat("Write a long essay."), SamplingParams(max_new_tokens=200))
    eng.step()
    eng.step()
    used = eng.pool.used
    assert eng.cancel("stop") and not eng.cancel("stop")
    assert eng.pool.used < used
    first = eng.step()
    assert [(o.request_id, o.finish) for o in first if o.finish] == [("stop", Finish.CANCELLED)]
    assert all(o.request_id == "keep" for o in first if not o.finish)
    rest = drain(eng)
    assert set(rest) == {"keep"} and rest["keep"][-1].finish is Finish.LENGTH


def test_a_deadline_ends_a_request_uncomputed(model: Llama) -> None:
    now = [100.0]
    eng = engine(model, clock=lambda: now[0])
    eng.add("late", chat("Hello"), SamplingParams(max_new_tokens=50), deadline_s=101.0)
    eng.step()
    now[0] = 101.0
    outs = eng.step()
    assert [(o.request_id, o.finish, o.output_tokens) for o in outs] == [
        ("late", Finish.DEADLINE, 1)]
    assert not eng.has_work() and eng.pool.used == 0


def test_requests_past_the_context_or_the_cache_are_refused(model: Llama) -> None:
    eng = engine(model)
    with pytest.raises(GenerationError, match="over the context"):
        eng.add("a", [1] * 8000, SamplingParams(max_new_tokens=400))
    with pytest.raises(GenerationError, match="do not fit the KV cache"):
        eng.add("b", [1] * 1000, SamplingParams(max_new_tokens=100))
    with pytest.raises(GenerationError, match="empty"):
        eng.add("c", [], SamplingParams())
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    assert not eng.has_work()
