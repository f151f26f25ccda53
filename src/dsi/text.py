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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[Sequence[int]], str]

LEFT_CONTEXT = 5  # prompt tokens the first window starts with
MAX_PENDING = 8  # pending tokens after which text ending in U+FFFD is released anyway (> 4 bytes)


class IncrementalDetokenizer:
    """Stable text of a growing token sequence, in linear total work (see the module docstring)."""

    def __init__(self, decode: Decode, prompt_ids: Sequence[int] = ()) -> None:
        self._decode = decode
        # only the left context of the first token is kept, not the whole prompt
        self._ids: list[int] = list(prompt_ids[-LEFT_CONTEXT:])  # the window
        self._read = len(self._ids)

    def push(self, tokens: Sequence[int]) -> str:
        """Add tokens; return the newly stable text (possibly empty)."""
        self._ids.extend(tokens)
        before = self._decode(self._ids[: self._read])
        after = self._decode(self._ids)
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
