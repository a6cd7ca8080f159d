"""The generation worker: a chat model served over Redis with continuous batching
(PROTOCOL.md "Generation", docs/generation.md). The floor above two rooms: it drives the
engine of gpu_worker/generation/ (torch, no Redis) with the Redis I/O of
gpu_worker/streams/ (intake, results, token streams).

    worker.py    GenerationWorker: the reader, engine and writer threads
    writing.py   the writer's bookkeeping: chunks numbered, results of finished jobs
    metrics.py   tokens, time to first token, the running batch, KV blocks
"""

from redbatch.gpu_worker.generating.worker import GenerationWorker

__all__ = ["GenerationWorker"]
