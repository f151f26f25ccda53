"""Classic speculative inference (SI): draft k tokens, then block on one target forward.

Leviathan et al. 2023 / Chen et al. 2023. Each iteration the drafter proposes
``kk = min(k, remaining - 1)`` tokens (stopping early at a drafted EOS); one target forward
scores all of them plus one more position; the longest accepted prefix is committed, then the
correction token (on a rejection) or the bonus token (all accepted). Drafter and target run
one after the other in the calling thread.
"""

from __future__ import annotations

import threading

import numpy as np

from dsi.engine.request import Output, Request, TokenCallback
from dsi.engine.result import GenerationResult
from dsi.engine.stats import GenerationStats
from dsi.models.base import LanguageModel, forward_rows
from dsi.sampling import bonus, decide, draft_from_logits, process_logits


class SpeculativeDecoder:
    """SI with lookahead ``k`` on one target session and one drafter session."""

    method = "si"

    def __init__(self, target: LanguageModel, drafter: LanguageModel, lookahead: int) -> None:
        self.lookahead = lookahead
        self._target = target.new_session()
        self._drafter = drafter.new_session()

    def generate(
        self, request: Request, on_tokens: TokenCallback | None = None, abort: threading.Event | None = None
    ) -> GenerationResult:
        params = request.sampling
        stats = GenerationStats(method=self.method, lookahead=self.lookahead)
        out = Output(request, stats, on_tokens, abort)
        while not out.finished:
            out.check_abort()
            base = tuple(out.tokens)
            drafts, qs = self._draft(base, min(self.lookahead, out.remaining - 1), request, stats)
            rows = forward_rows(self._target, base + tuple(drafts), len(drafts) + 1)  # [kk+1, V]
            stats.target_forwards += 1
            stats.verify_tasks += 1
            for i, x in enumerate(drafts):
                p = process_logits(rows[i], params)  # [V]
                decision = decide(p, x, qs[i], params, len(out.tokens))
                out.commit(decision.token)
                if decision.accepted:
                    stats.accepted_tokens += 1
                else:
                    stats.rejections += 1
                if not decision.accepted or out.finished:
                    break
            else:  # every draft accepted: the extra row gives a bonus token
                out.commit(bonus(process_logits(rows[len(drafts)], params), params, len(out.tokens)))
                stats.bonus_tokens += 1
        return GenerationResult(out.finalize(), stats)

    def _draft(
        self, base: tuple[int, ...], count: int, request: Request, stats: GenerationStats
    ) -> tuple[list[int], list[np.ndarray | None]]:
        drafts: list[int] = []
        qs: list[np.ndarray | None] = []
        if count <= 0:
            return drafts, qs
        params = request.sampling
        row = forward_rows(self._drafter, base, 1)[-1]  # [V]
        stats.drafter_forwards += 1
        while True:
            token, q = draft_from_logits(row, params, len(base) + len(drafts))
            drafts.append(token)
            qs.append(q)
            if len(drafts) >= count or token in request.eos_token_ids:
                break
            row = self._drafter.extend([token])[-1]
            stats.drafter_forwards += 1
        stats.drafted_tokens += len(drafts)
        return drafts, qs

    def close(self) -> None:
        self._target.close()
        self._drafter.close()
