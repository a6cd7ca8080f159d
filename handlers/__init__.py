"""Model handlers: what a served model provides (preprocess, load, postprocess), the built-in
ones, and the image decoding they share.

The neutral floor between the two sides of a worker: pool processes call ``preprocess``,
the worker's model threads call ``load`` and ``postprocess``; both import this package and
it imports neither of them (only ``common``). Write your own model against
:class:`~redbatch.handlers.base.Handler` and raise :class:`~redbatch.handlers.decode.InputError`
for a payload it cannot use.
"""

from redbatch.handlers.base import Handler, load_handler
from redbatch.handlers.decode import InputError
from redbatch.handlers.imagenet import (
    EfficientNetLite0,
    ImageClassifier,
    NullModel,
    TorchScriptClassifier,
)

__all__ = ["EfficientNetLite0", "Handler", "ImageClassifier", "InputError", "NullModel",
           "TorchScriptClassifier", "load_handler"]
