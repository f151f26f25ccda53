"""Incremental detokenisation: streamed pieces concatenate to the full decode, and a multi-byte
character is never emitted half-way (no U+FFFD in any piece)."""

from __future__ import annotations

import pytest

from dsi.text import IncrementalDetokenizer

BYTES_PER_TOKEN = 1


def byte_decode(ids):
    """A byte-level 'tokenizer': token i is byte i; invalid UTF-8 renders as U+FFFD."""
    return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("text", ["plain ascii", "héllo wörld", "日本語のテキスト", "emoji 🙂🚀 end", "a🎉"])
def test_pieces_concatenate_to_the_text_without_replacement_chars(text):
    data = list(text.encode("utf-8"))
    prompt = list("prompt: ".encode())
    detok = IncrementalDetokenizer(byte_decode, prompt)
    pieces = [detok.push([b]) for b in data]
    pieces.append(detok.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # a 4-byte emoji is released only when its last byte arrives
    if "🙂" in text:
        i = text.encode().index("🙂".encode())
        assert pieces[i] == pieces[i + 1] == pieces[i + 2] == ""


def test_flush_releases_a_dangling_partial_character():
    detok = IncrementalDetokenizer(byte_decode)
    assert detok.push(list("ok".encode())) == "ok"
    assert detok.push(["é".encode()[0]]) == ""
    assert detok.flush() == "\ufffd"
