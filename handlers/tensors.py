"""The null model for tensor payloads: redbatch's own path with no decoding at all.

A job's payload is ``FLOATS`` little-endian float32 values, copied into its slot as they
are; the model sums them. Its preprocessing is a copy, so it says ``inline_preprocess``
and the worker runs it in its own loop, without the pool (handlers/base.py). What a run of
it costs is the framework alone: Redis, intake, batching, the result writer and metrics,
which is what ``bench/overhead.py --payload tensor`` sets against a raw Redis loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from redbatch.common.config import LimitSettings
from redbatch.common.protocol import ErrorCode
from redbatch.handlers.decode import InputError

if TYPE_CHECKING:
    import torch

#: Values per payload; a payload is exactly this many float32s (16 bytes).
FLOATS = 4


class NullTensorModel:
    """Sums a payload of FLOATS float32 values: ``{"sum": s}``."""

    input_shape: tuple[int, ...] = (FLOATS,)
    input_dtype = "float32"
    inline_preprocess = True

    def __init__(self, limits: LimitSettings) -> None:
        self.limits = limits

    def preprocess(self, payload: bytes, content_type: str, params: Mapping[str, Any],
                   out: np.ndarray) -> None:
        if len(payload) != out.nbytes:
            raise InputError(ErrorCode.BAD_INPUT, f"expected {FLOATS} float32 values "
                             f"({out.nbytes} bytes), got {len(payload)} bytes")
        out[:] = np.frombuffer(payload, dtype="<f4")

    def load(self, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda batch: batch.sum(dim=1)

    def postprocess(self, outputs: torch.Tensor,
                    params: Sequence[Mapping[str, Any]]) -> list[Any]:
        return [{"sum": round(v, 4)} for v in outputs.tolist()]
