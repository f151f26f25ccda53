"""``WithLatency``: wrap any model so each forward takes a fixed wall-clock time.

The first forward of a session (the prefill) takes ``ttft`` seconds, every later one ``tpot``
seconds, whatever the number of new tokens: the memory-bound regime the DSI paper simulates (a GPU
up to its compute bound). ``token_s > 0`` adds that many seconds per token the forward computes (a
compute-bound CPU: a forward's time grows with its tokens). A draft tree's rows cost one forward of
its nodes (:meth:`LatencySession.tree_rows`), as a tree attention mask computes them.
With ``cv > 0`` each forward's latency is instead multiplied by an independent lognormal factor of
mean 1 and coefficient of variation ``cv`` (seeded per session from ``seed``): forwards whose
time varies, as on shared or throttled hardware.
The wrapped model's own compute time counts towards that latency (the forward lasts
``max(latency, compute)``), so emulated timings stay accurate for cheap inner models; so does what a
caller makes of the rows when it asks for that with them (``read``: a drafter's draw, a target server's
decisions), as an accelerator samples and decides on the device within its forward. The wait
is interruptible: a set cancel flag ends it at once and restores the session. It sleeps to within
50 us of its deadline and polls the rest (a 1 ns timer slack on Linux), so waiting forwards leave
the cores to the threads that compute.
With ``steps`` (a :class:`~dsi.models.emulated.steps.SharedSteps`), every session's forwards instead join the batched
steps of one emulated engine: a forward lasts until the end of the step it joined, whose time the batch's tokens set.
"""

from __future__ import annotations

import itertools
import math
import sys
import threading
import time
from collections.abc import Sequence

import numpy as np

from dsi.errors import ConfigError, TaskCancelled
from dsi.models.base import (
    CancelFlag,
    LanguageModel,
    ModelSession,
    common_prefix_length,
    context_limit,
    extend_rows,
    path_tree_rows,
    tree_rows,
)
from dsi.models.costs import ForwardCosts
from dsi.models.emulated.steps import SharedSteps, check_seconds

_SPIN_S = 0.00005  # final stretch of a wait done by polling, for precision beyond the timer's
_PR_SET_TIMERSLACK = 29  # Linux prctl: the slack the kernel may add to this thread's timed sleeps
_fine_timers = threading.local()


def _fine_timer_slack() -> None:
    """Make this thread's timed sleeps wake within microseconds (Linux: a timer slack of 1 ns; the default 50 us
    adds 70 us to every wait here), once per thread: so a wait sleeps to within :data:`_SPIN_S` of its deadline
    and polls only that last stretch, and waiting forwards leave the cores to the threads that compute."""
    if getattr(_fine_timers, "set", False):
        return
    _fine_timers.set = True
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)
        except (OSError, AttributeError):  # no prctl here: waits are 70 us coarser, and still right
            pass


def precise_wait(seconds: float, cancel: CancelFlag | None) -> bool:
    """Wait ``seconds`` (or until ``cancel`` is set). Returns True if cancelled."""
    deadline = time.perf_counter() + seconds
    flag = cancel if cancel is not None else threading.Event()
    remaining = seconds
    if remaining > _SPIN_S:
        _fine_timer_slack()
    while remaining > _SPIN_S:
        if flag.wait(remaining - _SPIN_S):
            return True
        remaining = deadline - time.perf_counter()
    while time.perf_counter() < deadline:
        if flag.is_set():
            return True
        time.sleep(0)
    return flag.is_set()


class WithLatency:
    """A model whose sessions take ``ttft`` s for their first forward and ``tpot`` s after
    (times a random lognormal factor of mean 1 when ``cv > 0``)."""

    def __init__(self, model: LanguageModel, ttft: float, tpot: float, cv: float = 0.0, seed: int = 0,
                 token_s: float = 0.0, one_forward_trees: bool = True, steps: SharedSteps | None = None) -> None:
        if not isinstance(one_forward_trees, bool):
            raise ConfigError(f"one_forward_trees={one_forward_trees!r} must be True (a tree costs one forward) "
                              "or False (one forward per root-to-leaf path)")
        self.model = model
        self.one_forward_trees = one_forward_trees
        self.ttft = check_seconds("ttft", ttft)
        self.tpot = check_seconds("tpot", tpot)
        self.cv = check_seconds("cv", cv)
        self.token_s = check_seconds("token_s", token_s)
        self.seed = seed
        if steps is not None and not isinstance(steps, SharedSteps):
            raise ConfigError(f"steps={steps!r} must be a dsi.models.emulated.steps.SharedSteps or None")
        self.steps = steps  # forwards of every session share its batched steps (their own latency is unused)
        self._sessions = itertools.count()
        self._lock = threading.Lock()

    @property
    def wrapped_model(self) -> object:
        """The model whose forwards this one passes on (:func:`dsi.models.determinism.base_model`)."""
        return self.model

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def forward_costs(self) -> ForwardCosts:
        """What a forward costs here (:mod:`dsi.models.costs`): its TPOT and ``token_s`` per token it computes (with
        shared steps, a step alone: its fixed time and its per-token cost)."""
        if self.steps is not None:
            return ForwardCosts(one_token_s=self.steps.step_s + self.steps.token_s, per_row_s=self.steps.token_s)
        return ForwardCosts(one_token_s=self.tpot + self.token_s, per_row_s=self.token_s)

    @property
    def max_context(self) -> int | None:
        """The wrapped model's declared context limit (:func:`dsi.models.base.context_limit`)."""
        return context_limit(self.model)

    def new_session(self) -> LatencySession:
        rng = None
        if self.cv > 0:
            import numpy as np

            with self._lock:
                rng = np.random.default_rng([self.seed, next(self._sessions)])
        return LatencySession(self.model.new_session(), self.ttft, self.tpot, self.cv, rng, self.token_s,
                              self.one_forward_trees, self.steps)

    def __getstate__(self) -> dict:  # picklable for process and Ray servers (locks are not)
        state = dict(self.__dict__)
        state.pop("_lock"), state.pop("_sessions")
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._sessions = itertools.count()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        noise = f", cv={self.cv}, seed={self.seed}" if self.cv else ""
        per_token = f", token_s={self.token_s}" if self.token_s else ""
        paths = "" if self.one_forward_trees else ", one_forward_trees=False"
        steps = "" if self.steps is None else f", steps={self.steps!r}"
        return f"WithLatency({self.model!r}, ttft={self.ttft}, tpot={self.tpot}{noise}{per_token}{paths}{steps})"


class LatencySession:
    def __init__(self, inner: ModelSession, ttft: float, tpot: float, cv: float = 0.0, rng=None,
                 token_s: float = 0.0, one_forward_trees: bool = True, steps: SharedSteps | None = None) -> None:
        self._inner = inner
        self._steps = steps
        self.one_forward_trees = one_forward_trees  # False: a tree costs one forward per root-to-leaf path
        self._ttft = ttft
        self._tpot = tpot
        self._token_s = token_s
        self._prefilled = False
        self._rng = rng
        if cv > 0:  # lognormal with mean 1: sigma^2 = ln(1 + cv^2), mu = -sigma^2 / 2
            self._sigma = math.sqrt(math.log1p(cv * cv))

    @property
    def tokens(self) -> tuple[int, ...]:
        return self._inner.tokens

    def extend(self, tokens: Sequence[int], cancel: CancelFlag | None = None) -> np.ndarray:
        return self.extend_rows(tokens, cancel, len(tokens), False)

    reads_rows = True  # a caller's reading of the rows (a draw, decisions) is timed within the forward

    def extend_rows(self, tokens: Sequence[int], cancel: CancelFlag | None, num_rows: int, greedy: bool,
                    read=None):
        """The inner session's rows, or ``read`` of them, in one forward's time: an accelerator's forward
        samples and decides on the device (:func:`dsi.models.base.extend_rows`), so the host waits for its
        result, not for the rows."""
        return self._timed(lambda: extend_rows(self._inner, tokens, cancel, num_rows, greedy, read=read), cancel,
                           len(tokens))

    def tree_rows(self, prefix: Sequence[int], tree, cancel: CancelFlag | None = None, *, greedy: bool = False,
                  top: int | None = None) -> np.ndarray:
        """A draft tree's rows (:func:`dsi.models.base.tree_rows`) in one forward's time, as a tree
        attention mask gives them: a tree of n nodes costs what a chain of n tokens costs. The rows are the inner
        session's tree kernel's where it has one, else computed path by path. With ``one_forward_trees=False``, one
        timed forward per root-to-leaf path (a backend without the kernel)."""
        if not self.one_forward_trees:
            return path_tree_rows(self, prefix, tree, cancel, greedy=greedy, top=top)
        computed = len(prefix) - min(common_prefix_length(self._inner.tokens, prefix), len(prefix) - 1) + len(tree)
        return self._timed(lambda: tree_rows(self._inner, prefix, tree, cancel, greedy=greedy, top=top), cancel,
                           computed)

    def _timed(self, run, cancel: CancelFlag | None, computed: int) -> np.ndarray:
        """``run()`` on the inner session, lasting one forward's latency (of ``computed`` tokens); a cancel
        restores the session (to the longest prefix of what it held that it still holds)."""
        start = time.perf_counter()
        latency = self._tpot if self._prefilled else self._ttft
        if self._rng is not None:
            latency *= float(self._rng.lognormal(-self._sigma ** 2 / 2, self._sigma))
        latency += self._token_s * computed
        before = self._inner.tokens
        rows = run()
        if self._steps is not None:  # the engine's next batched step, shared with every waiting forward
            cancelled = self._steps.join(computed, cancel)
        else:
            cancelled = precise_wait(latency - (time.perf_counter() - start), cancel)
        if cancelled:
            self._inner.truncate(common_prefix_length(before, self._inner.tokens))
            raise TaskCancelled("forward cancelled")
        self._prefilled = True
        return rows

    def truncate(self, length: int) -> None:
        self._inner.truncate(length)

    def close(self) -> None:
        self._inner.close()
