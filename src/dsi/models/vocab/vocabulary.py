"""Vocabularies as byte strings: what each token spells, how to spell bytes in tokens, and which
tokens two vocabularies share.

Two tokenizers of different model families cut the same text differently, but both spell text:
every token stands for a byte string (its *piece*). :class:`Vocabulary` holds the pieces of one
tokenizer's ids and spells a byte string back in its tokens (:meth:`Vocabulary.spell`);
:class:`Intersection` pairs the ids of two vocabularies whose pieces are the same bytes. A drafter
with its own tokenizer drafts for a target through them (:mod:`dsi.models.vocab.bridge`).

Pieces are read from the tokenizer, not guessed from ``decode`` of single tokens (which loses
the bytes of partial UTF-8 characters and leading spaces):

- a GGUF tokenizer (:class:`dsi.models.llamacpp.GGUFTokenizer`) gives each token's bytes
  (``token_bytes()``);
- a Hugging Face fast tokenizer with a ``ByteLevel`` decoder (GPT-2, Llama 3, Qwen, SmolLM...)
  maps each character of a token string back to its byte; SentencePiece-style decoders
  (``▁`` for a space, ``<0xNN>`` byte fallback) likewise; a decoder that joins tokens (``WordLevel``
  or ``WordPiece`` models: words with a space between them, ``##`` continuations without) spells a
  word as ``" word"``; added tokens spell their content;
- anything else falls back to ``decode([id])`` of tokens that decode to whole characters.

Nothing here decides tokens: a wrong or missing piece only costs drafts (the target verifies
every token), never exactness. No torch.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from dsi.errors import ConfigError
from dsi.models.base import check_int

logger = logging.getLogger(__name__)

# GPT-2's pre-tokenizer pattern with the standard library's classes ([^\W\d_] = a letter): byte-level BPE
# never merges across these pieces, so a token that ends before the last piece of a text is final
_PRE_TOKENS = re.compile(r"""'(?:[sdmt]|ll|ve|re)| ?[^\W\d_]+| ?\d+| ?[^\s\w]+|\s+(?!\S)|\s+""")


def last_word_start(data: bytes) -> int:
    """Byte offset in ``data`` where its last pre-token (a word with its leading space, a number, a run
    of punctuation or of spaces) starts: text appended to ``data`` may still change how the bytes
    from there on are tokenized, but not the bytes before (for byte-level BPE tokenizers, which
    split text this way before merging). Bytes that start no character at the very beginning (the
    rest of a character cut before ``data``) count as finished."""
    lead = 0
    while lead < len(data) and 0x80 <= data[lead] < 0xC0:
        lead += 1
    try:
        text = data[lead:].decode("utf-8")
    except UnicodeDecodeError as exc:
        text = data[lead: lead + exc.start].decode("utf-8")
    last = None
    for last in _PRE_TOKENS.finditer(text):
        pass
    if last is None:
        return lead
    return lead + len(text[: last.start()].encode("utf-8"))


@lru_cache(maxsize=1)
def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte <-> printable character table, inverted: character -> byte."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


class Vocabulary:
    """The pieces of one tokenizer's ids and a way to spell bytes in its tokens.

    ``pieces[i]`` is the byte string token ``i`` spells (``None``: unknown, the token is never
    proposed and spells nothing); ``encode_text`` tokenizes a ``str`` without adding special tokens
    (special tokens written in the text are recognised); ``start_ids`` are the tokens the tokenizer
    puts before a text (a BOS), which spell nothing.
    """

    def __init__(self, pieces: Sequence[bytes | None], encode_text: Callable[[str], list[int]],
                 start_ids: Sequence[int] = (), name: str = "vocabulary") -> None:
        self.pieces: tuple[bytes | None, ...] = tuple(pieces)
        self.encode_text = encode_text
        self.start_ids = tuple(int(t) for t in start_ids)
        self.name = name
        by_piece: dict[bytes, int] = {}
        for token, piece in enumerate(self.pieces):
            if piece:  # the first (lowest) id spelling a piece stands for it
                by_piece.setdefault(piece, token)
        self.by_piece = by_piece
        self._longest_piece = max((len(p) for p in by_piece), default=0)
        self._adds_space: bool | None = None  # whether encode_text puts a space before a text (found on use)

    def __len__(self) -> int:
        return len(self.pieces)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, size: int | None = None, name: str | None = None) -> Vocabulary:
        """The vocabulary of a Hugging Face tokenizer or a GGUF tokenizer, padded (with unknown pieces)
        or cut to ``size`` ids (a model's logit rows may outnumber its tokenizer's tokens)."""
        if tokenizer is None:
            raise ConfigError("a tokenizer is needed to translate between vocabularies (the model has none)")
        if size is not None:
            size = check_int(size, "size", 0)
        pieces = list(_pieces_of(tokenizer))
        if size is not None:
            pieces = (pieces + [None] * size)[:size]

        def encode_text(text: str) -> list[int]:
            return list(tokenizer.encode(text, add_special_tokens=False))

        try:
            start = list(tokenizer.encode("", add_special_tokens=True))
        except Exception:  # noqa: BLE001 - a tokenizer that cannot encode "" adds nothing we know of
            start = []
        eos = getattr(tokenizer, "eos_token_id", None)
        start = [t for t in start if t != eos]
        return cls(pieces, encode_text, start, name or getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)

    def piece(self, token: int) -> bytes:
        """The bytes ``token`` spells (empty when unknown: an integer outside the vocabulary); a ``token``
        that is no integer (float, str, bool, None...) is a :class:`ConfigError`."""
        if type(token) is not int:
            if not isinstance(token, int | np.integer) or isinstance(token, bool):
                raise ConfigError(f"token={token!r:.60} ({type(token).__name__}) is not a token id: an integer "
                                  f"in [0, {len(self.pieces)}) of {self.name}")
            token = int(token)
        if 0 <= token < len(self.pieces):
            return self.pieces[token] or b""
        return b""

    def spelling(self, tokens: Sequence[int]) -> bytes:
        return b"".join(self.piece(t) for t in tokens)

    def spell(self, data: bytes) -> list[int] | None:
        """Tokens whose pieces spell exactly ``data``, or None if this vocabulary cannot.

        Whole UTF-8 text is tokenized the tokenizer's own way; bytes that are not (a character cut
        by a token boundary) use single-byte tokens. If the tokenizer does not give the text back
        byte for byte (a normalizer, an added prefix space), the text is spelled byte by byte where
        single-byte tokens exist.
        """
        data = _check_bytes(data)
        if not data:
            return []
        single = self.by_piece.get(data)
        if single is not None:
            return [single]
        tokens: list[int] = []
        rest = data
        while rest:
            try:
                text, bad, rest = rest.decode("utf-8"), b"", b""
            except UnicodeDecodeError as exc:
                text, bad, rest = rest[: exc.start].decode("utf-8"), rest[exc.start: exc.end], rest[exc.end:]
            if text:
                ids = self._encode(text)
                if self.spelling(ids) != text.encode("utf-8"):
                    ids = self._bytewise(text.encode("utf-8"))
                    if ids is None:
                        return None
                tokens.extend(ids)
            if bad:
                ids = self._bytewise(bad)
                if ids is None:
                    return None
                tokens.extend(ids)
        return tokens

    def _bytewise(self, data: bytes) -> list[int] | None:
        ids = [self.by_piece.get(bytes([b])) for b in data]
        return None if None in ids else ids  # type: ignore[return-value]

    def tokens_of_prefix(self, data: bytes) -> list[int]:
        """Tokens spelling a prefix of ``data``: bytes that start no character (the rest of one a token
        boundary cut before ``data``) as the longest pieces spelling them, then this tokenizer's tokens
        of the whole UTF-8 text that follows up to the first broken or unfinished character, kept while
        their pieces spell ``data`` (a normalizer may give other bytes back: those are dropped)."""
        data = _check_bytes(data)
        out: list[int] = []
        at = 0
        while at < len(data):
            try:
                text = data[at:].decode("utf-8")
            except UnicodeDecodeError as exc:
                if exc.start > 0:
                    text = data[at: at + exc.start].decode("utf-8")
                elif exc.reason == "unexpected end of data":  # a character still being written: wait
                    return out
                else:  # the rest of a character cut before ``data``: the longest piece spelling it
                    token = self._longest_piece_at(data, at)
                    if token is None:
                        return out
                    out.append(token)
                    at += len(self.pieces[token] or b"")
                    continue
            ids, took = self._encode(text), 0
            for token in ids:
                piece = self.piece(token)
                if not piece or data[at: at + len(piece)] != piece:
                    break
                out.append(token)
                at += len(piece)
                took += 1
            if took or not ids:
                return out
            # the tokenizer gives these bytes back otherwise (a prefix space it adds, a normalizer): the
            # longest piece spelling them, then the tokenizer again on the rest
            token = self._longest_piece_at(data, at)
            if token is None:
                return out
            out.append(token)
            at += len(self.pieces[token] or b"")
        return out

    def _encode(self, text: str) -> list[int]:
        """``encode_text``, undoing a space the tokenizer puts before every text (SentencePiece's dummy
        prefix, ``add_prefix_space``): a text that starts with a space is encoded without it."""
        if self._adds_space is None:
            probe = self.encode_text("a")
            self._adds_space = self.spelling(probe) == b" a"
        if self._adds_space and text.startswith(" "):
            return self.encode_text(text[1:])
        return self.encode_text(text)

    def _longest_piece_at(self, data: bytes, start: int) -> int | None:
        for end in range(min(len(data), start + self._longest_piece), start, -1):
            token = self.by_piece.get(data[start:end])
            if token is not None:
                return token
        return None


def _check_bytes(data: object) -> bytes:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ConfigError(f"data={data!r:.60} ({type(data).__name__}) must be bytes (text: encode it as UTF-8)")
    return bytes(data)


@dataclass(frozen=True)
class Intersection:
    """The tokens two vocabularies share: ``target_ids[i]`` and ``drafter_ids[i]`` spell the same
    bytes (one pair per shared piece)."""

    target_ids: np.ndarray  # [n] int64
    drafter_ids: np.ndarray  # [n] int64

    @classmethod
    def of(cls, target: Vocabulary, drafter: Vocabulary) -> Intersection:
        pairs = sorted((t, drafter.by_piece[p]) for p, t in target.by_piece.items() if p in drafter.by_piece)
        t_ids = np.fromiter((t for t, _ in pairs), dtype=np.int64, count=len(pairs))
        d_ids = np.fromiter((d for _, d in pairs), dtype=np.int64, count=len(pairs))
        return cls(t_ids, d_ids)

    @property
    def size(self) -> int:
        return int(self.target_ids.size)

    def target_logits(self, drafter_row: np.ndarray, vocab_size: int) -> np.ndarray:
        """The drafter's logit row ``[V_drafter]`` restricted to the shared tokens, in the target's ids
        ``[vocab_size]`` (-inf elsewhere): after softmax, the drafter's law restricted to the
        intersection and renormalized."""
        out = np.full(vocab_size, -np.inf, dtype=np.result_type(drafter_row.dtype, np.float32))
        out[self.target_ids] = drafter_row[self.drafter_ids]
        return out


def same_vocabulary(a: Any, b: Any) -> bool:
    """True if two tokenizers map the same token strings to the same ids."""
    return a is b or a.get_vocab() == b.get_vocab()


# ---- reading the pieces out of a tokenizer ---------------------------------------------------------


def _pieces_of(tokenizer: Any) -> list[bytes | None]:
    own = getattr(tokenizer, "token_bytes", None)
    if callable(own):  # a GGUF tokenizer knows its bytes
        return list(own())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        pieces = _hf_fast_pieces(tokenizer, backend)
        if pieces is not None:
            return pieces
    return _decoded_pieces(tokenizer)


def _decoder_kinds(decoder: dict | None) -> set[str]:
    if not decoder:
        return set()
    kinds = {decoder.get("type", "")}
    for inner in decoder.get("decoders", []) or []:
        kinds |= _decoder_kinds(inner)
    if decoder.get("type") == "Replace" and decoder.get("pattern", {}).get("String") == "▁":
        kinds.add("SpaceReplace")
    return kinds


def _hf_fast_pieces(tokenizer: Any, backend: Any) -> list[bytes | None] | None:
    spec = json.loads(backend.to_str())
    decoder = spec.get("decoder") or {}
    kinds = _decoder_kinds(spec.get("decoder"))
    model = (spec.get("model") or {}).get("type")
    size = len(tokenizer)
    strings = tokenizer.convert_ids_to_tokens(list(range(size)))
    added = {int(i): t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    if "ByteLevel" in kinds:
        table = _byte_level_chars()

        def piece(s: str) -> bytes | None:
            try:
                return bytes(table[c] for c in s)
            except KeyError:
                return None
    elif kinds & {"Metaspace", "SpaceReplace", "ByteFallback"}:
        def piece(s: str) -> bytes | None:
            if len(s) == 6 and s.startswith("<0x") and s.endswith(">") and "ByteFallback" in kinds:
                try:
                    return bytes([int(s[3:5], 16)])
                except ValueError:
                    pass
            return s.replace("▁", " ").encode("utf-8")
    elif "WordPiece" in kinds or (not kinds and model in ("WordLevel", "WordPiece")):
        # decoders that join tokens: words with a space between them (a tokenizer without a decoder joins
        # with spaces too), WordPiece's continuations ("##ing") without one; so a word spells " word", as
        # in byte-level vocabularies, and the space before a text's first word is the tokenizer's own
        # (Vocabulary._encode undoes it, as for SentencePiece's dummy prefix)
        prefix = decoder.get("prefix", "##") if model == "WordPiece" or "WordPiece" in kinds else None

        def piece(s: str) -> bytes | None:
            if prefix and s.startswith(prefix):
                return s[len(prefix):].encode("utf-8")
            return b" " + s.encode("utf-8")
    else:
        return None
    out: list[bytes | None] = []
    for token, s in enumerate(strings):
        if token in added:
            out.append(added[token].encode("utf-8"))
        elif s is None:
            out.append(None)
        else:
            out.append(piece(s))
    return out


def _decoded_pieces(tokenizer: Any) -> list[bytes | None]:
    logger.info("%s: no byte-level decoder known; token pieces come from decode() (partial characters unknown)",
                type(tokenizer).__name__)
    out: list[bytes | None] = []
    for token in range(len(tokenizer)):
        text = tokenizer.decode([token])
        out.append(None if (not text or "\ufffd" in text) else text.encode("utf-8"))
    return out
