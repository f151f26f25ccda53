"""Speculation chosen by load: per request, a slot's speculative decoder or plain decoding, by measured rates.

A server's slots share what computes their forwards: the cores or device of an in-process backend, or the engines
of ``--target-servers``. Speculation that pays for one request takes compute from the others under load, where
drafts, rejected windows and preempted verifications cost more than they save. So a slot of a speculative server
holds two decoders over the same models (:class:`LoadChosenDecoder`): the configured one (DSI or SI, or
``--method auto``'s pick) and a plain (non-SI) one, and a :class:`LoadChooser` shared by the slots picks one per
request, from what the server measured as it ran. Both are lossless, so the output's law is the target's whatever
it picks (greedy: the same tokens; sampled with a seed: the same tokens for the same picks).

What it measures. Each request it saw through gives its generation's output rate (tokens over the generation's
wall time) under its **load level**: the requests running when it started (this one included), in the levels 1,
2, 3-4, 5-8, ... (:func:`level_of`). At one level every request shares the compute the same way, so the way with
the higher rate there gives the server the higher output rate. It keeps an exponential average per level and way.

How it picks (:meth:`LoadChooser.choose`):

- a way with fewer than :data:`MIN_SAMPLES` requests measured at the level is tried first (speculation first: the
  configured method is the one measured fastest for one request);
- then the way with the higher average, trying the other once in every ``EXPLORE_EVERY x gap ** 2`` requests at
  the level (``gap``: the ratio of the two averages, at least 1), so a change in load or acceptance is seen while
  a way far behind is tried rarely (each level is measured on its own: what pays at one load says little of
  another).

A request tried the losing way runs next to requests running the winning one, whose compute it shares: at a high
level such a lone speculative request can measure faster than it would be among its like. Its average then leads
for a few requests, which then measure among their like and bring it back. Long requests keep the way they
started with (a switch inside one is not made).
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

SPECULATIVE, PLAIN = "speculative", "plain"
WAYS = (SPECULATIVE, PLAIN)
MIN_SAMPLES = 2  # requests measured each way at a level before the averages decide
EXPLORE_EVERY = 16  # the losing way is tried once in this many requests x gap squared at a level
SMOOTHING = 0.3  # weight of the newest request in a level's average
MIN_TOKENS = 2  # a request of fewer output tokens says nothing of a rate (a prompt-only or one-token answer)


def level_of(running: int) -> int:
    """The load level of ``running`` requests (at least 1): 1, 2, then powers of two up (3-4 is 4, 5-8 is 8...)."""
    return 1 if running <= 1 else 1 << (running - 1).bit_length()


def level_label(level: int) -> str:
    """``"1"``, ``"2"``, ``"3-4"``, ``"5-8"``, ...: the running requests a level holds."""
    return str(level) if level <= 2 else f"{level // 2 + 1}-{level}"


@dataclass
class _Way:
    rate: float | None = None  # tokens per second of the generation, averaged
    samples: int = 0


@dataclass
class _Level:
    ways: dict[str, _Way] = field(default_factory=lambda: {w: _Way() for w in WAYS})
    since_explore: int = 0  # requests at this level since the losing way was last tried


@dataclass(frozen=True)
class Pick:
    """What :meth:`LoadChooser.choose` picked for one request, and why (the ``load`` of its ``dsi`` object)."""

    way: str
    running: int
    level: int
    reason: str
    rates: dict[str, float | None]

    def as_dict(self) -> dict:
        return {"way": self.way, "running": self.running, "level": level_label(self.level), "reason": self.reason,
                "rates": {w: None if r is None else round(r, 3) for w, r in self.rates.items()}}


class LoadChooser:
    """Picks a way per request from the rates measured by load level (see the module doc); thread-safe."""

    def __init__(self, min_samples: int = MIN_SAMPLES, explore_every: int = EXPLORE_EVERY,
                 smoothing: float = SMOOTHING) -> None:
        self.min_samples, self.explore_every, self.smoothing = min_samples, explore_every, smoothing
        self._levels: dict[int, _Level] = {}
        self._lock = threading.Lock()

    def _level(self, level: int) -> _Level:
        return self._levels.setdefault(level, _Level())

    def choose(self, running: int) -> Pick:
        """The way for a request that starts with ``running`` requests running (itself included)."""
        level = level_of(running)
        with self._lock:
            state = self._level(level)
            rates: dict[str, float | None] = {w: state.ways[w].rate for w in WAYS}
            young = [w for w in WAYS if state.ways[w].samples < self.min_samples]
            if young:
                way, reason = young[0], f"measuring: {state.ways[young[0]].samples} of {self.min_samples} requests"
            else:
                best = max(WAYS, key=lambda w: (rates[w] or 0.0, w == PLAIN))
                other = PLAIN if best == SPECULATIVE else SPECULATIVE
                gap = (rates[best] or 0.0) / rates[other] if rates[other] else math.inf
                every = self.explore_every * min(gap, 8.0) ** 2
                state.since_explore += 1
                if state.since_explore >= every:
                    state.since_explore = 0
                    way, reason = other, f"trying again (once in {every:.0f} requests): {best} leads by {gap:.2f}x"
                else:
                    way, reason = best, f"faster at this load by {gap:.2f}x"
        pick = Pick(way, running, level, reason, rates)
        log.info("load choice: %d running (level %s): %s (%s)", running, level_label(level), way, reason)
        return pick

    def record(self, pick: Pick, tokens: int, seconds: float) -> None:
        """What a request picked as ``pick`` gave: ``tokens`` output tokens in ``seconds`` of generation."""
        if tokens < MIN_TOKENS or not seconds > 0:
            return
        rate = tokens / seconds
        with self._lock:
            way = self._level(pick.level).ways[pick.way]
            way.rate = rate if way.rate is None else self.smoothing * rate + (1 - self.smoothing) * way.rate
            way.samples += 1

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Per level (its label): each way's averaged rate and samples, for /metrics and tests."""
        with self._lock:
            return {level_label(level): {w: {"rate": s.ways[w].rate, "samples": s.ways[w].samples} for w in WAYS}
                    for level, s in sorted(self._levels.items())}


class LoadChosenDecoder:
    """A slot's two decoders, one picked per request by a shared :class:`LoadChooser` from ``running()`` (the
    requests running now, this one included). Everything else a slot asks of a decoder (``pool``, ``healthy``,
    ``close``, ``choice``...) is the speculative one's, or both's."""

    def __init__(self, speculative: Any, plain: Any, chooser: LoadChooser, running: Any) -> None:
        self.speculative, self.plain, self.chooser, self._running = speculative, plain, chooser, running

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["speculative"], name)

    def generate(self, request: Any, on_tokens: Any = None, abort: Any = None) -> Any:
        pick = self.chooser.choose(max(1, int(self._running())))
        decoder = self.speculative if pick.way == SPECULATIVE else self.plain
        result = decoder.generate(request, on_tokens, abort)
        stats = result.stats
        self.chooser.record(pick, stats.new_tokens, stats.wall_time_s)
        stats.extra["load"] = pick.as_dict()
        return result

    def healthy(self) -> bool:
        return all(getattr(d, "healthy", lambda: True)() for d in (self.speculative, self.plain))

    def close(self) -> None:
        try:
            self.speculative.close()
        finally:
            self.plain.close()
