"""Plain decoding through the engines' own generation: one streamed completion a request, not a request a token.

Non-SI decoding over engines scored one row a request: a round trip, a prefix of a block recomputed and a
scheduling step of the engine for every token. An engine generates a sequence itself at the cost of its decoding
steps, batched with every other request it runs; this module asks it to. :meth:`EngineGeneration.tokens` opens a
:class:`~dsi.models.engines.streams.CompletionStream` after the request's context, ``max_tokens`` the tokens left
(``ignore_eos``: dsi's stop rules decide the end, and the stream is closed there), and yields the tokens as they
arrive. What it decodes is what plain decoding commits, so the output is exact:

- greedy on raw rows (no penalty, bias, ``min_tokens`` or constraint): ``temperature: 0`` is the engine's argmax of
  each raw row, the token dsi's greedy decoding takes from the same row;
- sampling that the engines' dsi_vllm processor draws (:meth:`~dsi.models.engines.target.EngineTarget.draws`: the
  request then runs with coupled draws, :mod:`dsi.coupling`): each step's token is the processor's coupled draw
  at that position, keyed as dsi keys it, so a seed gives the tokens non-SI gives when it scores a token a request.

Anything else (logprobs, processing that moves the argmax without draws) scores rows as before: the decoder asks
:meth:`~dsi.models.engines.target.EngineTarget.generation`, which answers None for it.

Faults. A stream that breaks, stalls for ``stall_s`` or answers garbage marks its engine lost
(:meth:`~dsi.models.engines.target.EngineTarget.mark_lost`, probed with its start check before it serves again), and
the generation goes on after the tokens already yielded, on the next engine in service; the request fails
(:class:`~dsi.errors.ServerLost`) only when every engine failed without a token in between. Tokens a broken stream
sent before it broke were decoded by the engine and stay committed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

from dsi.errors import ContextLengthError, ServerLost
from dsi.models.base import CancelFlag
from dsi.models.engines.draws import args as draw_args
from dsi.models.engines.streams import CompletionStream

log = logging.getLogger(__name__)

STALL_S = 60.0  # a stream that sends nothing for this long while the decoder waits is a frozen engine


class EngineGeneration:
    """Plain decoding of requests with sampling ``params`` through ``target``'s engines (see the module doc);
    ``coupled``: the engines draw (dsi_vllm's processor), else greedy. Counts the streams it opened."""

    def __init__(self, target: Any, params: Any, coupled: bool, stall_s: float = STALL_S) -> None:
        self.target = target
        self.stall_s = float(stall_s)
        self.extra = {"vllm_xargs": draw_args(params)} if coupled else {}
        self.streams = 0

    def tokens(self, context: Sequence[int], max_tokens: int, cancel: CancelFlag | None = None
               ) -> Iterator[list[int]]:
        """The engine's tokens after ``context``, up to ``max_tokens`` of them, in the chunks they arrive in. Closing
        the iterator (the caller's output ended) closes the stream, which aborts the engine's request."""
        target = self.target
        produced: list[int] = []
        failures = 0  # engines failed since the last token
        while len(produced) < max_tokens:
            engine = target.engine_in_service()
            start = tuple(context) + tuple(produced)
            room = max_tokens - len(produced)
            if engine.max_model_len is not None:
                room = min(room, engine.max_model_len - len(start))
            if room < 1:
                raise ContextLengthError(f"{len(start)} tokens leave no room to generate on {target.role} server "
                                         f"{engine.url} (max_model_len {engine.max_model_len})")
            stream = CompletionStream(engine.url, engine.model, start, 0, room, target.vocab_size,
                                      connect_timeout=target.connect_timeout, read_timeout=target.read_timeout,
                                      stall_s=self.stall_s, role=target.role, extra=self.extra)
            self.streams += 1
            got = 0
            try:
                while True:
                    chunk = stream.tokens_from(got, cancel)
                    if not chunk:
                        break
                    got += len(chunk)
                    produced.extend(chunk)
                    failures = 0
                    yield chunk
            except ServerLost as exc:
                target.mark_lost(engine.url, str(exc))
                failures += 1
                if failures >= len(target.urls):
                    raise
                log.warning("%s; plain decoding goes on after %d tokens on another engine", exc, len(produced))
                continue
            finally:
                stream.close()
            if got == 0:  # it ended (no error) without a token: an engine that does not generate as asked
                target.mark_lost(engine.url, f"ended a stream of {room} tokens before its first token")
                raise ServerLost(f"{target.role} server {engine.url} ended a stream of {room} tokens before its "
                                 f"first token (finish reason {stream.finish_reason!r})")
