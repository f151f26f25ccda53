"""One request between the HTTP handler (event loop) and an engine slot (its worker thread).

A :class:`Job` waits for a slot, runs ``decoder.generate`` on the slot's thread and reports
back through an ``asyncio.Queue``: text deltas while tokens are committed (streaming), then one
:class:`Outcome`. The token callback runs on the slot's thread: it detokenises incrementally
(multi-byte safe, :class:`dsi.text.IncrementalDetokenizer`), holds back text that could be the
start of a stop string, and on a stop string sets the request's abort flag, so the decoder stops
at once and preempts its verification tasks. :meth:`Job.cancel` (client gone, shutdown) sets the
same flag, or takes the request out of the queue if it has no slot yet.

Logprobs follow the text that is returned: with stop strings, each token is detokenised on its
own so that its text's start in the output is known, and only the tokens whose text starts
before the text released (before the stop string, once one appears) have their logprobs sent.
A token that straddles the cut is kept (part of its text is returned); the tokens of the stop
string, and any committed after it in the same step, are not. Tokens that are detokenised
together (the bytes of one character) are told apart by decoding that run alone, at the cut only.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from dsi.engine.request import GenerationAborted, Request
from dsi.engine.stats import GenerationStats
from dsi.errors import TaskCancelled
from dsi.logprobs import TokenLogprob, entry, raw_rows
from dsi.sampling import bonus
from dsi.server.codec import Codec
from dsi.server.logprobs import prompt_logprobs
from dsi.server.metrics import ServerMetrics
from dsi.server.prepare import PromptScoring
from dsi.server.scheduler import RequestCancelled, Scheduler, Slot
from dsi.transport.server import read_rows
from dsi.text import IncrementalDetokenizer

RUN_CONTEXT = 5  # tokens before a run decoded with it, so that its first token renders as in the output

log = logging.getLogger(__name__)


class StopStrings:
    """Streamed text with stop strings: releases text that cannot begin a stop string.

    ``feed`` returns the text that is safe to send; once a stop string appears, the text is cut
    just before it and :attr:`matched` is set. Text held back (a possible stop prefix) comes out
    of :meth:`flush` at the end. Only the held-back text is kept (at most the longest stop string
    less one character, plus the last delta), so each ``feed`` costs the same however long the
    output grows.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self.held = ""  # text not released yet: a stop string can only begin here
        self.matched: str | None = None

    def feed(self, delta: str) -> str:
        if self.matched is not None:
            return ""
        text = self.held + delta
        hits = [(i, s) for s in self.stops if (i := text.find(s)) >= 0]
        if hits:
            index, self.matched = min(hits)
            self.held = ""
            return text[:index]
        upto = max(0, len(text) - self._hold)
        self.held = text[upto:]
        return text[:upto]

    def flush(self) -> str:
        if self.matched is not None:
            return ""
        out, self.held = self.held, ""
        return out


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """``text`` up to its first stop string, and that string (None if there is none)."""
    hits = [(i, s) for s in stops if (i := text.find(s)) >= 0]
    if not hits:
        return text, None
    index, stop = min(hits)
    return text[:index], stop


@dataclass
class Outcome:
    """How a job ended. ``text``: the full completion (decoded at once, cut at a stop string)."""

    finish_reason: str  # "stop" | "length" | "cancelled" | "error"
    tokens: list[int]
    text: str = ""
    tail: str = ""  # streamed text not yet sent when generation ended
    stats: GenerationStats | None = None
    error: BaseException | None = None
    queue_time_s: float = 0.0
    prompt_logprobs: list | None = None  # vLLM's prompt_logprobs, when asked
    echo_logprobs: list[TokenLogprob] | None = None  # echo with logprobs: prompt positions 1.. (0 has no row)
    # when the request asked: one per token of ``tokens``, up to the last whose text is returned (a stop
    # string's tokens are left out, as the text leaves the string out)
    logprobs: list[TokenLogprob] | None = None
    tail_logprobs: list[TokenLogprob] | None = None  # those of the tokens whose text is ``tail``

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens)


class Job:
    """One generation request. Create it on the event loop, then :meth:`start` it."""

    def __init__(
        self,
        request: Request,
        codec: Codec,
        metrics: ServerMetrics,
        *,
        stop: Sequence[str] = (),
        stream: bool = False,
        scoring: PromptScoring | None = None,
        pinned: bool = False,
    ) -> None:
        self.id = uuid.uuid4().hex[:12]  # names the job in the server log and in 500 answers
        self.pinned = pinned  # runs the slot's configured way, not one chosen by load (a seeded sampled request)
        self.request = request
        self.codec = codec
        self.metrics = metrics
        self.stop = tuple(stop)
        self.stream = stream
        self.scoring = scoring  # what the prompt's own rows are asked for (None: nothing)
        self.abort = threading.Event()
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancel_reason: str | None = None
        self.arrived = time.perf_counter()
        self._loop = asyncio.get_running_loop()
        self._ticket: asyncio.Future | None = None
        self._scheduler: Scheduler | None = None
        self._task: asyncio.Task | None = None
        # owned by the slot thread while generating
        self._detok = IncrementalDetokenizer(codec.decode, request.prompt)
        self._stops = StopStrings(self.stop)
        self._tokens: list[int] = []
        self._entries: list[TokenLogprob] = []  # their logprobs, when the request asks
        self._streamed = 0  # entries already sent with streamed text
        # with stop strings and logprobs: per token, the output's stable length when it was detokenised (the
        # start of its text, or of the run of tokens detokenised together that it belongs to; module doc)
        self._starts: list[int] | None = [] if self.stop and request.logprobs is not None else None
        self._length = 0  # characters of output detokenised so far (kept with _starts)
        self._released = 0  # characters of output let through the stop strings (sent, or returned)
        self._stopped_at: int | None = None  # tokens committed when a stop string appeared
        self._last_token_at: float | None = None

    # ---- event loop side ---------------------------------------------------------------------
    def start(self, scheduler: Scheduler) -> None:
        """Join the queue (raises :class:`QueueFull` at once if it is full) and start running."""
        self._scheduler = scheduler
        self._ticket = scheduler.reserve()
        self._task = asyncio.create_task(self._run(scheduler), name="dsi-serve-job")

    def add_done_callback(self, callback) -> None:
        """Call ``callback(job)`` on the event loop once the job has ended."""
        self._task.add_done_callback(lambda _: callback(self))

    @property
    def queued(self) -> bool:
        """Still waiting for a slot."""
        return self._ticket is not None and not self._ticket.done()

    @property
    def done(self) -> bool:
        return self._task is not None and self._task.done()

    def cancel(self, reason: str) -> None:
        """Stop this request now: leave the queue, or abort the decoder (its tasks are preempted)."""
        if self.done:
            return
        if self.cancel_reason is None:
            self.cancel_reason = reason
        self.abort.set()
        if self._scheduler is not None and self._ticket is not None and not self._ticket.done():
            self._scheduler.withdraw(self._ticket, reason)

    async def wait_finished(self) -> None:
        if self._task is not None:
            await asyncio.shield(self._task)

    async def outcome(self) -> Outcome:
        """Wait for the end of the job (text deltas are dropped)."""
        while True:
            kind, payload = await self.events.get()
            if kind == "done":
                return payload

    async def deltas(self) -> AsyncIterator[tuple[str, object]]:
        """``("text", (str, logprob entries or None))`` items as text becomes stable (the entries of
        the tokens committed since the last item), then one ``("done", Outcome)``."""
        while True:
            kind, payload = await self.events.get()
            yield kind, payload
            if kind == "done":
                return

    async def _run(self, scheduler: Scheduler) -> None:
        outcome: Outcome
        try:
            slot = await self._ticket
        except RequestCancelled:
            outcome = Outcome("cancelled", [], queue_time_s=time.perf_counter() - self.arrived)
            self._finish(outcome)
            return
        queue_time = time.perf_counter() - self.arrived
        self.metrics.queue_time.observe(queue_time)
        future = self._loop.run_in_executor(slot.executor, self._generate, slot)
        try:
            outcome = await asyncio.shield(future)
        except asyncio.CancelledError:  # the loop is going away: stop the thread, free the slot after it
            self.abort.set()
            future.add_done_callback(lambda _: scheduler.release(slot))
            raise
        except BaseException as exc:  # noqa: BLE001 - reported to the client, never raised into the loop
            log.error("job %s: generation failed", self.id, exc_info=exc)
            outcome = Outcome("error", list(self._tokens), error=exc)
        scheduler.release(slot)
        outcome.queue_time_s = queue_time
        self._finish(outcome)

    def _finish(self, outcome: Outcome) -> None:
        self.metrics.finished.labels(outcome.finish_reason).inc()
        if outcome.stats is not None:
            self.metrics.observe_generation(outcome.stats, len(self.request.prompt), outcome.completion_tokens)
        if outcome.finish_reason in ("stop", "length"):
            self.metrics.latency.observe(time.perf_counter() - self.arrived)
        self.events.put_nowait(("done", outcome))

    # ---- slot thread side --------------------------------------------------------------------
    def _post(self, item: tuple[str, object]) -> None:
        self._loop.call_soon_threadsafe(self.events.put_nowait, item)

    def _on_tokens(self, tokens: list[int], entries: list[TokenLogprob] | None = None) -> None:
        if self._stopped_at is not None:
            return  # committed in the same step as the stop string; not part of the answer
        if entries is not None:
            self._entries.extend(entries)
        now = time.perf_counter()
        if self._last_token_at is None:
            self.metrics.ttft.observe(now - self.arrived)
        else:
            self.metrics.itl.observe(now - self._last_token_at)
        self._last_token_at = now
        self._tokens.extend(tokens)
        text = self._detokenize(tokens)
        if not text:
            return
        out = self._stops.feed(text)
        self._released += len(out)
        if self._stops.matched is not None:
            self._stopped_at = len(self._tokens)
            self.abort.set()
        if out and self.stream:
            self._post(("text", (out, self._take_entries())))

    def _detokenize(self, tokens: list[int]) -> str:
        """The new stable text of ``tokens``; with ``_starts``, one token at a time, noting where each starts."""
        if self._starts is None:
            return self._detok.push(tokens)
        pieces = []
        for token in tokens:
            self._starts.append(self._length)
            piece = self._detok.push([token])
            self._length += len(piece)
            pieces.append(piece)
        return "".join(pieces)

    def _covering(self, length: int) -> int:
        """How many tokens have text starting within the first ``length`` characters of the output."""
        if self._starts is None:
            return len(self._tokens)
        n = bisect.bisect_left(self._starts, length)  # the tokens whose run starts before ``length``
        run = bisect.bisect_left(self._starts, self._starts[n - 1]) if n else 0
        if n - run <= 1:  # the last run is one token (the usual case): its text starts where its run does
            return n
        # the last run's tokens were detokenised together: where does each one's text start?
        start, tokens = self._starts[run], self._tokens
        left = (list(self.request.prompt[-RUN_CONTEXT:]) + tokens[:run])[-RUN_CONTEXT:]
        before = self.codec.decode(left)

        def offset(j: int) -> int:  # where token j's text starts: after the complete characters before it
            text = self.codec.decode(left + tokens[run:j])
            return start + len(text[len(before):].rstrip("\ufffd"))

        return run + 1 + bisect.bisect_left(range(run + 1, n), length, key=offset)

    def _take_entries(self) -> list[TokenLogprob] | None:
        """The logprobs of the tokens whose text was released since the last streamed text (None: not asked)."""
        if self.request.logprobs is None:
            return None
        upto = max(self._streamed, self._covering(self._released))
        entries, self._streamed = self._entries[self._streamed:upto], upto
        return entries

    def _generate(self, slot: Slot) -> Outcome:
        if self.abort.is_set():  # cancelled between getting the slot and starting
            return Outcome("cancelled", [])
        slot.served += 1
        scored = echoed = stats = reason = None
        try:
            if self.scoring is not None:
                scored, echoed, stats, reason = self._score(slot, self.scoring)
            if reason is None:  # no prompt logprobs, or more than the one token their forward gives
                pinned = getattr(slot.decoder, "generate_configured", None) if self.pinned else None
                result = (pinned or slot.decoder.generate)(self.request, self._on_tokens, self.abort)
                stats = result.stats if stats is None else after_scoring(result.stats, stats)
                reason = stats.finish_reason
        except (GenerationAborted, TaskCancelled) as exc:
            stats = getattr(exc, "stats", None)
            reason = "cancelled"
        except Exception as exc:  # noqa: BLE001 - a failed worker: answer 500; rebuild the decoder only if broken
            log.exception("job %s on slot %d: generation failed", self.id, slot.index)
            try:
                slot.recover()
            except Exception:  # noqa: BLE001
                log.exception("slot %d: could not rebuild its decoder", slot.index)
            return Outcome("error", list(self._tokens), error=exc)
        tail = ""
        if self._stopped_at is None:
            tail = self._stops.feed(self._detok.flush())
            tail += self._stops.flush()
            self._released += len(tail)
        tokens = self._tokens if self._stopped_at is None else self._tokens[: self._stopped_at]
        if self._stops.matched is not None:
            reason = "stop"
        text, stop = cut_at_stop(self.codec.decode(tokens), self.stop)
        if stop is not None:
            reason = "stop"
        logprobs = tail_logprobs = None
        if self.request.logprobs is not None:
            cut = stop is not None or self._stops.matched is not None  # the text ends before a stop string
            logprobs = self._entries[: self._covering(min(self._released, len(text))) if cut else len(tokens)]
            tail_logprobs = logprobs[self._streamed:]
        return Outcome(reason, list(tokens), text=text, tail=tail, stats=stats, prompt_logprobs=scored,
                       echo_logprobs=echoed, logprobs=logprobs, tail_logprobs=tail_logprobs)

    def _score(self, slot: Slot, scoring: PromptScoring
               ) -> tuple[list | None, list[TokenLogprob] | None, GenerationStats | None, str | None]:
        """vLLM's ``prompt_logprobs`` and the echoed prompt's logprobs, from one forward of the slot's
        decoder over the prompt (its cache reused; on a DSI slot, one task on a target server).

        With ``max_tokens=1`` that forward's last row also gives the completion token, drawn as non-SI
        draws its first token (so nothing more runs); the reason is then "length" or "stop" (EOS).
        With ``max_tokens=0`` (echo) nothing is generated: "length". Otherwise the reason is None and
        the request goes on to generate as usual (its stats then hold this forward too: :func:`after_scoring`).
        Both lists hold raw log-probabilities, as vLLM's. The stats say what ran: the target's one forward, no
        speculation, so method "ar" (non-SI) whatever the slot runs (:func:`scoring_stats`), with measured times."""
        began = time.perf_counter()
        if scoring.prompt_logprobs is None and scoring.echo_logprobs is None:  # echo, max_tokens=0: nothing to compute
            return None, None, scoring_stats(began, None), "length"
        prompt = self.request.prompt
        first = scoring.from_position
        rows = slot.decoder.score(prompt, first, self.abort)  # [len(prompt) - first + 1, V]
        forward_s = time.perf_counter() - began
        scored = echoed = None
        if scoring.prompt_logprobs is not None:
            n = scoring.prompt_logprobs
            decode = None if n == -1 else (lambda t: self.codec.decode([t]))
            scored = prompt_logprobs(rows[scoring.first - first:], prompt, scoring.first, n, decode)
        if scoring.echo_logprobs is not None:  # rows[p - 1] decides prompt[p]
            raw = raw_rows(rows[:len(prompt) - 1])
            echoed = [entry(raw[p - 1], prompt[p], scoring.echo_logprobs) for p in range(1, len(prompt))]
        if not scoring.generate:
            return scored, echoed, scoring_stats(began, forward_s), "length"
        if self.request.max_new_tokens != 1:
            return scored, echoed, scoring_stats(began, forward_s), None
        # the last row decides the token as the decoder's own first row would (read_rows: the same numbers)
        tokens, probs, logprobs = read_rows(rows[-1:], self.request.verify_task(0, prompt, 1))
        token = int(tokens[0]) if probs is None else bonus(probs[0], self.request.sampling, len(prompt))
        if logprobs is None:
            self._on_tokens([token])
        else:
            self._on_tokens([token], [entry(logprobs[0], token, self.request.logprobs)])
        reason = "stop" if token in self.request.eos_token_ids else "length"
        return scored, echoed, scoring_stats(began, forward_s, token, reason), reason


def scoring_stats(began: float, forward_s: float | None, token: int | None = None,
                  reason: str = "length") -> GenerationStats:
    """The stats of a request answered from one target forward over its prompt (:meth:`Job._score`),
    begun at ``began`` (``time.perf_counter``): non-SI's (it drafts nothing and verifies nothing,
    on one target server), one forward of ``forward_s`` seconds (None: none ran, an echo of the
    prompt only), ``token`` the one token it gave (None: none, max_tokens=0)."""
    stats = GenerationStats(method="ar", finish_reason=reason)
    if forward_s is not None:
        stats.target_forwards = stats.completed_target_forwards = 1
        stats.target_busy_s = stats.completed_target_s = forward_s
    if token is not None:
        stats.new_tokens = stats.bonus_tokens = 1
        stats.stop_token = token if reason == "stop" else None
    stats.wall_time_s = time.perf_counter() - began
    stats.time_to_first_token_s = stats.wall_time_s if token is not None else 0.0
    return stats


def after_scoring(stats: GenerationStats, scoring: GenerationStats) -> GenerationStats:
    """``stats`` of a generation that followed a scoring forward (prompt_logprobs with max_tokens > 1),
    counting that forward and its time too: times are from the start of the request's run."""
    stats.target_forwards += scoring.target_forwards
    stats.completed_target_forwards += scoring.completed_target_forwards
    stats.target_busy_s += scoring.target_busy_s
    stats.completed_target_s += scoring.completed_target_s
    stats.wall_time_s += scoring.wall_time_s
    if stats.new_tokens:
        stats.time_to_first_token_s += scoring.wall_time_s
    return stats
