"""Generation jobs (PROTOCOL.md "Generation"): the payload, its limits, and the token
stream's entries. Pure: the worker validates payloads with it, the clients read entries.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from redbatch.common.protocol.errors import ErrorCode, ProtocolError

#: The payload's limits (PROTOCOL.md "Generation limits").
MAX_PAYLOAD_BYTES = 65_536
MAX_MESSAGES = 64
MAX_NEW_TOKENS = 1024
DEFAULT_MAX_NEW_TOKENS = 128
MAX_TEMPERATURE = 4.0
MAX_STOPS = 4
MAX_STOP_BYTES = 64
MAX_SEED = 2**63 - 1
ROLES = ("system", "user", "assistant")
FIELDS = frozenset({"messages", "prompt", "max_new_tokens", "temperature", "top_p", "seed",
                    "stop"})
CONTENT_TYPE = "application/json"
#: Why a generation ended (the token stream's ``finish``, the result's ``finish_reason``).
FINISH_REASONS = ("stop", "length", "cancelled", "deadline", "error")
#: What a client sets the stop key to, and for how long (ms).
STOP_VALUE = "1"
STOP_TTL_MS = 600_000


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A valid payload: ``messages`` (chat) or ``prompt`` (raw text), never both."""

    messages: tuple[Mapping[str, str], ...] | None
    prompt: str | None
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def to_json(self) -> bytes:
        out: dict[str, Any] = {"max_new_tokens": self.max_new_tokens,
                               "temperature": self.temperature, "top_p": self.top_p,
                               "stop": list(self.stop)}
        if self.seed is not None:
            out["seed"] = self.seed
        if self.messages is not None:
            out["messages"] = [dict(m) for m in self.messages]
        else:
            out["prompt"] = self.prompt
        return json.dumps(out, ensure_ascii=False).encode()


def _int(value: Any, name: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"{name} must be an integer from {low} to {high}")
    return value


def _number(value: Any, name: str) -> float:
    if type(value) not in (int, float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a number")
    return float(value)


def _messages(value: Any) -> tuple[Mapping[str, str], ...]:
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_MESSAGES:
        raise ValueError(f"messages must be an array of 1 to {MAX_MESSAGES} messages")
    for i, m in enumerate(value):
        if (not isinstance(m, dict) or set(m) != {"role", "content"}
                or m["role"] not in ROLES or not isinstance(m["content"], str)):
            raise ValueError(f"message {i} must be {{role: {'|'.join(ROLES)}, content: "
                             "string}")
    return tuple(value)


def _stops(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > MAX_STOPS or not all(
            isinstance(s, str) and 1 <= len(s.encode()) <= MAX_STOP_BYTES for s in value):
        raise ValueError(f"stop must be an array of at most {MAX_STOPS} strings of 1 to "
                         f"{MAX_STOP_BYTES} bytes")
    return tuple(value)


def parse_request(payload: bytes, max_new_tokens: int = MAX_NEW_TOKENS) -> GenerationRequest:
    """The request a payload holds; ValueError (answered ``bad_input``) saying what is wrong.
    The caller checks the size first (``payload_too_large``)."""
    try:
        data = json.loads(payload.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError("the payload is not UTF-8") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"the payload is not JSON: {e.msg}") from None
    if not isinstance(data, dict):
        raise ValueError("the payload must be a JSON map")
    unknown = sorted(set(data) - FIELDS)
    if unknown:
        raise ValueError(f"unknown fields {unknown[:4]}")
    if ("messages" in data) == ("prompt" in data):
        raise ValueError("give exactly one of messages and prompt")
    prompt = data.get("prompt")
    if "prompt" in data and (not isinstance(prompt, str) or not prompt):
        raise ValueError("prompt must be a non-empty string")
    messages = _messages(data["messages"]) if "messages" in data else None
    temperature = _number(data.get("temperature", 0.0), "temperature")
    top_p = _number(data.get("top_p", 1.0), "top_p")
    if not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise ValueError(f"temperature must be 0 to {MAX_TEMPERATURE:g}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError("top_p must be over 0 and at most 1")
    seed = data.get("seed")
    return GenerationRequest(
        messages, prompt,
        _int(data.get("max_new_tokens", min(DEFAULT_MAX_NEW_TOKENS, max_new_tokens)),
             "max_new_tokens", 1,
             max_new_tokens),
        temperature, top_p, None if seed is None else _int(seed, "seed", 0, MAX_SEED),
        _stops(data.get("stop", [])))


def job_charge(payload: bytes, content_type: str) -> int:
    """A job's charge against its lane's token bound (PROTOCOL.md "Admission control"),
    the admission call's ``<charge>``: for a generation payload (JSON, at most
    MAX_PAYLOAD_BYTES, a map holding ``prompt`` or ``messages``) its length in bytes plus
    its ``max_new_tokens`` (DEFAULT_MAX_NEW_TOKENS when absent or not an integer from 1 to
    MAX_NEW_TOKENS); 0 for any other job. Bytes stand in for the prompt's tokens, which
    only the worker can count: a byte-level BPE token spans one byte of text or more, and
    the JSON around the text pays for most of the chat template's tokens."""
    if content_type != CONTENT_TYPE or len(payload) > MAX_PAYLOAD_BYTES:
        return 0
    try:
        data = json.loads(payload)
    except (ValueError, RecursionError):  # not UTF-8, not JSON, nested too deep
        return 0
    if not isinstance(data, dict) or not ("prompt" in data or "messages" in data):
        return 0
    new = data.get("max_new_tokens")
    if isinstance(new, int) and not isinstance(new, bool) and 1 <= new <= MAX_NEW_TOKENS:
        return len(payload) + new
    return len(payload) + DEFAULT_MAX_NEW_TOKENS


def chunk_id(index: int) -> str:
    """The entry id of chunk ``index`` (from 1) of a token stream."""
    return f"0-{index}"


def chunk_index(entry_id: bytes | str) -> int:
    """The chunk index an entry id names (``0-n`` -> n)."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(text.partition("-")[2])


def parse_payload(payload: bytes, max_new_tokens: int = MAX_NEW_TOKENS) -> GenerationRequest:
    """:func:`parse_request` for the worker: ProtocolError ``payload_too_large`` past
    MAX_PAYLOAD_BYTES, ``bad_input`` for anything else wrong."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise ProtocolError(ErrorCode.PAYLOAD_TOO_LARGE,
                            f"{len(payload)} bytes, over {MAX_PAYLOAD_BYTES}")
    try:
        return parse_request(payload, max_new_tokens)
    except ValueError as e:
        raise ProtocolError(ErrorCode.BAD_INPUT, str(e)) from None


def _count(value: str | None) -> int:
    return int(value) if value else 0


@dataclass(frozen=True, slots=True)
class Chunk:
    """One token stream entry (PROTOCOL.md "Token stream"); the usage fields only on the
    last (``finish`` set)."""

    index: int
    token_ids: list[int]
    text: str
    finish: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft_ms: float | None = None
    error: str | None = None

    def fields(self) -> dict[str, str]:
        """The entry's fields, all strings."""
        out = {"tokens": " ".join(map(str, self.token_ids)), "text": self.text}
        if self.finish is not None:
            out.update(finish=self.finish, prompt_tokens=str(self.prompt_tokens),
                       completion_tokens=str(self.completion_tokens),
                       cached_tokens=str(self.cached_tokens),
                       ttft_ms="" if self.ttft_ms is None else repr(self.ttft_ms))
            if self.error is not None:
                out["error"] = self.error
        return out

    @classmethod
    def read(cls, entry_id: bytes | str, fields: Mapping[Any, Any]) -> Chunk:
        """An entry as Redis returns it; ValueError (or UnicodeDecodeError) for one that
        is not a token stream entry."""
        f = {(k.decode() if isinstance(k, bytes) else str(k)):
             (v.decode() if isinstance(v, bytes) else str(v)) for k, v in fields.items()}
        if "tokens" not in f or "text" not in f:
            raise ValueError("not a token stream entry")
        ttft = f.get("ttft_ms")
        return cls(chunk_index(entry_id), [int(t) for t in f["tokens"].split()], f["text"],
                   f.get("finish"), _count(f.get("prompt_tokens")),
                   _count(f.get("completion_tokens")), _count(f.get("cached_tokens")),
                   float(ttft) if ttft else None, f.get("error"))
