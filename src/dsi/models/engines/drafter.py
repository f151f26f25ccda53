"""A drafter served by an inference engine over HTTP (vLLM's OpenAI server, or a ``dsi serve``).

:class:`EngineDrafter` is a :class:`~dsi.models.base.LanguageModel` whose sessions draft from one
*streamed* completion: the engine decodes greedily after the session's context and streams each token
with its top-N log-probabilities (``logprobs: N``, ``return_tokens_as_token_ids``, ``ignore_eos``), so
the drafter runs at the engine's own decoding speed, with no round trip per token. A session answers
"the row after this context" from the stream as long as the context is the stream's start plus the
tokens it streamed; any other context (a rejection's correction, a sampled draft other than the
engine's greedy token, a tree's side branch) closes the stream, which vLLM and ``dsi serve`` take as
the client gone and abort, and opens a new one there. A stream that ends (its ``max_tokens``) is
followed by a new one from where it ended. Forwards of several rows (rare for a drafter) are one
prompt-logprobs request, as :class:`~dsi.models.engines.target.EngineTarget` computes them.

What a row holds, and why the output stays exact:

- greedy drafting on raw rows asks for argmax ids only: the streamed token itself (N = 1);
- otherwise a row holds the engine's top ``top`` log-probabilities (default 20, vLLM's default
  ``--max-logprobs``) and ``-inf`` elsewhere. The drafter samples its draft from that row's processed
  law q with dsi's own counter-based uniforms, and verification uses exactly that q, so the output
  has exactly the target's law whatever q is (speculative sampling is lossless for any drafter law
  the drafts are drawn from). With ``top_k <= top`` (and the processors that only shift logits),
  q is exactly the drafter's own processed law; otherwise it is that law restricted to its top
  ``top`` tokens, which changes how often drafts are accepted, never the output.

Determinism. A draft is a function of the drafter's rows and the seed, as with a local drafter, so a
seed gives the same tokens for any SP, window policy and timing as long as the engine computes the
drafter's rows bit for bit the same each time. An engine batching other requests may not (vLLM's
rows depend on its batch unless ``VLLM_BATCH_INVARIANT``); a row that moves can then change a
sampled draft at a near-tie, and so, rarely, a sampled output (never its law; greedy output is the
target's whatever the drafts are).

Faults. A stream that cannot start or breaks (refused, reset, 5xx, malformed lines) raises
:class:`~dsi.errors.ServerLost` from the forward: the request ends with a clear error naming the
URL (DSI: "the drafter failed"), and the session opens a new stream at its next forward. A frozen
engine is a forward that does not return: DSI's liveness deadline for the drafter ends the request
(docs/engines.md); a stream silent for ``stall_s`` (60 s) raises :class:`~dsi.errors.ServerLost` (SI,
which drafts in the request's thread, has no other deadline). The session's cancel flag abandons a
wait within ``CANCEL_POLL_S``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from dsi.errors import ConfigError, ContextLengthError, ServerLost, TaskCancelled
from dsi.models.base import CancelFlag, LanguageModel, check_int, check_token_ids
from dsi.models.engines.streams import CompletionStream
from dsi.models.engines.target import (
    CONNECT_TIMEOUT_S,
    READ_TIMEOUT_S,
    EngineTarget,
    LocalText,
    check_url,
    dense_rows,
)

log = logging.getLogger(__name__)

DEFAULT_TOP = 20  # log-probabilities per drafted row (vLLM's default --max-logprobs)
DEFAULT_HORIZON = 64  # tokens a stream asks for; one that ends is followed by a new one
STALL_S = 60.0  # a stream that sends nothing for this long while a forward waits is a frozen engine


class EngineDrafter(LocalText):
    """The drafter as served by the engine at ``url`` (see the module doc).

    ``reference``: the local copy of the drafter: its vocabulary, tokenizer and context limit, and the
    model a canary forward on the engine is compared with at start (as for target engines). ``top``:
    log-probabilities per row when rows are needed (sampling, penalties, trees). ``horizon``: the
    tokens one stream asks for. ``stall_s``: how long a forward waits for a stream that sends nothing
    before it takes the engine for frozen (:class:`~dsi.errors.ServerLost`): SI drafts in the request's
    own thread, with no liveness deadline of its own; DSI's deadline is usually shorter.
    """

    deterministic = False  # an engine's rows depend on its own batching: nothing here can promise bits

    def __init__(self, url: str, reference: LanguageModel, *, top: int = DEFAULT_TOP, horizon: int = DEFAULT_HORIZON,
                 model: str | None = None, connect_timeout: float = CONNECT_TIMEOUT_S,
                 read_timeout: float = READ_TIMEOUT_S, stall_s: float = STALL_S) -> None:
        if not isinstance(top, int) or isinstance(top, bool) or top < 1:
            raise ConfigError(f"top={top!r} must be an integer >= 1 (log-probabilities per drafted row)")
        if not isinstance(horizon, int) or isinstance(horizon, bool) or horizon < 1:
            raise ConfigError(f"horizon={horizon!r} must be an integer >= 1 (tokens one stream asks for)")
        self.url = check_url(url, "drafter")
        # the start-up checks (models listed, a canary forward against the reference) and the scorer of
        # forwards of several rows
        self.scorer = EngineTarget([self.url], reference, model=model, connect_timeout=connect_timeout,
                                   read_timeout=read_timeout, role="drafter")
        self.engine = self.scorer.engines[self.url]
        self.reference = reference
        self.vocab_size = int(reference.vocab_size)
        self.tokenizer = getattr(reference, "tokenizer", None)
        self.top = min(top, self.vocab_size)
        self.horizon = horizon
        self.stall_s = float(stall_s)
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        # a stream's context and the one token it generates must fit the engine's max_model_len
        limits = [n - 1 for n in (self.engine.max_model_len,) if n]
        local = getattr(reference, "max_context", None)
        limits += [local] if isinstance(local, int) else []
        self.max_context = min(limits) if limits else None

    def __repr__(self) -> str:  # also what method="auto" caches its choice under
        return f"EngineDrafter({self.url} ({self.engine.model}); reference {self.reference!r})"

    def new_session(self) -> StreamingSession:
        return StreamingSession(self)


class StreamingSession:
    """One token sequence whose rows come from the drafter engine's streams (see the module doc)."""

    def __init__(self, drafter: EngineDrafter) -> None:
        self._drafter = drafter
        self._tokens: tuple[int, ...] = ()
        self._stream: CompletionStream | None = None
        self._scoring = None  # an EngineSession for forwards of several rows, made on first use
        # streams opened, and rows read from them (a request's stats carry the changes)
        self.counters = {"drafter_streams": 0, "drafter_stream_tokens": 0}

    def __repr__(self) -> str:
        return f"StreamingSession({self._drafter.url}, {len(self._tokens)} tokens)"

    @property
    def tokens(self) -> tuple[int, ...]:
        return self._tokens

    def extend(self, tokens: Sequence[int], cancel: CancelFlag | None = None) -> np.ndarray:
        return self.extend_rows(tokens, cancel, len(tokens), False)

    def extend_rows(self, tokens: Sequence[int], cancel: CancelFlag | None, num_rows: int, greedy: bool
                    ) -> np.ndarray:
        """The last ``num_rows`` rows after ``self.tokens + tokens``: argmax ids with ``greedy``, else
        rows holding the engine's top log-probabilities (``-inf`` elsewhere)."""
        context = self._tokens + tuple(check_token_ids(tokens, self._drafter.vocab_size, "tokens", self._drafter.url))
        drafter = self._drafter
        limit = drafter.max_context
        if limit is not None and len(context) > limit:
            raise ContextLengthError(f"{len(context)} tokens exceed the context of {limit} tokens that drafter "
                                     f"server {drafter.url} leaves")
        if cancel is not None and cancel.is_set():
            raise TaskCancelled()
        if num_rows > 1:
            out = self._score(context, cancel, num_rows, greedy)
        else:
            token, row = self._next(context, cancel, greedy)
            out = np.array([token], dtype=np.int64) if greedy else dense_rows([row], drafter.vocab_size)
        self._tokens = context
        return out

    def _next(self, context: tuple[int, ...], cancel: CancelFlag | None, greedy: bool
              ) -> tuple[int, dict[int, float]]:
        """The engine's greedy token after ``context`` and its row, from the open stream if ``context``
        is on it, else from a new stream started there. A stream that failed is closed (the next
        forward opens a new one)."""
        try:
            return self._from_stream(context, cancel, greedy)
        except ServerLost:
            self._close_stream()
            raise

    def _from_stream(self, context: tuple[int, ...], cancel: CancelFlag | None, greedy: bool
                     ) -> tuple[int, dict[int, float]]:
        stream = self._stream
        needed = 1 if greedy else self._drafter.top
        if stream is not None:
            j = stream.follows(context, cancel) if stream.n >= needed else None
            if j is not None:
                got = stream.row(j, cancel)
                if got is not None:
                    self.counters["drafter_stream_tokens"] += 1
                    return got
            self._close_stream()  # off the stream (or it ended there): a new one from this context
        drafter = self._drafter
        limit = drafter.max_context
        room = drafter.horizon if limit is None else min(drafter.horizon, limit + 1 - len(context))
        if room < 1:
            raise ContextLengthError(f"the drafter server {drafter.url} has no room after {len(context)} tokens")
        self._stream = stream = CompletionStream(
            drafter.url, drafter.engine.model, context, needed, room, drafter.vocab_size,
            connect_timeout=drafter.connect_timeout, read_timeout=drafter.read_timeout, stall_s=drafter.stall_s,
            role="drafter")
        self.counters["drafter_streams"] += 1
        got = stream.row(0, cancel)
        if got is None:
            raise ServerLost(f"drafter server {self._drafter.url} ended a stream before its first token")
        self.counters["drafter_stream_tokens"] += 1
        return got

    def _score(self, context: tuple[int, ...], cancel: CancelFlag | None, num_rows: int, greedy: bool) -> np.ndarray:
        if self._scoring is None:
            self._scoring = self._drafter.scorer.new_session()
        self._scoring.truncate(0)
        if greedy:
            return self._scoring.extend_rows(context, cancel, num_rows, True)
        return self._scoring.extend_rows(context, cancel, num_rows, False, top=self._drafter.top)

    def _close_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()

    def truncate(self, length: int) -> None:
        self._tokens = self._tokens[: check_int(length, "length", 0, len(self._tokens))]  # the stream stays open: a context on it still reads it

    def close(self) -> None:
        self._close_stream()
        if self._scoring is not None:
            self._scoring.close()


def drafter_engine(drafter: LanguageModel | None, url: object, **options: Any) -> EngineDrafter:
    """``drafter`` (the local reference) served by the engine at ``url`` (``--drafter-server``)."""
    if drafter is None:
        raise ConfigError(f"drafter_server={url!r} needs the local drafter too (drafter=, --drafter): its "
                          "tokenizer and vocabulary, and the reference the engine is checked against")
    if isinstance(drafter, EngineDrafter):
        raise ConfigError(f"the drafter is already served by {drafter.url}; drop drafter_server={url!r}")
    if not isinstance(url, str):
        raise ConfigError(f"drafter_server={url!r} must be one URL like http://127.0.0.1:8000/v1")
    return EngineDrafter(url, drafter, **options)


__all__ = ["EngineDrafter", "StreamingSession", "drafter_engine", "DEFAULT_TOP", "DEFAULT_HORIZON"]
