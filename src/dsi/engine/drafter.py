"""The drafter thread of DSI: it drafts continuously and never waits for a verification.

The orchestrator calls :meth:`DraftWorker.restart` with a new epoch and the committed tokens
(at the start and after every rejection). The worker cancels its running forward, rolls its
session back to the longest common prefix, and drafts up to ``limit`` tokens, reporting each as
a :class:`Draft` event and finally a :class:`DraftsDone`. Events carry the epoch so that drafts
of an abandoned context are recognised and ignored.

A drafter's context limit (its declared ``max_context``) never fails a request: drafting stops
where the drafter runs out of room (:func:`capped_drafts`; not even a prefill when the context
alone is too long), and a :class:`~dsi.errors.ContextLengthError` raised by the drafter's
session ends the drafts like the token limit does. The engines then commit the target's own
tokens (bonus tokens), which keeps the output lossless. A drafter session with nothing to
propose (:class:`~dsi.errors.DraftUnavailable`: a drafter of another vocabulary whose text has
ended) ends the drafts the same way. Any other drafter error stays an error.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from dsi.errors import ContextLengthError, DraftUnavailable, TaskCancelled
from dsi.models.base import (
    LanguageModel,
    check_sampling,
    context_limit,
    drafts_ids_only,
    extend_rows,
    forward_rows,
    session_counters,
    tree_rows,
)
from dsi.models.determinism import start_fresh_unless_deterministic
from dsi.sampling import DraftRead, Prefix, SamplingParams, draft_from_logits
from dsi.engine.trees import draft_with_alternatives, likeliest_draft
from dsi.trees import ROOT, DraftTree
from dsi.transport.liveness import HISTORY, LivenessPolicy

log = logging.getLogger(__name__)


def request_info(model: LanguageModel, sampling: SamplingParams) -> dict:
    """Check that the drafter ``model`` can serve a request with ``sampling`` (raises
    :class:`~dsi.errors.ConfigError` if not) and return what it reports about it for the stats
    (a drafter of another vocabulary: its mode and the vocabulary intersection); ``{}`` for others."""
    check_sampling(model, sampling)
    info = getattr(model, "request_info", None)
    return dict(info(sampling)) if info is not None else {}


def capped_drafts(model: LanguageModel, context_length: int, wanted: int) -> int:
    """How many of ``wanted`` drafts the drafter ``model`` can make after ``context_length`` tokens.

    Drafting d tokens feeds the drafter the context and the first d - 1 drafts (the last draft
    is never fed back), so a drafter holding at most L tokens can make L - n + 1 drafts after n
    tokens: none when the context alone is longer than L. No declared limit: ``wanted``.
    """
    limit = context_limit(model)
    if limit is None:
        return max(wanted, 0)
    return max(min(wanted, limit - context_length + 1), 0)


@dataclass(frozen=True)
class SideStep:
    """The next token of a side chain: the side child ``side`` of the draft at index ``root`` continued by the
    drafter. Its first token is the drafter's likeliest token after the child (a guess at the target's draw
    there, ``q`` None); the next ones are the drafter's own drafts after it, drawn as the chain draws them
    (:func:`dsi.sampling.draft_from_logits` at their absolute positions, ``q`` their processed law, None when
    greedy), with the side children a main-path draft there would get (``sides``), so they are the drafts a
    restart after the child would make."""

    root: int
    side: int
    token: int
    q: np.ndarray | None = None
    sides: tuple[int, ...] = ()


@dataclass(frozen=True)
class Draft:
    epoch: int
    index: int  # position in the draft, 0 = first token after the committed context
    token: int
    q: np.ndarray | None  # [V] processed drafter distribution; None when greedy
    # draft trees: this position's side children (the tree shape's choice among the drafter's likeliest tokens)
    sides: tuple[int, ...] = ()
    # draft trees that continue side children (DSI's ``"branches"``): the next token of each side chain that grew in
    # the forward that drafted this token
    side_steps: tuple[SideStep, ...] = ()


@dataclass(frozen=True)
class DraftsDone:
    epoch: int
    count: int  # drafts produced in this epoch
    context_limited: bool = False  # the drafter's session refused to go further (ContextLengthError)


@dataclass(frozen=True)
class DrafterFailed:
    epoch: int
    error: str
    exception: BaseException


@dataclass(frozen=True)
class _Job:
    epoch: int
    context: tuple[int, ...]
    limit: int
    sampling: SamplingParams
    eos_token_ids: frozenset[int]
    cancel: threading.Event
    prompt_len: int = 0  # how much of the context is the prompt (penalties, min_tokens)
    alternatives: int = 0  # draft trees: report this many likeliest tokens with each draft (0: none)
    alternatives_floor: float = 0.0  # ... only those other than the draft with this drafter probability
    # draft trees: a position's side children from its draft and likeliest tokens (the shape's ``sides``)
    side_children: Callable[[int, list[tuple[int, float]]], list[int]] | None = None
    # side chains (DSI's "branches"): each side child continues by up to this many tokens, one per drafter step,
    # computed with the main path's next row in one tree forward (0: side children stay leaves)
    side_depth: int = 0
    fresh: bool = False  # the request's first job: start from an empty cache unless deterministic


def _draft_at(row: np.ndarray, job: _Job, position: int, prefix: Prefix) -> tuple[int, np.ndarray | None,
                                                                                   tuple[int, ...]]:
    """The draft at ``position`` from the drafter's raw logits ``row`` after ``prefix`` (the chain's own:
    :func:`dsi.sampling.draft_from_logits`), its processed law (None when greedy), and, where the job's tree
    asks for them, its side children (the shape's choice among its likeliest tokens)."""
    if not job.alternatives:
        token, q = draft_from_logits(row, job.sampling, position, prefix)
        return token, q, ()
    token, q, ranked = draft_with_alternatives(row, job.sampling, position, prefix, job.alternatives,
                                               job.alternatives_floor)
    return token, q, () if job.side_children is None else tuple(job.side_children(token, ranked))


def _grows(key: tuple[int, int], chain: list[int], job: _Job, limit: int) -> bool:
    """Whether the side chain ``key`` (draft index, side child) with tokens ``chain`` after the child takes its next
    token: shorter than the job's depth, not ended by EOS, and its next token at an index a draft may have."""
    root, _ = key
    return (len(chain) < job.side_depth and not (chain and chain[-1] in job.eos_token_ids)
            and root + len(chain) + 1 < limit)


class DraftWorker:
    """Drafts on its own thread with its own session of ``model``.

    A forward that runs past its liveness deadline (:meth:`overdue`: the policy of
    :mod:`dsi.transport.liveness`, from the slowest of the worker's recent forwards) marks a frozen
    drafter; the orchestrator then :meth:`abandon` s it (a thread cannot be killed: whatever it sends
    later carries an old epoch and is ignored) and its decoder starts a new worker.
    """

    def __init__(self, model: LanguageModel, on_event: Callable[[object], None]) -> None:
        self._model = model
        self._on_event = on_event
        self._forward_began: float | None = None  # when the running forward began (None: none running)
        self._durations: deque[float] = deque(maxlen=HISTORY)  # the last forwards' seconds
        self._abandoned = False
        self._cond = threading.Condition()
        self._job: _Job | None = None
        self._closed = False
        self.forwards = 0  # drafter forwards started (read by the orchestrator for stats)
        self.busy_s = 0.0  # time spent in drafter forwards, finished or cancelled (likewise)
        self._session = None  # the drafter's session (its own counters are read for stats)
        self._thread = threading.Thread(target=self._run, name="dsi-drafter", daemon=True)
        self._thread.start()

    def restart(
        self,
        epoch: int,
        context: tuple[int, ...],
        limit: int,
        sampling: SamplingParams,
        eos_token_ids: frozenset[int],
        prompt_len: int = 0,
        alternatives: int = 0,
        alternatives_floor: float = 0.0,
        side_children: Callable[[int, list[tuple[int, float]]], list[int]] | None = None,
        side_depth: int = 0,
        fresh: bool = False,
    ) -> None:
        """Abandon the current drafts and start drafting ``limit`` tokens after ``context`` (the
        caller has capped ``limit`` at the drafter's room: :meth:`capped`); the first ``prompt_len``
        tokens of ``context`` are the request's prompt. ``alternatives``: each draft also reports the
        drafter's that many likeliest tokens (draft trees); with ``alternatives_floor`` > 0, only those
        other than the draft with at least that drafter probability
        (:func:`dsi.engine.trees.draft_with_alternatives`). ``side_children(token, alternatives)``: a
        draft's side children, reported with it; with ``side_depth`` > 0, each side child continues as a side
        chain of up to that many tokens, one per drafter step: each forward computes the main path's next row
        and the row after each growing chain in one tree (:func:`dsi.models.base.tree_rows`), and the next draft
        reports the chains' new tokens (``Draft.side_steps``, :meth:`_with_chains`). ``fresh``: the request's
        first job: the session starts from an empty cache, as a fresh drafter's would, unless its rows are the
        canonical ones (:func:`~dsi.models.determinism.start_fresh_unless_deterministic`)."""
        with self._cond:
            if self._job is not None:
                self._job.cancel.set()
            self._job = _Job(epoch, context, limit, sampling, eos_token_ids, threading.Event(), prompt_len,
                             alternatives, alternatives_floor, side_children, side_depth, fresh)
            self._cond.notify()

    def stop(self) -> None:
        """Abandon the current job (the thread stays, idle)."""
        with self._cond:
            if self._job is not None:
                self._job.cancel.set()
            self._job = None

    def capped(self, context_length: int, wanted: int) -> int:
        """:func:`capped_drafts` for this worker's model."""
        return capped_drafts(self._model, context_length, wanted)

    def counters(self) -> dict[str, int]:
        """The work counters of the drafter's session (:func:`dsi.models.base.session_counters`)."""
        return session_counters(self._session)

    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._abandoned

    def overdue(self, policy: LivenessPolicy) -> tuple[float, float] | None:
        """``(seconds running, deadline)`` of a forward past its deadline, or None."""
        began = self._forward_began
        if began is None or not policy.enabled:
            return None
        running = time.perf_counter() - began
        deadline = (policy.floor_s + policy.factor * max(self._durations)) if self._durations else policy.unmeasured_s
        return (running, deadline) if running > deadline else None

    def abandon(self) -> None:
        """Give up on a frozen worker: it is no longer alive to its decoder, and stops if it ever returns."""
        self._abandoned = True
        with self._cond:
            self._closed = True
            if self._job is not None:
                self._job.cancel.set()
            self._cond.notify()

    def close(self, timeout: float = 10.0) -> None:
        if self._abandoned:  # frozen: nothing to wait for (it stops by itself if it ever returns)
            return
        with self._cond:
            self._closed = True
            if self._job is not None:
                self._job.cancel.set()
            self._cond.notify()
        self._thread.join(timeout)

    def _next_job(self) -> _Job | None:
        with self._cond:
            while not self._closed and (self._job is None or self._job.cancel.is_set()):
                self._cond.wait()
            return None if self._closed else self._job

    def _run(self) -> None:
        session = self._session = self._model.new_session()
        try:
            while (job := self._next_job()) is not None:
                try:
                    self._draft(session, job)
                except TaskCancelled:
                    continue
                except Exception as exc:
                    # the request raises it (WorkerError, cause chained): the traceback only for debugging
                    log.debug("drafter failed", exc_info=True)
                    self._on_event(DrafterFailed(job.epoch, f"{type(exc).__name__}: {exc}", exc))
                with self._cond:
                    if self._job is job:
                        self._job = None
        finally:
            session.close()

    def _draft(self, session, job: _Job) -> None:
        params, cancel = job.sampling, job.cancel
        count = 0
        limit = job.limit  # capped at the drafter's own context by the orchestrator
        limited = False
        if job.fresh:
            start_fresh_unless_deterministic(session, self._model)
        try:
            if limit > 0:
                # argmax ids only (taken where the logits are) where greedy decoding reads raw rows, and
                # no tree asks for the likeliest tokens
                ids_only = drafts_ids_only(self._model, params) and not job.alternatives
                drafted: list[int] = []

                def draw() -> Callable[[np.ndarray], tuple]:
                    """How a forward's last row gives the next draft, after ``drafted`` at its position (run within
                    the forward where the session can: :func:`dsi.models.base.extend_rows`'s ``read``): its argmax
                    id, the draft with its side children (trees), or a :class:`~dsi.sampling.DraftRead` (decided
                    on the drafter's device where it decides there)."""
                    if ids_only:
                        return lambda ids: (int(ids[-1]), None)
                    tokens = (*job.context, *drafted)
                    if job.alternatives:
                        return lambda rows: _draft_at(rows[-1], job, len(tokens),
                                                      Prefix(tokens, job.prompt_len, job.eos_token_ids))
                    return DraftRead(tokens, params, job.prompt_len, job.eos_token_ids)

                drawn = self._forward(lambda: forward_rows(session, job.context, 1, cancel, greedy=ids_only,
                                                           read=draw()))
                steps: tuple[SideStep, ...] = ()
                chains: dict[tuple[int, int], list[int]] = {}  # (draft index, side child) -> the chain after it
                while True:
                    token, q, sides = (*drawn, ())[:3]  # a DraftRead's and an id's have no side children
                    drafted.append(token)
                    if cancel.is_set():
                        raise TaskCancelled("drafts abandoned")
                    self._on_event(Draft(job.epoch, count, token, q, sides, steps))
                    if job.side_depth > 0:
                        chains.update(((count, side), []) for side in sides if side not in job.eos_token_ids)
                    count += 1
                    if count >= limit or token in job.eos_token_ids:
                        break
                    growing = [key for key, chain in chains.items() if _grows(key, chain, job, limit)]
                    if growing:
                        out, steps = self._forward(lambda: self._with_chains(session, job, drafted, chains, growing))
                        for step in steps:
                            chains[(step.root, step.side)].append(step.token)
                        drawn = draw()(out[None])
                    else:
                        drawn = self._forward(lambda: extend_rows(session, [token], cancel, 1, ids_only, read=draw()))
                        steps = ()
        except ContextLengthError as exc:  # a declared limit reached: no more drafts, not a failure
            log.debug("drafter stopped after %d drafts at its context limit: %s", count, exc)
            limited = True
        except DraftUnavailable as exc:  # nothing to propose (e.g. a foreign drafter's text ended)
            log.debug("drafter stopped after %d drafts: %s", count, exc)
        self._on_event(DraftsDone(job.epoch, count, limited))

    @staticmethod
    def _with_chains(session, job: _Job, drafted: list[int], chains: dict[tuple[int, int], list[int]],
                     growing: list[tuple[int, int]]) -> tuple[np.ndarray, tuple[SideStep, ...]]:
        """The row after ``drafted`` and the next token of each ``growing`` side chain, from one tree forward
        rooted at the earliest chain's position: the main path from there (the session keeps it, as
        :func:`~dsi.models.base.extend_rows` would), and under each side child its chain so far. A chain's
        first token is the drafter's likeliest token after the child (the argmax of its processed row: a guess
        at the target's draw after a child that wins, more often right than a sampled draft and a fraction of
        its cost); the next ones are the chain's own drafts (:class:`SideStep`). Whether they are right never
        changes a committed token."""
        newest = len(drafted) - 1
        start = min([newest, *(root for root, _ in growing)])
        before = (*job.context, *drafted[:start])
        tokens: list[int] = []
        parents: list[int] = []
        for index in range(start, newest + 1):  # the main path first: each node's first child
            parents.append(ROOT if index == start else len(tokens) - 1)
            tokens.append(drafted[index])
        ends = []
        for root, side in growing:
            parent = ROOT if root == start else root - start - 1  # the main node before the side child
            for token in (side, *chains[(root, side)]):
                tokens.append(token)
                parents.append(parent)
                parent = len(tokens) - 1
            ends.append(parent)
        rows = tree_rows(session, before, DraftTree(tuple(tokens), tuple(parents)), job.cancel)
        steps = []
        for (root, side), end in zip(growing, ends, strict=True):
            chain = chains[(root, side)]
            context = (*job.context, *drafted[:root], side, *chain)
            prefix = Prefix(context, job.prompt_len, job.eos_token_ids)
            if chain:  # drafted as the main path's draft there would be, with its side children
                token, q, sides = _draft_at(rows[1 + end], job, len(context), prefix)
            else:
                token, q, sides = likeliest_draft(rows[1 + end], job.sampling, prefix), None, ()
            steps.append(SideStep(root, side, token, q, sides))
        return rows[1 + newest - start], tuple(steps)

    def _forward(self, run):
        """Run one drafter forward, counting it and its time (also when it is cancelled)."""
        self.forwards += 1
        start = self._forward_began = time.perf_counter()
        try:
            return run()
        finally:
            elapsed = time.perf_counter() - start
            self.busy_s += elapsed
            self._durations.append(elapsed)
            self._forward_began = None
