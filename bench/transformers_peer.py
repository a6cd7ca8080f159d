"""transformers' own continuous batching as the peer of bench/generate_engine.py: the same
GGUF file (dequantized to float32 by transformers), the same seeded arrivals, the same
torch threads, greedy, EOS 2.

transformers (>= 5.24, with accelerate and gguf: the ``reference`` extra) is never a
dependency of redbatch; without it the engine bench skips this peer and says so. Its
``ContinuousBatchingManager`` generates in a thread of its own: the driver adds each
request at its arrival time (``add_request(..., streaming=True)``) and reads the outputs as
they come, so time to first token is timed as the engine's is, from the arrival. One
warm-up request runs before the clock starts.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol


class Timed(Protocol):
    id: str
    arrival_s: float
    prompt: list[int]
    max_new_tokens: int


def available() -> str | None:
    """None when transformers' continuous batching can run here, else why not."""
    try:
        import transformers  # noqa: F401
        from transformers.generation.configuration_utils import (  # noqa: F401
            ContinuousBatchingConfig,
        )
    except ImportError as e:
        return f"transformers is not installed ({e}): pip install 'redbatch[reference]'"
    return None


def load() -> Any:
    """The reference model on the same GGUF file, with paged SDPA attention."""
    import torch
    from redbatch.handlers.smollm2 import gguf_path
    from transformers import AutoModelForCausalLM
    logging.getLogger("transformers").setLevel(logging.ERROR)
    path = gguf_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32,
                                                 attn_implementation="paged|sdpa")
    return model.eval()


def _warm(manager: Any, prompt: list[int]) -> None:
    """One short request through the manager before the clock starts: its first one
    sizes its cache and runs torch's first calls (28 s here), which a server pays once."""
    manager.add_request(prompt, request_id="warm-up", max_new_tokens=2)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        out = manager.get_result(request_id="warm-up", timeout=1.0)
        if out is not None and out.is_finished():
            return
    raise RuntimeError("transformers' manager did not answer its warm-up in 300 s")


def drive(model: Any, jobs: list[Timed], max_running: int, max_batch_tokens: int,
          run: Any) -> Any:
    """Replay ``jobs``' arrivals into transformers' manager; fills and returns ``run``
    (tokens, span, CPU, TTFT; steps unknown: 0)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    config = GenerationConfig(max_new_tokens=max(j.max_new_tokens for j in jobs),
                              do_sample=False, eos_token_id=2, pad_token_id=2)
    batching = ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens,
                                        max_requests_per_batch=max_running)
    manager = model.init_continuous_batching(generation_config=config,
                                             continuous_batching_config=batching)
    manager.start()
    _warm(manager, jobs[0].prompt)
    pending, first, done = list(jobs), set(), 0
    by_id = {j.id: j for j in jobs}
    start, cpu = time.perf_counter(), time.process_time()
    try:
        while done < len(jobs):
            now = time.perf_counter() - start
            while pending and pending[0].arrival_s <= now:
                job = pending.pop(0)
                manager.add_request(job.prompt, request_id=job.id,
                                    max_new_tokens=job.max_new_tokens, streaming=True)
            wait = pending[0].arrival_s - now if pending else 0.05
            out = manager.get_result(timeout=max(0.001, min(wait, 0.05)))
            if out is None:
                continue
            if out.error:
                raise RuntimeError(f"transformers failed request {out.request_id}: {out.error}")
            at = time.perf_counter() - start
            if out.generated_tokens and out.request_id not in first:
                first.add(out.request_id)
                run.ttft_s.append(at - by_id[out.request_id].arrival_s)
            if out.is_finished():
                run.tokens += len(out.generated_tokens)
                done += 1
        run.span_s = time.perf_counter() - start - jobs[0].arrival_s
        run.cpu_s = time.process_time() - cpu
    finally:
        manager.stop(block=True, timeout=30)
    return run
