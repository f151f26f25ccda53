"""Non-SI: plain autoregressive decoding with the target, one forward per token.

The reference every other method must reproduce (greedy) or match in distribution (sampling).
Sampling draws each token with the BONUS uniform of its absolute position.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np

from dsi.engine.lifecycle import DecoderLifecycle, check_score, model_errors, prepare_request
from dsi.engine.request import Output, Request, TokenCallback
from dsi.engine.result import GenerationResult
from dsi.engine.stats import GenerationStats
from dsi.models.base import LanguageModel, check_sampling, forward_rows
from dsi.models.determinism import start_fresh_unless_deterministic
from dsi.logprobs import LogprobsRead
from dsi.sampling import BonusRead, GreedyRead


class AutoregressiveDecoder(DecoderLifecycle):
    """Non-SI decoding on one session of ``target`` (kept across requests for cache reuse); one request
    at a time (:mod:`dsi.engine.lifecycle`)."""

    method = "ar"

    def __init__(self, target: LanguageModel) -> None:
        super().__init__()
        self._model = target
        self._session = target.new_session()

    def _generate(self, request: Request, on_tokens: TokenCallback | None,
                  abort: threading.Event | None) -> GenerationResult:
        request = prepare_request(request, self._model)
        # refuses what the target cannot serve exactly (engines; whole rows for logprobs)
        check_sampling(self._model, request.sampling, request.logprobs is not None)
        stats = GenerationStats(method=self.method)
        out = Output(request, stats, on_tokens, abort)
        start_fresh_unless_deterministic(self._session, self._model)  # the same request, the same tokens
        while not out.finished:
            out.check_abort()
            task = request.verify_task(0, out.tokens, 1)
            start = time.perf_counter()
            # an argmax id where greedy decoding reads the raw row (and no logprobs); else the token read from the
            # processed row, with its logprob row where asked (on a GPU, where the row is: dsi.models.hf.device_laws)
            greedy = request.sampling.greedy
            reader: object = None
            if not task.ids_only:
                reader = (GreedyRead if greedy else BonusRead)(task.context, request.sampling, task.prompt_len,
                                                               task.stop_ids)
                if task.logprobs_mode is not None:
                    reader = LogprobsRead(reader, task.logprobs_mode, task.logprobs_top)
            with model_errors("target"):
                got = forward_rows(self._session, task.context, 1, greedy=task.ids_only, top=task.row_top,
                                   read=reader)
            elapsed = time.perf_counter() - start
            stats.target_busy_s += elapsed
            stats.completed_target_s += elapsed
            stats.target_forwards += 1
            stats.completed_target_forwards += 1
            got, logprobs = got if task.logprobs_mode is not None else (got, None)
            token = int(got[-1]) if task.ids_only or greedy else int(got)  # argmax ids, or the drawn token
            out.commit(token, None if logprobs is None else logprobs[0])
            stats.bonus_tokens += 1
        return GenerationResult(out.finalize(), stats, out.logprobs)

    def score(self, tokens: Sequence[int], first: int, cancel: threading.Event | None = None) -> np.ndarray:
        """The target's raw logits after ``tokens[:p]`` for p = ``first`` .. ``len(tokens)``
        (``[len(tokens) - first + 1, V]``), on the decoder's target session: its cache from earlier
        requests is reused, so only what differs from them is computed (``dsi serve``'s
        ``prompt_logprobs``, what a dsi verifying on this server asks)."""
        tokens = check_score(tokens, first, self._model)
        with self._turn(), model_errors("target"):
            return forward_rows(self._session, tokens, len(tokens) - first + 1, cancel)

    def healthy(self) -> bool:
        """Always: its sessions re-align with each request's context, so a failed request leaves
        nothing broken behind."""
        return True

    def _release(self) -> None:
        self._session.close()
