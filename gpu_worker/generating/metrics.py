"""The generation worker's own Prometheus series, on the worker's registry beside the
common ones of gpu_worker/metrics.py (docs/operations.md "Metrics and health").

  counters
  redbatch_generated_tokens_total                     answer tokens computed
  redbatch_prompt_tokens_total        kind            prompt tokens of started requests:
                                                      computed, or cached (prefix hits)
  redbatch_generation_steps_total                     engine steps that ran the model
  histograms, seconds
  redbatch_time_to_first_token_seconds                a request's first token, from its read
  redbatch_inter_token_seconds                        one decode step (each running
                                                      sequence waits one step a token)
  gauges
  redbatch_running_sequences                          in the running batch
  redbatch_waiting_sequences                          read, waiting for a place
  redbatch_kv_blocks                                  blocks of the KV cache (at start)
  redbatch_kv_blocks_used                             blocks held or cached-and-unfree

Recorded by the engine thread once per step, for the whole step (one observe per series),
never once per token.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from redbatch.gpu_worker.generation.engine import StepOutput

#: Time to first token: a queued prefill waits for the running batch's steps.
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: One decode step of the running batch: a few ms on a GPU, tens to hundreds on a CPU.
STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class GenerationMetrics:
    """The series above for one model, bound to its label once."""

    def __init__(self, registry: CollectorRegistry, model: str, kv_blocks: int) -> None:
        m = ["model"]
        self.generated = Counter("redbatch_generated_tokens_total", "Answer tokens computed.",
                                 m, registry=registry).labels(model)
        prompt = Counter("redbatch_prompt_tokens_total", "Prompt tokens of started requests: "
                         "computed, or found in the prefix cache (cached).", [*m, "kind"],
                         registry=registry)
        self.prompt_computed = prompt.labels(model, "computed")
        self.prompt_cached = prompt.labels(model, "cached")
        self.steps = Counter("redbatch_generation_steps_total", "Engine steps that ran the "
                             "model.", m, registry=registry).labels(model)
        self.ttft = Histogram("redbatch_time_to_first_token_seconds", "Time from reading a "
                              "generation job to its first token, s.", m,
                              buckets=TTFT_BUCKETS_S, registry=registry).labels(model)
        self.inter_token = Histogram("redbatch_inter_token_seconds", "Duration of one engine "
                                     "step that decoded (the time between two tokens of a "
                                     "running sequence), s.", m, buckets=STEP_BUCKETS_S,
                                     registry=registry).labels(model)
        self.running = Gauge("redbatch_running_sequences", "Sequences in the running batch.",
                             m, registry=registry).labels(model)
        self.waiting = Gauge("redbatch_waiting_sequences", "Generation jobs read and waiting "
                             "for a place in the running batch.", m,
                             registry=registry).labels(model)
        Gauge("redbatch_kv_blocks", "Blocks of the KV cache.", m,
              registry=registry).labels(model).set(kv_blocks)
        self.kv_used = Gauge("redbatch_kv_blocks_used", "KV cache blocks held by sequences "
                             "(or cached and not yet free).", m, registry=registry).labels(model)

    def step(self, outputs: Sequence[StepOutput], seconds: float, running: int,
             waiting: int, kv_used: int) -> None:
        """One engine step: its outputs and duration, then the batch and cache after it."""
        tokens = 0
        for out in outputs:
            tokens += len(out.token_ids)
            if out.finish is not None:
                self.prompt_cached.inc(out.cached_tokens)
                self.prompt_computed.inc(out.prompt_tokens - out.cached_tokens)
                if out.ttft_s is not None:
                    self.ttft.observe(out.ttft_s)
        if tokens:
            self.generated.inc(tokens)
            self.steps.inc()
            self.inter_token.observe(seconds)
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_used.set(kv_used)
