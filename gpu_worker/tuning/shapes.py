"""Run time by (rows, padded length), measured at start for a model whose inputs vary in
length (the text model), so the length-bucketed batcher's deadline rule has real figures
from the first request on (gpu_worker/batching/shaping.py ``TokenLatencyEstimator``).

A calibration profile holds times by batch size, for fixed-shape inputs. A text batch's
time depends on its rows and its longest text, so the worker times a small grid of shapes
on its own model (a few seconds), seeds the estimator with them, and the estimator follows
the batches actually run from then on. The inputs are the handler's ``sample_input(cost)``
payloads, preprocessed as the pool would; the slots they used are cleared afterwards.
The warm-up runs on the longest input too (``longest_inputs``), so that on CUDA it learns
the device memory a full batch of the longest texts takes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
from redbatch.gpu_worker.device.runner import ModelRunner
from redbatch.gpu_worker.device.watchdog import Watch, unwatched
from redbatch.handlers.base import Handler, max_cost_of

#: Lengths timed, tokens (each capped at the model's longest input), and rows as shares of
#: the largest batch; a shape past the token budget is not timed (it never runs), but for
#: one row, which always may.
LENGTHS = (16, 64)
ROW_SHARES = (0.25, 1.0)


def shape_grid(max_rows: int, max_cost: int, max_tokens: int) -> list[tuple[int, int]]:
    """The (rows, length) shapes to time: 1, a quarter and all of ``max_rows`` rows by 16,
    64 and ``max_cost`` tokens, within ``max_tokens`` padded tokens (one row always)."""
    rows = sorted({1, *(max(1, round(share * max_rows)) for share in ROW_SHARES)})
    lengths = sorted({min(n, max_cost) for n in (*LENGTHS, max_cost)})
    return [(r, n) for r in rows for n in lengths if r == 1 or r * n <= max_tokens]


def measure_shapes(handler: Handler, runner: ModelRunner, slots: np.ndarray,
                   grid: list[tuple[int, int]],
                   watch: Watch = unwatched) -> dict[tuple[int, int], float]:
    """Seconds of one batch of each shape in ``grid`` (after an untimed run of it), each
    shape's runs inside ``watch``."""
    sample: Callable[[int], bytes] = handler.sample_input  # type: ignore[attr-defined]
    times: dict[tuple[int, int], float] = {}
    for rows, length in grid:
        payload = sample(length)
        for slot in range(rows):
            handler.preprocess(payload, "", {}, slots[slot])
        ids = list(range(rows))
        params: list[dict[str, object]] = [{} for _ in range(rows)]
        with watch(f"timing text batches of {rows} x {length} tokens"):
            runner.run(ids, params)
            start = time.perf_counter()
            runner.run(ids, params)
            times[(rows, length)] = time.perf_counter() - start
    slots[:max((r for r, _ in grid), default=0)] = 0
    return times


def can_measure(handler: Handler) -> bool:
    """Whether the handler makes inputs of a given cost (its optional ``sample_input``)."""
    return callable(getattr(handler, "sample_input", None))


@contextmanager
def longest_inputs(handler: Handler, slots: np.ndarray, rows: int) -> Iterator[None]:
    """Within it, the first ``rows`` slots hold the handler's longest input (its
    ``sample_input(max_cost)``), cleared after: the warm-up then runs what the largest
    batches cost, and learns their device memory per input, not that of empty slots.
    Does nothing for a handler whose inputs all cost the same."""
    cost = max_cost_of(handler)
    if cost is None or not can_measure(handler):
        yield
        return
    sample: Callable[[int], bytes] = handler.sample_input  # type: ignore[attr-defined]
    payload = sample(cost)
    rows = min(rows, len(slots))
    for slot in range(rows):
        handler.preprocess(payload, "", {}, slots[slot])
    try:
        yield
    finally:
        slots[:rows] = 0
