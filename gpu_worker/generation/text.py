"""A sequence's answer as text deltas: never half a character, never past a stop string.

Pure: the tokenizer's ``decode`` is injected. Byte-level BPE decodes to the concatenation of
its tokens' bytes, so the text of the first n tokens is a prefix of the text of more, except
while a character's bytes are split over tokens: the decoder then ends in U+FFFD, and the
delta waits for the rest. With stop strings, the last ``len(longest stop) - 1`` characters
wait too, until they cannot begin one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class TextStream:
    """Feed a sequence's tokens one by one; each ``push`` returns the text now safe to send."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()) -> None:
        self._decode, self._stop = decode, [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = []
        self._text = ""        # everything decoded so far, complete characters only
        self.sent = 0          # characters of it handed out
        self.stopped = False   # a stop string was found: the answer ends before it

    def push(self, token: int) -> str:
        """Add a token; the new text safe to send ("" while it is held back)."""
        if self.stopped:
            return ""
        self._ids.append(token)
        text = self._decode(self._ids)
        if text.endswith(REPLACEMENT):
            return ""
        self._text = text
        cut = self._find_stop()
        if cut is not None:
            self.stopped, self._text = True, text[:cut]
            return self._take(cut)
        return self._take(len(text) - self._hold)

    def flush(self) -> str:
        """The text held back, at the end of the sequence."""
        return self._take(len(self._text))

    @property
    def text(self) -> str:
        return self._text

    def _find_stop(self) -> int | None:
        start = max(0, self.sent - self._hold)
        found = [i for i in (self._text.find(s, start) for s in self._stop) if i >= 0]
        return min(found) if found else None

    def _take(self, end: int) -> str:
        if end <= self.sent:
            return ""
        delta, self.sent = self._text[self.sent:end], end
        return delta
