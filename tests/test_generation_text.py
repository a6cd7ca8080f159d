"""Text deltas of a generated answer (gpu_worker/generation/text.py): pure, a fake decoder
that maps each token to bytes, as byte-level BPE does."""

from __future__ import annotations

from collections.abc import Sequence

from redbatch.gpu_worker.generation.text import TextStream

#: A token is a piece of UTF-8: "é" is split over tokens 1 and 2, "🚀" over 3, 4 and 5.
PIECES = {0: b"caf", 1: b"\xc3", 2: b"\xa9", 3: b"\xf0\x9f", 4: b"\x9a", 5: b"\x80",
          6: b" ", 7: b"EN", 8: b"D", 9: b"!", 10: b"ok"}


def decode(ids: Sequence[int]) -> str:
    return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")


def feed(stream: TextStream, ids: Sequence[int]) -> list[str]:
    return [stream.push(i) for i in ids]


def test_a_character_split_over_tokens_is_sent_whole() -> None:
    s = TextStream(decode)
    assert feed(s, [0, 1, 2, 6, 3, 4, 5]) == ["caf", "", "é", " ", "", "", "🚀"]
    assert s.flush() == ""


def test_a_stop_string_over_several_tokens_is_never_sent() -> None:
    s = TextStream(decode, stop=["END"])
    deltas = feed(s, [10, 6, 7, 8, 9])
    assert "".join(deltas) == "ok " and s.stopped
    assert s.flush() == "" and s.text == "ok "


def test_text_held_for_a_possible_stop_string_comes_out_when_it_is_not_one() -> None:
    s = TextStream(decode, stop=["END"])           # the last 2 characters wait
    assert feed(s, [10, 7, 9]) == ["", "ok", "E"]
    assert s.flush() == "N!" and s.text == "okEN!" and not s.stopped


def test_the_held_tail_is_flushed_at_the_end() -> None:
    s = TextStream(decode, stop=["END"])
    sent = "".join(feed(s, [10, 6, 7]))
    assert sent + s.flush() == "ok EN"
