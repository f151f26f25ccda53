"""SI's lookahead chosen per window by goodput under load: how many drafts a verification should carry now.

A verification of k drafts costs the target one forward of k + 1 positions and the drafter k steps; it commits
``E(k) = (1 - a^(k+1)) / (1 - a)`` tokens on average for an acceptance rate ``a`` (every draft accepted with
probability a, independently: Leviathan et al. 2023). Alone on a GPU-like engine the forward costs about the same
for any small k, so a long window pays. Under load, the engines batch every running request's positions into one
step, and a step's time grows with the positions it computes: each request's k + 1 positions now slow every other
request. SmartSpec / TurboSpec (Liu et al., arXiv 2406.14066) choose k per step by goodput, from a batch-time model
and predicted acceptance; this is that rule for dsi's SI, with every input measured as the server runs:

- ``L(x) = a0 + b * x``, a verification's latency (the round trip as dsi sees it: the engine's step, its queue and
  HTTP) against ``x = running x (k + 1)``, the positions the running requests would put in the engine's steps if
  each sent such a window: a least-squares line over an exponentially weighted window of verifications;
- ``d``, the drafter's time per draft, and the acceptance rate (the server's, shrunk toward by each request's own
  once it has decisions: prompts differ);
- ``running``: the requests the server runs now (its scheduler's count, this one included).

It picks ``k`` in ``0 .. max_lookahead`` that maximises a request's rate ``E(k) / (k d + L(running (k + 1)))``
(the server's goodput is ``running`` times it, so the same k). ``k = 0`` is a verification of no draft: a plain
step. Every ``EXPLORE_EVERY``-th window takes a neighbour of the best k instead, so that the line sees more than one
``x`` at a steady load (without it, a slope could never be measured at one load level).

The output never depends on k (each position is decided by its prefix, its draft and the uniforms of its absolute
position: :mod:`dsi.sampling`), so the choice changes only the time. Thread-safe: one instance serves every slot.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

DECAY = 0.97  # weight of the past in the latency line and the drafter's step (about the last 30 windows)
ACCEPT_DECAY = 0.98  # weight of the past in the server's acceptance rate (about the last 50 decisions)
PRIOR_DECISIONS = 8.0  # a request's own acceptance counts as this many of the server's decisions against it
EXPLORE_EVERY = 8  # every this-many-th window takes a neighbour of the best k
MIN_SPREAD = 1e-6  # below this variance of x, the slope is taken as 0 (one x seen: no slope measurable)


def expected_tokens(k: int, acceptance: float) -> float:
    """Tokens one verification of ``k`` drafts commits on average (accepted drafts plus the correction or bonus)."""
    a = min(max(acceptance, 0.0), 0.999)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class LookaheadByLoad:
    """Per-window lookahead of SI by goodput under load (see the module doc). ``running``: the requests running
    now; ``max_lookahead``: the largest k it takes."""

    def __init__(self, max_lookahead: int, running: Callable[[], int] = lambda: 1,
                 explore_every: int = EXPLORE_EVERY) -> None:
        if not isinstance(max_lookahead, int) or isinstance(max_lookahead, bool) or max_lookahead < 1:
            raise ValueError(f"max_lookahead={max_lookahead!r} must be an integer >= 1")
        self.max_lookahead = max_lookahead
        self._running = running
        self.explore_every = explore_every
        self._lock = threading.Lock()
        # exponentially weighted sums of the latency line: weight, x, y, x^2, x*y
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.draft_s: float | None = None  # one drafter step, averaged
        self.accepted = self.decided = 0.0  # the server's decisions, decayed
        self.windows = 0
        self.chosen: dict[int, int] = {}  # k -> windows that took it

    def running(self) -> int:
        return max(1, int(self._running()))

    # ---- what it measures --------------------------------------------------------------------------------------
    def observe_verification(self, positions: int, running: int, seconds: float) -> None:
        """A verification of ``positions`` (k + 1) rows sent while ``running`` requests ran took ``seconds``."""
        if not seconds > 0:
            return
        x = float(running * positions)
        with self._lock:
            self._w = DECAY * self._w + 1.0
            self._x = DECAY * self._x + x
            self._y = DECAY * self._y + seconds
            self._xx = DECAY * self._xx + x * x
            self._xy = DECAY * self._xy + x * seconds

    def observe_drafts(self, count: int, seconds: float) -> None:
        """The drafter made ``count`` drafts in ``seconds``."""
        if count < 1 or not seconds > 0:
            return
        step = seconds / count
        with self._lock:
            self.draft_s = step if self.draft_s is None else DECAY * self.draft_s + (1 - DECAY) * step

    def observe_decisions(self, accepted: int, rejected: int) -> None:
        """A window's decisions: ``accepted`` drafts kept, ``rejected`` (0 or 1) replaced."""
        with self._lock:
            for kept in [1.0] * accepted + [0.0] * rejected:
                self.accepted = ACCEPT_DECAY * self.accepted + kept
                self.decided = ACCEPT_DECAY * self.decided + 1.0

    # ---- what it predicts --------------------------------------------------------------------------------------
    def line(self) -> tuple[float, float] | None:
        """The latency line ``(a0, b)`` (seconds, seconds per position), or None before any verification."""
        with self._lock:
            return self._line()

    def _line(self) -> tuple[float, float] | None:
        if self._w <= 0:
            return None
        mean_x, mean_y = self._x / self._w, self._y / self._w
        spread = self._xx / self._w - mean_x ** 2
        slope = (self._xy / self._w - mean_x * mean_y) / spread if spread > MIN_SPREAD * max(1.0, mean_x ** 2) else 0.0
        slope = max(slope, 0.0)  # a step never gets cheaper with more positions: noise says otherwise
        return max(mean_y - slope * mean_x, 0.0), slope

    def acceptance(self, accepted: int = 0, decided: int = 0) -> float | None:
        """The acceptance rate for a request that has ``accepted`` of ``decided`` drafts so far: the server's, moved
        toward the request's own; None before any decision."""
        with self._lock:
            if self.decided <= 0 and decided <= 0:
                return None
            server = self.accepted / self.decided if self.decided > 0 else accepted / decided
        return (accepted + PRIOR_DECISIONS * server) / (decided + PRIOR_DECISIONS)

    def _rates(self, running: int, acceptance: float) -> dict[int, float] | None:
        """Each k's predicted rate (tokens per second of a request) while ``running`` requests run, from one reading
        of the line and the drafter's step; None until both were measured."""
        with self._lock:
            line, draft_s = self._line(), self.draft_s
        if line is None or draft_s is None:
            return None
        a0, slope = line
        rates = {}
        for k in range(self.max_lookahead + 1):
            seconds = k * draft_s + a0 + slope * running * (k + 1)
            rates[k] = expected_tokens(k, acceptance) / seconds if seconds > 0 else 0.0
        return rates

    def rate(self, k: int, running: int, acceptance: float) -> float | None:
        """A request's predicted tokens per second with windows of ``k`` drafts while ``running`` requests run."""
        rates = self._rates(running, acceptance)
        return None if rates is None else rates[k]

    def best(self, accepted: int = 0, decided: int = 0, running: int | None = None) -> int | None:
        """The lookahead of the highest predicted rate for a request with ``accepted`` of ``decided`` drafts kept,
        while ``running`` requests run (None: now); None until every input was measured."""
        acceptance = self.acceptance(accepted, decided)
        rates = None if acceptance is None else self._rates(self.running() if running is None else running,
                                                             acceptance)
        return None if rates is None else max(rates, key=lambda j: (rates[j], -j))

    def choose(self, accepted: int = 0, decided: int = 0) -> int:
        """The lookahead of a request's next window (``accepted`` of its ``decided`` drafts kept so far): the
        configured largest until every input was measured, then the goodput rule (see the module doc)."""
        k = self.best(accepted, decided)
        with self._lock:
            window = self.windows
            self.windows += 1
        if k is None:
            k = self.max_lookahead
        elif window % self.explore_every == self.explore_every - 1:  # a neighbour: above, then below, in turn
            k = k + 1 if k < self.max_lookahead and (window // self.explore_every) % 2 == 0 else max(k - 1, 0)
        with self._lock:
            self.chosen[k] = self.chosen.get(k, 0) + 1
        return k

    def snapshot(self) -> dict[str, Any]:
        """What it measured and chose, for ``/metrics`` and tests."""
        with self._lock:
            line = self._line()
            return {"latency_line_s": None if line is None else {"base": line[0], "per_position": line[1]},
                    "draft_s": self.draft_s,
                    "acceptance": None if self.decided <= 0 else self.accepted / self.decided,
                    "windows": self.windows, "lookaheads": dict(sorted(self.chosen.items()))}
