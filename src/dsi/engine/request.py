"""A generation request, its one check, and the committed output every engine appends to.

:class:`Request` is what a decoder's ``generate`` takes; :func:`check_request` is the one check of it,
made where every decoder receives a request (:func:`dsi.engine.lifecycle.prepare_request`) and by
:func:`dsi.engine.api.make_request`, so a hand-made request, :func:`dsi.generate` and the server meet the
same errors.

:class:`Output` owns the committed token sequence of one request: it appends tokens, streams
them to the caller's callback, and knows when generation is over (``max_new_tokens`` reached,
or the target committed EOS). Engines only decide *which* token comes next.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from dsi.engine.stats import GenerationStats
from dsi.errors import ConfigError, DSIError, is_int, require, shown
import numpy as np

from dsi.logprobs import TokenLogprob, check_mode, entry
from dsi.models.base import check_token_ids
from dsi.transport.base import VerifyTask
from dsi.sampling import Prefix, SamplingParams
from dsi.trees import DraftTree

# called with the tokens just committed; with a request that asks for logprobs, also with their entries
TokenCallback = Callable[..., None]


class GenerationAborted(DSIError):
    """The caller's abort flag was set (e.g. the HTTP client went away).

    ``tokens``: the new tokens committed before the abort; ``stats``: the run's statistics (the
    engine may still add late counters, e.g. drafter forwards, before the exception leaves
    ``generate``). A server uses them to report usage of a request it stopped (stop strings).
    """

    def __init__(self, message: str, tokens: list[int] | None = None, stats: GenerationStats | None = None) -> None:
        super().__init__(message)
        self.tokens: list[int] = list(tokens or [])
        self.stats = stats


@dataclass(frozen=True)
class Request:
    """One request to a decoder (``decoder.generate(request)``), as :func:`dsi.generate` takes its arguments:
    ``prompt`` (token ids, at least one), ``max_new_tokens`` (>= 1), ``sampling`` (a
    :class:`~dsi.sampling.SamplingParams`; None: greedy), ``eos_token_ids`` (None, one id or several: any of
    them, committed, ends the request; the sampling's ``stop_token_ids`` end it too and ``ignore_eos`` makes
    these ordinary tokens), ``logprobs`` (None, or N >= 0: each new token's log-probability and its row's
    top N) in ``logprobs_mode`` (``"raw"`` or ``"processed"``: :mod:`dsi.logprobs`).

    The decoder checks it when it receives it (:func:`check_request`, against the target's vocabulary) and
    refuses a bad one with the :class:`~dsi.errors.ConfigError` :func:`dsi.generate` would raise;
    :func:`dsi.make_request` builds one and checks it at once.

    ``committed``: the request's first new tokens, committed by another decoder (``dsi serve`` hands a request over
    from speculation to plain decoding, or back, at a decided position: :mod:`dsi.server.load_choice`). This decoder
    starts after them; its result's tokens include them (its logprobs and statistics cover only its own part)."""

    prompt: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    eos_token_ids: frozenset[int] = frozenset()  # any of these, committed by the target, ends it
    logprobs: int | None = None  # report each new token's logprob and this many top ones (None: none)
    logprobs_mode: str = "raw"  # their distribution: "raw" or "processed" (dsi.logprobs)
    # a continuation: new tokens another decoder already committed for this request; this one goes on after them
    # (they count in max_new_tokens, and the logit processors see them as output, not prompt)
    committed: tuple[int, ...] = ()

    def verify_task(self, task_id: int, context: Sequence[int], num_rows: int,
                    tree: DraftTree | None = None, draft_probs: Sequence[float] | None = None,
                    scope: int | None = None) -> VerifyTask:
        """The task of scoring the last ``num_rows`` positions of ``context`` for this request (its
        sampling, prompt length, stop ids and logprobs mode): what a target server, SI or non-SI runs.
        ``draft_probs``: see :class:`~dsi.transport.base.VerifyTask` (sampled chain tasks without logprobs);
        ``scope``: its ``request`` (None: the servers' caches are reused whatever filled them)."""
        return VerifyTask(task_id, tuple(context), num_rows, self.sampling, len(self.prompt), self.eos_token_ids,
                          None if self.logprobs is None else self.logprobs_mode, tree,
                          None if draft_probs is None else tuple(float(x) for x in draft_probs), self.logprobs,
                          scope)

    @property
    def decided_remotely(self) -> bool:
        """Whether a chain verification of this request may be decided on its target server (sampled): its tasks
        then carry their drafts' drafter probabilities. Not with coupled draws: the target's draw decides, from its
        whole law (dsi.coupling)."""
        return not self.sampling.greedy and not self.sampling.coupled

    def tree_task(self, task_id: int, prefix: Sequence[int], tree: DraftTree, scope: int | None = None) -> VerifyTask:
        """The task of scoring the draft ``tree`` after ``prefix`` (its ``1 + len(tree)`` rows) for this request."""
        return self.verify_task(task_id, prefix, 1 + len(tree), tree, scope=scope)

    def prefix(self, tokens: Sequence[int]) -> Prefix:
        """What the logit processors see before a row that follows ``tokens`` (prompt included)."""
        return Prefix(tokens, len(self.prompt), self.eos_token_ids)


def _eos_ids(eos: object, vocab_size: int | None) -> frozenset[int]:
    """``eos_token_ids`` (None, one id, or a collection of ids) as a frozenset of ids in the vocabulary."""
    if eos is None:
        return frozenset()
    one = isinstance(eos, int | np.integer | str | bytes) or not hasattr(eos, "__iter__")
    allowed = "ids >= 0" if vocab_size is None else f"ids in [0, {vocab_size})"
    out = []
    for token in (eos,) if one else eos:  # type: ignore[union-attr]
        if not (isinstance(token, int | np.integer) and not isinstance(token, bool | np.bool_) and token >= 0
                and (vocab_size is None or token < vocab_size)):
            raise ConfigError(f"eos_token_id={shown(token)} must be None, a token id or a list of token {allowed}")
        out.append(int(token))
    return frozenset(out)


def check_request(request: object, vocab_size: int | None = None) -> Request:
    """``request`` checked, as the engines read it; :class:`~dsi.errors.ConfigError` naming the first bad field.

    The one check of a request's fields, in :func:`dsi.generate`'s order and words: ``max_new_tokens`` an
    integer >= 1; ``sampling`` a :class:`~dsi.sampling.SamplingParams` (None: greedy); ``prompt`` a non-empty
    sequence of token ids; ``eos_token_ids`` None, an id or ids; with ``vocab_size`` (the target's), every
    id of the prompt, of ``eos_token_ids`` and of the sampling's ``logit_bias`` and ``stop_token_ids`` inside
    the vocabulary and ``logprobs`` at most ``vocab_size``; ``logprobs`` None or an integer >= 0;
    ``logprobs_mode`` one of :data:`dsi.logprobs.LOGPROBS_MODES`. The request comes back with ``prompt`` a tuple of
    ints, ``sampling`` set, and ``eos_token_ids`` the frozenset of what ends generation: these ids (none under
    ``ignore_eos``) and the sampling's ``stop_token_ids`` (checking it again changes nothing)."""
    if not isinstance(request, Request):
        raise ConfigError(f"request={shown(request)} must be a dsi.Request (dsi.make_request builds one)")
    n = request.max_new_tokens
    require(is_int(n) and n >= 1, f"max_new_tokens={shown(n)} must be an integer >= 1")
    sampling = SamplingParams() if request.sampling is None else request.sampling
    require(isinstance(sampling, SamplingParams), f"sampling={shown(sampling)} must be a dsi.SamplingParams")
    if isinstance(request.prompt, str | bytes):
        raise ConfigError("prompt must be a sequence of token ids; tokenize text first")
    prompt = tuple(check_token_ids(request.prompt, vocab_size, "prompt"))
    require(len(prompt) > 0, "prompt is empty; it needs at least one token id")
    eos = _eos_ids(request.eos_token_ids, vocab_size)
    if vocab_size is not None:
        for what, ids in (("logit_bias", [t for t, _ in sampling.logit_bias]),
                          ("stop_token_ids", sampling.stop_token_ids)):
            outside = [t for t in ids if t >= vocab_size]
            require(not outside, f"{what} names token id(s) [{', '.join(shown(t) for t in outside[:5])}] outside the "
                               f"vocabulary [0, {vocab_size})")
    logprobs = request.logprobs
    allowed = ">= 0" if vocab_size is None else f"in [0, {vocab_size}]"
    ok = logprobs is None or (is_int(logprobs) and logprobs >= 0 and (vocab_size is None or logprobs <= vocab_size))
    require(ok, f"logprobs={shown(logprobs)} must be None or an integer {allowed} (the top tokens reported per token)")
    check_mode(request.logprobs_mode)
    committed = tuple(check_token_ids(request.committed, vocab_size, "committed"))
    require(len(committed) < n, f"committed holds {len(committed)} tokens; a continuation needs fewer than "
                                f"max_new_tokens={n}")
    # what ends generation: EOS (unless ignore_eos makes it an ordinary token) and the stop ids
    stops = (frozenset() if sampling.ignore_eos else eos) | frozenset(sampling.stop_token_ids)
    require(not stops.intersection(committed[-1:]), f"committed ends with a stop id ({committed[-1:]}): the "
                                                   "request is over, there is nothing to continue")
    if type(request.prompt) is tuple and prompt == request.prompt and sampling is request.sampling \
            and type(request.eos_token_ids) is frozenset and stops == request.eos_token_ids \
            and type(request.committed) is tuple and committed == request.committed:
        return request
    return replace(request, prompt=prompt, sampling=sampling, eos_token_ids=stops, committed=committed)


class Output:
    """The committed sequence of one request (prompt + new tokens)."""

    def __init__(
        self,
        request: Request,
        stats: GenerationStats,
        on_tokens: TokenCallback | None = None,
        abort: threading.Event | None = None,
    ) -> None:
        self.request = request
        self.stats = stats
        self.tokens: list[int] = [*request.prompt, *request.committed]
        # with request.logprobs: one entry per new token, from the row that decided it
        self.logprobs: list[TokenLogprob] | None = [] if request.logprobs is not None else None
        self._on_tokens = on_tokens
        self._abort = abort
        self._start = time.perf_counter()
        self.finished = request.max_new_tokens <= 0

    @property
    def new_count(self) -> int:
        return len(self.tokens) - len(self.request.prompt)

    @property
    def remaining(self) -> int:
        return self.request.max_new_tokens - self.new_count

    def commit(self, token: int, logprob_row: tuple[np.ndarray, float] | None = None) -> None:
        """Append ``token``; ``logprob_row`` (the log-probability row that decided it, as
        :class:`dsi.logprobs.LogprobRows` gives rows) is needed when the request asks for logprobs.
        The callback then gets ``(tokens, entries)``."""
        if self.finished:
            raise RuntimeError("commit after the output finished")
        entries = None
        if self.logprobs is not None:
            if logprob_row is None:
                raise RuntimeError("the request asks for logprobs but the engine gave no row")
            entries = [entry(logprob_row, token, self.request.logprobs)]
            self.logprobs.extend(entries)
        self.tokens.append(token)
        if self.new_count == 1:
            self.stats.time_to_first_token_s = time.perf_counter() - self._start
        if token in self.request.eos_token_ids:
            self.finished = True
            self.stats.finish_reason = "stop"
            self.stats.stop_token = token
        elif self.new_count >= self.request.max_new_tokens:
            self.finished = True
            self.stats.finish_reason = "length"
        if self._on_tokens is not None:
            if entries is None:
                self._on_tokens([token])
            else:
                self._on_tokens([token], entries)

    def check_abort(self) -> None:
        if self._abort is not None and self._abort.is_set():
            self.stats.finish_reason = "abort"
            raise GenerationAborted("generation aborted by the caller", self.finalize(), self.stats)

    def new_tokens(self) -> list[int]:
        return self.tokens[len(self.request.prompt) :]

    def elapsed(self) -> float:
        return time.perf_counter() - self._start

    def finalize(self) -> list[int]:
        self.stats.new_tokens = self.new_count
        self.stats.wall_time_s = self.elapsed()
        return self.new_tokens()

