"""Incremental detokenisation for streaming: text is released only once it is stable.

Byte-level tokenizers split multi-byte characters across tokens, and many tokenizers change
the rendering of earlier tokens when more arrive (spaces, merges). Following the approach of
Hugging Face text-generation-inference and vLLM, we decode a short window twice, before and
after the new tokens, and emit only the difference, holding back text that ends in an
incomplete character (U+FFFD).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[Sequence[int]], str]


class IncrementalDetokenizer:
    def __init__(self, decode: Decode, prompt_ids: Sequence[int] = ()) -> None:
        self._decode = decode
        self._ids: list[int] = list(prompt_ids)
        # start the window a few tokens back so the first token renders with its left context
        self._prefix = max(0, len(self._ids) - 5)
        self._read = len(self._ids)

    def push(self, tokens: Sequence[int]) -> str:
        """Add tokens; return the newly stable text (possibly empty)."""
        self._ids.extend(tokens)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever text is still held back (at the end of generation)."""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return after[len(before) :] if len(after) > len(before) else ""
