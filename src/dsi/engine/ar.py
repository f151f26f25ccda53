"""Non-SI: plain autoregressive decoding with the target, one forward per token.

The reference every other method must reproduce (greedy) or match in distribution (sampling).
Sampling draws each token with the BONUS uniform of its absolute position.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np

from dsi.engine.lifecycle import DecoderLifecycle, prepare_request, model_errors
from dsi.engine.request import Output, Request, TokenCallback
from dsi.engine.result import GenerationResult
from dsi.engine.stats import GenerationStats
from dsi.models.base import LanguageModel, check_sampling, forward_rows
from dsi.models.determinism import start_fresh_unless_deterministic
from dsi.sampling import BonusRead, GreedyRead, bonus
from dsi.transport.server import read_rows


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
            position = len(out.tokens)

            def read(rows: np.ndarray, task=task, position=position) -> tuple[int, object]:
                """The token and its logprob row from the forward's row (within the forward where the session
                can: :func:`dsi.models.base.extend_rows`)."""
                tokens, probs, logprobs = read_rows(rows, task)
                token = int(tokens[0]) if probs is None else bonus(probs[0], request.sampling, position)
                return token, None if logprobs is None else logprobs[0]

            # an argmax id where greedy decoding reads the raw row (and no logprobs); without logprobs, the token
            # read from the processed row (on a GPU, where the row is: dsi.models.device_laws); else the token and
            # its logprobs
            greedy = request.sampling.greedy
            reader: object = read
            if task.ids_only:
                reader = None
            elif task.logprobs_mode is None:
                reader = (GreedyRead if greedy else BonusRead)(task.context, request.sampling, task.prompt_len,
                                                               task.stop_ids)
            with model_errors("target"):
                got = forward_rows(self._session, task.context, 1, greedy=task.ids_only, top=task.row_top,
                                   read=reader)
            elapsed = time.perf_counter() - start
            stats.target_busy_s += elapsed
            stats.completed_target_s += elapsed
            stats.target_forwards += 1
            stats.completed_target_forwards += 1
            if task.ids_only or (task.logprobs_mode is None and greedy):  # argmax ids
                out.commit(int(got[-1]))
            elif task.logprobs_mode is None:  # the drawn token
                out.commit(int(got))
            else:
                out.commit(*got)
            stats.bonus_tokens += 1
        return GenerationResult(out.finalize(), stats, out.logprobs)

    def score(self, tokens: Sequence[int], first: int, cancel: threading.Event | None = None) -> np.ndarray:
        """The target's raw logits after ``tokens[:p]`` for p = ``first`` .. ``len(tokens)``
        (``[len(tokens) - first + 1, V]``), on the decoder's target session: its cache from earlier
        requests is reused, so only what differs from them is computed (``dsi serve``'s
        ``prompt_logprobs``, what a dsi verifying on this server asks)."""
        with self._turn(), model_errors("target"):
            return forward_rows(self._session, tokens, len(tokens) - first + 1, cancel)

    def healthy(self) -> bool:
        """Always: its sessions re-align with each request's context, so a failed request leaves
        nothing broken behind."""
        return True

    def _release(self) -> None:
        self._session.close()
