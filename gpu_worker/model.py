"""The device path: load the model once, run batches gathered from shared-memory slots.

The same code runs on CPU and CUDA. On CUDA the batch is gathered into a
pinned host buffer, copied with ``non_blocking=True`` on a dedicated stream
and run there; on CPU the gather buffer is an ordinary tensor and the copy
is a no-op. Never imports redis: results go back to the caller as values.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from redbatch.common.protocol import ErrorCode
from redbatch.gpu_worker.handlers import Handler

logger = logging.getLogger(__name__)


def resolve_device(spec: str) -> torch.device:
    """'auto' picks cuda when available; 'cuda:N' checks that N exists."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {spec!r} asked for, but CUDA is not available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {spec!r}: only {torch.cuda.device_count()} GPUs")
    return device


def choose_torch_threads(requested: int, pool_processes: int) -> int:
    """Intra-op threads: what was asked, else the cores the pool leaves free (at least 1)."""
    if requested > 0:
        return requested
    return max(1, (os.cpu_count() or 1) - pool_processes)


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


class ModelRunner:
    """Runs ``handler``'s model on batches of slot indices; used from one thread."""

    def __init__(self, handler: Handler, device: torch.device, slots: np.ndarray,
                 max_batch_size: int) -> None:
        self.handler = handler
        self.device = device
        self.max_batch_size = max_batch_size
        self._slots = torch.from_numpy(slots)  # shares the shared-memory pages
        cuda = device.type == "cuda"
        self._host = torch.empty((max_batch_size, *slots.shape[1:]),
                                 dtype=self._slots.dtype, pin_memory=cuda)
        self._stream = torch.cuda.Stream(device) if cuda else None  # type: ignore[no-untyped-call]
        self._model = handler.load(device)
        if cuda:
            torch.backends.cudnn.benchmark = True

    def warmup(self, sizes: Sequence[int]) -> dict[int, float]:
        """Run each batch size twice so first requests don't pay for lazy init; returns the
        second (warm) run time of each size in seconds, the batcher's first estimates."""
        timings = {}
        for size in sorted(set(sizes)):
            batch = torch.zeros((size, *self._host.shape[1:]), dtype=self._host.dtype)
            self._forward(batch)
            start = time.perf_counter()
            self._forward(batch)
            timings[size] = time.perf_counter() - start
            logger.info("warm-up batch %d: %.1f ms", size, timings[size] * 1000)
        return timings

    def _forward(self, host_batch: torch.Tensor) -> torch.Tensor:
        context = torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()
        with torch.inference_mode(), context:
            inputs = host_batch.to(self.device, non_blocking=True)
            outputs = self._model(inputs)
            # .cpu() waits for this stream only; the host buffer may be reused after it.
            return outputs.cpu()

    def run(self, slot_ids: Sequence[int],
            params: Sequence[Mapping[str, Any]]) -> list[Outcome]:
        """One outcome per slot, in order; outputs holding NaN or infinity are flagged.

        Raises whatever the model raises, and BatchSizeMismatch when the
        handler returns a different number of outputs than inputs.
        """
        n = len(slot_ids)
        index = torch.as_tensor(slot_ids, dtype=torch.long)
        batch = torch.index_select(self._slots, 0, index, out=self._host[:n])
        raw = self._forward(batch)
        finite = torch.isfinite(raw.reshape(n, -1)).all(dim=1).tolist()
        outputs = self.handler.postprocess(raw, params)
        if len(outputs) != n:
            raise BatchSizeMismatch(f"model returned {len(outputs)} outputs for {n} inputs")
        return [Outcome(out) if ok else
                Outcome(error=ErrorCode.NON_FINITE_OUTPUT, message="output holds NaN or inf")
                for out, ok in zip(outputs, finite, strict=True)]

    def run_isolating(self, slot_ids: Sequence[int],
                      params: Sequence[Mapping[str, Any]]) -> list[Outcome]:
        """Like ``run``, but a failing batch is split in halves and retried, so one bad
        request gets ``inference_failed`` and the others their outputs. Out-of-memory is
        handled the same way. Raises DeviceFailure when the device itself is broken."""
        try:
            return self.run(slot_ids, params)
        except Exception as e:
            if _is_device_fatal(e):
                raise DeviceFailure(str(e)) from e
            if isinstance(e, torch.cuda.OutOfMemoryError):
                torch.cuda.empty_cache()
            if len(slot_ids) == 1:
                logger.warning("request failed in the model: %s: %s", type(e).__name__, e)
                return [Outcome(error=ErrorCode.INFERENCE_FAILED,
                                message=f"{type(e).__name__}: {e}")]
            mid = len(slot_ids) // 2
            return self.run_isolating(slot_ids[:mid], params[:mid]) + \
                self.run_isolating(slot_ids[mid:], params[mid:])

    def close(self) -> None:
        """Drop the view on shared memory so the segment can be closed."""
        self._slots = torch.empty(0)
