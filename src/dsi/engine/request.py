"""A generation request and the committed output every engine appends to.

:class:`Output` owns the committed token sequence of one request: it appends tokens, streams
them to the caller's callback, and knows when generation is over (``max_new_tokens`` reached,
or the target committed EOS). Engines only decide *which* token comes next.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dsi.engine.stats import GenerationStats
from dsi.errors import DSIError
import numpy as np

from dsi.logprobs import TokenLogprob, entry
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
    prompt: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    eos_token_ids: frozenset[int] = frozenset()  # any of these, committed by the target, ends it
    logprobs: int | None = None  # report each new token's logprob and this many top ones (None: none)
    logprobs_mode: str = "raw"  # their distribution: "raw" or "processed" (dsi.logprobs)

    def verify_task(self, task_id: int, context: Sequence[int], num_rows: int,
                    tree: DraftTree | None = None, draft_probs: Sequence[float] | None = None) -> VerifyTask:
        """The task of scoring the last ``num_rows`` positions of ``context`` for this request (its
        sampling, prompt length, stop ids and logprobs mode): what a target server, SI or non-SI runs.
        ``draft_probs``: see :class:`~dsi.transport.base.VerifyTask` (sampled chain tasks without logprobs)."""
        return VerifyTask(task_id, tuple(context), num_rows, self.sampling, len(self.prompt), self.eos_token_ids,
                          None if self.logprobs is None else self.logprobs_mode, tree,
                          None if draft_probs is None else tuple(float(x) for x in draft_probs), self.logprobs)

    @property
    def decided_remotely(self) -> bool:
        """Whether a chain verification of this request may be decided on its target server (sampled): its tasks
        then carry their drafts' drafter probabilities."""
        return not self.sampling.greedy

    def tree_task(self, task_id: int, prefix: Sequence[int], tree: DraftTree) -> VerifyTask:
        """The task of scoring the draft ``tree`` after ``prefix`` (its ``1 + len(tree)`` rows) for this request."""
        return self.verify_task(task_id, prefix, 1 + len(tree), tree)

    def prefix(self, tokens: Sequence[int]) -> Prefix:
        """What the logit processors see before a row that follows ``tokens`` (prompt included)."""
        return Prefix(tokens, len(self.prompt), self.eos_token_ids)


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
        self.tokens: list[int] = list(request.prompt)
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

