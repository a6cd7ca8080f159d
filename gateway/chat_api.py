"""OpenAI chat and completions bodies to generation jobs, and token stream chunks to
OpenAI responses and server-sent events: pure, no I/O.

``POST /v1/chat/completions`` takes ``messages`` (``system``, ``developer`` read as
``system``, ``user``, ``assistant``; content a text or a list of text parts) and
``POST /v1/completions`` a ``prompt`` (a text, or a list of one). Both take
``max_completion_tokens`` or ``max_tokens`` (the job's ``max_new_tokens``), ``temperature``,
``top_p``, ``seed``, ``stop`` (a text or a list), ``stream`` and
``stream_options.include_usage``, and the gateway's ``timeout`` (s, the job's deadline).
What the workers cannot honour is refused (400), never ignored: ``n`` over 1, ``logprobs``,
``tools``, a ``response_format`` that is not text, ``echo``, ``suffix``, penalties other
than 0. The payload itself is checked by the worker (PROTOCOL.md "Generation payload").

A stream's events carry ``id: <job id>/<chunk index>``: a client that reconnects with that
as ``Last-Event-ID`` (on the same route) reads on after that chunk, with no gap and no
duplicate. ``finish_reason`` is the protocol's: ``stop``, ``length``, and also
``cancelled`` (stopped while running: the text so far) and ``deadline``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from redbatch.common.protocol.generation import Chunk, GenerationRequest
from redbatch.gateway.errors import bad_request
from redbatch.gateway.openai_api import parse_timeout

CHAT, TEXT = "chat.completion", "text_completion"
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
#: Fields taken and ignored: they ask for nothing the answer would show.
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls",
                     "prompt_cache_key", "safety_identifier", "stream_options", "timeout",
                     "model", "messages", "prompt", "max_tokens", "max_completion_tokens",
                     "temperature", "top_p", "seed", "stop", "stream", "n"})
#: Fields refused unless they hold their default: a worker cannot honour them.
REFUSED = {"logprobs": (None, False), "top_logprobs": (None, 0), "tools": (None, []),
           "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None,),
           "response_format": (None, {"type": "text"}), "echo": (None, False),
           "suffix": (None,), "best_of": (None, 1), "logit_bias": (None, {}),
           "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
           "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,),
           "reasoning_effort": (None,), "web_search_options": (None,)}
EVENT_ID = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.-]*:[A-Za-z0-9_.:-]{1,100})/([0-9]{1,9})$")


@dataclass(frozen=True, slots=True)
class GenerationAsk:
    """A chat or completions request: the job's payload and how to answer."""

    model: str
    kind: str
    request: GenerationRequest
    stream: bool
    include_usage: bool
    timeout_s: float | None

    def payload(self) -> bytes:
        return self.request.to_json()


def parse_generation(body: Any, kind: str, max_timeout_s: float,
                     default_max_tokens: int) -> GenerationAsk:
    """The request in ``body`` (decoded JSON) for ``kind`` (CHAT or TEXT); ApiError 400
    for what it lacks or asks that the workers cannot do. Unset, ``temperature`` and
    ``top_p`` are OpenAI's 1 and the answer at most ``default_max_tokens``."""
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model must be the name of a served model", "model")
    for name, defaults in REFUSED.items():
        if name in body and body[name] not in defaults:
            raise bad_request(f"{name} is not supported by this server", name)
    unknown = sorted(set(body) - IGNORED - set(REFUSED))
    if unknown:
        raise bad_request(f"unknown fields {unknown[:5]}", unknown[0])
    if body.get("n") not in (None, 1):
        raise bad_request("n must be 1: one answer per request", "n")
    messages, prompt = (_messages(body.get("messages")), None) if kind == CHAT else \
        (None, _prompt(body.get("prompt")))
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    request = GenerationRequest(
        messages, prompt, default_max_tokens if limit is None else limit,
        1.0 if body.get("temperature") is None else body["temperature"],
        1.0 if body.get("top_p") is None else body["top_p"], body.get("seed"),
        _stops(body.get("stop")))
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("stream_options must be an object", "stream_options")
    stream = body.get("stream")
    if stream not in (None, True, False):
        raise bad_request("stream must be true or false", "stream")
    return GenerationAsk(model, kind, request, bool(stream),
                         bool((options or {}).get("include_usage")),
                         parse_timeout(body.get("timeout"), max_timeout_s))


def _messages(value: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise bad_request("messages must be a non-empty list", "messages")
    out = []
    for m in value:
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad_request("each message needs a role: system, developer, user or "
                              "assistant", "messages")
        out.append({"role": ROLES[m["role"]], "content": _content(m.get("content"))})
    return tuple(out)


def _content(value: Any) -> str:
    """A message's text: a string, or the concatenated text of a list of text parts."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    raise bad_request("a message's content must be text (or a list of text parts)",
                      "messages")


def _prompt(value: Any) -> str:
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str):
        raise bad_request("prompt must be a text (or a list of one text)", "prompt")
    return value


def _stops(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise bad_request("stop must be a text or a list of texts", "stop")


def parse_event_id(value: str | None) -> tuple[str, int] | None:
    """(public job id, last chunk index) of a ``Last-Event-ID``, or None when absent;
    ApiError 400 for one that is not ours."""
    if not value:
        return None
    found = EVENT_ID.match(value.strip())
    if not found:
        raise bad_request("Last-Event-ID is not an event id of this gateway's",
                          "Last-Event-ID")
    return found.group(1), int(found.group(2))


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def answer(ask: GenerationAsk, job_id: str, output: Mapping[str, Any],
           created_s: int) -> dict[str, Any]:
    """The whole answer (no stream) from the job's result ``output``."""
    text, finish = str(output["text"]), str(output["finish_reason"])
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
    if ask.kind == CHAT:
        choice["message"] = {"role": "assistant", "content": text, "refusal": None}
    else:
        choice["text"] = text
    return {"id": job_id, "object": ask.kind, "created": created_s, "model": ask.model,
            "choices": [choice], "system_fingerprint": None,
            "usage": usage(int(output.get("prompt_tokens") or 0),
                           int(output.get("completion_tokens") or 0),
                           int(output.get("cached_tokens") or 0))}


def events(ask: GenerationAsk, job_id: str, chunks: Sequence[Chunk], created_s: int,
           first: bool) -> bytes:
    """The server-sent events of ``chunks``: one per chunk, named by its index (and,
    ``first``, the assistant's role before them); the last holds its ``finish_reason`` and
    is followed by the usage when asked and ``[DONE]``. A chunk that ends in ``error`` is
    an ``error`` event."""
    out: list[str] = []
    obj = "chat.completion.chunk" if ask.kind == CHAT else TEXT
    base = {"id": job_id, "object": obj, "created": created_s, "model": ask.model,
            "system_fingerprint": None}

    def event(index: int | None, choice: dict[str, Any] | None, **more: Any) -> None:
        body = {**base, "choices": [] if choice is None else [choice], **more}
        named = "" if index is None else f"id: {job_id}/{index}\n"
        out.append(f"{named}data: {json.dumps(body, ensure_ascii=False)}\n\n")

    def choice(text: str | None, finish: str | None) -> dict[str, Any]:
        found: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if ask.kind == CHAT:
            found["delta"] = {} if text is None else {"content": text}
        else:
            found["text"] = text or ""
        return found

    if first and ask.kind == CHAT:
        event(0, {"index": 0, "delta": {"role": "assistant", "content": ""},
                  "finish_reason": None, "logprobs": None})
    for c in chunks:
        if c.finish == "error":
            error = {"message": f"the job failed: {c.error or 'internal'}",
                     "type": "api_error", "param": None, "code": c.error or "internal"}
            out.append(f"id: {job_id}/{c.index}\nevent: error\n"
                       f"data: {json.dumps({'error': error})}\n\n")
            break
        event(c.index, choice(c.text or (None if c.finish else ""), c.finish))
        if c.finish is not None:
            if ask.include_usage:
                event(None, None, usage=usage(c.prompt_tokens, c.completion_tokens,
                                              c.cached_tokens))
            out.append("data: [DONE]\n\n")
    return "".join(out).encode()
