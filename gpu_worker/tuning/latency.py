"""The default latency budget: the largest batch that costs no tail latency against batch 1.

Batching buys throughput with latency: a job waits for its batch to fill and for the
batch before it to finish, and a large batch takes longer. How much that costs depends
on the shape of the latency table: on a GPU a batch of 64 may take barely longer than
one image, so batching only shortens the queue; on a CPU whose time grows almost
linearly with the batch, a large batch adds latency and little capacity.

The rule (docs/tuning.md "The default latency budget"): a max batch size is within the default
budget when a server running it, loaded to LOAD of its own capacity with Poisson
arrivals, has a p99 no worse than a batch-1 server of the same variant at LOAD of its
own capacity (within WITHIN_NOISE); the choice among those sizes is the usual one
(choosing.py: the smallest reaching PEAK_SHARE of the best throughput). The bound is a
set of sizes, not a p95 in ms: a p95 over a few runs can be one outlier (a first
compiled run of 3.7 s was seen), and a size may pass while a smaller one does not (a
compiled batch of 2 measured no faster than two batches of 1 here, while 4 was).

The p99s come from a small queue simulation, not a formula: a batch-1 server is an
M/D/c queue (about 11 service times at 80% load with one lane), but a batching
server's tail depends on the latency table, the max wait and the lanes. The arrivals
are one fixed pseudo-random sequence, scaled to each rate, so a table always gives
the same budget and two sizes are compared on the same arrivals.

The simulation reads the table through a fitted line, latency = a + c x batch size:
single sizes vary from calibration to calibration on a shared machine (a compiled
EfficientNet's batch of 4 took 31.8, 47.2 and 33.8 ms in three runs here), and
comparing raw rows flipped the budget between batch 1 and 4; the line pools every
size, and gave sizes 1, 2 and 4 for all three. Models on CPUs follow a line closely
(a few ms of fixed cost, then a cost per image); a GPU's flat start fits as a large a
and a small c, which admits large batches, as it should.

Pure: numpy and the profile's rows only.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np
from redbatch.gpu_worker.tuning.profile import Row

#: The load, as a share of each server's own capacity, at which the p99s are compared.
LOAD = 0.8
#: Simulated arrivals per p99 (the first tenth is warm-up); enough for a stable 99th
#: percentile, few enough that a whole calibration's tables take well under a second.
ARRIVALS = 20_000
SEED = 15
#: A size's p99 may exceed batch 1's by this factor and still count as no worse: the
#: tables it is simulated from vary more than that from run to run on a shared machine,
#: and a budget that flips between neighbouring sizes makes an unstable choice.
WITHIN_NOISE = 1.05


def _arrivals() -> np.ndarray:
    """Cumulative unit-rate exponential gaps: arrival times at 1 job per ms."""
    return np.cumsum(np.random.default_rng(SEED).exponential(1.0, ARRIVALS))


def fitted_line(rows: Sequence[Row]) -> tuple[float, float]:
    """``(a, c)``: batch latency ~ a + c x size (ms), least squares on relative error
    over every size measured, both terms at least 0. One size: flat."""
    sizes = np.array([r.batch_size for r in rows], dtype=float)
    ms = np.array([r.median_ms for r in rows])
    if len(rows) < 2:
        return float(ms[0]), 0.0
    weight = 1.0 / ms
    (a, c), *_ = np.linalg.lstsq(np.stack([weight, sizes * weight], axis=1),
                                 np.ones_like(ms), rcond=None)
    if c < 0:  # flatter than flat: a constant
        return float(np.average(ms, weights=weight ** 2)), 0.0
    if a < 0:  # through the origin
        return 0.0, float(np.sum(sizes * weight ** 2 * ms) / np.sum((sizes * weight) ** 2))
    return float(a), float(c)


def batch_latency(rows: Sequence[Row], padded: bool) -> np.ndarray:
    """Milliseconds a batch of k jobs takes by the fitted line, indexed by k (0 unused),
    up to the largest size measured; ``padded`` (a compiled model runs only the sizes it
    was compiled for): the next measured size's."""
    a, c = fitted_line(rows)
    sizes = np.array([r.batch_size for r in rows])
    ks = np.arange(int(sizes[-1]) + 1)
    if padded:
        ks = sizes[np.minimum(np.searchsorted(sizes, ks), len(sizes) - 1)]
    return np.asarray(a + c * ks, dtype=float)


def p99_at_load(latency_ms: np.ndarray, max_batch: int, max_wait_ms: float, lanes: int,
                load: float = LOAD) -> float:
    """p99 time in system (ms) of a server running batches of up to ``max_batch`` on
    ``lanes`` lanes at once, at ``load`` of its capacity (lanes x max_batch jobs per
    batch time)."""
    times = sojourns(latency_ms, max_batch, max_wait_ms, lanes, load)
    return float(np.percentile(times[len(times) // 10:], 99))


def sojourns(latency_ms: np.ndarray, max_batch: int, max_wait_ms: float, lanes: int,
             load: float) -> np.ndarray:
    """Each simulated job's time in system, ms, in arrival order. A lane that finds the
    queue empty waits up to ``max_wait_ms`` for its batch to fill, as the batcher does;
    one that finds jobs waiting takes up to ``max_batch`` of them at once."""
    rate = load * lanes * max_batch / latency_ms[max_batch]  # jobs per ms
    t = _arrivals() / rate
    n = len(t)
    sojourn = np.empty(n)
    free = [0.0] * lanes
    i = 0
    while i < n:
        lane_free = heapq.heappop(free)
        if t[i] >= lane_free:  # idle: wait for the batch to fill or the wait to pass
            fill = t[i + max_batch - 1] if i + max_batch - 1 < n else np.inf
            start = min(fill, t[i] + max_wait_ms) if max_batch > 1 else t[i]
        else:
            start = lane_free
        k = min(int(np.searchsorted(t, start, side="right")), i + max_batch) - i
        end = start + latency_ms[k]
        sojourn[i:i + k] = end - t[i:i + k]
        heapq.heappush(free, end)
        i += k
    return sojourn


def default_sizes(rows: Sequence[Row], max_wait_ms: float, padded: bool
                  ) -> tuple[frozenset[int] | None, str]:
    """The max batch sizes within the default budget for one variant's table (sizes
    ascending), and why, in words; None without a batch-1 row to compare with."""
    if not rows or rows[0].batch_size != 1:
        return None, "no default latency budget: batch 1 was not measured"
    latency = batch_latency(rows, padded)
    lanes = rows[0].batches_at_once
    reference = p99_at_load(latency, 1, max_wait_ms, lanes)
    tails = {r.batch_size: p99_at_load(latency, r.batch_size, max_wait_ms, lanes)
             for r in rows}
    within = frozenset(s for s, tail in tails.items() if tail <= reference * WITHIN_NOISE)
    largest = max(within)
    ms = next(r.median_ms for r in rows if r.batch_size == largest)
    return within, (f"the default latency budget: batch sizes {sorted(within)}, up to "
                    f"{ms:.0f} ms a batch (p99 at {LOAD:.0%} load: {tails[largest]:.0f} ms at "
                    f"{largest}, batch 1's {reference:.0f} ms)")
