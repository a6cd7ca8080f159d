"""OpenAI request bodies to jobs, and results to OpenAI responses: pure, no I/O.

``POST /v1/embeddings`` takes ``input`` as one text or a list of texts; the texts go to the
text model in jobs of up to 16 (one JSON array each, which it embeds in one job), and the
vectors come back in the texts' order, as floats or, with ``encoding_format: base64`` (the
``openai`` package's default), as base64 of little-endian float32, as OpenAI sends them.
"""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redbatch.gateway.errors import bad_request

TEXTS_PER_JOB = 16
"""Most texts the text model embeds in one job (PROTOCOL.md "Payload types")."""
ENCODINGS = ("float", "base64")


@dataclass(frozen=True, slots=True)
class EmbeddingsRequest:
    model: str
    texts: list[str]
    encoding: str
    timeout_s: float | None

    def chunks(self) -> list[list[str]]:
        """The texts in jobs of up to TEXTS_PER_JOB, in order."""
        return [self.texts[i:i + TEXTS_PER_JOB] for i in range(0, len(self.texts), TEXTS_PER_JOB)]


def parse_timeout(value: Any, max_s: float) -> float | None:
    """A request's ``timeout`` (s, a positive number up to ``max_s``), or None when absent."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise bad_request("timeout must be a number of seconds", "timeout") from None
    if (not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value)
            or not 0 < value <= max_s):
        raise bad_request(f"timeout must be a number of seconds in (0, {max_s:g}]", "timeout")
    return float(value)


def parse_embeddings(body: Any, max_texts: int, max_timeout_s: float) -> EmbeddingsRequest:
    """The embeddings request in ``body`` (decoded JSON); ApiError 400 for what it lacks."""
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model must be the name of a served model", "model")
    texts = body.get("input")
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, list) or not texts:
        raise bad_request("input must be a text or a non-empty list of texts", "input")
    if not all(isinstance(t, str) for t in texts):
        raise bad_request("input must hold texts: token arrays are not taken", "input")
    if len(texts) > max_texts:
        raise bad_request(f"input holds {len(texts)} texts; at most {max_texts}", "input")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ENCODINGS:
        raise bad_request("encoding_format must be float or base64", "encoding_format")
    if body.get("dimensions") is not None:
        raise bad_request("dimensions cannot be chosen: the model's vectors are returned",
                          "dimensions")
    return EmbeddingsRequest(model, texts, encoding,
                             parse_timeout(body.get("timeout"), max_timeout_s))


def vectors_of(outputs: Sequence[Any]) -> list[list[float]]:
    """The vectors of the jobs' outputs (``{embeddings: [...]}`` each), in order."""
    vectors: list[list[float]] = []
    for output in outputs:
        found = output.get("embeddings") if isinstance(output, dict) else None
        if not isinstance(found, list):
            raise ValueError("the model answered no embeddings: is it a text model?")
        vectors.extend(found)
    return vectors


def embeddings_response(model: str, vectors: list[list[float]],
                        encoding: str) -> dict[str, Any]:
    """The OpenAI embeddings response for ``vectors``, in order."""
    return {
        "object": "list",
        "model": model,
        "data": [{"object": "embedding", "index": i, "embedding": _encoded(v, encoding)}
                 for i, v in enumerate(vectors)],
        # The text model does not report its token counts.
        "usage": {"prompt_tokens": 0, "total_tokens": 0},
    }


def _encoded(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def models_response(live: dict[str, int], created_s: int) -> dict[str, Any]:
    """``GET /v1/models``: the models with a live worker, and how many."""
    return {"object": "list", "data": [
        {"id": m, "object": "model", "created": created_s, "owned_by": "redbatch",
         "workers": n} for m, n in sorted(live.items())]}
