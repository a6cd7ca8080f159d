"""A model whose forward pass fails as a broken device does, for bench/gpu_correct.py:
``redbatch worker --model gpu_faults:device_error`` (bench/ on PYTHONPATH).

The null_tensor model (nothing to load, no pool) whose forward pass raises the RuntimeError
a CUDA kernel fault gives ("CUDA error: an illegal memory access ...") on a batch holding
POISON (its warm-up passes): the worker must take the device as failed and exit with code
3, leaving the job for another worker.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import torch
from redbatch.common.config import LimitSettings
from redbatch.handlers.tensors import NullTensorModel

#: The payload whose batch fails: four float32s, the first MARK.
MARK = 1000.0
POISON = struct.pack("<4f", MARK, 0.0, 0.0, 0.0)
MESSAGE = "CUDA error: an illegal memory access was encountered (injected by bench/gpu_faults.py)"


class DeviceError(NullTensorModel):
    def load(self, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
        def forward(batch: torch.Tensor) -> torch.Tensor:
            if bool((batch[:, 0] == MARK).any()):
                raise RuntimeError(MESSAGE)
            return batch.sum(dim=1)

        return forward


def device_error(limits: LimitSettings) -> DeviceError:
    return DeviceError(limits)
