"""DSI: the orchestrator of one drafter thread and a pool of target servers.

Timor et al., "Distributed Speculative Inference", ICLR 2025; see docs/architecture.md. State of
one request: ``committed`` (prompt + verified tokens), the ``draft`` after the last (re)start
point ``base``, and the verification *windows* sent for it. Relative position r counts from
``base``:

- window 0 is the zero-draft task on ``base`` itself (the non-SI chain); it decides r = 0;
- window w >= 1 has context ``base + draft[: last_w]`` and decides r in (last_{w-1}, last_w]
  (last_0 = 0): its rows compare drafts last_{w-1} + 1 ... last_w, the last row deciding the first
  draft of the next window.

Where windows end is the *window policy*. With a fixed lookahead k, last_w = w k: a window is sent
after every k drafts. Event-driven (``lookahead="auto"``): a window is sent as soon as a target
server is idle and undispatched drafts exist, carrying all of them (at most ``max_window``); while
every server is busy, drafts pile up for the next window. Either way each position's decision is a
function of its prefix, its draft and the counter-based uniforms of its absolute position only,
so where windows end (which may depend on timing) never changes the output. Results are applied
strictly in window order; an early result waits, stored, for its turn. A rejection commits the
correction token, preempts every outstanding task (all of them contain the rejected draft),
rolls the drafter back and restarts with a new zero-draft task. Where the drafter stopped early
(its model gave out before the token limit without EOS, e.g. at the end of its context, see
:mod:`dsi.engine.drafter`) the target's row gives a bonus token; a drafter with no room left
after ``committed`` is not run at all, and every position is a bonus (non-SI on the pool).
A position whose draft is still being computed waits for it (at most one drafter step), so the
output never depends on timing. Only the target commits EOS.

With a draft tree (:mod:`dsi.trees`) window w >= 1 is the tree of its context's drafts from last_{w-1} on,
each with its position's side children (every drafted position's side children go with the first window sent
after its draft), and with ``"branches"`` (and ``"auto"`` where a verified row is nearly free,
:func:`dsi.trees.grows_side_chains`) each side child with its side chain as far as drafted by then (the
drafter's likeliest token after the child, then its own drafts; a later window whose chains grew is rooted at
their position and carries them again). A rejection whose correction is a side child commits it, and the next
position is the target's own token from the row after it; with ``"branches"`` the child's side chain starts
the next epoch (its first token a guess at that draw), and the rows after its tokens, from the window that
carried most of it, decide the positions after it as the main path's would be (:meth:`_DSIRun.apply`,
docs/architecture.md "Draft trees").
"""

from __future__ import annotations

import bisect
import itertools
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dsi.engine.drafter import Draft, DrafterFailed, DraftsDone, DraftWorker, request_info
from dsi.engine.lifecycle import DecoderLifecycle, check_score, prepare_request
from dsi.engine.request import Output, Request, TokenCallback
from dsi.engine.result import GenerationResult
from dsi.engine.stats import GenerationStats
from dsi.engine.trees import ranking_floor, request_shape, row_of, side_count
from dsi.errors import ConfigError, TaskCancelled, WorkerError
from dsi.models.base import LanguageModel, check_sampling, counter_changes
from dsi.models.determinism import is_deterministic
from dsi.sampling import SamplingParams, bonus, decide_greedy, decide_row
from dsi.transport.base import ServerDied, TargetPool, TaskAborted, TaskFailed, TaskResult, VerifyTask
from dsi.transport.liveness import LivenessPolicy
from dsi import trees as tree_shapes
from dsi.trees import ROOT, DraftTree, TreeShape, check_windowed
from dsi.windows import WindowPacer, window_end

log = logging.getLogger(__name__)

_POLL_S = 0.05  # how often a waiting orchestrator checks its abort flag and its workers


@dataclass
class _Window:
    first: int  # first relative position decided
    last: int  # last relative position decided (inclusive); context = base + draft[:last]
    task_id: int
    result: TaskResult | None = None
    # a tree window: the row deciding each relative position on the main path, and the row after each
    # side child (relative position, token) -> row; None: a chain window (row r - first decides r)
    main_rows: dict[int, int] | None = None
    side_rows: dict[tuple[int, int], int] | None = None
    # ... and the rows after each side child's chain (DSI's "branches"), as far as it went with this window
    continued_rows: dict[tuple[int, int], list[int]] | None = None
    root: int = 0  # a tree window: the relative position its tree starts at (its prefix is base + draft[:root])

    def row(self, r: int) -> int:
        """The row of this window's result that decides relative position ``r``."""
        return r - self.first if self.main_rows is None else self.main_rows[r]


class DSIDecoder(DecoderLifecycle):
    """DSI over ``pool`` (SP target servers) and a drafter thread on ``drafter``.

    Build it once and call :meth:`generate` for each request (one request at a time: calls from several
    threads are serialised, :mod:`dsi.engine.lifecycle`), then :meth:`close`. The pool must have been
    created with this decoder's :attr:`events` queue's ``put`` as its ``on_event`` callback (see
    :func:`dsi.engine.api.build_decoder`).
    """

    method = "dsi"

    def __init__(self, drafter: LanguageModel, lookahead: int | str, pool_factory, trace: bool = False,
                 max_window: int | None = None, target: LanguageModel | None = None, liveness: object = None,
                 draft_tree: TreeShape = None, side_depth: int | None = None) -> None:
        super().__init__()
        check_windowed(draft_tree)  # refuses a shape DSI cannot branch by (widths per depth, branches)
        side_depth = tree_shapes.DSI_CHAIN_DEPTH if side_depth is None else side_depth
        if not isinstance(side_depth, int) or isinstance(side_depth, bool) or side_depth < 1:
            raise ConfigError(f"side_depth={side_depth!r} must be an int >= 1 (the tokens a side chain continues by)")
        self.side_depth = side_depth  # "branches": how far each side child's chain goes (dsi.trees.DSI_CHAIN_DEPTH)
        self.lookahead = lookahead  # k, or "auto" for event-driven windows (read at each request)
        self.draft_tree = draft_tree  # side children at each position (dsi.trees); None: chains
        self.max_window = max_window  # event-driven: the most drafts one window carries (None: no cap)
        self.pacer = WindowPacer()  # event-driven: latency and acceptance estimates, kept across requests
        # with trace=True, each request's ("submit", task_id, context) and ("apply", task_id,
        # position) records are kept here, for tests of the algorithm's invariants
        self.trace: list[tuple] | None = [] if trace else None
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self._task_ids = itertools.count()
        self._epochs = itertools.count(1)
        self._requests = itertools.count(1)  # each request's (and each scoring's) scope on the servers (VerifyTask.request)
        self.pool: TargetPool = pool_factory(self.events.put)
        self._drafter_model = drafter
        self._target_model = target  # only to check requests against what it can serve (engines)
        # the drafter's forwards get the deadline the target servers' tasks get (dsi.transport.liveness)
        self.liveness = LivenessPolicy.from_option(liveness)
        try:
            self._drafter = DraftWorker(drafter, self.events.put)
        except BaseException:
            self.pool.close()
            raise

    def _generate(self, request: Request, on_tokens: TokenCallback | None,
                  abort: threading.Event | None) -> GenerationResult:
        request = prepare_request(request, self._target_model)
        # refuses what the target cannot serve exactly (whole rows for logprobs)
        check_sampling(self._target_model, request.sampling, request.logprobs is not None)
        if not self._drafter.is_alive():  # a drafter frozen (abandoned) or dead in an earlier request: a new one
            self._drafter = DraftWorker(self._drafter_model, self.events.put)
        info = request_info(self._drafter_model, request.sampling)  # refuses what the drafter cannot serve
        run = _DSIRun(self, request, on_tokens, abort)
        run.stats.extra.update(info)
        try:
            run.loop()
        finally:
            run.stop()
        return GenerationResult(run.out.finalize(), run.stats, run.out.logprobs)

    def score(self, tokens: Sequence[int], first: int, cancel: threading.Event | None = None) -> np.ndarray:
        """The target's raw logits after ``tokens[:p]`` for p = ``first`` .. ``len(tokens)``
        (``[len(tokens) - first + 1, V]`` float32), as one task on a target server, which reuses its
        cache (``dsi serve``'s ``prompt_logprobs`` and ``echo`` with ``logprobs`` on a DSI slot).

        Between requests, so the events of the queue are this task's or stale (a previous request's
        late drafts and results, which are dropped as its own loop drops them)."""
        tokens = check_score(tokens, first, self._target_model)
        with self._turn():
            return self._score(tokens, first, cancel)

    def _score(self, tokens: Sequence[int], first: int, cancel: threading.Event | None) -> np.ndarray:
        task = VerifyTask(next(self._task_ids), tuple(int(t) for t in tokens), len(tokens) - first + 1,
                          SamplingParams(temperature=0.0), logprobs_mode="raw", request=self.request_scope())
        self.pool.submit(task)
        while True:
            try:
                event = self.events.get(timeout=_POLL_S)
            except queue.Empty:
                if cancel is not None and cancel.is_set():
                    self.pool.cancel([task.task_id])
                    raise TaskCancelled("prompt scoring cancelled") from None
                if self.pool.alive_servers() == 0:
                    raise WorkerError("no target server is alive") from None
                continue
            if isinstance(event, TaskResult) and event.task_id == task.task_id:
                return event.logprobs.values  # the raw logits (float32): dsi.logprobs.logprob_rows, mode "raw"
            if isinstance(event, TaskFailed) and event.task_id == task.task_id:
                raise WorkerError(f"target server {event.server_id} failed: {event.error}") from event.exception
            if isinstance(event, ServerDied) and self.pool.alive_servers() == 0:  # its task was re-queued
                raise WorkerError(f"no target server is alive (server {event.server_id} died last: {event.error})")

    def request_scope(self) -> int | None:
        """A new request's scope on the target servers (:attr:`VerifyTask.request`): its own number, so that a
        server whose cache an earlier request filled starts it from an empty cache (the cached rows were
        computed in that request's cuts: the answer would depend on what was served before); None where the
        target's rows are the canonical ones whatever the cut (the deterministic mode: caches are kept)."""
        number = next(self._requests)
        return None if is_deterministic(self._target_model) else number

    def healthy(self) -> bool:
        """Whether this decoder can serve another request: a failed request (a model error, a lost
        server that was replaced, a frozen or dead drafter, which the next request replaces) leaves it
        usable; only a pool with no server left (all given up) calls for a new decoder."""
        return self.pool.alive_servers() > 0

    def _release(self) -> None:
        self._drafter.close()
        self.pool.close()


class _DSIRun:
    """The state of one request inside a :class:`DSIDecoder`."""

    def __init__(
        self, decoder: DSIDecoder, request: Request, on_tokens: TokenCallback | None, abort: threading.Event | None
    ) -> None:
        self.decoder = decoder
        self.request = request
        self.k = decoder.lookahead
        self.event_driven = self.k == "auto"
        self.scope = decoder.request_scope()
        self.first_epoch = True  # the drafter starts the request as a fresh one would (unless deterministic)
        self.max_window = decoder.max_window
        self.pool = decoder.pool
        self.drafter = decoder._drafter
        self.stats = GenerationStats(
            method="dsi", lookahead=self.k, num_target_servers=self.pool.num_servers
        )
        self.out = Output(request, self.stats, on_tokens, abort)
        self.tree = request_shape(decoder.draft_tree, decoder._drafter_model, request.sampling, self.stats)
        if self._continues():  # how far each side child's chain goes ("branches", "auto" where rows are nearly free)
            self.stats.extra["tree_side_chain_depth"] = decoder.side_depth
        self._drafter_forwards_at_start = self.drafter.forwards
        self._drafter_busy_at_start = self.drafter.busy_s
        self._drafter_counters_at_start = self.drafter.counters()
        self.epoch = 0
        self.base: tuple[int, ...] = ()
        self.draft: list[int] = []
        self.qs: list = []
        self.sides: list[tuple[int, ...]] = []  # draft trees: the side children at each drafted position
        # draft trees: this epoch follows a side child that won, so its first position is the target's own
        # draw (a bonus) from the row after that child, and gets no rescue ("auto" and widths)
        self.bonus_first = False
        # side chains (DSI's "branches"): (relative position, side child) -> the chain's tokens after the child and
        # their drafter laws and side children (the first, a guess at the target's draw after the child, has neither)
        self.chains: dict[tuple[int, int], list[tuple[int, np.ndarray | None, tuple[int, ...]]]] = {}
        self.chains_sent: dict[tuple[int, int], int] = {}  # ... and how much of each a window has carried
        self.seeded = 0  # drafts this epoch began with (a side child's chain), not the drafter's
        self.aliases: dict[int, int] = {}  # task_id -> a second window index the task's result decides for
        self.drafter_done = False
        self.limit = 0
        self.windows: dict[int, _Window] = {}
        self.lasts: list[int] = []  # last_w of windows 1, 2, ... of this epoch (increasing)
        self._last_draft_at = 0.0
        self.outstanding: dict[int, int] = {}  # task_id -> window index (current epoch)
        self.task_ids: set[int] = set()  # every task this request submitted (others are a previous request's)

    # ---- main loop -------------------------------------------------------------------------
    def loop(self) -> None:
        if self.out.finished:
            return
        self.restart()
        while not self.out.finished:
            try:
                event = self.decoder.events.get(timeout=_POLL_S)
            except queue.Empty:
                self.out.check_abort()
                self.check_workers()
                self.submit_ready_windows()  # e.g. a restarted server: idle without an event
                continue
            self.handle(event)
            self.out.check_abort()
            # decide first: a draft may complete a rejection, and no window is sent into a dying epoch
            self.apply()
            if not self.out.finished:
                self.submit_ready_windows()  # new drafts, or (event-driven) a server became idle

    def stop(self) -> None:
        """Cancel whatever is still running for this request; collect late statistics."""
        self.stats.cancelled_tasks += self.discard_epoch()
        self.drafter.stop()
        self.stats.drafter_forwards = self.drafter.forwards - self._drafter_forwards_at_start
        self.stats.drafter_busy_s = self.drafter.busy_s - self._drafter_busy_at_start
        self.stats.extra.update(counter_changes(self._drafter_counters_at_start, self.drafter.counters()))

    def cancel_outstanding(self) -> int:
        """Cancel every task of this request not yet applied; return how many there were."""
        count = len(self.outstanding)
        if count:
            self.pool.cancel(list(self.outstanding))
            self.outstanding.clear()
        return count

    def discard_epoch(self) -> int:
        """Drop this epoch's tasks whose results will not be used: cancel the outstanding ones and
        discard results that arrived early for windows past the last decided position (their
        target time is wasted). Return how many tasks were dropped."""
        decided = len(self.out.tokens) - len(self.base)  # relative positions decided this epoch
        used = {w.task_id for w in self.windows.values() if w.result is not None and w.first < decided}
        unused = {w.task_id: w.result for w in self.windows.values()
                  if w.result is not None and w.task_id not in used}
        self.stats.wasted_target_s += sum(result.compute_s for result in unused.values())
        self.aliases.clear()
        return self.cancel_outstanding() + len(unused)

    def check_workers(self) -> None:
        if self.pool.alive_servers() == 0:
            raise WorkerError("no target server is alive")
        if not self.drafter.is_alive():
            raise WorkerError("the drafter thread died")
        late = self.drafter.overdue(self.decoder.liveness)
        if late is not None:
            self.drafter.abandon()
            raise WorkerError(f"the drafter is frozen: its forward has run {late[0]:.1f} s, past its liveness deadline "
                              f"of {late[1]:.1f} s; this request ends, and the decoder's next request gets a new "
                              "drafter")

    # ---- events ------------------------------------------------------------------------------
    def handle(self, event: object) -> None:
        if isinstance(event, Draft):
            if event.epoch == self.epoch and event.index + self.seeded == len(self.draft):
                now = time.perf_counter()
                if event.index > 0:
                    self.decoder.pacer.add_drafter(now - self._last_draft_at)
                self._last_draft_at = now
                for step in event.side_steps:
                    self.chains.setdefault((step.root + self.seeded, step.side), []).append(
                        (step.token, step.q, step.sides))
                self.draft.append(event.token)
                self.qs.append(event.q)
                self.sides.append(event.sides)
                self.stats.drafted_tokens += 1
        elif isinstance(event, DraftsDone):
            if event.epoch == self.epoch:
                self.drafter_done = True
                if event.context_limited:
                    self._count_context_limited()
        elif isinstance(event, TaskResult | TaskAborted) and event.task_id not in self.task_ids:
            return  # a late answer to a task a previous request cancelled: not this request's time
        elif isinstance(event, TaskResult):
            self.stats.target_forwards += 1
            self.stats.target_busy_s += event.compute_s
            self.stats.completed_target_forwards += 1
            self.stats.completed_target_s += event.compute_s
            index = self.outstanding.pop(event.task_id, None)
            self.decoder.pacer.add_target(event.compute_s)
            if index is None:  # computed on a context a rejection made stale
                self.stats.wasted_target_s += event.compute_s
            else:
                self.windows[index].result = event
                alias = self.aliases.pop(event.task_id, None)
                if alias is not None:
                    self.windows[alias].result = event
        elif isinstance(event, TaskAborted):
            self.stats.target_forwards += 1
            self.stats.target_busy_s += event.compute_s
            self.stats.wasted_target_s += event.compute_s
            self.outstanding.pop(event.task_id, None)
        elif isinstance(event, ServerDied):  # its running task was re-queued by the pool
            self.stats.extra["dead_servers"] = self.stats.extra.get("dead_servers", 0) + 1
            log.debug("target server %d died: %s", event.server_id, event.error)  # the pool logged it
            if self.pool.alive_servers() == 0:
                raise WorkerError(f"no target server is alive (server {event.server_id} died last: {event.error})")
        elif isinstance(event, TaskFailed):
            if event.task_id in self.outstanding:
                raise WorkerError(f"target server {event.server_id} failed: {event.error}") from event.exception
            log.warning("stale task %d failed on server %d: %s", event.task_id, event.server_id, event.error)
        elif isinstance(event, DrafterFailed):
            if event.epoch == self.epoch:
                raise WorkerError(f"the drafter failed: {event.error}") from event.exception
            log.warning("the drafter failed on abandoned drafts: %s", event.error)

    # ---- windows -----------------------------------------------------------------------------
    def restart(self, after_side: bool = False, adopt: _Window | None = None, side_row: int = 0,
                seed: Sequence[tuple[int, np.ndarray | None, tuple[int, ...]]] = (),
                chain: tuple[_Window, list[int]] | None = None
                ) -> None:
        """Start a new epoch on the committed tokens: zero-draft task + fresh drafting.

        ``after_side``: the last committed token is a side child that won, so the new epoch's first position is
        the target's own draw from the row after it (a bonus). ``adopt``: a window of the old epoch whose tree
        holds that child, kept as the new epoch's window 0 (it computes that row, ``side_row``, and was sent
        earlier than a new zero-draft task would be). ``seed`` (``"branches"``): the child's side chain, drafted
        beside the main path, (token, drafter law, side children): the new epoch's first drafts, so they go on if
        the bonus is the chain's first token (the drafter's likeliest there, a guess: that position is the
        target's draw, so it needs no law), the next ones tested as drafts, with the side children the main
        path's drafts there would have had (so where the tree branches, and so the tokens, never depend on
        whether a chain was seeded). ``chain``: the window that carried most of that chain
        and the rows after its tokens there: it becomes window 1, deciding positions 1 .. len(rows) from the
        rows it has (the same task as window 0's, or a later one)."""
        keep = {w.task_id for w in (adopt, None if chain is None else chain[0]) if w is not None}
        if keep:
            self.windows = {i: w for i, w in self.windows.items() if w.task_id not in keep}
            for task_id in keep:
                self.outstanding.pop(task_id, None)
        self.stats.preempted_tasks += self.discard_epoch()
        self.epoch = next(self.decoder._epochs)
        self.base = tuple(self.out.tokens)
        self.draft, self.qs, self.sides, self.windows, self.lasts = [], [], [], {}, []
        self.chains, self.chains_sent = {}, {}
        self.seeded = 0
        self.drafter_done = False
        self.bonus_first = after_side
        self.limit = self.out.remaining  # positions after base that may be committed
        seed = list(seed)[: self.limit]
        for end, (token, _, _) in enumerate(seed):  # nothing is drafted after EOS
            if token in self.request.eos_token_ids:
                seed = seed[: end + 1]
                break
        if seed:
            self.draft = [token for token, _, _ in seed]
            self.qs = [None] + [q for _, q, _ in seed[1:]]
            self.sides, self.seeded = [()] + [sides for _, _, sides in seed[1:]], len(seed)
        if adopt is None:
            self.submit_window(0, 0, 0)
        else:
            self.windows[0] = _Window(0, 0, adopt.task_id, adopt.result, main_rows={0: side_row})
            if adopt.result is None:
                self.outstanding[adopt.task_id] = 0
            self.stats.extra["tree_adopted_windows"] = self.stats.extra.get("tree_adopted_windows", 0) + 1
            holder, rows = chain if chain is not None else (None, [])
            ended = bool(seed) and seed[-1][0] in self.request.eos_token_ids  # no position after its EOS
            rows = rows[: min(len(seed) - ended, self.limit - 1)]  # row p - 1 (after the chain's p-th token) decides p
            if holder is not None and rows:
                self.windows[1] = _Window(1, len(rows), holder.task_id, holder.result,
                                          main_rows={p: row for p, row in enumerate(rows, start=1)})
                self.lasts.append(len(rows))
                if holder.result is None:
                    if holder.task_id == adopt.task_id:
                        self.aliases[holder.task_id] = 1
                    else:
                        self.outstanding[holder.task_id] = 1
                self.stats.extra["tree_side_chain_rows"] = (self.stats.extra.get("tree_side_chain_rows", 0)
                                                           + len(rows))
        wanted = self.limit - self.seeded
        if self.seeded and (self.draft[-1] in self.request.eos_token_ids or wanted <= 0):
            self.drafter.stop()  # the seed ends the drafts: nothing to draft after it
            self.drafter_done = True
            return
        drafts = self.drafter.capped(len(self.base) + self.seeded, wanted)  # the drafter's context may allow fewer
        if drafts < wanted:
            self._count_context_limited()
        if drafts > 0:
            self.drafter.restart(self.epoch, self.base + tuple(self.draft), drafts, self.request.sampling,
                                 self.request.eos_token_ids, len(self.request.prompt), self._alternatives(),
                                 ranking_floor(self.tree), None if self.tree is None else self.tree.sides,
                                 self.decoder.side_depth if self._continues() else 0, fresh=self.first_epoch)
            self.first_epoch = False
        else:  # no room for even one draft: no prefill; every position is the target's own token
            self.drafter.stop()
            self.drafter_done = True

    def _continues(self) -> bool:
        """Whether side children continue (``"branches"``, and ``"auto"`` where a verified row is nearly free:
        :func:`dsi.trees.grows_side_chains`): the drafter drafts a side chain after each."""
        return tree_shapes.grows_side_chains(self.tree)

    def _alternatives(self) -> int:
        """How many likeliest tokens the drafter reports with each draft (what the tree's sides need)."""
        return 0 if self.tree is None else side_count(self.tree) + 1

    def _count_context_limited(self) -> None:
        """Count an epoch whose drafts the drafter's context cut short (``drafter_context_limited``)."""
        self.stats.extra["drafter_context_limited"] = self.stats.extra.get("drafter_context_limited", 0) + 1

    def submit_window(self, index: int, first: int, last: int) -> None:
        task_id = next(self.decoder._task_ids)
        context = self.base + tuple(self.draft[:last])
        window = self.windows[index] = _Window(first, last, task_id)
        tree = self._window_tree(window) if self.tree is not None and index > 0 else None
        if index > 0:
            self.lasts.append(last)
            self.stats.draft_windows += 1
            self.stats.window_drafts += last - first + 1
        self.outstanding[task_id] = index
        self.task_ids.add(task_id)
        self.stats.verify_tasks += 1
        if self.decoder.trace is not None:
            self.decoder.trace.append(("submit", task_id, context))
        if tree is None:
            draft_probs = None
            laws = self.qs[first:last]
            if self.request.decided_remotely and all(q is not None for q in laws):
                # each draft's drafter probability: the server decides them, and sends back one law, not n
                draft_probs = [float(q[self.draft[r]]) for r, q in enumerate(laws, start=first)]
            self.pool.submit(self.request.verify_task(task_id, context, last - first + 1, draft_probs=draft_probs,
                                                      scope=self.scope))
        else:
            self.stats.extra["tree_windows"] = self.stats.extra.get("tree_windows", 0) + 1
            self.stats.extra["tree_side_nodes"] = self.stats.extra.get("tree_side_nodes", 0) + len(window.side_rows)
            prefix = self.base + tuple(self.draft[: window.root])
            self.pool.submit(self.request.tree_task(task_id, prefix, tree, scope=self.scope))

    def _window_tree(self, window: _Window) -> DraftTree | None:
        """The tree of a window deciding relative positions ``first..last``: the drafts of its context from
        ``first - 1`` on (``draft[first - 1 : last]``, the main path), each with its position's side children
        (and with ``"branches"`` each side child's chain as far as drafted); None when it has no side child
        (the window goes as a chain). Sets the window's rows: ``first..last`` are decided by the rows after the
        main drafts before them, and a rejected draft at ``p`` whose correction is a side child finds the row
        after that child here (and the rows after its chain). So every drafted position's side children go with
        the first window sent after its draft, and no window waits for a draft it does not decide. A side chain
        of an earlier undecided position that grew since a window last carried it goes too: the tree is then
        rooted at that position, the main path from there (its nodes cost the target no extra time where a
        verified row is free, which is where ``"branches"`` is priced to branch)."""
        decided = len(self.out.tokens) - len(self.base)
        start = window.first - 1
        for (r, side), chain in self.chains.items():
            if decided <= r < start and len(chain) > self.chains_sent.get((r, side), 0):
                start = min(start, r)
        tokens: list[int] = []
        parents: list[int] = []
        main_rows, side_rows, continued_rows = {}, {}, {}
        parent = ROOT
        for r in range(start, window.last):
            node = len(tokens)
            tokens.append(self.draft[r])
            parents.append(parent)
            for side in () if r == 0 and self.bonus_first else self.sides[r]:
                side_node = len(tokens)
                side_rows[(r, side)] = row_of(side_node)
                tokens.append(side)
                parents.append(parent)
                chain = self.chains.get((r, side), ())
                if chain:  # "branches": the side chain under the child, as far as drafted
                    rows = continued_rows[(r, side)] = []
                    for token, _, _ in chain:
                        rows.append(row_of(len(tokens)))
                        tokens.append(token)
                        parents.append(len(tokens) - 2)
                    self.chains_sent[(r, side)] = len(chain)
            if r + 1 >= window.first:
                main_rows[r + 1] = row_of(node)
            parent = node
        if not side_rows:
            return None
        window.main_rows, window.side_rows, window.continued_rows = main_rows, side_rows, continued_rows
        window.root = start
        return DraftTree(tuple(tokens), tuple(parents))

    def horizon(self) -> int:
        """The last relative position that may still need deciding in this epoch."""
        count = len(self.draft)
        ended_with_eos = count > 0 and self.draft[-1] in self.request.eos_token_ids
        if self.drafter_done:
            # a drafter that stopped before the limit without EOS leaves one bonus position
            return count - 1 if ended_with_eos or count >= self.limit else count
        return count - 1 if ended_with_eos else self.limit - 1

    def submit_ready_windows(self) -> None:
        """Send the windows the policy calls for, cut at the horizon (never past the output's end).

        Fixed k: every window whose k drafts exist. Event-driven (:mod:`dsi.windows`): while a server
        is idle and enough drafts exist past the last window sent, one window carrying all of them."""
        while True:
            index = len(self.windows)  # next window to send (window 0 is sent at every restart)
            first = (self.lasts[-1] if self.lasts else 0) + 1
            drafted = len(self.draft)
            if self.event_driven:
                last = window_end(
                    first, drafted, self.horizon(), idle_servers=self.pool.idle_servers(),
                    min_window=self.decoder.pacer.min_window(self.pool.alive_servers()),
                    max_window=self.max_window, drafter_done=self.drafter_done,
                    in_flight=len(self.outstanding),
                )
                if last is None:
                    return
            else:
                last = min(first - 1 + self.k, self.horizon())
                if first > last or drafted < last:
                    return
            self.submit_window(index, first, last)

    # ---- decisions ---------------------------------------------------------------------------
    def commit(self, token: int, result: TaskResult, row: int) -> None:
        """Commit ``token``, decided by row ``row`` of ``result`` (whose log-probabilities it reports)."""
        if self.decoder.trace is not None:
            self.decoder.trace.append(("apply", result.task_id, len(self.out.tokens)))
        self.out.commit(token, None if result.logprobs is None else result.logprobs[row])

    def apply(self) -> None:
        """Decide every position whose deciding result (and draft) is available, in order."""
        params = self.request.sampling
        while not self.out.finished:
            r = len(self.out.tokens) - len(self.base)
            # the deciding window: 0 for r = 0, else the first whose last >= r
            index = 0 if r == 0 else bisect.bisect_left(self.lasts, r) + 1
            window = self.windows.get(index)
            if window is None or window.result is None:
                return
            row = window.row(r)
            result = window.result
            position = len(self.out.tokens)
            if r == 0 and self.bonus_first:  # after a side child that won: the target's own draw
                if r >= len(self.draft) and not self.drafter_done:
                    return  # whether this epoch's drafts still hold needs its first draft (at most one step)
                token = self._bonus(result, row, position)
                self.commit(token, result, row)
                self.stats.bonus_tokens += 1
                if r < len(self.draft) and self.draft[r] == token:
                    if self.seeded:  # "branches": the drafter's likeliest token after the side child was that draw
                        self.stats.extra["tree_side_guesses_right"] = (
                            self.stats.extra.get("tree_side_guesses_right", 0) + 1)
                    continue  # the drafts after it were drafted on it
            elif r < len(self.draft):
                if params.greedy:
                    decision = decide_greedy(result.tokens[row], self.draft[r])
                else:
                    decision = decide_row(result.probs, row, self.draft[r], self.qs[r], params, position)
                token, accepted = decision.token, decision.accepted
                self.commit(token, result, row)
                self.decoder.pacer.add_decision(accepted)
                if accepted:
                    self.stats.accepted_tokens += 1
                    continue
                if self.tree is not None and token in self.sides[r]:
                    # the correction (the chain's too) is a side child: its window computed the row after it
                    self.stats.accepted_tokens += 1
                    self.stats.extra["tree_side_accepts"] = self.stats.extra.get("tree_side_accepts", 0) + 1
                    if self.out.finished:
                        return
                    # the window sent with that side child: this one, or the next for its last position
                    holder = window if r < window.last else self.windows.get(index + 1)
                    if holder is not None and (r, token) not in (holder.side_rows or {}):
                        # a window adopted from a side chain, deciding seeded drafts, carries no side children
                        holder = None
                    # "branches": the side chain drafted after the child, beside the main path (or none)
                    chain = self.chains.get((r, token), []) if self._continues() else []
                    if holder is None:  # not sent yet: the next epoch's zero-draft task computes that row
                        self.restart(after_side=True, seed=chain)
                        continue
                    if chain:  # the new epoch starts with it; the window that carried most of it has its rows
                        carrier = max((w for w in self.windows.values() if (r, token) in (w.continued_rows or {})),
                                      key=lambda w: (len(w.continued_rows[(r, token)]), -w.task_id), default=None)
                        if carrier is not None:
                            self.stats.extra["tree_continued_sides"] = (
                                self.stats.extra.get("tree_continued_sides", 0) + 1)
                        self.restart(after_side=True, adopt=holder, side_row=holder.side_rows[(r, token)], seed=chain,
                                     chain=None if carrier is None else (carrier, carrier.continued_rows[(r, token)]))
                        continue
                    if holder.result is None:  # still running: it becomes the next epoch's window 0
                        self.restart(after_side=True, adopt=holder, side_row=holder.side_rows[(r, token)])
                        continue
                    side = holder.side_rows[(r, token)]
                    self.commit(self._bonus(holder.result, side, position + 1), holder.result, side)
                    self.stats.bonus_tokens += 1
                else:
                    self.stats.rejections += 1
            elif self.drafter_done:
                token = self._bonus(result, row, position)
                self.commit(token, result, row)
                self.stats.bonus_tokens += 1
            else:
                return  # the draft for this position is still being computed
            if not self.out.finished:
                self.restart()

    def _bonus(self, result: TaskResult, row: int, position: int) -> int:
        """The target's own token at ``position`` from ``row`` of ``result``: its argmax, or a bonus draw."""
        probs = result.probs[row] if result.probs is not None else None
        return int(result.tokens[row]) if probs is None else bonus(probs, self.request.sampling, position)
