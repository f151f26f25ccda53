"""The text side of the served model: tokenise prompts and chats, detokenise outputs.

:class:`HFCodec` wraps a :class:`dsi.models.hf.model.HFModel` (its tokenizer, chat template, EOS ids
and context length). Hugging Face fast tokenizers are not safe to use from several threads at once
("Already borrowed"), and the server encodes on its preparation threads while slot threads decode
outputs and the event loop names logprobs' tokens: encoding and decoding each have a copy of a Hugging
Face tokenizer and a lock of their own, so a long prompt's tokenisation holds up no stream (a GGUF's
vocabulary, which cannot be copied, keeps one lock). Any object with the same attributes can stand in
for it (tests use a byte codec over synthetic models).

Tokenising is bounded by the context: ``encode(text, limit)`` gives up with
:class:`PromptTooLong` once ``text`` surely has more than ``limit`` tokens, after tokenising
prefixes of it rather than all of it (:func:`encode_within`), so a 20 MB prompt for a model of
32k positions costs the tokenisation of 256 kB.
"""

from __future__ import annotations

import copy
import logging
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from dsi.errors import ConfigError
from dsi.models.base import check_token_ids

logger = logging.getLogger(__name__)

PROBE_CHARS_PER_TOKEN = 8  # the first prefix tried: this many characters per allowed token (text has ~4)
PROBE_GROWTH = 2  # each further prefix is this many times longer
PROBE_SLACK = 16  # tokens a prefix cut inside a word may have beyond its share of the text's
WORD_SEARCH = 1024  # characters before a cut searched for whitespace to cut at
_ID_TEXT = re.compile(r"\s*[0-9]{1,10}\s*")  # a token id in a prompt of IdsCodec (every vocabulary is below 10**10)


class PromptTooLong(Exception):
    """A prompt has more than ``limit`` tokens: exactly ``count``, or at least ``count`` if not ``exact``."""

    def __init__(self, count: int, limit: int, exact: bool) -> None:
        super().__init__(f"the prompt has {'' if exact else 'at least '}{count} tokens, more than {limit}")
        self.count = count
        self.limit = limit
        self.exact = exact


class Codec(Protocol):
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_context: int | None

    def encode(self, text: str, limit: int | None = None, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt (with the tokenizer's special tokens, e.g. BOS, unless told not to);
        :class:`PromptTooLong` if there are more than ``limit``."""

    def encode_chat(self, messages: list[dict[str, Any]], limit: int | None = None, add_generation_prompt: bool = True,
                    add_special_tokens: bool = False, tools: list[dict] | None = None) -> list[int]:
        """Token ids of the chat template applied to ``messages`` and ``tools`` (same ``limit``);
        ``add_special_tokens``: the tokenizer's special tokens on top of the template's own."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids`` (valid ids only: the caller checks them against the vocabulary)."""


def _cut(text: str, size: int) -> str:
    """``text[:size]``, shortened to end before a whitespace if one is near, so it ends with a whole word."""
    start = max(0, size - WORD_SEARCH)
    space = max(text.rfind(c, start, size) for c in " \n\t")
    return text[: space if space > 0 else size]


def encode_within(encode: Callable[[str], list[int]], text: str, limit: int | None) -> list[int]:
    """``encode(text)``, or :class:`PromptTooLong` without tokenising all of a text far beyond ``limit``.

    A text longer than ``PROBE_CHARS_PER_TOKEN * (limit + 1)`` characters (more than natural text
    needs for ``limit`` tokens) is first tokenised by prefixes of that length, then
    ``PROBE_GROWTH`` times longer each time, each cut before a whitespace where one is near: the
    words of the prefix are words of the text, so the prefix has no more tokens than the text.
    Where no whitespace is near (a long word, text without spaces), a cut changes only the tokens
    around it, which ``PROBE_SLACK`` covers. Once a prefix has more than ``limit + PROBE_SLACK``
    tokens, so has the text. The work is that of the prefix that proves it (``PROBE_CHARS_PER_TOKEN
    * limit`` characters for natural text); a text within the limit is probed only if it has
    more than ``PROBE_CHARS_PER_TOKEN`` characters per token, and then costs at most twice one
    tokenisation.
    """
    if limit is None:
        return encode(text)
    size = PROBE_CHARS_PER_TOKEN * (limit + 1)
    while size < len(text):
        count = len(encode(_cut(text, size)))
        if count > limit + PROBE_SLACK:
            raise PromptTooLong(count - PROBE_SLACK, limit, exact=False)
        size *= PROBE_GROWTH
    ids = encode(text)
    if len(ids) > limit:
        raise PromptTooLong(len(ids), limit, exact=True)
    return ids


class HFCodec:
    """Tokenizer helpers of an ``HFModel``, the same calls ``dsi generate`` makes."""

    def __init__(self, model: Any) -> None:
        if getattr(model, "tokenizer", None) is None:
            raise ConfigError(f"{getattr(model, 'name', model)!r} has no tokenizer; dsi serve needs one for text")
        self._model = model
        self._lock = threading.Lock()  # encoding and the chat template (preparation threads)
        # decoding (slot threads, logprobs' names on the event loop): a copy of the tokenizer and a lock of its
        # own, where the tokenizer can be copied (a Hugging Face one); else the model's decode under the same lock
        self._decoder, self._decode_lock = _decoding_copy(model.tokenizer), threading.Lock()
        if self._decoder is None:
            self._decode_lock = self._lock
        self._decode_limit = max(model.vocab_size, len(model.tokenizer))  # ids a logit row or the tokenizer knows
        self._name = getattr(model, "name", "the served model")
        self.vocab_size: int = model.vocab_size
        self.eos_token_ids: tuple[int, ...] = tuple(model.eos_token_ids)
        self.max_context: int | None = model.max_context
        self._info: dict[str, Any] | None = None  # tokenizer_info(), once asked

    def encode(self, text: str, limit: int | None = None, add_special_tokens: bool = True) -> list[int]:
        def encode(part: str) -> list[int]:
            with self._lock:
                if add_special_tokens:
                    return self._model.encode(part)
                return list(self._model.tokenizer.encode(part, add_special_tokens=False))

        return encode_within(encode, text, limit)

    def encode_chat(self, messages: list[dict[str, Any]], limit: int | None = None, add_generation_prompt: bool = True,
                    add_special_tokens: bool = False, tools: list[dict] | None = None) -> list[int]:
        tok = self._model.tokenizer
        if not getattr(tok, "chat_template", None):  # no model path in the message: clients see it
            raise ConfigError("the served model's tokenizer has no chat template; use /v1/completions")
        with self._lock:
            try:
                text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                               tokenize=False)
            except Exception as exc:  # noqa: BLE001 - jinja raises TemplateError and others
                raise ConfigError(f"the chat template rejected the messages: {exc}") from exc

        def encode(part: str) -> list[int]:
            with self._lock:
                return list(tok.encode(part, add_special_tokens=add_special_tokens))

        return encode_within(encode, text, limit)

    def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's ``/tokenizer_info`` of the tokenizer (:func:`dsi.server.tokenizer_info.tokenizer_config`): plain
        attributes, read without a lock (no tokenisation), made once."""
        if self._info is None:
            from dsi.server.tokenizer_info import tokenizer_config

            self._info = tokenizer_config(self._model.tokenizer, self.max_context)
        return self._info

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The model's decode (ids checked; with a Hugging Face tokenizer, ids past it decode to nothing, as
        :meth:`dsi.models.hf.model.HFModel.decode` does), on the decoding copy of the tokenizer where there is one."""
        if self._decoder is None:
            with self._decode_lock:
                return self._model.decode(ids, skip_special_tokens=skip_special_tokens)
        ids = check_token_ids(ids, self._decode_limit, of=self._name)
        with self._decode_lock:
            return self._decoder.decode(ids, skip_special_tokens=skip_special_tokens)


def _decoding_copy(tokenizer: Any) -> Any:
    """A copy of a Hugging Face ``tokenizer`` for decoding beside its encoding; None for another kind (a GGUF's
    vocabulary is read through llama.cpp's pointers: no copy) or one that cannot be copied (the server then
    decodes under the encoder's lock, as it did before the copy)."""
    if not type(tokenizer).__module__.startswith("transformers."):
        return None
    try:
        return copy.deepcopy(tokenizer)
    except Exception as exc:  # noqa: BLE001 - any tokenizer a user brings: serve on, with one lock
        logger.info("dsi serve: the tokenizer could not be copied for decoding (%s: %s); encoding and decoding "
                    "share one lock", type(exc).__name__, exc)
        return None


class IdsCodec:
    """The text side of a model with no tokenizer (the synthetic models of ``dsi serve --synthetic``):
    a prompt is its token ids, separated by commas or whitespace (``"1,2,3"``, ``"1 2 3"``: what a load generator's
    word-level tokenizer of the ids writes), and ids decode to the comma-separated form."""

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int] = (), max_context: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_context = max_context

    def encode(self, text: str, limit: int | None = None, add_special_tokens: bool = True) -> list[int]:
        parts = [part for part in re.split(r"[,\s]", text) if part.strip()]
        # ASCII digits, at most 10 (int() alone reads "٥" as 5 and "1_0" as 10, and fails past 4300 digits)
        if not all(_ID_TEXT.fullmatch(part) for part in parts):
            raise ConfigError(f"this model has no tokenizer: a prompt is token ids (ASCII digits) separated by commas "
                              f"or spaces, "
                              f"not {text[:40]!r}")
        ids = [int(part) for part in parts]
        if limit is not None and len(ids) > limit:
            raise PromptTooLong(len(ids), limit, True)
        return ids

    def encode_chat(self, messages: list[dict[str, Any]], limit: int | None = None, add_generation_prompt: bool = True,
                    add_special_tokens: bool = False, tools: list[dict] | None = None) -> list[int]:
        raise ConfigError("this model has no tokenizer and no chat template; use /v1/completions with token ids")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return ",".join(str(int(t)) for t in ids)
