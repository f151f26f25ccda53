"""The text side of the served model: tokenise prompts and chats, detokenise outputs.

:class:`HFCodec` wraps a :class:`dsi.models.hf.HFModel` (its tokenizer, chat template, EOS ids
and context length). Calls are serialised with a lock: Hugging Face fast tokenizers are not safe
to use from several threads at once ("Already borrowed"), and the server encodes on the event
loop while slot threads decode. Any object with the same attributes can stand in for it (tests
use a byte codec over synthetic models).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol

from dsi.errors import ConfigError


class Codec(Protocol):
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_context: int | None

    def encode(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class HFCodec:
    """Tokenizer helpers of an ``HFModel``, the same calls ``dsi generate`` makes."""

    def __init__(self, model: Any) -> None:
        if getattr(model, "tokenizer", None) is None:
            raise ConfigError(f"{getattr(model, 'name', model)!r} has no tokenizer; dsi serve needs one for text")
        self._model = model
        self._lock = threading.Lock()
        self.vocab_size: int = model.vocab_size
        self.eos_token_ids: tuple[int, ...] = tuple(model.eos_token_ids)
        self.max_context: int | None = model.max_context

    def encode(self, text: str) -> list[int]:
        with self._lock:
            return self._model.encode(text)

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        tok = self._model.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ConfigError(f"{self._model.name}'s tokenizer has no chat template; use /v1/completions")
        with self._lock:
            try:
                text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            except Exception as exc:  # noqa: BLE001 - jinja raises TemplateError and others
                raise ConfigError(f"the chat template rejected the messages: {exc}") from exc
            return list(tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        with self._lock:
            return self._model.decode(ids)
