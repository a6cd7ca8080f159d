"""Payload types (PROTOCOL.md "Payload types"): how a client turns a value into a job's
``payload`` bytes and ``content_type``, and how a handler reads it back.

The wire stays bytes: ``content_type`` says how they were made, and a handler that wants
the value calls :func:`decode_payload`. Four kinds, one home:

========================  ===========================  ===============================
value                     content_type                 bytes
========================  ===========================  ===============================
bytes-like                ``application/octet-stream`` as they are (or the type given)
str                       ``text/plain; charset=utf-8`` UTF-8
numpy array               ``application/x-npy``        the ``.npy`` format, no pickle
JSON value (dict, list,   ``application/json``         UTF-8 JSON
int, float, bool, None)
========================  ===========================  ===============================

numpy is imported only for an array: a client-only install has none, and needs none.
"""

from __future__ import annotations

import functools
import io
import json
import sys
from typing import Any

BYTES = "application/octet-stream"
TEXT = "text/plain; charset=utf-8"
JSON = "application/json"
NPY = "application/x-npy"

MAX_NPY_DIMS = 32
"""Most dimensions of an array payload (numpy's own limit is 64)."""


@functools.lru_cache(maxsize=256)  # a deployment sends a few types: one split each
def media_type(content_type: str) -> str:
    """The media type of a content type, lower case, without parameters
    (``"Text/Plain; charset=utf-8"`` -> ``"text/plain"``)."""
    return content_type.split(";", 1)[0].strip().lower()


def encode_payload(value: Any, content_type: str | None = None) -> tuple[bytes, str]:
    """``(payload, content_type)`` for ``value``: bytes-like as they are (``content_type``
    or BYTES), str as UTF-8 (TEXT), a numpy array as ``.npy`` (NPY), and any other JSON
    value as UTF-8 JSON (JSON). A ``content_type`` given for a value that is not bytes
    replaces the one chosen, the encoding stays. Raises TypeError for a value none of
    them can carry (an object array, a set, a float NaN in JSON)."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value), content_type or BYTES
    if isinstance(value, str):
        return value.encode(), content_type or TEXT
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.ndarray):
        return _npy(numpy, value), content_type or NPY
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise TypeError(f"payload of type {type(value).__name__} is not bytes, str, a "
                        f"numpy array or a JSON value: {e}") from None
    return text.encode(), content_type or JSON


def _npy(numpy: Any, array: Any) -> bytes:
    if array.dtype.hasobject:
        raise TypeError("a numpy array of Python objects cannot be sent (it would need pickle)")
    buffer = io.BytesIO()
    numpy.lib.format.write_array(buffer, numpy.asanyarray(array), allow_pickle=False)
    return buffer.getvalue()


def decode_payload(payload: bytes, content_type: str) -> Any:
    """The value a payload carries, by its ``content_type``: a str for ``text/plain``
    (UTF-8), a JSON value for ``application/json``, a numpy array for
    ``application/x-npy`` (never unpickled), else the bytes themselves. Raises ValueError,
    with a message fit for a ``bad_input`` answer, for bytes that are not what their type
    says. Bounded by the payload limit the worker already applied."""
    kind = media_type(content_type)
    try:
        if kind == "text/plain":
            return payload.decode("utf-8")
        if kind == "application/json":
            return json.loads(payload.decode("utf-8"), parse_constant=_no_constant)
        if kind == NPY:
            return _load_npy(payload)
    except RecursionError:
        raise ValueError(f"{kind} payload is nested too deeply") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{kind} payload does not decode: {e}") from None
    return payload


def _no_constant(name: str) -> float:
    raise ValueError(f"JSON payload holds {name}, which JSON does not allow")


def _load_npy(payload: bytes) -> Any:
    import numpy  # the worker side has it; only an array payload gets here

    try:
        array = numpy.load(io.BytesIO(payload), allow_pickle=False)
    except (ValueError, EOFError, OSError) as e:
        raise ValueError(f"application/x-npy payload does not decode: {e}") from None
    if not isinstance(array, numpy.ndarray) or array.ndim > MAX_NPY_DIMS:
        raise ValueError(f"application/x-npy payload is not an array of at most "
                         f"{MAX_NPY_DIMS} dimensions")
    return array
