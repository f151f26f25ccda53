"""Incremental detokenisation for streaming: text is released only once it is stable.

Byte-level tokenizers split multi-byte characters across tokens, and many tokenizers change
the rendering of earlier tokens when more arrive (spaces, merges). Following the approach of
Hugging Face text-generation-inference and vLLM, we decode a short window twice, before and
after the new tokens, and emit only the difference, holding back text that ends in an
incomplete character (U+FFFD).

Glossary: the *window* is the ids kept: ``ids[:read]`` is text already emitted (the left context,
so that the next token renders with its leading space), ``ids[read:]`` the *pending* tokens not
yet emitted. The work of one :meth:`IncrementalDetokenizer.push` is the decode of the
window, so the window must stay bounded whatever the model outputs. Two outputs would make it
grow without end (and the total work quadratic) in the plain algorithm:

- tokens that add no text (special tokens skipped by the decode): pending tokens after which
  the window decodes exactly as before are dropped, since they contribute nothing to the text;
- text that keeps ending in U+FFFD (an invalid byte sequence, or the character U+FFFD itself):
  a UTF-8 character spans at most 4 bytes, so once more than :data:`MAX_PENDING` tokens are
  pending the text is released as it renders, U+FFFD included.

The ids themselves are checked by ``decode`` (a model's ``decode`` refuses ids outside its vocabulary
with :class:`~dsi.errors.ConfigError`); a push whose decode raises leaves the window as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence, Set

from dsi.errors import ConfigError

Decode = Callable[[Sequence[int]], str]

LEFT_CONTEXT = 5  # prompt tokens the first window starts with
MAX_PENDING = 8  # pending tokens after which text ending in U+FFFD is released anyway (> 4 bytes)


class IncrementalDetokenizer:
    """Stable text of a growing token sequence, in linear total work (see the module docstring)."""

    def __init__(self, decode: Decode, prompt_ids: Sequence[int] = ()) -> None:
        if not callable(decode):
            raise ConfigError(f"decode={decode!r} must be callable: token ids -> text")
        self._decode = decode
        # only the left context of the first token is kept, not the whole prompt
        self._ids: list[int] = _as_list(prompt_ids, "prompt_ids")[-LEFT_CONTEXT:]  # the window
        self._read = len(self._ids)

    def push(self, tokens: Sequence[int]) -> str:
        """Add tokens; return the newly stable text (possibly empty). A decode that fails (an id it
        refuses) leaves the detokenizer as it was."""
        ids = self._ids + _as_list(tokens, "tokens")
        before = self._decode(ids[: self._read])
        after = self._decode(ids)
        self._ids = ids
        incomplete = after.endswith("\ufffd")
        if len(after) > len(before) and not incomplete:
            return self._advance(after[len(before) :])
        if after == before and not incomplete:  # the pending tokens render as nothing (skipped specials)
            del self._ids[self._read :]
            return ""
        if len(self._ids) - self._read > MAX_PENDING:  # no character is that long: release as rendered
            return self._advance(after[len(before) :] if len(after) > len(before) else "")
        return ""

    def flush(self) -> str:
        """Whatever text is still held back (at the end of generation)."""
        before = self._decode(self._ids[: self._read])
        after = self._decode(self._ids)
        self._advance("")
        return after[len(before) :] if len(after) > len(before) else ""

    def _advance(self, text: str) -> str:
        """The pending tokens become the left context of the next window."""
        del self._ids[: self._read]
        self._read = len(self._ids)
        return text


def _as_list(ids: object, name: str) -> list:
    """``ids`` (a sequence of token ids) as a list; its elements are the decode's to check."""
    if isinstance(ids, str | bytes | bytearray | Mapping | Set) or not isinstance(ids, Iterable):
        raise ConfigError(f"{name}={ids!r:.60} ({type(ids).__name__}) must be a sequence of token ids")
    return list(ids)
