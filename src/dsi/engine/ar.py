"""Non-SI: plain autoregressive decoding with the target, one forward per token.

The reference every other method must reproduce (greedy) or match in distribution (sampling).
Sampling draws each token with the BONUS uniform of its absolute position.

A target that generates by itself (engines: ``target.generation(sampling, logprobs)`` returns a plan, see
:mod:`dsi.models.engines.generation`) decodes the request there instead, where that is exact: the decoder commits
the tokens it streams and closes the stream where dsi's stop rules end the output.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence

import numpy as np

from dsi.errors import TaskCancelled, WorkerError
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
        # made now, except where the target generates by itself (engines): there the session scores only the requests
        # the engines' generation cannot serve exactly, and is made at the first of them (a session on an engine
        # holds a connection, which a server's plain decoders, one a slot, would hold for nothing)
        self._session = None if hasattr(target, "generation") else target.new_session()

    @property
    def session(self) -> object:
        """The decoder's target session (made on first use where it was not made at once)."""
        if self._session is None:
            self._session = self._model.new_session()
        return self._session

    def _generate(self, request: Request, on_tokens: TokenCallback | None,
                  abort: threading.Event | None) -> GenerationResult:
        request = prepare_request(request, self._model)
        # refuses what the target cannot serve exactly (engines; whole rows for logprobs)
        check_sampling(self._model, request.sampling, request.logprobs is not None)
        stats = GenerationStats(method=self.method)
        out = Output(request, stats, on_tokens, abort)
        generation = getattr(self._model, "generation", None)
        plan = generation(request.sampling, request.logprobs is not None) if generation is not None else None
        if plan is not None:
            return self._generate_streamed(plan, out, abort)
        start_fresh_unless_deterministic(self.session, self._model)  # the same request, the same tokens
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
                got = forward_rows(self.session, task.context, 1, greedy=task.ids_only, top=task.row_top,
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

    def _generate_streamed(self, plan: object, out: Output, abort: threading.Event | None) -> GenerationResult:
        """The request decoded by the target's own generation (``plan``: what ``target.generation`` gave): each
        streamed token committed as it arrives, the stream closed where the output ends."""
        stats = out.stats
        start = time.perf_counter()
        stream = plan.tokens(tuple(out.tokens), out.remaining, abort)  # type: ignore[attr-defined]
        try:
            with model_errors("target"):
                for token in itertools.chain.from_iterable(stream):  # type: ignore[call-overload]
                    out.commit(int(token))
                    stats.bonus_tokens += 1
                    if out.finished:
                        break
        except TaskCancelled:
            out.check_abort()  # the caller's abort (or a hand-over): GenerationAborted with the tokens so far
            raise
        finally:
            stream.close()  # type: ignore[attr-defined]
            elapsed = time.perf_counter() - start
            stats.target_busy_s += elapsed
            stats.completed_target_s += elapsed
            stats.target_forwards += stats.bonus_tokens
            stats.completed_target_forwards += stats.bonus_tokens
            stats.extra["engine_streams"] = plan.streams  # type: ignore[attr-defined]
        if not out.finished:
            out.check_abort()
            raise WorkerError(f"the target's generation ended after {out.new_count} of "
                              f"{out.request.max_new_tokens} tokens without a stop")
        return GenerationResult(out.finalize(), stats, out.logprobs)

    def score(self, tokens: Sequence[int], first: int, cancel: threading.Event | None = None) -> np.ndarray:
        """The target's raw logits after ``tokens[:p]`` for p = ``first`` .. ``len(tokens)``
        (``[len(tokens) - first + 1, V]``), on the decoder's target session: its cache from earlier
        requests is reused, so only what differs from them is computed (``dsi serve``'s
        ``prompt_logprobs``, what a dsi verifying on this server asks)."""
        tokens = check_score(tokens, first, self._model)
        with self._turn(), model_errors("target"):
            return forward_rows(self.session, tokens, len(tokens) - first + 1, cancel)

    def healthy(self) -> bool:
        """Always: its sessions re-align with each request's context, so a failed request leaves
        nothing broken behind."""
        return True

    def _release(self) -> None:
        if self._session is not None:
            self._session.close()
