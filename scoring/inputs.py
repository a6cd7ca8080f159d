"""What to score: image files, folders (recursive) and manifests, streamed one item at a time.

A manifest names files (``.txt``: a path a line; ``.jsonl``: ``{"id", "path"}``) or, for a
text model, holds the texts themselves (``.jsonl``: ``{"id", "text"}``; ``.txt`` with
``texts=True``, ``score --texts``: a text a line, its id the manifest's name and the line
number) or, for a chat model, the prompts (``.jsonl``: ``{"id", "prompt"}`` or ``{"id",
"messages"}``, with the request's other fields: ``max_new_tokens``, ``temperature``, ...).

Nothing here holds the whole input list: folders are walked lazily and
manifests read line by line, so a million inputs cost no more memory than ten.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"})
MANIFEST_SUFFIXES = frozenset({".txt", ".jsonl"})


@dataclass(frozen=True, slots=True)
class Item:
    """One input: ``id`` names it in the output (and for --resume); ``path`` is read and sent,
    or, for a text of a manifest, ``text`` is sent and ``path`` is empty, or, for a prompt
    of a manifest, ``request`` (a generation request, PROTOCOL.md "Generation") is sent as
    JSON and ``path`` is empty."""

    id: str
    path: str
    text: str | None = None
    request: Mapping[str, Any] | None = None


class ManifestError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Unsendable:
    """Why an item cannot be sent: its record's error ``code`` and ``message``."""

    code: str
    message: str


def read_payload(item: Item,
                 max_bytes: int) -> bytes | str | Mapping[str, Any] | Unsendable:
    """The item's payload: its text, its request, or its file's bytes (``max_bytes`` at
    most); or why it
    cannot be sent: the file cannot be read (``unreadable_file``) or either is over the
    limit (``payload_too_large``)."""
    if item.text is not None:
        if len(item.text.encode()) <= max_bytes:
            return item.text
        return Unsendable("payload_too_large", f"text is longer than {max_bytes} bytes")
    if item.request is not None:  # sent as JSON; the worker checks its fields (bad_input)
        if len(json.dumps(item.request, ensure_ascii=False).encode()) <= max_bytes:
            return item.request
        return Unsendable("payload_too_large", f"request is longer than {max_bytes} bytes")
    try:
        with open(item.path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        return Unsendable("unreadable_file", f"cannot read file: {e.strerror or e}")
    if len(data) > max_bytes:
        return Unsendable("payload_too_large", f"file is larger than {max_bytes} bytes")
    return data


def iter_items(inputs: Iterable[str], texts: bool = False) -> Iterator[Item]:
    """Items of every input, in order: files as given, folders walked (sorted, by image
    suffix), ``.txt`` manifests (a path a line, or with ``texts`` a text a line) and
    ``.jsonl`` manifests (``id`` and ``path`` or ``text``). Relative paths in a manifest
    are relative to the manifest's folder."""
    for raw in inputs:
        path = Path(raw)
        if path.is_dir():
            yield from _walk(path)
        elif path.suffix.lower() == ".txt":
            yield from (_txt_texts if texts else _txt_manifest)(path)
        elif path.suffix.lower() == ".jsonl":
            yield from _jsonl_manifest(path)
        else:
            yield Item(raw, raw)


def iter_files(inputs: Iterable[str]) -> Iterator[Path]:
    """The files ``submit`` sends, in order: each file as given, whatever it holds (a
    ``.txt`` is a text payload there, not a manifest), and folders walked as by
    ``iter_items``. Manifests are ``score``'s."""
    for raw in inputs:
        path = Path(raw)
        if path.is_dir():
            yield from (Path(item.path) for item in _walk(path))
        else:
            yield path


def _walk(folder: Path) -> Iterator[Item]:
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            if os.path.splitext(name)[1].lower() in IMAGE_SUFFIXES:
                full = os.path.join(root, name)
                yield Item(full, full)


def _resolve(manifest: Path, entry: str) -> str:
    return entry if os.path.isabs(entry) else str(manifest.parent / entry)


def _lines(manifest: Path) -> Iterator[tuple[int, str]]:
    """Numbered lines of a manifest; an unreadable one is a ManifestError, not a traceback."""
    try:
        with open(manifest, encoding="utf-8") as f:
            yield from enumerate(f, 1)
    except OSError as e:
        raise ManifestError(f"{manifest}: cannot read manifest: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise ManifestError(f"{manifest}: manifest is not UTF-8 text ({e})") from e


def _txt_manifest(manifest: Path) -> Iterator[Item]:
    for _, line in _lines(manifest):
        entry = line.strip()
        if entry and not entry.startswith("#"):
            yield Item(entry, _resolve(manifest, entry))


def _txt_texts(manifest: Path) -> Iterator[Item]:
    """A text a line (its line ending dropped, blank lines skipped): ``name:line``."""
    for number, line in _lines(manifest):
        text = line.rstrip("\r\n")
        if text.strip():
            yield Item(f"{manifest.name}:{number}", "", text)


def _jsonl_manifest(manifest: Path) -> Iterator[Item]:
    for number, line in _lines(manifest):
        if not line.strip():
            continue
        try:
            yield _jsonl_item(manifest, json.loads(line))
        except (ValueError, KeyError, TypeError) as e:
            raise ManifestError(f"{manifest}:{number}: expected an object with 'id' and "
                                f"'path', 'text', 'prompt' or 'messages' ({e})") from e


def _jsonl_item(manifest: Path, row: dict[str, object]) -> Item:
    if "prompt" in row or "messages" in row:
        return Item(str(row["id"]), "", request={k: v for k, v in row.items() if k != "id"})
    if "text" not in row:
        return Item(str(row["id"]), _resolve(manifest, str(row["path"])))
    text = row["text"]
    if not isinstance(text, str):
        raise TypeError(f"'text' is {type(text).__name__}, not a string")
    return Item(str(row["id"]), "", text)


def count_items(inputs: Iterable[str], texts: bool = False) -> int | None:
    """How many items ``iter_items`` will yield (a second pass, for the progress bar's ETA);
    None when a manifest is unreadable (the scoring pass reports that)."""
    try:
        return sum(1 for _ in iter_items(inputs, texts))
    except ManifestError:
        return None
