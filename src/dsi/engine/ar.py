"""Non-SI: plain autoregressive decoding with the target, one forward per token.

The reference every other method must reproduce (greedy) or match in distribution (sampling).
Sampling draws each token with the BONUS uniform of its absolute position.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np

from dsi.engine.request import Output, Request, TokenCallback
from dsi.engine.result import GenerationResult
from dsi.engine.stats import GenerationStats
from dsi.logprobs import logprob_row
from dsi.models.base import LanguageModel, check_sampling, forward_rows
from dsi.models.determinism import start_fresh_unless_deterministic
from dsi.sampling import bonus, greedy_tokens, process_logits


class AutoregressiveDecoder:
    """Non-SI decoding on one session of ``target`` (kept across requests for cache reuse)."""

    method = "ar"

    def __init__(self, target: LanguageModel) -> None:
        self._model = target
        self._session = target.new_session()

    def generate(
        self, request: Request, on_tokens: TokenCallback | None = None, abort: threading.Event | None = None
    ) -> GenerationResult:
        check_sampling(self._model, request.sampling, request.logprobs is not None)  # refuses what the target cannot serve exactly (engines)
        stats = GenerationStats(method=self.method)
        out = Output(request, stats, on_tokens, abort)
        start_fresh_unless_deterministic(self._session, self._model)  # the same request, the same tokens
        while not out.finished:
            out.check_abort()
            params = request.sampling
            start = time.perf_counter()
            # an argmax id where greedy decoding reads the raw row (and no logprobs); else the row [V]
            row = forward_rows(self._session, out.tokens, 1, greedy=not request.wants_rows, top=request.row_top)[-1]
            elapsed = time.perf_counter() - start
            stats.target_busy_s += elapsed
            stats.completed_target_s += elapsed
            stats.target_forwards += 1
            stats.completed_target_forwards += 1
            if not request.wants_rows:
                out.commit(int(row))
            else:
                prefix = request.prefix(out.tokens)
                if params.greedy:
                    probs, token = None, int(greedy_tokens(row[None], params, out.tokens, len(request.prompt),
                                                           request.eos_token_ids)[0])
                else:
                    probs = process_logits(row, params, prefix)
                    token = bonus(probs, params, len(out.tokens))
                logprobs = (None if request.logprobs is None else
                            logprob_row(row, params, prefix, request.logprobs_mode, probs))
                out.commit(token, logprobs)
            stats.bonus_tokens += 1
        return GenerationResult(out.finalize(), stats, out.logprobs)

    def score(self, tokens: Sequence[int], first: int, cancel: threading.Event | None = None) -> np.ndarray:
        """The target's raw logits after ``tokens[:p]`` for p = ``first`` .. ``len(tokens)``
        (``[len(tokens) - first + 1, V]``), on the decoder's target session: its cache from earlier
        requests is reused, so only what differs from them is computed (``dsi serve``'s
        ``prompt_logprobs``, what a dsi verifying on this server asks)."""
        return forward_rows(self._session, tokens, len(tokens) - first + 1, cancel)

    def healthy(self) -> bool:
        """Always: its sessions re-align with each request's context, so a failed request leaves
        nothing broken behind."""
        return True

    def close(self) -> None:
        self._session.close()
