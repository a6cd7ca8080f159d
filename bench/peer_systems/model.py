"""The model every peer serves: redbatch's EfficientNet-Lite0 handler, in a peer's process.

Same decode and preprocessing (``EfficientNetLite0.preprocess``), the same eager forward
(``load``) and the same top-5 post-processing as the redbatch worker's plain path; what a
user of another serving system would wrap. Decoding runs in the calling thread, one image
after another, as it would in a typical handler.

``PEER_MODEL_VARIANT`` (``bench/peers.py --peer-variant``) gives the peers one of redbatch's
device-path variants instead, e.g. ``channels_last+bf16``: the serving systems compared with
the same forward pass. Not ``compile``: the peers batch to any size, and a compiled graph per
size would compile while being measured.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from redbatch.common.config import LimitSettings
from redbatch.gpu_worker.device.prepare import precision, prepare_model
from redbatch.gpu_worker.tuning.variants import parse_variant
from redbatch.handlers import EfficientNetLite0

#: Variable that sets the torch intra-op threads of a peer's model process; unset: all cores.
THREADS_ENV = "PEER_TORCH_THREADS"
#: Variable naming the device-path variant of the peers' model; unset: eager float32.
VARIANT_ENV = "PEER_MODEL_VARIANT"


def torch_threads() -> int:
    """Threads for torch in this process: PEER_TORCH_THREADS, else every core."""
    return int(os.environ.get(THREADS_ENV) or 0) or (os.cpu_count() or 1)


class Classifier:
    """Decode, batch and run EfficientNet-Lite0; one instance per serving process."""

    def __init__(self, threads: int | None = None) -> None:
        torch.set_num_threads(threads or torch_threads())
        self.handler = EfficientNetLite0(LimitSettings())
        self.variant = parse_variant(os.environ.get(VARIANT_ENV) or "eager")
        if self.variant.compile:
            raise ValueError(f"{VARIANT_ENV}: compile is not offered to the peers (see above)")
        self.model = prepare_model(self.handler.load(torch.device("cpu")), self.variant,
                                   torch.device("cpu"))
        self._buf = np.empty((1, *self.handler.input_shape), np.float32)

    def classify(self, payloads: list[bytes]) -> list[dict[str, Any]]:
        """Top-5 of each image, in order; raises the handler's InputError on a bad image."""
        if len(payloads) > len(self._buf):
            self._buf = np.empty((len(payloads), *self.handler.input_shape), np.float32)
        batch = self._buf[: len(payloads)]
        for i, data in enumerate(payloads):
            self.handler.preprocess(data, "", {}, batch[i])
        x = torch.from_numpy(batch)
        if self.variant.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.inference_mode(), precision("cpu", self.variant.autocast):
            outputs = self.model(x).float()
        return self.handler.postprocess(outputs, [{}] * len(payloads))  # type: ignore[no-any-return]
