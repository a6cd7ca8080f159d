"""The device path: load the model once, run batches gathered from shared-memory slots.

NOTE [ Device path ]

    slots (shared memory) --index_select--> host buffer A|B (pinned on CUDA)
        --copy stream, non_blocking--> device input --(event)--> compute stream:
        model(input) [channels_last, autocast] --non_blocking--> pinned output --(event)

  ``submit`` gathers a batch into one of two host buffers, in turn, and on
  CUDA only enqueues work: the copy on its own stream, the forward pass on the
  compute stream once the copy's event fired, and the copy of the outputs back
  into pinned memory. It returns at once, so the next batch is gathered and
  its copy overlaps this batch's compute. ``collect`` waits for the batch's
  own event only, then postprocesses. Before a host buffer is written again,
  the copy that last read it must be done (its event): the two buffers let a
  batch be gathered while the previous one is still being copied.
  On CPU the same calls reduce to the plain path: no streams, events or
  pinning. With one lane ``submit`` runs the forward pass and ``collect``
  postprocesses; with two or more (the default on multi-core CPUs, see
  ``cpu_lanes``), ``submit`` hands the forward pass to a lane thread of its
  own and returns, so that many batches run at once, each on its share of the
  cores; a host buffer is reused only once the forward pass that read it is done.

The runner is used by one launching thread and one collecting thread; the
retries of a failing batch (``collect``) go through ``submit`` too, so
submitting holds a lock. Never imports redis: results go back as values.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from redbatch.common.config import TuneSettings, default_of
from redbatch.common.protocol import ErrorCode
from redbatch.gpu_worker.device.first_calls import FIRST_CALLS
from redbatch.gpu_worker.device.prepare import (
    AUTOCAST_DTYPES,
    OOM_HOLD_S,
    limit_ceiling,
    next_batch_limit,
    precision,
    prepare_model,
    total_memory,
    use_compile_settings,
)
from redbatch.gpu_worker.device.watchdog import Watch, unwatched
from redbatch.gpu_worker.tuning.profile import Variant
from redbatch.handlers.base import Handler

logger = logging.getLogger(__name__)


class BatchSizeMismatch(RuntimeError):
    pass


class DeviceFailure(RuntimeError):
    """The device is unusable (a CUDA error other than out-of-memory): the worker must exit
    so its supervisor restarts it; its jobs are taken over by other workers."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one request of a batch got: an output, or an error code with a message."""

    output: Any = None
    error: ErrorCode | None = None
    message: str = ""


def _is_device_fatal(e: Exception) -> bool:
    text = str(e)
    return isinstance(e, RuntimeError) and not isinstance(e, torch.cuda.OutOfMemoryError) \
        and ("CUDA error" in text or "device-side assert" in text)


@dataclass(slots=True)
class InFlight:
    """A submitted batch: its outputs are ready once ``done`` fired (CUDA) or at once (CPU)."""

    slot_ids: Sequence[int]
    params: Sequence[Mapping[str, Any]]
    size: int
    outputs: torch.Tensor | None = None
    error: Exception | None = None
    done: Any = None  # torch.cuda.Event on CUDA, _LaneDone with CPU lanes
    timing: tuple[Any, Any] | None = None  # CUDA start and end events of the forward pass
    compute_s: float = 0.0
    #: Seconds the batch took, for the latency estimator: on CUDA its forward pass on the
    #: device, on CPU from submit to outcomes (postprocessing included).
    run_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)


class ModelRunner:
    """Runs ``handler``'s model on batches of slot indices (see NOTE [ Device path ])."""

    def __init__(self, handler: Handler, device: torch.device, slots: np.ndarray,
                 max_batch_size: int, variant: Variant | None = None, *,
                 model: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 memory_watermark: float = default_of(TuneSettings, "memory_watermark"),
                 host_buffers: list[torch.Tensor] | None = None, lanes: int = 1) -> None:
        self.handler = handler
        self.device = device
        self.max_batch_size = max_batch_size
        self.variant = variant or Variant()
        #: Largest batch to submit now; lowered under memory pressure (CUDA).
        self.batch_limit = max_batch_size
        self._slots = torch.from_numpy(slots)  # shares the shared-memory pages
        cuda = self._cuda = device.type == "cuda"
        #: Batches that may be in flight at once: 2 on CUDA (copy beside compute), the lanes
        #: on CPU.
        self.depth = 2 if cuda else max(1, lanes)
        self._lanes = ThreadPoolExecutor(
            self.depth, thread_name_prefix="redbatch-lane",
            initializer=use_compile_settings if self.variant.compile else None) \
            if not cuda and self.depth > 1 else None
        #: Batch sizes the model has run (a compiled one: has a graph for); a size's first
        #: call holds FIRST_CALLS (NOTE [ First calls ]).
        self._sizes_run: set[int] = set()
        #: False once ``warmup`` is done: from then on a compile is a surprise worth a warning.
        self._warming = True
        # Calibration's runners share buffers: they wait for each batch before the next.
        self._host = host_buffers or [
            torch.empty((max_batch_size, *slots.shape[1:]), dtype=self._slots.dtype,
                        pin_memory=cuda) for _ in range(max(2, self.depth))]
        # What must be done before a buffer is written again: the copy (CUDA) or the forward
        # pass (CPU lanes) that last read it.
        self._host_free: list[Any] = [None] * len(self._host)
        self._turn = 0
        self._lock = threading.Lock()
        self._copy_stream: Any = torch.cuda.Stream(device) if cuda else None  # type: ignore[no-untyped-call]
        self._compute_stream: Any = torch.cuda.Stream(device) if cuda else None  # type: ignore[no-untyped-call]
        if cuda:
            torch.backends.cudnn.benchmark = True
        self._autocast = AUTOCAST_DTYPES.get(self.variant.autocast or "")
        loaded = model if model is not None else handler.load(device)
        self._model = prepare_model(loaded, self.variant, device)
        self._watermark_bytes = int(memory_watermark * total_memory(device))
        self._bytes_per_item = 0
        self._base_bytes = 0
        #: (limit, until when) after an out-of-memory: see OOM_HOLD_S.
        self._oom_hold: tuple[int, float] | None = None

    @property
    def pipelined(self) -> bool:
        """True on CUDA: submit enqueues the copy and the forward pass and returns."""
        return self._cuda

    # ------------------------------------------------------------------ warm-up

    def warmup(self, sizes: Sequence[int], watch: Watch = unwatched) -> dict[int, float]:
        """Run each batch size on every lane, then once more timed, inside ``watch``, so
        first requests don't pay for lazy init (CUDA: cuDNN's benchmarking; compiling);
        returns the warm run's time of each size in seconds. CUDA: learns memory per item."""
        timings = {}
        for size in sorted({min(s, self.max_batch_size) for s in sizes}):
            ids = list(range(min(size, len(self._slots))))
            pad = size if size > len(ids) else None
            # Every lane thread once: a thread's first forward pass (a compiled model's
            # guards in it) is paid here, not by a request. A failure fails the start.
            with watch(f"warm-up at batch {size} ({self.variant.name})"):
                for job in [self.submit(ids, [{}] * len(ids), pad) for _ in range(self.depth)]:
                    self.finish(job)
                start = time.perf_counter()
                self._peak_reset()
                self.run(ids, [{}] * len(ids), pad)
                timings[size] = time.perf_counter() - start
            self._learn_memory(size)
            logger.info("warm-up batch %d: %.1f ms", size, timings[size] * 1000)
        self._warming = False
        return timings

    def _peak_reset(self) -> None:
        if self.pipelined:
            torch.cuda.synchronize(self.device)
            self._base_bytes = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def _learn_memory(self, size: int) -> None:
        if self.pipelined:
            peak = torch.cuda.max_memory_allocated(self.device) - self._base_bytes
            self._bytes_per_item = max(self._bytes_per_item, peak // max(size, 1))

    # ------------------------------------------------------------------ one batch

    def submit(self, slot_ids: Sequence[int], params: Sequence[Mapping[str, Any]],
               pad_to: int | None = None) -> InFlight:
        """Gather the slots and start the batch; never raises for a model error (it is
        kept in the returned InFlight for ``collect``). ``pad_to`` rounds the batch up to
        that size with copies of its first input; only the real rows come back."""
        size = self._compiled_size(max(len(slot_ids), pad_to or 0))
        job = InFlight(slot_ids, params, size)
        try:
            if size > self.max_batch_size:
                raise ValueError(f"batch of {size} over the max batch size "
                                 f"{self.max_batch_size}")
            with self._lock:
                host, turn = self._gather(slot_ids, size)
                if self._cuda:
                    self._enqueue(job, host, turn)
                elif self._lanes is not None:
                    job.done = self._host_free[turn] = \
                        _LaneDone(self._lanes.submit(self._run_now, job, host))
                else:
                    self._run_now(job, host)
        except Exception as e:
            job.error = e
        return job

    def _compiled_size(self, size: int) -> int:
        """A compiled model runs the smallest size it has compiled that holds ``size``: a
        batch split to isolate a failure must not compile a new graph (seconds, holding
        the GIL) while serving."""
        if not self.variant.compile:
            return size
        # A copy (one C call, under the GIL): a lane thread may add a size meanwhile.
        return min((s for s in self._sizes_run.copy() if s >= size), default=size)

    def _gather(self, slot_ids: Sequence[int], size: int) -> tuple[torch.Tensor, int]:
        turn, self._turn = self._turn, (self._turn + 1) % len(self._host)
        if self._host_free[turn] is not None:
            self._host_free[turn].synchronize()
        host = self._host[turn]
        n = len(slot_ids)
        torch.index_select(self._slots, 0, torch.as_tensor(slot_ids, dtype=torch.long),
                           out=host[:n])
        if size > n:
            host[n:size] = host[0]  # padding: copies of a real input, never stale memory
        return host[:size], turn

    def _format(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.variant.channels_last and inputs.dim() == 4:
            return inputs.contiguous(memory_format=torch.channels_last)
        return inputs

    def _precision(self) -> AbstractContextManager[None]:
        return precision(self.device.type, self.variant.autocast)

    def _run_now(self, job: InFlight, host: torch.Tensor) -> None:
        """CPU: the forward pass, here or in a lane thread; a failure is kept in ``job``."""
        start = time.perf_counter()
        try:
            outputs = self._forward(host) if len(host) in self._sizes_run \
                else self._first_call(host)
            # The output must not alias the host buffer, which a later batch overwrites.
            job.outputs = outputs.clone() if _shares_memory(outputs, host) else outputs
        except Exception as e:
            job.error = e
        job.compute_s = time.perf_counter() - start

    def _forward(self, host: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode(), self._precision():
            return self._model(self._format(host))

    def _first_call(self, host: torch.Tensor) -> torch.Tensor:
        """The first call at a size, alone in the process (NOTE [ First calls ])."""
        if self.variant.compile and self._sizes_run and not self._warming:
            logger.warning("compiling batch size %d while serving (not warmed up)", len(host))
        with FIRST_CALLS:
            outputs = self._forward(host)
            self._sizes_run.add(len(host))
        return outputs

    def _enqueue(self, job: InFlight, host: torch.Tensor, turn: int) -> None:
        with torch.cuda.stream(self._copy_stream):
            inputs = host.to(self.device, non_blocking=True)
            copied = _event()
            copied.record()
        self._host_free[turn] = copied
        compute = self._compute_stream
        compute.wait_event(copied)
        with torch.cuda.stream(compute), torch.inference_mode():
            # Allocated on the copy stream, used on this one: keep its memory until done here.
            inputs.record_stream(compute)
            begin, end = _event(timing=True), _event(timing=True)
            begin.record()
            with self._precision():
                outputs = self._model(self._format(inputs))
            end.record()
            back = torch.empty(outputs.shape, dtype=outputs.dtype, pin_memory=True)
            back.copy_(outputs, non_blocking=True)
            done = _event()
            done.record()
        job.outputs, job.done, job.timing = back, done, (begin, end)

    def _outcomes(self, job: InFlight) -> list[Outcome]:
        if job.done is not None:
            job.done.synchronize()
        if job.error is not None:
            raise job.error
        if job.timing is not None:
            job.compute_s = job.timing[0].elapsed_time(job.timing[1]) / 1000
            self._watch_memory()
        assert job.outputs is not None
        n = len(job.slot_ids)
        raw = job.outputs[:n]
        if self._autocast is not None and raw.is_floating_point():
            raw = raw.float()  # handlers get full-precision outputs whatever ran
        finite = torch.isfinite(raw.reshape(n, -1)).all(dim=1).tolist()
        outputs = self.handler.postprocess(raw, job.params)
        if len(outputs) != n:
            raise BatchSizeMismatch(f"model returned {len(outputs)} outputs for {n} inputs")
        return [Outcome(out) if ok else
                Outcome(error=ErrorCode.NON_FINITE_OUTPUT, message="output holds NaN or inf")
                for out, ok in zip(outputs, finite, strict=True)]

    def _watch_memory(self) -> None:
        free, _ = torch.cuda.mem_get_info(self.device)
        cached = torch.cuda.memory_reserved(self.device) - \
            torch.cuda.memory_allocated(self.device)
        self.follow_memory(free + cached, time.monotonic())

    def follow_memory(self, headroom_bytes: int, now: float) -> None:
        """Lower or restore the batch limit after a batch, from the device memory still
        available; never back to a size that ran out of memory within OOM_HOLD_S."""
        limit = next_batch_limit(self.batch_limit,
                                 limit_ceiling(self.max_batch_size, self._oom_hold, now),
                                 headroom_bytes, self._watermark_bytes, self._bytes_per_item)
        if limit != self.batch_limit:
            logger.warning("device memory headroom %.0f MiB (watermark %.0f MiB): batch "
                           "limit %d -> %d", headroom_bytes / 2**20,
                           self._watermark_bytes / 2**20, self.batch_limit, limit)
            self.batch_limit = limit

    # ------------------------------------------------------------------ public runs

    def run(self, slot_ids: Sequence[int], params: Sequence[Mapping[str, Any]],
            pad_to: int | None = None) -> list[Outcome]:
        """One outcome per slot, in order; outputs holding NaN or infinity are flagged.

        Raises whatever the model raises, and BatchSizeMismatch when the
        handler returns a different number of outputs than inputs.
        """
        return self.finish(self.submit(slot_ids, params, pad_to))

    def finish(self, job: InFlight) -> list[Outcome]:
        """Wait for a submitted batch and return its outcomes; raises as ``run`` does."""
        return self._outcomes(job)

    def collect(self, job: InFlight) -> list[Outcome]:
        """Wait for a submitted batch and return its outcomes. A failing batch is split in
        halves and run again, so one bad request gets ``inference_failed`` and the others
        their outputs; out-of-memory is handled the same way and lowers the batch limit.
        Raises DeviceFailure when the device itself is broken."""
        try:
            outcomes = self._outcomes(job)
            job.run_s = job.compute_s if self._cuda else time.perf_counter() - job.started
        except Exception as e:
            outcomes = self._isolate(e, job.slot_ids, job.params)
            job.run_s = time.perf_counter() - job.started
        return outcomes

    def run_isolating(self, slot_ids: Sequence[int],
                      params: Sequence[Mapping[str, Any]]) -> list[Outcome]:
        """``run`` with the failure handling of ``collect``."""
        return self.collect(self.submit(slot_ids, params))

    def _isolate(self, e: Exception, slot_ids: Sequence[int],
                 params: Sequence[Mapping[str, Any]]) -> list[Outcome]:
        if _is_device_fatal(e):
            raise DeviceFailure(str(e)) from e
        if isinstance(e, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
            self.batch_limit = max(1, min(self.batch_limit, len(slot_ids) // 2))
            self._oom_hold = (self.batch_limit, time.monotonic() + OOM_HOLD_S)
            logger.warning("out of device memory at batch %d: batch limit now %d",
                           len(slot_ids), self.batch_limit)
        if len(slot_ids) == 1:
            logger.warning("request failed in the model: %s: %s", type(e).__name__, e)
            return [Outcome(error=ErrorCode.INFERENCE_FAILED, message=f"{type(e).__name__}: {e}")]
        mid = len(slot_ids) // 2
        return self.run_isolating(slot_ids[:mid], params[:mid]) + \
            self.run_isolating(slot_ids[mid:], params[mid:])

    def close(self) -> None:
        """Drop the view on shared memory so the segment can be closed (lanes only ever
        read the host buffers, never the slots)."""
        self._slots = torch.empty(0)
        if self._lanes is not None:
            self._lanes.shutdown(wait=False)


class _LaneDone:
    """A lane's forward pass, waited for like a CUDA event."""

    def __init__(self, future: Future[None]) -> None:
        self._future = future

    def synchronize(self) -> None:
        wait([self._future])  # its failure, if any, is in the job


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return bool(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())
    except RuntimeError:
        return False


def _event(timing: bool = False) -> Any:
    return torch.cuda.Event(enable_timing=timing)  # type: ignore[no-untyped-call]
