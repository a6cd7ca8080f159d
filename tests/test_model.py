"""The default model on real photos, through the same preprocess and device path the worker uses."""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from conftest import SAMPLES
from PIL import Image
from redbatch.common.config import LimitSettings
from redbatch.gpu_worker.efficientnet_lite import load_efficientnet_lite0
from redbatch.gpu_worker.handlers import EfficientNetLite0, Handler, imagenet_labels
from redbatch.gpu_worker.model import ModelRunner, resolve_device
from redbatch.preproc_worker.decode import normalise_into, open_image, resize_center_crop
from redbatch.preproc_worker.shm import SlotArray

CAT_LABELS = {"tabby", "tiger cat", "Egyptian cat"}
COFFEE_LABELS = {"espresso", "cup", "coffee mug"}


@dataclass
class Device:
    """The worker's device path over real shared-memory slots, without Redis or a pool."""

    runner: Device
    slots: SlotArray

    @property
    def handler(self) -> Handler:
        return self.runner.handler


@pytest.fixture(scope="module")
def runner() -> Iterator[Device]:
    handler = EfficientNetLite0(LimitSettings())
    slots = SlotArray.create(8, handler.input_shape, handler.input_dtype)
    run = ModelRunner(handler, resolve_device("cpu"), slots.array, max_batch_size=8)
    yield Device(run, slots)
    run.close()
    slots.close()


def classify(device: Device, payloads: list[bytes]) -> list[dict[str, Any]]:
    for i, data in enumerate(payloads):
        device.handler.preprocess(data, "", {}, device.slots.array[i])
    outcomes = device.runner.run(list(range(len(payloads))), [{}] * len(payloads))
    assert all(o.error is None for o in outcomes)
    return [o.output for o in outcomes]


def test_checkpoint_loads_strictly_and_labels_are_imagenet() -> None:
    model = load_efficientnet_lite0()  # strict=True inside; a missing key would raise
    assert sum(p.numel() for p in model.parameters()) > 4_000_000
    labels = imagenet_labels()
    assert len(labels) == 1000 and labels[281] == "tabby" and labels[967] == "espresso"


def test_real_photos_get_the_right_classes(runner: Device) -> None:
    cat, coffee = ((SAMPLES / n).read_bytes() for n in ("cat.jpg", "coffee.jpg"))
    out = classify(runner, [cat, coffee])
    assert out[0]["label"] in CAT_LABELS and out[1]["label"] in COFFEE_LABELS
    assert out[1]["score"] > 0.5
    for o in out:
        assert [t["score"] for t in o["top5"]] == sorted((t["score"] for t in o["top5"]),
                                                         reverse=True)
        assert set(o["top5"][0]) == {"label", "class_id", "score"}
        assert o["top5"][0]["label"] == o["label"]


def test_batched_and_single_runs_agree(runner: Device) -> None:
    cat = (SAMPLES / "cat.jpg").read_bytes()
    single = classify(runner, [cat])[0]
    batched = classify(runner, [cat] * 5)
    assert all(b["class_id"] == single["class_id"] for b in batched)
    assert all(abs(b["score"] - single["score"]) < 1e-4 for b in batched)


def test_draft_decoding_of_a_large_jpeg_keeps_the_prediction(runner: Device) -> None:
    photo = Image.open(SAMPLES / "cat.jpg").convert("RGB")
    big = photo.resize((photo.width * 4, photo.height * 4), Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    big.save(buf, "JPEG", quality=92)
    drafted = classify(runner, [buf.getvalue()])[0]
    full = np.empty((3, 224, 224), np.float32)
    img = open_image(buf.getvalue(), LimitSettings())  # no draft: full-size decode
    normalise_into(resize_center_crop(img, 256, 224), full, 127.0, 128.0)
    model = load_efficientnet_lite0()
    with torch.inference_mode():
        logits = model(torch.from_numpy(full)[None])
    assert int(logits.argmax()) == drafted["class_id"]
    assert drafted["label"] in CAT_LABELS
