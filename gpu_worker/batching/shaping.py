"""Shape-aware batching for variable-length requests (text): length buckets and a token budget.

Pure like batcher.py: no I/O, no threads, the clock injected as ``now``. ``ShapedBatcher`` is a
``Batcher`` with the same calls (``add``, ``pop_ready``, ``pop_expired``, ``next_wakeup``,
``run_size``, ``set_limit``); images keep the plain ``Batcher``, whose behaviour this module
does not touch.

Costs. Each request carries ``cost``: its length in tokens (an int >= 1; ``cost_of``). Longer
than the last bucket edge goes in the last bucket.

Padded tokens. A batch runs every row padded to its longest request (``padded_length``: the
largest cost in the batch, *not* rounded up to the bucket edge: the text model runs eagerly,
one shape is as cheap to run as another, so every token past the longest is pure waste). Its
padded tokens are rows x padded length. A released batch never holds more than
``max_batch_size`` rows nor more than ``ShapePolicy.max_batch_tokens`` padded tokens, except a
single request alone, which always fits.

Buckets. Requests are grouped by length into buckets (``ShapePolicy.edges``: a request goes in
the first bucket whose edge holds it). Each bucket keeps the two lanes' FIFOs and the plain
batcher's release rules, per bucket: it is due when it is full (another request as long as its
longest would pass the rows or token limit), when its oldest interactive request has waited
``max_wait_s`` or its oldest bulk request ``bulk_max_wait_s``, or when its earliest deadline
would otherwise be missed given the expected run time of the batch it would form (a
``TokenRunTimeModel``: seconds by rows and padded length, e.g. ``TokenLatencyEstimator``).

Lanes and buckets. The lanes choose the bucket, then compose the batch inside it as the plain
batcher does:

* bulk that starves (unserved for ``LanePolicy.bulk_starve_s``) makes the bucket holding the
  oldest bulk request due, and that bucket goes first; its batch gives bulk its owed places;
* otherwise, among due buckets, the one whose oldest interactive request is oldest goes first;
  with no interactive request in any due bucket, the one whose oldest bulk request is oldest;
* inside the batch: owed bulk places, then interactive requests, then bulk requests while the
  batch stays within ``bulk_batch_budget_s`` (when interactive traffic is recent). Each queue
  is taken oldest first and stops at the first request that does not fit (FIFO is kept).

Neighbours. A bucket released by its wait, its deadline or bulk starvation (so not full) may
fill its room from its two adjacent buckets (one edge shorter first, then one edge longer), in
the lane order above, oldest first in each, while the rows and token limits allow, but only from
a neighbour that is due itself and not full: those requests would be released now anyway, so
joining them saves a launch for at most one edge of padding. A neighbour that is not yet due is
left to fill up, and a full one releases on its own next (mixing either would only pad). No
request waits on a neighbour: each bucket's own wait releases it, so a lone request in a sparse
bucket is never stranded past its wait.

Edges and padding waste. Within a bucket a batch pads up to about the bucket's width: with
powers of two (the default) padded / real tokens is about 1.3-1.4 for a saturated long-tailed
mix; four edges per octave (``octave_edges(per_octave=4)``) bring it to about 1.1.

Times are seconds on one monotonic clock chosen by the caller.

The module runs a little past 400 lines: one policy with its run-time estimator and the
small pieces only it uses; the plain rules stay in batcher.py.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic

from redbatch.common.config import DEFAULT_MAX_BATCH_TOKENS
from redbatch.gpu_worker.batching.batcher import (
    Batcher,
    LanePolicy,
    RunTimeModel,
    T,
    no_run_time,
)

#: Longest text the embedding model reads, tokens.
DEFAULT_MAX_LENGTH = 256
#: Smallest bucket edge of the default powers of two, tokens.
DEFAULT_SMALLEST_EDGE = 8
#: Bucket edges per doubling of the length (1: powers of two). A worker serves with
#: SERVING_EDGES_PER_OCTAVE: four edges a doubling kept the padding of a long-tailed mix near
#: 1.1 padded tokens a real one, powers of two near 1.35 (tests/test_batcher.py).
DEFAULT_EDGES_PER_OCTAVE = 1
SERVING_EDGES_PER_OCTAVE = 4
#: How fast the run-time fit forgets older runs (weight of the newest observation).
DEFAULT_TOKEN_SMOOTHING = 0.05

TokenRunTimeModel = Callable[[int, int], float]
"""Expected seconds to run a batch of ``rows`` requests padded to ``length`` tokens."""


def octave_edges(max_length: int = DEFAULT_MAX_LENGTH, smallest: int = DEFAULT_SMALLEST_EDGE,
                 per_octave: int = DEFAULT_EDGES_PER_OCTAVE) -> tuple[int, ...]:
    """Geometric bucket edges from ``smallest`` up to ``max_length`` (always the last edge),
    ``per_octave`` of them per doubling, rounded to whole tokens; 1: powers of two."""
    if smallest < 1 or max_length < smallest or per_octave < 1:
        raise ValueError("need 1 <= smallest <= max_length and per_octave >= 1")
    edges: list[int] = []
    step = 0
    while (edge := round(smallest * 2 ** (step / per_octave))) < max_length:
        if not edges or edge > edges[-1]:
            edges.append(edge)
        step += 1
    return (*edges, max_length)


DEFAULT_EDGES = octave_edges()


def cost_of(item: object) -> int:
    """A request's length in tokens: its ``cost`` attribute, an int >= 1."""
    cost = getattr(item, "cost", None)
    if isinstance(cost, bool) or not isinstance(cost, int) or cost < 1:
        raise ValueError(f"a shaped request needs an int cost >= 1, not {cost!r}")
    return cost


def rows_of(item: object) -> int:
    """Rows of the model's batch a request fills: its ``rows`` attribute (a list of texts:
    one per text), 1 without one."""
    rows = getattr(item, "rows", 1)
    return rows if isinstance(rows, int) and rows >= 1 else 1


def padded_length(batch: Iterable[object]) -> int:
    """The length a batch runs at: its longest request's cost (0 for an empty batch)."""
    return max((cost_of(item) for item in batch), default=0)


@dataclass(frozen=True, slots=True)
class ShapePolicy:
    """Token budget and length buckets of a shaped batcher (see the module docstring)."""

    #: Most padded tokens (rows x longest length) a batch may hold; a lone request always fits.
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS  # common/config.py, the worker's too
    #: Upper edges of the length buckets, tokens, increasing.
    edges: tuple[int, ...] = DEFAULT_EDGES

    def __post_init__(self) -> None:
        if self.max_batch_tokens < 1:
            raise ValueError("max_batch_tokens must be >= 1")
        if not self.edges or self.edges[0] < 1:
            raise ValueError("edges must be a non-empty sequence of lengths >= 1")
        if any(b <= a for a, b in zip(self.edges, self.edges[1:], strict=False)):
            raise ValueError("edges must be strictly increasing")

    def bucket(self, cost: int) -> int:
        """Index of the bucket a request of ``cost`` tokens goes in."""
        return min(bisect.bisect_left(self.edges, cost), len(self.edges) - 1)


class TokenLatencyEstimator:
    """Expected run time by (rows, padded length): time = a + b x rows x length.

    A least-squares fit over observed runs, each older run's weight shrinking by
    ``1 - smoothing`` at every new one (so it follows a drifting device), seeded from
    calibration figures. With one distinct size seen, the line goes through the origin;
    a fit that would give a negative slope or intercept drops that term.
    """

    def __init__(self, smoothing: float = DEFAULT_TOKEN_SMOOTHING) -> None:
        if not 0 < smoothing <= 1:
            raise ValueError("smoothing must be in (0, 1]")
        self._keep = 1.0 - smoothing
        self._sums = [0.0] * 5  # weight, x, y, x*x, x*y with x = rows x length

    def _add(self, rows: int, length: int, seconds: float, weight: float) -> None:
        x = float(rows * length)
        for i, v in enumerate((1.0, x, seconds, x * x, x * seconds)):
            self._sums[i] += weight * v

    def seed(self, seconds_by_shape: Mapping[tuple[int, int], float]) -> None:
        """Start from measured times keyed by (rows, padded length); non-positive keys are
        ignored. Later observations move the fit as usual."""
        for (rows, length), seconds in seconds_by_shape.items():
            if rows > 0 and length > 0:
                self._add(rows, length, float(seconds), 1.0)

    def observe(self, rows: int, length: int, seconds: float) -> None:
        self._sums = [s * self._keep for s in self._sums]
        self._add(rows, length, seconds, 1.0)

    def coefficients(self) -> tuple[float, float]:
        """(a, b) of the current fit; (0, 0) before any figure."""
        w, x, y, xx, xy = self._sums
        if w <= 0 or xx <= 0:
            return 0.0, 0.0
        spread = w * xx - x * x
        if spread <= 1e-9 * w * xx:
            return 0.0, xy / xx
        b = (w * xy - x * y) / spread
        a = (y - b * x) / w
        if b < 0:
            return y / w, 0.0
        if a < 0:
            return 0.0, xy / xx
        return a, b

    def __call__(self, rows: int, length: int) -> float:
        a, b = self.coefficients()
        return a + b * rows * length


Entry = tuple[int, T]  # (cost, request)


class _Bucket(Generic[T]):
    """One length bucket: the two lanes' FIFOs of (cost, request)."""

    def __init__(self) -> None:
        self.interactive: deque[Entry[T]] = deque()
        self.bulk: deque[Entry[T]] = deque()

    def __len__(self) -> int:
        return len(self.interactive) + len(self.bulk)

    def entries(self) -> list[Entry[T]]:
        return [*self.interactive, *self.bulk]

    def longest(self) -> int:
        return max((cost for cost, _ in self.entries()), default=0)

    def rows(self) -> int:
        return sum(rows_of(item) for _, item in self.entries())

    def earliest_deadline(self) -> float | None:
        deadlines = [i.deadline_s for _, i in self.entries() if i.deadline_s is not None]
        return min(deadlines) if deadlines else None


class _Draft(Generic[T]):
    """A batch being composed under the size limit (requests) and the token limit (rows, a
    request of several texts counting one a text, x the longest)."""

    def __init__(self, max_requests: int, max_tokens: int) -> None:
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.interactive: list[T] = []
        self.bulk: list[T] = []
        self.longest = 0
        self.rows = 0

    @property
    def requests(self) -> int:
        return len(self.interactive) + len(self.bulk)

    def fits(self, cost: int, rows: int) -> bool:
        if self.requests == 0:
            return True
        return self.requests < self.max_requests and \
            (self.rows + rows) * max(self.longest, cost) <= self.max_tokens

    def take(self, queue: deque[Entry[T]], limit: int,
             allowed: Callable[[int, int], bool] = lambda cost, rows: True) -> int:
        """Take from the head of ``queue`` (at most ``limit``) while each fits; how many."""
        taken = 0
        while queue and taken < limit:
            cost, item = queue[0]
            rows = rows_of(item)
            if not (self.fits(cost, rows) and allowed(cost, rows)):
                break
            queue.popleft()
            (self.bulk if item.bulk else self.interactive).append(item)
            self.longest = max(self.longest, cost)
            self.rows += rows
            taken += 1
        return taken


class ShapedBatcher(Batcher[T]):
    """A Batcher over length buckets with a token budget (the policy in the module docstring).

    ``token_run_time`` gives expected seconds by (rows, padded length); without one, the
    size-only ``run_time`` is used and the length ignored.
    """

    def __init__(self, max_batch_size: int, max_wait_s: float,
                 shape: ShapePolicy | None = None,
                 token_run_time: TokenRunTimeModel | None = None,
                 run_time: RunTimeModel = no_run_time,
                 lanes: LanePolicy | None = None,
                 preferred_sizes: Sequence[int] = (),
                 always_round_up: bool = False) -> None:
        super().__init__(max_batch_size, max_wait_s, run_time, lanes, preferred_sizes,
                         always_round_up)
        self.shape = shape or ShapePolicy()
        self.token_run_time: TokenRunTimeModel = \
            token_run_time or (lambda rows, length: run_time(rows))
        self._buckets: list[_Bucket[T]] = [_Bucket() for _ in self.shape.edges]
        self._count = 0
        self._bulk_count = 0

    def __len__(self) -> int:
        return self._count

    def padded_length(self, batch: Iterable[T]) -> int:
        """The length the model runs ``batch`` at (``padded_length``)."""
        return padded_length(batch)

    def seed(self, seconds_by_shape: Mapping[tuple[int, int], float]) -> None:
        """Measured times by (rows, padded length), for a ``token_run_time`` that learns."""
        start = getattr(self.token_run_time, "seed", None)
        if start is not None:
            start(seconds_by_shape)

    def observe(self, rows: int, length: int, seconds: float) -> None:
        """A batch's measured run time, for a ``token_run_time`` that learns (a
        TokenLatencyEstimator); the worker calls it after each run."""
        learn = getattr(self.token_run_time, "observe", None)
        if learn is not None:
            learn(rows, length, seconds)

    def add(self, item: T) -> None:
        cost = cost_of(item)
        bucket = self._buckets[self.shape.bucket(cost)]
        if item.bulk:
            if not self._bulk_count:
                self._bulk_served_s = max(self._bulk_served_s, item.arrival_s)
            bucket.bulk.append((cost, item))
            self._bulk_count += 1
        else:
            self._last_interactive_s = max(self._last_interactive_s, item.arrival_s)
            bucket.interactive.append((cost, item))
        self._count += 1

    # ------------------------------------------------------------------ when

    def _full(self, bucket: _Bucket[T]) -> bool:
        return len(bucket) >= self.max_batch_size or \
            (bucket.rows() + 1) * bucket.longest() > self.shape.max_batch_tokens

    def _starving(self, now: float) -> bool:
        return bool(self._bulk_count) and \
            now - self._bulk_served_s >= self.lanes.bulk_starve_s

    def _oldest_bulk_bucket(self) -> int | None:
        heads = [(b.bulk[0][1].arrival_s, i) for i, b in enumerate(self._buckets) if b.bulk]
        return min(heads)[1] if heads else None

    def _bucket_release_at(self, index: int) -> float | None:
        """When bucket ``index`` must be released (None when empty)."""
        bucket = self._buckets[index]
        if not bucket:
            return None
        if self._full(bucket):
            return float("-inf")
        waits = [q[0][1].arrival_s + wait for q, wait in
                 ((bucket.interactive, self.max_wait_s),
                  (bucket.bulk, self.lanes.bulk_max_wait_s)) if q]
        if self._bulk_count and index == self._oldest_bulk_bucket():
            waits.append(self._bulk_served_s + self.lanes.bulk_starve_s)
        release = min(waits)
        deadline = bucket.earliest_deadline()
        if deadline is not None:
            length = bucket.longest()
            rows = min(bucket.rows(), max(1, self.shape.max_batch_tokens // length))
            release = min(release, deadline - self.token_run_time(rows, length))
        return release

    def _due(self, now: float) -> list[int]:
        return [i for i in range(len(self._buckets))
                if (at := self._bucket_release_at(i)) is not None and at <= now]

    def _choose(self, due: list[int], now: float) -> int:
        """The due bucket that goes first (lanes decide; see the module docstring)."""
        oldest_bulk = self._oldest_bulk_bucket()
        if oldest_bulk is not None and self._starving(now) and oldest_bulk in due:
            return oldest_bulk
        with_interactive = [i for i in due if self._buckets[i].interactive]
        if with_interactive:
            return min(with_interactive,
                       key=lambda i: self._buckets[i].interactive[0][1].arrival_s)
        return min(due, key=lambda i: self._buckets[i].bulk[0][1].arrival_s)

    # ------------------------------------------------------------------ what

    def _order(self, index: int, due: list[int]) -> list[int]:
        """Bucket ``index``, then, when it has room, its adjacent buckets that are due too and
        not full: the shorter first."""
        if self._full(self._buckets[index]):
            return [index]
        return [index, *(j for j in (index - 1, index + 1)
                         if j in due and not self._full(self._buckets[j]))]

    def _within_budget(self, draft: _Draft[T], now: float) -> Callable[[int, int], bool]:
        """Whether one more bulk request of a cost and rows keeps the batch within the bulk
        budget."""
        budget = self.lanes.bulk_batch_budget_s
        if budget is None or now - self._last_interactive_s > self.lanes.interactive_recent_s:
            return lambda cost, rows: True
        return lambda cost, rows: draft.requests == 0 or \
            self.token_run_time(draft.rows + rows, max(draft.longest, cost)) <= budget

    def _compose(self, index: int, due: list[int], now: float) -> list[T]:
        order = [self._buckets[j] for j in self._order(index, due)]
        draft: _Draft[T] = _Draft(self.max_batch_size, self.shape.max_batch_tokens)
        owed = self._reserve if self._starving(now) else 0
        for bucket in order:
            owed -= draft.take(bucket.bulk, owed)
        for bucket in order:
            draft.take(bucket.interactive, self.max_batch_size)
        allowed = self._within_budget(draft, now)
        for bucket in order:
            draft.take(bucket.bulk, self.max_batch_size, allowed)
        return draft.interactive + draft.bulk

    def pop_ready(self, now: float) -> list[T]:
        """The next batch if one is due at ``now``, else an empty list (call it only when
        the model is free). A returned batch holds at least one request and keeps the rows
        and token limits."""
        due = self._due(now)
        if not due:
            return []
        batch = self._compose(self._choose(due, now), due, now)
        bulk = sum(item.bulk for item in batch)
        if bulk:
            self._bulk_served_s = now
        self._count -= len(batch)
        self._bulk_count -= bulk
        return batch

    def pop_expired(self, now: float) -> list[T]:
        """Requests whose deadline is already past; they must be answered, not run."""
        expired: list[T] = []
        for bucket in self._buckets:
            for queue in (bucket.interactive, bucket.bulk):
                late = [i for _, i in queue if i.deadline_s is not None and i.deadline_s <= now]
                if late:
                    expired += late
                    keep = [e for e in queue if e[1].deadline_s is None or e[1].deadline_s > now]
                    queue.clear()
                    queue.extend(keep)
        self._count -= len(expired)
        self._bulk_count -= sum(i.bulk for i in expired)
        return expired

    def next_wakeup(self, now: float) -> float | None:
        """When ``pop_ready``/``pop_expired`` may next have work; None when empty."""
        times = [at for i in range(len(self._buckets))
                 if (at := self._bucket_release_at(i)) is not None]
        times += [d for b in self._buckets if (d := b.earliest_deadline()) is not None]
        return max(now, min(times)) if times else None
