"""Handlers used by the tests through the 'module:factory' form of --model.

They wrap the real default model and add failure modes triggered by payload
prefixes, so crash handling is tested with real processes and real photos.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
from redbatch.common.config import LimitSettings
from redbatch.gpu_worker.handlers import EfficientNetLite0

CRASH = b"CRASH"  # the preprocessing process dies on this payload
SLOW = b"SLOW"  # preprocessing sleeps a second first, then fails as a bad image


class Crashy(EfficientNetLite0):
    def preprocess(self, payload: bytes, content_type: str, params: Mapping[str, Any],
                   out: np.ndarray) -> None:
        if payload.startswith(CRASH):
            os._exit(13)
        if payload.startswith(SLOW):
            time.sleep(1.0)
        super().preprocess(payload, content_type, params, out)


def crashy(limits: LimitSettings) -> Crashy:
    return Crashy(limits)


class Unencodable(EfficientNetLite0):
    """Returns outputs msgpack cannot carry (a set), as a buggy user handler might."""

    def postprocess(self, outputs: Any, params: Any) -> list[Any]:
        return [{"labels": {"a", "b"}} for _ in range(len(outputs))]


def unencodable(limits: LimitSettings) -> Unencodable:
    return Unencodable(limits)
