"""Speculation chosen by load: per request, and during long ones, a slot's speculative decoder or plain decoding.

A server's slots share what computes their forwards: the cores or device of an in-process backend, or the engines
of ``--target-servers``. Speculation that pays for one request takes compute from the others under load, where
drafts, rejected windows and preempted verifications cost more than they save. So a slot of a speculative server
holds two decoders over the same models (:class:`LoadChosenDecoder`): the configured one (DSI or SI, or
``--method auto``'s pick) and a plain (non-SI) one, and a :class:`LoadChooser` shared by the slots picks one per
request, from what the server measured as it ran, and may hand a running request over to the other at a decided
position. Both are lossless, so the output's law is the target's whatever it picks (greedy: the same tokens wherever a
row's logits do not depend on how its forward was cut, as on llama.cpp or bf16 only in the deterministic mode:
docs/serving.md; sampled with a seed: the same tokens for the same picks and hand-overs).

What it measures. Each stretch of a request run one way (a *segment*: the whole request, or the part before or
after a hand-over) gives that way's decode rate: the tokens committed after its first commit over the time since
(:class:`SegmentClock`; the prefill, which both ways pay, is left out, and speculation's first burst of tokens too).
It is filed under the segment's **load level**: the requests running when it started (itself included), in the
levels 1, 2, 3-4, 5-8, ... (:func:`level_of`). At one level every request shares the compute the same way, so the
way with the higher rate there gives the server the higher output rate. It keeps an exponential average per level
and way.

How it picks a request's way (:meth:`LoadChooser.choose`):

- at a level where a lower level measured plain decoding faster, speculation is presumed slower here too (its gain
  only shrinks as load grows: more requests share each forward) and is not measured first: plain decoding runs,
  and speculation is tried at the exploration rate below, against the lower level's gap;
- otherwise a way with fewer than :data:`MIN_SAMPLES` segments measured at the level is tried first, the two in
  turn (speculation first), so plain decoding's rate is known after two requests; a way measured once at
  :data:`CLEAR_GAP` times slower than the other needs no second measurement;
- then the way with the higher average, trying the other once in every ``EXPLORE_EVERY x gap ** 2`` requests at
  the level (``gap``: the ratio of the two averages, at least 1), so a change in load or acceptance is seen while
  a way far behind is tried rarely.

When it hands a request over (:meth:`LoadChooser.handoff`, asked at each commit): once the running segment has
decoded :data:`HANDOFF_MIN_TOKENS` tokens in :data:`HANDOFF_MIN_BURSTS` commits (speculation commits a window at
once) and at least :data:`HANDOFF_MIN_REMAINING` are left, if the other way's
average at the level running now beats the segment's own rate by :data:`HANDOFF_MARGIN`. Speculation that runs
slower than plain decoding for this request (its prompt's acceptance, or a load that grew) goes on plainly; plain
decoding goes on speculating when the load fell to where speculation measured faster. A request hands over once
at most (never back: each hand-over re-reads the prompt). The hand-over happens where the running decoder checks
its abort flag, between decided windows: the next decoder goes on after the committed tokens
(:attr:`~dsi.engine.request.Request.committed`), which it recomputes as a prompt (one prefill). The rule reads only
the count and times of committed tokens, so the hand-over point is a stopping time of the committed output and the
output keeps the target's law; every uniform is keyed by absolute position (:mod:`dsi.sampling`), so a seeded
request gives the same tokens for the same hand-overs.

A sampled request with a seed (given by the client, or the server's ``--seed``) runs the configured way whatever
the load, and is never handed over (:meth:`LoadChosenDecoder.generate_configured`, the server's choice): a seed
then gives the same tokens however busy the server was and whatever ran before, as clients expect of a seed (lm-eval
scores must not depend on request order). Greedy requests get the same tokens either way (up to the near-ties above), and unseeded sampled
ones the same law.

Over batching engines with SI (``--target-servers``; the slot's speculative decoder has a
:class:`~dsi.engine.goodput.LookaheadByLoad`), the way is chosen by goodput instead (:meth:`LoadChooser.choose_by_goodput`):
SI's lookahead follows the load window by window, from a measured line of a verification's latency against the
positions the running requests put in the engines' steps, the drafter's step and the acceptance rate, down to
windows of no draft; a request starts plainly (the engines' own generation) only where the rule predicts that no
draft pays at the load it starts at, and is never handed over (its windows follow the load as it changes). Per-request
rates mislead there: under a shared bottleneck a request run one way among requests run the other is slowed by them
as much, so its rate does not show what its way costs the others; a batch-time model does (SmartSpec, arXiv
2406.14066).

A request tried the losing way runs next to requests running the winning one, whose compute it shares: at a high
level such a lone speculative request can measure faster than it would be among its like. Its average then leads
for a few requests, which then measure among their like and bring it back.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

from dsi.engine.request import GenerationAborted, Request
from dsi.engine.result import GenerationResult
from dsi.engine.stats import GenerationStats

log = logging.getLogger(__name__)

SPECULATIVE, PLAIN = "speculative", "plain"
WAYS = (SPECULATIVE, PLAIN)
MIN_SAMPLES = 2  # segments measured each way at a level before the averages decide (unless the gap is clear)
CLEAR_GAP = 1.5  # a way measured once this many times slower than the other needs no second measurement
EXPLORE_EVERY = 16  # the losing way is tried once in this many requests x gap squared at a level
SMOOTHING = 0.3  # weight of the newest request in a level's average
MIN_TOKENS = 2  # a segment of fewer decoded tokens (after its first burst) says nothing of a rate
HANDOFF_MIN_TOKENS = 6  # tokens a segment decodes (after its first burst) before its rate may hand it over
HANDOFF_MIN_BURSTS = 4  # ... in this many commits at least (a speculative rate over one or two windows is noise)
HANDOFF_MIN_REMAINING = 8  # a request with fewer tokens left is not handed over (the next way re-reads the prompt)
HANDOFF_MARGIN = 0.15  # the other way's average must beat the segment's rate by this fraction
BURST_S = 0.005  # commits this close to a segment's first belong to its first burst (a window decided at once)


def other_way(way: str) -> str:
    """The way that is not ``way``."""
    return PLAIN if way == SPECULATIVE else SPECULATIVE


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


def _picked(way: str, running: int, level: int, reason: str, rates: dict[str, float | None]) -> Pick:
    """The pick, said in the log (at ``-v``)."""
    log.info("load choice: %d running (level %s): %s (%s)", running, level_label(level), way, reason)
    return Pick(way, running, level, reason, rates)


class LoadChooser:
    """Picks a way per request, and when to hand one over, from the rates measured by load level (see the module
    doc); thread-safe."""

    def __init__(self, min_samples: int = MIN_SAMPLES, explore_every: int = EXPLORE_EVERY,
                 smoothing: float = SMOOTHING) -> None:
        self.min_samples, self.explore_every, self.smoothing = min_samples, explore_every, smoothing
        self._levels: dict[int, _Level] = {}
        self._lock = threading.Lock()

    def _level(self, level: int) -> _Level:
        return self._levels.setdefault(level, _Level())

    def _gap_below(self, level: int) -> float | None:
        """How far plain decoding led speculation (plain rate / speculative rate) at the nearest lower level where
        both were measured; None where none was, or speculation led there."""
        for lower in sorted((lv for lv in self._levels if lv < level), reverse=True):
            ways = self._levels[lower].ways
            measured = all(ways[w].samples >= self.min_samples or self._clearly_behind(ways, w) for w in WAYS)
            if measured and all(ways[w].samples for w in WAYS):
                gap = (ways[PLAIN].rate or 0.0) / (ways[SPECULATIVE].rate or math.inf)
                return gap if gap > 1.0 else None
        return None

    @staticmethod
    def _clearly_behind(ways: dict[str, _Way], way: str) -> bool:
        """Whether ``way``, measured, trails the other way (measured) by at least :data:`CLEAR_GAP`."""
        other = ways[other_way(way)]
        mine = ways[way]
        return bool(mine.samples and other.samples and other.rate >= CLEAR_GAP * mine.rate)

    def choose(self, running: int) -> Pick:
        """The way for a request that starts with ``running`` requests running (itself included)."""
        level = level_of(running)
        with self._lock:
            state = self._level(level)
            ways = state.ways
            rates: dict[str, float | None] = {w: ways[w].rate for w in WAYS}
            below = self._gap_below(level) if ways[SPECULATIVE].samples < self.min_samples else None
            young = [w for w in WAYS if ways[w].samples < self.min_samples and not (w == SPECULATIVE and below)
                     and not self._clearly_behind(ways, w)]
            if young:
                way = min(young, key=lambda w: (ways[w].samples, w != SPECULATIVE))  # in turn, speculation first
                reason = f"measuring: {ways[way].samples} of {self.min_samples} segments"
                if below:
                    reason += f" (a lower level measured plain decoding {below:.2f}x faster)"
            else:
                if below and ways[SPECULATIVE].rate is None:  # presumed slower by the lower level's gap
                    best, other, gap, why = PLAIN, SPECULATIVE, below, "a lower level measured plain decoding"
                else:
                    best = max(WAYS, key=lambda w: (rates[w] or 0.0, w == PLAIN))
                    other = other_way(best)
                    gap = (rates[best] or 0.0) / rates[other] if rates[other] else math.inf
                    why = "faster at this load"
                every = self.explore_every * min(gap, 8.0) ** 2
                state.since_explore += 1
                if state.since_explore >= every:
                    state.since_explore = 0
                    way, reason = other, f"trying again (once in {every:.0f} requests): {best} leads by {gap:.2f}x"
                else:
                    way, reason = best, f"{why} by {gap:.2f}x"
        return _picked(way, running, level, reason, rates)

    def choose_by_goodput(self, running: int, lookahead: Any) -> Pick:
        """The way for a request that starts with ``running`` requests running, on a server whose speculation is SI
        with its lookahead by goodput (``lookahead``: its :class:`~dsi.engine.goodput.LookaheadByLoad`): plain
        decoding where the best lookahead at this load is none, else SI (which also runs while the inputs of the
        rule are still being measured)."""
        level = level_of(running)
        with self._lock:
            rates: dict[str, float | None] = {w: self._level(level).ways[w].rate for w in WAYS}
        k = lookahead.best(running=running)
        if k is None:
            way, reason = SPECULATIVE, "goodput: measuring (SI's windows measure the engines)"
        elif k == 0:
            way, reason = PLAIN, f"goodput: no draft pays at {running} running"
        else:
            way, reason = SPECULATIVE, f"goodput: windows of {k} drafts pay most at {running} running"
        return _picked(way, running, level, reason, rates)

    def record_rate(self, way: str, level: int, tokens: int, seconds: float) -> None:
        """What a segment run ``way`` at ``level`` gave: ``tokens`` decoded in ``seconds`` (too few: nothing)."""
        if tokens < MIN_TOKENS or not seconds > 0:
            return
        rate = tokens / seconds
        with self._lock:
            averaged = self._level(level).ways[way]
            averaged.rate = rate if averaged.rate is None else (self.smoothing * rate
                                                                + (1 - self.smoothing) * averaged.rate)
            averaged.samples += 1

    def handoff(self, way: str, running: int, tokens: int, rate: float | None, remaining: int,
                bursts: int = HANDOFF_MIN_BURSTS) -> str | None:
        """Why a segment running ``way`` should hand its request over to the other way now, or None: it decoded
        ``tokens`` at ``rate`` (tokens/s, after its first burst) in ``bursts`` commits, ``remaining`` are left, and
        ``running`` requests run now (see the module doc)."""
        if rate is None or min(tokens - HANDOFF_MIN_TOKENS, bursts - HANDOFF_MIN_BURSTS,
                               remaining - HANDOFF_MIN_REMAINING) < 0:
            return None
        level = level_of(running)
        other = other_way(way)
        with self._lock:
            state = self._levels.get(level)
            theirs = None if state is None or not state.ways[other].samples else state.ways[other].rate
        if theirs is None or theirs <= rate * (1 + HANDOFF_MARGIN):
            return None
        return (f"{other} measured {theirs:.2f} tok/s at level {level_label(level)}, this request's {way} decoding "
                f"{rate:.2f} tok/s")

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Per level (its label): each way's averaged rate and samples, for /metrics and tests."""
        with self._lock:
            return {level_label(level): {w: {"rate": s.ways[w].rate, "samples": s.ways[w].samples} for w in WAYS}
                    for level, s in sorted(self._levels.items())}


class SegmentClock:
    """A segment's decode rate from its commits: the tokens committed after its first burst (the commits within
    :data:`BURST_S` of its first: the prefill's token, or a whole first window) over the time since that burst."""

    def __init__(self) -> None:
        self.first = self.burst_end = None  # times of the first commit and of the first burst's last
        self.last = 0.0
        self.burst = self.count = 0
        self.bursts = 0  # commits after the first burst, those within BURST_S of the one before counted as one

    def tick(self, count: int = 1, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        if self.first is None:
            self.first = now
        if now - self.first <= BURST_S:
            self.burst += count
            self.burst_end = now
        elif now - self.last > BURST_S:
            self.bursts += 1
        self.count += count
        self.last = now

    @property
    def decoded(self) -> int:
        """Tokens committed after the first burst."""
        return self.count - self.burst

    @property
    def seconds(self) -> float:
        return self.last - self.burst_end if self.burst_end is not None else 0.0

    @property
    def rate(self) -> float | None:
        return self.decoded / self.seconds if self.decoded and self.seconds > 0 else None


class _HandOver:
    """What the running decoder polls as its abort flag: the caller's, or a hand-over decided (see the module doc)."""

    def __init__(self, caller: threading.Event | None) -> None:
        self.caller = caller
        self.reason: str | None = None

    def is_set(self) -> bool:
        return self.reason is not None or (self.caller is not None and self.caller.is_set())


_COUNTERS = ("drafted_tokens", "accepted_tokens", "rejections", "bonus_tokens", "verify_tasks", "draft_windows",
             "window_drafts", "preempted_tasks", "cancelled_tasks", "target_forwards", "drafter_forwards",
             "target_busy_s", "completed_target_forwards", "completed_target_s", "drafter_busy_s", "wasted_target_s")


class LoadChosenDecoder:
    """A slot's two decoders, one picked per request by a shared :class:`LoadChooser` from ``running()`` (the
    requests running now, this one included), and the request handed over between them where the chooser says so.
    Everything else a slot asks of a decoder (``pool``, ``healthy``, ``close``, ``choice``...) is the speculative
    one's, or both's."""

    def __init__(self, speculative: Any, plain: Any, chooser: LoadChooser, running: Any) -> None:
        self.speculative, self.plain, self.chooser, self._running = speculative, plain, chooser, running

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["speculative"], name)

    def _running_now(self) -> int:
        return max(1, int(self._running()))

    def generate(self, request: Request, on_tokens: Any = None, abort: Any = None) -> GenerationResult:
        start = time.perf_counter()
        # SI over batching engines, its lookahead by goodput: the same rule picks the way, and no hand-over is made
        # (SI's windows follow the load as it changes, down to none)
        lookahead = getattr(self.speculative, "policy", None)
        pick = (self.chooser.choose(self._running_now()) if lookahead is None
                else self.chooser.choose_by_goodput(self._running_now(), lookahead))
        way, level = pick.way, pick.level
        entries: list = []  # every segment's logprob entries (a continuation's result holds only its own)
        handoffs: list[dict] = []
        merged: GenerationStats | None = None
        committed: tuple[int, ...] = ()
        while True:
            clock, flag = SegmentClock(), _HandOver(abort)
            done = len(committed)

            def on_commit(tokens: list[int], logprobs: Any = None, clock=clock, flag=flag, way=way) -> None:
                clock.tick(len(tokens))
                if logprobs is not None:
                    entries.extend(logprobs)
                if on_tokens is not None and logprobs is None:
                    on_tokens(tokens)
                elif on_tokens is not None:
                    on_tokens(tokens, logprobs)
                if flag.reason is None and not handoffs and lookahead is None:  # once at most
                    remaining = request.max_new_tokens - done - clock.count
                    flag.reason = self.chooser.handoff(way, self._running_now(), clock.decoded,
                                                       clock.rate, remaining, clock.bursts)

            decoder = self.speculative if way == SPECULATIVE else self.plain
            segment = replace(request, committed=committed) if committed else request
            try:
                result = decoder.generate(segment, on_commit, flag)
            except GenerationAborted as exc:
                merged = _merge(merged, exc.stats)
                if flag.reason is None or (abort is not None and abort.is_set()) or exc.stats is None:
                    self._finish(merged, pick, handoffs, start, len(exc.tokens))
                    raise GenerationAborted(str(exc), exc.tokens, merged) from exc
                self.chooser.record_rate(way, level, clock.decoded, clock.seconds)
                committed = tuple(exc.tokens)
                other = other_way(way)
                handoffs.append({"at": len(committed), "to": other, "reason": flag.reason})
                log.info("load choice: hand-over after %d tokens to %s (%s)", len(committed), other, flag.reason)
                way, level = other, level_of(self._running_now())
                continue
            self.chooser.record_rate(way, level, clock.decoded, clock.seconds)
            merged = _merge(merged, result.stats)
            self._finish(merged, pick, handoffs, start, len(result.tokens))
            logprobs = entries if request.logprobs is not None else result.logprobs
            return GenerationResult(result.tokens, merged, logprobs)

    def generate_configured(self, request: Request, on_tokens: Any = None, abort: Any = None) -> GenerationResult:
        """``request`` on the configured (speculative) way, whatever the load, handed over never: a sampled request
        with a seed (the same seed, the same tokens, as a server without the option gives)."""
        # SI's lookahead by load (dsi.engine.goodput) would move where windows end, and with them a seed's tokens
        policy = getattr(self.speculative, "policy", None)
        if policy is not None:
            self.speculative.policy = None
        try:
            result = self.speculative.generate(request, on_tokens, abort)
        finally:
            if policy is not None:
                self.speculative.policy = policy
        result.stats.extra["load"] = {"way": SPECULATIVE, "running": self._running_now(), "level": "seeded",
                                      "reason": "seeded: the configured way, so its seed gives the same tokens "
                                                "whatever the load", "rates": {}, "handoffs": []}
        return result

    @staticmethod
    def _finish(stats: GenerationStats | None, pick: Pick, handoffs: list[dict], start: float, tokens: int) -> None:
        if stats is None:
            return
        stats.new_tokens, stats.wall_time_s = tokens, time.perf_counter() - start
        stats.extra["load"] = {**pick.as_dict(), "handoffs": handoffs}
        if "lookaheads" in stats.extra:  # SI's windows by goodput (dsi.engine.goodput): k -> windows
            stats.extra["load"]["lookaheads"] = {str(k): n for k, n in sorted(stats.extra["lookaheads"].items())}
            log.info("load choice: the request's windows by lookahead %s", stats.extra["load"]["lookaheads"])

    def healthy(self) -> bool:
        return all(getattr(d, "healthy", lambda: True)() for d in (self.speculative, self.plain))

    def close(self) -> None:
        try:
            self.speculative.close()
        finally:
            self.plain.close()


def _merge(into: GenerationStats | None, more: GenerationStats | None) -> GenerationStats | None:
    """A request's statistics over its segments: the first segment's (its method, time to first token, extra), the
    counters summed, the end (finish reason, stop token) of the last."""
    if more is None:
        return into
    if into is None:
        return replace(more, extra=dict(more.extra))
    for name in _COUNTERS:
        setattr(into, name, getattr(into, name) + getattr(more, name))
    into.finish_reason, into.stop_token = more.finish_reason, more.stop_token
    return into
