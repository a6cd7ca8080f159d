"""The handler interface (what a served model provides), and how ``--model`` picks one.

A handler is used in two places: pool processes call ``preprocess`` (so this
module must not import torch at import time), and the worker calls ``load``
once and ``postprocess`` after each batch.

``--model`` accepts:

* a built-in name: ``efficientnet_lite0`` (the default), ``all_minilm_l6_v2`` (sentence
  embeddings of UTF-8 texts, handlers/text.py), ``null`` (the mean colour of a 32x32
  thumbnail: decoding, and nothing else) or ``null_tensor`` (the sum of four float32
  values: no decoding either);
* a TorchScript file ``path/to/model.pt`` taking N x 3 x 224 x 224 float
  images (ImageNet mean/std) and returning N x classes logits;
* a factory ``package.module:callable`` taking a ``LimitSettings`` and
  returning an object with the :class:`Handler` attributes. The factory is
  named by the operator on the command line, never by a job.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from redbatch.common.config import GENERATION_MODELS, LimitSettings
from redbatch.handlers.imagenet import EfficientNetLite0, NullModel, TorchScriptClassifier
from redbatch.handlers.tensors import NullTensorModel
from redbatch.handlers.text import AllMiniLmL6V2

if TYPE_CHECKING:
    import torch


class Handler(Protocol):
    """What a served model provides.

    ``preprocess`` writes one input into ``out`` (shape ``input_shape``, dtype
    ``input_dtype``) and raises ``InputError`` for unusable payloads. It may return the
    input's cost as an int (a text model: its tokens), which the worker batches by, or a
    (cost, rows) pair for an input that fills several rows of the model's batch (a list of
    texts: its longest text's tokens, and one row a text); None says every input costs the
    same. A handler whose inputs have costs says the largest in
    ``max_cost``: the worker then groups them in length buckets under a token budget
    (gpu_worker/batching/shaping.py, ``--max-batch-tokens``).
    ``load`` returns a callable from a batch tensor to an output tensor.
    ``postprocess`` turns the batch output into one msgpack-able value per request.

    Optional: ``inline_preprocess = True`` says that ``preprocess`` is trivial (a copy or a
    cast of a tensor payload: cheaper than the hop to a pool process and back, and unable to
    crash the process), so the worker runs it in its own main loop, with no pool hop. A
    handler without the attribute goes through the pool (:func:`preprocesses_inline`).

    Optional: ``calibration_samples(n)`` returns ``n`` real inputs as (payload, content
    type) pairs, like the ones the model serves. Calibration runs every variant on them and
    keeps only variants that give the plain model's top class on nearly all
    (gpu_worker/tuning/profile.py MIN_TOP1_AGREEMENT). Without it, a reduced-precision
    variant is never chosen unless the operator allows it (``--allow-reduced-precision``).
    The image classifiers return the sample photos and crops of them (handlers/samples.py).

    Optional: ``calibrates = False`` says that calibration cannot measure this model (it
    times fixed-shape inputs, and a text batch's cost depends on its longest text): the
    worker serves it without a profile, and ``redbatch calibrate`` refuses it in one line.
    """

    input_shape: tuple[int, ...]
    input_dtype: str

    def preprocess(self, payload: bytes, content_type: str, params: Mapping[str, Any],
                   out: np.ndarray) -> int | tuple[int, int] | None: ...

    def load(self, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]: ...

    def postprocess(self, outputs: torch.Tensor,
                    params: Sequence[Mapping[str, Any]]) -> list[Any]: ...


def preprocesses_inline(handler: Handler) -> bool:
    """Whether the worker runs this handler's ``preprocess`` itself rather than in the pool
    (its optional ``inline_preprocess`` attribute; False when absent)."""
    return bool(getattr(handler, "inline_preprocess", False))


BUILTIN: dict[str, Callable[[LimitSettings], Handler]] = {
    "efficientnet_lite0": EfficientNetLite0,
    "all_minilm_l6_v2": AllMiniLmL6V2,
    "null": NullModel,
    "null_tensor": NullTensorModel,
}


def max_cost_of(handler: Handler) -> int | None:
    """The largest cost ``preprocess`` returns for this handler's inputs (its optional
    ``max_cost``: the text model's 256 tokens), or None: its inputs all cost the same."""
    cost = getattr(handler, "max_cost", None)
    return cost if isinstance(cost, int) and cost > 0 else None


def calibrates(handler: Handler) -> bool:
    """Whether calibration can measure this handler's model (its optional ``calibrates``
    attribute; True when absent)."""
    return bool(getattr(handler, "calibrates", True))


def check_spec(spec: str) -> None:
    """Raise the ValueError :func:`load_handler` would for ``spec`` when it can tell without
    loading anything (an unknown name, a TorchScript file that is not there), so that a
    command refuses it before starting a worker; a factory is only checked by loading it."""
    if spec in BUILTIN or spec in GENERATION_MODELS or ":" in spec:
        return
    if spec.endswith((".pt", ".pth", ".ts")):
        if not Path(spec).is_file():
            raise ValueError(f"TorchScript file {spec!r} does not exist")
        return
    raise ValueError(f"unknown model {spec!r}: use one of {sorted(BUILTIN)}, a TorchScript "
                     "file (*.pt) or a factory 'package.module:callable'")


def load_handler(spec: str, limits: LimitSettings) -> Handler:
    """Build the handler that ``spec`` names; raises ValueError with the accepted forms."""
    check_spec(spec)
    if spec in BUILTIN:
        return BUILTIN[spec](limits)
    if ":" not in spec:
        return TorchScriptClassifier(spec, limits)
    module_name, _, attr = spec.partition(":")
    factory = getattr(importlib.import_module(module_name), attr)
    return factory(limits)  # type: ignore[no-any-return]
