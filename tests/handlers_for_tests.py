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
from redbatch.common.protocol import ErrorCode
from redbatch.handlers import EfficientNetLite0
from redbatch.handlers.decode import InputError

CRASH = b"CRASH"  # the preprocessing process dies on this payload
SLOW = b"SLOW"  # preprocessing sleeps a second first, then fails as a bad image
BULKY = b"BULKY"  # refused with a message far bigger than a pipe's buffer (1 MB)


class Crashy(EfficientNetLite0):
    def preprocess(self, payload: bytes, content_type: str, params: Mapping[str, Any],
                   out: np.ndarray) -> None:
        if payload.startswith(CRASH):
            os._exit(13)
        if payload.startswith(BULKY):
            raise InputError(ErrorCode.BAD_INPUT, "x" * 1_000_000)
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


class WorkerKiller(EfficientNetLite0):
    """Kills the worker process itself (not a pool process) when a batch holds a job with
    the param ``kill_worker``: a poison job, as a model that segfaults on one input would be.
    With the param ``hang`` the batch never finishes, as on a hung GPU; with ``sleep_s`` it
    takes that many seconds longer, as a slow batch would."""

    def postprocess(self, outputs: Any, params: Any) -> list[Any]:
        if any(p.get("kill_worker") for p in params):
            os._exit(17)
        if any(p.get("hang") for p in params):
            time.sleep(3600)
        time.sleep(max((float(p.get("sleep_s", 0)) for p in params), default=0.0))
        return super().postprocess(outputs, params)


def killer(limits: LimitSettings) -> WorkerKiller:
    return WorkerKiller(limits)


FAIL = b"FAILMODEL"  # the model raises when a batch holds this request
NAN = b"NANMODEL"  # the model returns NaN for this request


class Flaky(EfficientNetLite0):
    """Marks inputs in their shared-memory slot so that the model itself misbehaves on them."""

    def preprocess(self, payload: bytes, content_type: str, params: Mapping[str, Any],
                   out: np.ndarray) -> None:
        for marker, value in ((FAIL, 1000.0), (NAN, -1000.0)):
            if payload.startswith(marker):
                out[...] = value
                return
        super().preprocess(payload, content_type, params, out)

    def load(self, device: Any) -> Any:
        model = super().load(device)

        def forward(batch: Any) -> Any:
            if bool((batch[:, 0, 0, 0] == 1000.0).any()):
                raise RuntimeError("the model cannot take this input")
            logits = model(batch)
            logits[batch[:, 0, 0, 0] == -1000.0] = float("nan")
            return logits

        return forward


def flaky(limits: LimitSettings) -> Flaky:
    return Flaky(limits)


HANG = b"HANGMODEL"  # the model's forward pass never returns on a batch holding this


class HangsInForward(EfficientNetLite0):
    """A forward pass stuck in the device, as a hung kernel or a deadlock in torch would be:
    ``hangs_in_forward`` on a batch holding a HANG payload (in a CPU lane thread),
    ``hangs_at_warmup`` on every batch, ``hangs_under_autocast`` in autocast variants only
    (calibration's bf16/fp16). The thread waits for ever, leaving the GIL as torch does."""

    def __init__(self, limits: LimitSettings, when: str) -> None:
        super().__init__(limits)
        self.when = when

    def preprocess(self, payload: bytes, content_type: str, params: Mapping[str, Any],
                   out: np.ndarray) -> None:
        if payload.startswith(HANG):
            out[...] = 2000.0
            return
        super().preprocess(payload, content_type, params, out)

    def load(self, device: Any) -> Any:
        import threading

        import torch

        model = super().load(device)
        when = self.when

        def forward(batch: Any) -> Any:
            marked = bool((batch[:, 0, 0, 0] == 2000.0).any())
            if when == "always" or (when == "marked" and marked) \
                    or (when == "autocast" and torch.is_autocast_enabled("cpu")):
                threading.Event().wait()
            return model(batch)

        return forward


def hangs_in_forward(limits: LimitSettings) -> HangsInForward:
    return HangsInForward(limits, "marked")


def hangs_at_warmup(limits: LimitSettings) -> HangsInForward:
    return HangsInForward(limits, "always")


def hangs_under_autocast(limits: LimitSettings) -> HangsInForward:
    return HangsInForward(limits, "autocast")
