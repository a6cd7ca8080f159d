"""The null model for tensor payloads: redbatch's own path with no decoding at all.

A job's payload is ``FLOATS`` little-endian float32 values, copied into its slot as they
are, or the same numbers as a numpy array or a JSON list (content types
``application/x-npy`` and ``application/json``: the client's payload encoders); the model
sums them. Its preprocessing is a copy, so it says ``inline_preprocess`` and the worker runs
it in its own loop, without the pool (handlers/base.py). What a run of it costs is the
framework alone: Redis, intake, batching, the result writer and metrics, which is what
``bench/overhead.py --payload tensor`` sets against a raw Redis loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from redbatch.common.config import LimitSettings
from redbatch.common.protocol import ErrorCode
from redbatch.common.protocol.payloads import JSON, NPY, decode_payload, media_type
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
        """Raw little-endian float32 bytes (the fast path), or FLOATS numbers sent as a
        numpy array or a JSON list (``common/protocol/payloads.py``)."""
        if media_type(content_type) in (NPY, JSON):
            out[:] = _values(payload, content_type)
            return
        if len(payload) != out.nbytes:
            raise InputError(ErrorCode.BAD_INPUT, f"expected {FLOATS} float32 values "
                             f"({out.nbytes} bytes), got {len(payload)} bytes")
        out[:] = np.frombuffer(payload, dtype="<f4")

    def load(self, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda batch: batch.sum(dim=1)

    def postprocess(self, outputs: torch.Tensor,
                    params: Sequence[Mapping[str, Any]]) -> list[Any]:
        return [{"sum": round(v, 4)} for v in outputs.tolist()]


def _values(payload: bytes, content_type: str) -> np.ndarray:
    """The FLOATS finite numbers of an array or JSON payload; InputError for anything else."""
    try:
        value = decode_payload(payload, content_type)
        values = np.asarray(value, dtype=np.float32)
    except (ValueError, TypeError) as e:
        raise InputError(ErrorCode.BAD_INPUT, str(e)) from None
    if values.shape != (FLOATS,) or not np.isfinite(values).all():
        raise InputError(ErrorCode.BAD_INPUT, f"expected {FLOATS} finite numbers, got shape "
                         f"{values.shape}")
    return values
