"""The event-driven window policy of DSI (``lookahead="auto"``): when to send a verification window.

Pure arithmetic over what the orchestrator observes; shared by the engine
(:mod:`dsi.engine.dsi`) and the event simulator (:mod:`dsi.sim.events`) so that the simulator's
ideal is the same policy. It knows nothing about models, threads or time sources.

A fixed lookahead k exists only so that verification windows never wait for a busy target
server: Equation 1 of the paper asks k >= T / (SP d) for a target forward of T seconds, a drafter
step of d seconds and SP servers. The event-driven policy needs no k:

- a window is sent only when a target server is idle (so it never waits), and it carries every
  draft made since the previous window (while every server is busy, drafts pile up);
- but not before it holds ``min_window`` drafts, unless no more drafts can come for it (the
  drafter is done, or the drafts reach the last position that may need deciding) or no task of
  the epoch is in flight: then the next position to decide has no verification running, and
  waiting would idle the non-SI chain that makes DSI never slower than non-SI. Without that
  floor an idle server would get a one-draft window at once and be busy when a full window is
  ready; the servers then fall into step, one carrying large late windows and the others tiny
  ones. Measured on emulated latencies (target 20 ms, drafter 1 ms, SP = 2, a = 0.9): 1.25x the
  best fixed k without the floor, 1.00x with it
  (docs/results.md#event-driven-windows-against-every-fixed-lookahead);
- ``min_window`` is Equation 1's smallest k from running estimates of T and d, lowered when
  rejections come early: the windows that cover the positions likely to be decided before the
  next rejection (``1.5 / (1 - a)`` of them for an estimated acceptance a, a margin over the mean
  distance ``1 / (1 - a)``) only need to fit on the servers beside the zero-draft task, so
  ``ceil(1.5 / ((1 - a)(SP - 1)))`` drafts per window suffice; smaller windows are verified
  sooner, and the windows past a rejection are preempted anyway. Before any estimate exists it is
  1. (Tried on the event simulator over the bench scenarios and the paper's Table 1 rows: within
  1.4% of the best fixed k everywhere; Equation 1 alone was up to 9% slower, the mean distance
  without the servers up to 2.6%.)

Each position's decision depends on its prefix, its draft and the counter-based uniforms of its
absolute position only, so where windows end never changes the output: only the time it takes.
"""

from __future__ import annotations

import math

_DECAY = 0.98  # weight of the past in the acceptance estimate (about the last 50 decisions)
_ALPHA = 0.2  # weight of a new latency sample


class WindowPacer:
    """Running estimates of the target forward, the drafter step and the acceptance rate."""

    def __init__(self) -> None:
        self.target_s: float | None = None  # one target forward (a verification)
        self.drafter_s: float | None = None  # one drafter step
        self.accepted = 0.0  # exponentially decayed counts of decided drafts
        self.rejected = 0.0

    def add_target(self, seconds: float) -> None:
        if seconds > 0:
            self.target_s = seconds if self.target_s is None else (1 - _ALPHA) * self.target_s + _ALPHA * seconds

    def add_drafter(self, seconds: float) -> None:
        if seconds > 0:
            self.drafter_s = seconds if self.drafter_s is None else (1 - _ALPHA) * self.drafter_s + _ALPHA * seconds

    def add_decision(self, accepted: bool) -> None:
        self.accepted = _DECAY * self.accepted + (1.0 if accepted else 0.0)
        self.rejected = _DECAY * self.rejected + (0.0 if accepted else 1.0)

    @property
    def acceptance(self) -> float | None:
        total = self.accepted + self.rejected
        return self.accepted / total if total > 0 else None

    def min_window(self, servers: int) -> int:
        """The fewest drafts a window should carry with ``servers`` target servers (>= 1)."""
        if not self.target_s or not self.drafter_s or servers < 1:
            return 1
        k = max(1, math.ceil(self.target_s / (servers * self.drafter_s) - 1e-9))  # Equation 1
        if self.rejected > 0:  # 1.5 x the expected distance to the next rejection, over the free servers
            distance = (self.accepted + self.rejected) / self.rejected  # 1 / (1 - a)
            k = min(k, max(1, math.ceil(1.5 * distance / max(servers - 1, 1) - 1e-9)))
        return k


def window_end(
    first: int,
    drafts: int,
    horizon: int,
    *,
    idle_servers: int,
    min_window: int,
    max_window: int | None,
    drafter_done: bool,
    in_flight: int = 1,
) -> int | None:
    """The end (last relative position, inclusive) of the window to send now, or None to wait.

    ``first``: the first position the next window would decide; ``drafts``: drafts made so far in
    this epoch (positions ``0 .. drafts - 1``); ``horizon``: the last position that may still need
    deciding; ``in_flight``: tasks of this epoch sent and not finished. The window decides
    ``first .. end`` and its context holds ``end`` drafts.
    """
    if idle_servers < 1:
        return None
    end = min(drafts, horizon)
    if max_window is not None:
        end = min(end, first - 1 + max_window)
    if end < first:
        return None
    complete = drafter_done or drafts >= horizon  # no later draft can join this window
    if end - first + 1 < min(min_window, max_window or min_window) and not complete and in_flight > 0:
        return None
    return end
