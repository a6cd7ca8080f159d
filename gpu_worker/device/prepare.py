"""The device and the threads a model runs on, and how the model is prepared for them:
which device, how many CPU lanes and torch threads, autocast, channels_last and
torch.compile, and how far device memory lets a batch grow.

Heuristics and settings only; the runner that uses them is runner.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch
from redbatch.gpu_worker.tuning.profile import Variant

AUTOCAST_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


@contextmanager
def precision(device_type: str, autocast: str | None) -> Iterator[None]:
    """torch.autocast to a variant's dtype ('float16', 'bfloat16'); nothing for None."""
    dtype = AUTOCAST_DTYPES.get(autocast or "")
    with torch.autocast(device_type, dtype=dtype) if dtype is not None else nullcontext():
        yield


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


def cpu_lanes(requested: int) -> int:
    """Batches a CPU worker runs at once: what was asked, else 2 with 2 cores or more.

    The model is nearly all the work on CPU (EfficientNet-Lite0 here: about 17 core-ms per
    photo against 4.5 of decoding), so every core should run it. One forward pass on all
    cores synchronises its threads hundreds of times, and stalls whenever another process
    (a pool process decoding, a neighbour) takes one of them: measured on 2 cores, batch 8,
    2 threads gave 93 img/s alone but 29 beside one busy process. Two batches at once, each
    on half the cores, gave 79-91 alone and 60-63 beside it; one thread 54 and 47.
    """
    if requested > 0:
        return requested
    return 2 if (os.cpu_count() or 1) >= 2 else 1


def choose_torch_threads(requested: int, pool_processes: int, device_type: str = "cpu",
                         lanes: int = 1) -> int:
    """Intra-op threads: what was asked; else on CPU each lane's share of the cores, on CUDA
    the cores the pool leaves free (at least 1; ``pool_processes`` 0: the default pool,
    :func:`choose_pool_processes`)."""
    if requested > 0:
        return requested
    cores = os.cpu_count() or 1
    if device_type == "cpu":
        return max(1, cores // max(lanes, 1))
    return max(1, cores - choose_pool_processes(pool_processes, device_type, lanes, 1, cores))


#: Cores a CUDA worker's model keeps from the pool: its threads launch batches and collect
#: outputs, and mostly wait on the device.
CUDA_MODEL_CORES = 1
#: The least share of a CPU worker's cores its pool gets, as a divisor: a third. With the
#: default threads the model's lanes take every core and the pool shares them; decoding is
#: about a third of a photo's CPU time there (EfficientNet-Lite0 compiled in bf16: 6.9
#: CPU-ms in the model, 3.2 decoding a sample photo), so fewer processes would make
#: decoding the limit on a many-core CPU.
CPU_POOL_SHARE_DIVISOR = 3


def choose_pool_processes(requested: int, device_type: str, lanes: int, torch_threads: int,
                          cores: int | None = None) -> int:
    """Preprocessing processes: ``requested`` when above 0; else (0: auto) the cores the
    model's threads leave, at least 1.

    CUDA: ``cores`` - CUDA_MODEL_CORES. CPU: ``cores`` - ``lanes`` x ``torch_threads``, and
    at least a third of the cores (CPU_POOL_SHARE_DIVISOR), since by default the lanes'
    threads take them all. ``cores``: os.cpu_count() when None.
    """
    if requested > 0:
        return requested
    cores = cores or os.cpu_count() or 1
    if device_type == "cpu":
        return max(1, cores - lanes * torch_threads, cores // CPU_POOL_SHARE_DIVISOR)
    return max(1, cores - CUDA_MODEL_CORES)


def pool_rule(device_type: str) -> str:
    """The default pool's rule on this device type, in words, for the start-up log."""
    if device_type == "cpu":
        return ("the cores left after the model's lanes x torch threads, at least a third "
                "of the cores")
    return f"the cores minus {CUDA_MODEL_CORES} for the model's launching and collecting threads"


def prepare_model(model: Callable[[torch.Tensor], torch.Tensor], variant: Variant,
                  device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """Eval mode and the variant's memory format (modules only; other callables as they
    are), then torch.compile when asked. Changes a module in place."""
    if isinstance(model, torch.nn.Module):
        model.eval()
        model.to(memory_format=torch.channels_last if variant.channels_last  # type: ignore[call-overload]
                 else torch.contiguous_format)
    if variant.compile:
        use_compile_settings()
        return torch.compile(model, dynamic=False)
    return model


def use_compile_settings() -> None:
    """torch.compile's settings for this worker, in the calling thread.

    Since torch 2.13 a config value set in one thread is not seen by others, and a
    compiled model compiles each new shape in the thread that first calls it (a CPU
    lane): every such thread calls this first.
    """
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    # Weights become constants of the graph: inference only, and much faster on CPU
    # (EfficientNet-Lite0 on one thread: 60 img/s compiled without it, 78 with it).
    inductor_config.freezing = True
    # One graph per batch size: allow as many as calibration measures (default 8, past
    # which torch silently falls back to eager).
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), 64))


def next_batch_limit(limit: int, max_batch_size: int, headroom_bytes: int,
                     watermark_bytes: int, bytes_per_item: int) -> int:
    """The batch limit after a batch, from the device memory still available
    (``headroom_bytes``: free in the driver plus cached by torch and unused).

    Below the watermark, halve it (at least 1); with room for the watermark plus twice
    the current limit's activations, double it back towards ``max_batch_size``.
    """
    if headroom_bytes < watermark_bytes:
        return max(1, limit // 2)
    if limit < max_batch_size and \
            headroom_bytes > watermark_bytes + 2 * limit * max(bytes_per_item, 1):
        return min(max_batch_size, limit * 2)
    return limit


#: After running out of memory at a batch size, the limit stays below that size this long,
#: s, however much memory looks free between batches: what is free after a batch says
#: nothing of the peak a larger one needs. Doubling straight back ran out of memory again
#: every few batches on an H200 (bench/gpu_correct.py, 2026-12-04).
OOM_HOLD_S = 300.0


def limit_ceiling(max_batch_size: int, held: tuple[int, float] | None, now: float) -> int:
    """The largest batch limit free memory may restore: ``held`` (a limit, until when, on
    the monotonic clock) after an out-of-memory, else ``max_batch_size``."""
    return held[0] if held is not None and now < held[1] else max_batch_size


def total_memory(device: torch.device) -> int:
    """Bytes of memory on a CUDA device; 0 elsewhere."""
    if device.type != "cuda":
        return 0
    return int(torch.cuda.get_device_properties(device).total_memory)


def memory_in_use(device: str) -> tuple[int, int]:
    """(allocated, reserved) bytes of a CUDA device, for the sampler's gauges."""
    return (int(torch.cuda.memory_allocated(device)), int(torch.cuda.memory_reserved(device)))
