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


# ---- bounded work: the window never grows with the output --------------------------------------

SPECIAL = 300  # ids >= 256 are special tokens, skipped by the decode


def counting(decode):
    """``decode`` that also counts the token ids it was given, over all calls."""
    work = {"ids": 0, "calls": 0}

    def wrapped(ids):
        work["ids"] += len(ids)
        work["calls"] += 1
        return decode(ids)

    return wrapped, work


def skipping_decode(ids):
    """Bytes, with special tokens skipped, and the leading space dropped as SentencePiece does."""
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace").removeprefix(" ")


def stream(decode, prompt, tokens):
    detok = IncrementalDetokenizer(decode, prompt)
    pieces = [detok.push([t]) for t in tokens]
    pieces.append(detok.flush())
    return pieces


N = 3000  # tokens: the quadratic version decodes about N**2 ids (millions), the linear one ~N * 20


@pytest.mark.parametrize("name, tokens", [
    ("lone continuation bytes", [0x80] * N),
    ("lead bytes without continuation", [0xE6] * N),
    ("the character U+FFFD itself", list("\ufffd".encode()) * (N // 3)),
    ("skipped special tokens", list(b"ab") + [SPECIAL] * N + list(b"cd")),
    ("a 4-byte character then specials", list("🙂".encode()) + [SPECIAL] * N),
])
def test_work_per_token_is_bounded(name, tokens):
    decode, work = counting(skipping_decode)
    pieces = stream(decode, list(b"prompt: "), tokens)
    assert "".join(pieces) == skipping_decode(tokens), name
    assert work["calls"] <= 2 * len(tokens) + 2
    assert work["ids"] <= 40 * len(tokens), f"{name}: {work['ids']} ids decoded for {len(tokens)} tokens"


def test_skipped_specials_keep_the_left_context():
    """Specials between words are dropped from the window, not the words before them: the space
    of ' world' survives (a decode that drops a leading space would lose it otherwise)."""
    tokens = [*b"hello", SPECIAL, SPECIAL, *b" world", SPECIAL, *b" \xc3", SPECIAL, 0xA9]
    pieces = stream(skipping_decode, [], tokens)
    assert "".join(pieces) == "hello world é"
    assert not any("\ufffd" in p for p in pieces)


def test_invalid_bytes_are_released_after_a_bounded_wait():
    """Garbage that keeps ending in U+FFFD is streamed (not held back to the end), a few tokens late."""
    detok = IncrementalDetokenizer(skipping_decode)
    pieces = [detok.push([0x80]) for _ in range(50)]
    assert sum(len(p) for p in pieces) >= 50 - 10 and set("".join(pieces)) == {"\ufffd"}


# ---- bad ids: refused by the decode, and the detokenizer goes on as if they had not been pushed ------


def checked_decode(ids):
    """``byte_decode`` refusing what a model's ``decode`` refuses: anything but token ids 0..255."""
    from dsi.errors import ConfigError

    for i, token in enumerate(ids):
        if type(token) is not int or not 0 <= token < 256:
            raise ConfigError(f"ids[{i}]={token!r} is no token id in [0, 256)")
    return byte_decode(ids)


@pytest.mark.parametrize("bad", [[300], [-1], [1.5], [None], ["a"]])
def test_a_push_the_decode_refuses_leaves_the_window_as_it_was(bad):
    from dsi.errors import ConfigError

    detok = IncrementalDetokenizer(checked_decode, list(b"prompt: "))
    assert detok.push(list(b"he")) == "he"
    with pytest.raises(ConfigError, match=r"ids\[\d+\]="):
        detok.push(bad)
    assert detok.push(list(b"llo")) == "llo"  # the refused ids are not in the window
    assert detok.flush() == ""


@pytest.mark.parametrize("bad", [5, None, "abc", b"abc", {1: 2}])
def test_tokens_and_prompt_ids_must_be_sequences_of_ids(bad):
    from dsi.errors import ConfigError

    detok = IncrementalDetokenizer(byte_decode, list(b"ok"))
    with pytest.raises(ConfigError, match=r"tokens=.* must be a sequence of token ids"):
        detok.push(bad)
    assert detok.push(list(b"!")) == "!"
    with pytest.raises(ConfigError, match=r"prompt_ids=.* must be a sequence of token ids"):
        IncrementalDetokenizer(byte_decode, bad)
    with pytest.raises(ConfigError, match=r"decode=.* must be callable"):
        IncrementalDetokenizer(None, [])
