"""``CallableLM``: any Python next-token function as a language model (target or drafter).

The function receives the whole context as a tuple of token ids and returns the logits of the
next token, ``[vocab_size]``. There is no real cache: the session keeps the token list and
calls the function once per new position, checking the cancel flag between positions. With
``max_context``, a session refuses (:class:`~dsi.errors.ContextLengthError`) to hold more tokens,
like a real model with a fixed number of positions. The function only ever sees token ids in
``[0, vocab_size)`` (:func:`~dsi.models.base.check_token_ids` refuses others first).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from dsi.errors import ConfigError, ContextLengthError, TaskCancelled
from dsi.models.base import CancelFlag, check_int, check_logits, check_token_ids
from dsi.models.costs import ForwardCosts

NextLogits = Callable[[tuple[int, ...]], np.ndarray]


class CallableLM:
    """A language model defined by ``next_logits(context) -> logits [vocab_size]``."""

    # Its rows are a function of the context: deterministic with no mode to switch (dsi.models.determinism).
    deterministic_by_construction = True

    def __init__(
        self, next_logits: NextLogits, vocab_size: int, name: str = "callable", max_context: int | None = None
    ) -> None:
        if not callable(next_logits):
            raise ConfigError(f"next_logits={next_logits!r} must be callable")
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 2:
            raise ConfigError(f"vocab_size={vocab_size!r} must be an integer >= 2")
        if max_context is not None and (not isinstance(max_context, int) or isinstance(max_context, bool)
                                        or max_context < 1):
            raise ConfigError(f"max_context={max_context!r} must be None (no limit) or an integer >= 1")
        self.next_logits = next_logits
        self._vocab_size = vocab_size
        self.name = name
        self.max_context = max_context  # the most tokens a session may hold; None: no limit

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def new_session(self) -> CallableSession:
        return CallableSession(self)

    def forward_costs(self) -> ForwardCosts:
        """Nothing a draft tree should weigh (:mod:`dsi.models.costs`): a function of the context, on no hardware."""
        return ForwardCosts(one_token_s=0.0, per_row_s=0.0)

    def __repr__(self) -> str:
        limit = "" if self.max_context is None else f", max_context={self.max_context}"
        return f"CallableLM(name={self.name!r}, vocab_size={self._vocab_size}{limit})"


class CallableSession:
    """A token list; each ``extend`` calls the model's function once per new token."""

    def __init__(self, model: CallableLM) -> None:
        self._model = model
        self._tokens: list[int] = []

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(self._tokens)

    def extend(self, tokens: Sequence[int], cancel: CancelFlag | None = None) -> np.ndarray:
        vocab, limit = self._model.vocab_size, self._model.max_context
        tokens = check_token_ids(tokens, vocab, "tokens", self._model.name)
        if limit is not None and len(self._tokens) + len(tokens) > limit:
            raise ContextLengthError(f"{len(self._tokens) + len(tokens)} tokens exceed max_context={limit} "
                                     f"of {self._model!r}")
        context = list(self._tokens)
        rows = np.empty((len(tokens), vocab), dtype=np.float64)  # [n, V]
        for i, token in enumerate(tokens):
            if cancel is not None and cancel.is_set():
                raise TaskCancelled("forward cancelled")
            context.append(token)
            rows[i] = check_logits(self._model.next_logits(tuple(context)), vocab, repr(self._model))
        self._tokens = context
        return rows

    def truncate(self, length: int) -> None:
        del self._tokens[check_int(length, "truncate length", 0, len(self._tokens)):]

    def close(self) -> None:
        self._tokens = []
