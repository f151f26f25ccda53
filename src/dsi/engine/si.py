"""Classic speculative inference (SI): draft k tokens, then block on one target forward.

Leviathan et al. 2023 / Chen et al. 2023. Each iteration the drafter proposes
``kk = min(k, remaining - 1)`` tokens (stopping early at a drafted EOS); one target forward
scores all of them plus one more position; the longest accepted prefix is committed, then the
correction token (on a rejection) or the bonus token (all accepted). Drafter and target run
one after the other in the calling thread.

The drafter's context limit never fails a request: ``kk`` is also capped at the drafter's room
(:func:`dsi.engine.drafter.capped_drafts`), and a drafter session that raises
:class:`~dsi.errors.ContextLengthError` ends the iteration's drafts. With no drafts the
target's extra row gives the bonus token: plain non-SI steps once the drafter is out of room.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from dsi.engine.drafter import capped_drafts, request_info
from dsi.engine.goodput import LookaheadByLoad
from dsi.engine.lifecycle import DecoderLifecycle, check_score, model_errors, prepare_request
from dsi.engine.request import Output, Request, TokenCallback
from dsi.engine.result import GenerationResult
from dsi.engine.stats import GenerationStats
from dsi.engine.trees import TreeDrafter, decide_tree, ended_on_leaf, parent_row, request_shape
from dsi.errors import ContextLengthError, DraftUnavailable
from dsi.models.base import (
    LanguageModel,
    check_sampling,
    counter_changes,
    drafts_ids_only,
    extend_rows,
    forward_rows,
    session_counters,
)
from dsi.models.determinism import start_fresh_unless_deterministic
from dsi.sampling import DraftRead, bonus, decide_greedy, decide_row
from dsi.transport.base import TaskResult, VerifyTask
from dsi.transport.server import run_verify_task
from dsi.trees import TreeShape, grow


class SpeculativeDecoder(DecoderLifecycle):
    """SI with lookahead ``k`` on one target session and one drafter session; with ``draft_tree`` (a
    :data:`dsi.trees.TreeShape`), each iteration spends its k drafts as a tree (:mod:`dsi.engine.trees`).
    One request at a time (:mod:`dsi.engine.lifecycle`)."""

    method = "si"

    def __init__(self, target: LanguageModel, drafter: LanguageModel, lookahead: int,
                 draft_tree: TreeShape = None) -> None:
        super().__init__()
        self.lookahead = lookahead
        self.draft_tree = draft_tree
        # where set (dsi serve with speculation by load): each window's lookahead, up to ``lookahead``, chosen by
        # goodput under the server's load (dsi.engine.goodput), which this decoder's windows also measure. Greedy
        # output and the sampled law never depend on it; a seeded sampled request's tokens do (a position is decided
        # by a draft or by a bonus draw as windows end), so the server unsets it for those
        self.policy: LookaheadByLoad | None = None
        self._target_model = target
        self._drafter_model = drafter
        self._target = target.new_session()
        self._drafter = drafter.new_session()

    def _generate(self, request: Request, on_tokens: TokenCallback | None,
                  abort: threading.Event | None) -> GenerationResult:
        request = prepare_request(request, self._target_model)
        params = request.sampling
        # refuses what the target cannot serve exactly (engines; whole rows for logprobs)
        check_sampling(self._target_model, params, request.logprobs is not None)
        stats = GenerationStats(method=self.method, lookahead=self.lookahead)
        stats.extra.update(request_info(self._drafter_model, params))
        counters = session_counters(self._drafter)
        out = Output(request, stats, on_tokens, abort)
        start_fresh_unless_deterministic(self._target, self._target_model)  # the same request, the same tokens
        start_fresh_unless_deterministic(self._drafter, self._drafter_model)
        try:
            self._run(out, request, stats)
        finally:
            stats.extra.update(counter_changes(counters, session_counters(self._drafter)))
        return GenerationResult(out.finalize(), stats, out.logprobs)

    def _run(self, out: Output, request: Request, stats: GenerationStats) -> None:
        params = request.sampling
        shape = request_shape(self.draft_tree, self._drafter_model, params, stats)
        policy = self.policy
        while not out.finished:
            out.check_abort()
            base = tuple(out.tokens)
            k = self.lookahead if policy is None else policy.choose(stats.accepted_tokens,
                                                                    stats.accepted_tokens + stats.rejections)
            wanted = min(k, out.remaining - 1)
            count = capped_drafts(self._drafter_model, len(base), wanted)
            if shape is not None and count > 0:
                self._tree_iteration(out, request, stats, base, count, shape)
                continue
            drafting_s = stats.drafter_busy_s
            drafts, qs, limited = self._draft(base, count, request, stats)
            if policy is not None:
                policy.observe_drafts(len(drafts), stats.drafter_busy_s - drafting_s)
                running, verifying_s = policy.running(), stats.target_busy_s
            if limited or count < wanted:
                stats.extra["drafter_context_limited"] = stats.extra.get("drafter_context_limited", 0) + 1
            # sampled: the drafts' drafter probabilities go with the task, decided with the forward (read_chain_laws)
            draft_probs = ([float(q[x]) for x, q in zip(drafts, qs, strict=True)]
                           if request.decided_remotely else None)
            result = self._verify(request.verify_task(0, base + tuple(drafts), len(drafts) + 1,
                                                      draft_probs=draft_probs), stats)
            if policy is not None:
                policy.observe_verification(len(drafts) + 1, running, stats.target_busy_s - verifying_s)
                decided = (stats.accepted_tokens, stats.rejections)
            logprobs = result.logprobs
            for i, x in enumerate(drafts):
                if params.greedy:
                    decision = decide_greedy(result.tokens[i], x)
                else:
                    decision = decide_row(result.probs, i, x, qs[i], params, len(out.tokens))
                out.commit(decision.token, None if logprobs is None else logprobs[i])
                if decision.accepted:
                    stats.accepted_tokens += 1
                else:
                    stats.rejections += 1
                if not decision.accepted or out.finished:
                    break
            else:  # every draft accepted: the extra row gives a bonus token
                last = len(drafts)
                out.commit(int(result.tokens[last]) if params.greedy else bonus(result.probs[last], params,
                                                                                len(out.tokens)),
                           None if logprobs is None else logprobs[last])
                stats.bonus_tokens += 1
            if policy is not None:
                policy.observe_decisions(stats.accepted_tokens - decided[0], stats.rejections - decided[1])
                windows = stats.extra.setdefault("lookaheads", {})  # k -> this request's windows of k drafts
                windows[len(drafts)] = windows.get(len(drafts), 0) + 1

    def _verify(self, task: VerifyTask, stats: GenerationStats) -> TaskResult:
        """One verification, as a DSI target server runs it (greedy: the argmax ids of the processed rows;
        sampling: the processed laws too; logprob rows when asked), counted in ``stats``."""
        start = time.perf_counter()
        with model_errors("target"):
            result = run_verify_task(self._target, task, 0, None)
        elapsed = time.perf_counter() - start
        stats.target_busy_s += elapsed
        stats.completed_target_s += elapsed
        stats.target_forwards += 1
        stats.completed_target_forwards += 1
        stats.verify_tasks += 1
        return result

    def _tree_iteration(self, out: Output, request: Request, stats: GenerationStats, base: tuple[int, ...],
                        count: int, shape: TreeShape) -> None:
        """One SI iteration whose ``count`` drafts form a tree: grow it, verify it in one tree task, commit
        the walk (the chain's tokens; then the target's own after a leaf)."""
        start = time.perf_counter()
        with model_errors("drafter"):
            drafter = TreeDrafter.for_shape(self._drafter, request, base, shape)
            tree = grow(shape, count, drafter.propose, drafter.propose_many, drafter.probability)
        stats.drafter_forwards += drafter.forwards
        stats.drafter_busy_s += time.perf_counter() - start
        stats.drafted_tokens += len(tree)
        if drafter.context_limited:
            stats.extra["drafter_context_limited"] = stats.extra.get("drafter_context_limited", 0) + 1
        result = self._verify(request.tree_task(0, base, tree), stats)
        stats.extra["tree_windows"] = stats.extra.get("tree_windows", 0) + 1
        stats.extra["tree_side_nodes"] = stats.extra.get("tree_side_nodes", 0) + len(tree) - len(tree.main_path())
        with model_errors("drafter"):  # the walk may read the drafter's laws of side children
            walked = decide_tree(tree, result, drafter, request.sampling, len(base))
        logprobs = result.logprobs
        for index, token in enumerate(walked.tokens(tree)):
            row = parent_row(walked, index)
            out.commit(token, None if logprobs is None else logprobs[row])
            if index < len(walked.accepted):
                stats.accepted_tokens += 1
                node = walked.accepted[index]
                if tree.children(tree.parents[node])[0] != node:
                    stats.extra["tree_side_accepts"] = stats.extra.get("tree_side_accepts", 0) + 1
            elif ended_on_leaf(tree, walked):
                stats.bonus_tokens += 1
            else:
                stats.rejections += 1
            if out.finished:
                break

    def _draft(
        self, base: tuple[int, ...], count: int, request: Request, stats: GenerationStats
    ) -> tuple[list[int], list[np.ndarray | None], bool]:
        """Up to ``count`` drafts after ``base``, their laws (None when greedy), and whether the
        drafter's context limit cut them short."""
        drafts: list[int] = []
        qs: list[np.ndarray | None] = []
        limited = False
        if count <= 0:
            return drafts, qs, limited
        params = request.sampling
        start = time.perf_counter()
        try:
            with model_errors("drafter"):  # (its context limit and DraftUnavailable pass through)
                stats.drafter_forwards += 1
                ids_only = drafts_ids_only(self._drafter_model, params)

                def draw() -> DraftRead | Callable[[np.ndarray], tuple[int, None]]:
                    """How the forward's last row gives the next draft (within the forward where the session can;
                    on the drafter's device where it decides there): its argmax id, or a DraftRead."""
                    if ids_only:
                        return lambda ids: (int(ids[-1]), None)
                    return DraftRead(base + tuple(drafts), params, len(request.prompt), request.eos_token_ids)

                drawn = forward_rows(self._drafter, base, 1, greedy=ids_only, read=draw())
                while True:
                    token, q = drawn
                    drafts.append(token)
                    qs.append(q)
                    if len(drafts) >= count or token in request.eos_token_ids:
                        break
                    stats.drafter_forwards += 1
                    drawn = extend_rows(self._drafter, [token], None, 1, ids_only, read=draw())
        except ContextLengthError:  # the drafter's declared limit: no more drafts this iteration
            limited = True
        except DraftUnavailable:  # nothing to propose here (a drafter of another vocabulary): no more drafts now
            pass
        stats.drafter_busy_s += time.perf_counter() - start
        stats.drafted_tokens += len(drafts)
        return drafts, qs, limited

    def score(self, tokens: Sequence[int], first: int, cancel: threading.Event | None = None) -> np.ndarray:
        """The target's raw logits after ``tokens[:p]`` for p = ``first`` .. ``len(tokens)``
        (``[len(tokens) - first + 1, V]``), on the decoder's target session: its cache from earlier
        requests is reused, so only what differs from them is computed (``dsi serve``'s
        ``prompt_logprobs``, what a dsi verifying on this server asks)."""
        tokens = check_score(tokens, first, self._target_model)
        with self._turn(), model_errors("target"):
            return forward_rows(self._target, tokens, len(tokens) - first + 1, cancel)

    def healthy(self) -> bool:
        """Always: its sessions re-align with each request's context, so a failed request leaves
        nothing broken behind."""
        return True

    def _release(self) -> None:
        self._target.close()
        self._drafter.close()
