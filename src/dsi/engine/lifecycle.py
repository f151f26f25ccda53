"""What every decoder shares around its requests: one request at a time, the checks made before any
forward, model failures raised as dsi's own errors, and closing.

The concurrency contract of a decoder (non-SI, SI and DSI alike, on every transport):

- it serves **one request at a time**. ``generate`` and ``score`` called from several threads at once are
  serialised: each call waits for the one before it to end. A call whose abort flag is set while it waits
  ends with :class:`~dsi.engine.request.GenerationAborted` without running;
- a call made from inside a running request's own ``on_tokens`` callback, on that request's thread, would
  wait for itself: it is refused at once with a :class:`~dsi.errors.ConfigError`;
- ``close`` waits for the running request to end (set its abort flag to end it sooner), then releases the
  workers; afterwards ``generate`` and ``score`` raise :class:`~dsi.errors.DecoderClosed`. Closing twice
  is harmless, and a decoder is a context manager that closes on exit;
- to serve requests in parallel, build one decoder per concurrent request (``dsi serve``'s slots do):
  decoders may share their models; a model's sessions are each used by one thread at a time.

Checks before work (:func:`prepare_request`): a request that :func:`dsi.generate` would refuse (the one
check, :func:`~dsi.engine.request.check_request`, against the target's vocabulary), or whose prompt plus
``max_new_tokens`` exceed the target's declared context, is refused before the first forward, whatever
built it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

from dsi.engine.request import GenerationAborted, Request, TokenCallback, check_request
from dsi.engine.result import GenerationResult
from dsi.errors import ConfigError, ContextLengthError, DecoderClosed, DSIError, WorkerError
from dsi.models.base import check_token_ids, context_limit

_WAIT_POLL_S = 0.05  # how often a call waiting for the decoder looks at its abort flag


def prepare_request(request: Request, target: object) -> Request:
    """``request`` as a decoder runs it on ``target``: refused before any forward if it is not a valid request
    for ``target`` (:func:`~dsi.engine.request.check_request` against its vocabulary: the errors
    :func:`dsi.generate` raises) or ``target`` cannot serve it whole (a prompt plus ``max_new_tokens`` longer
    than its declared context), and its sampling's :class:`~dsi.constraints.Constraint` bound to ``target``'s
    vocabulary (the grammar compiled once per vocabulary; a grammar the library refuses is a ConfigError quoting it). A constrained request
    also ends at the vocabulary's EOS ids, the only tokens a complete grammar allows, whatever EOS ids it was given
    (none, from Python: it would go on past the grammar's end, unconstrained). A sampled request on engines that
    draw its rows themselves (``target.draws``: dsi_vllm's processor) runs with coupled draws (:mod:`dsi.coupling`)."""
    vocab = getattr(target, "vocab_size", None)
    request = check_request(request, vocab if isinstance(vocab, int) else None)
    limit = context_limit(target)
    if limit is not None and len(request.prompt) + request.max_new_tokens > limit:
        raise ContextLengthError(
            f"prompt of {len(request.prompt)} tokens + max_new_tokens={request.max_new_tokens} exceeds the context "
            f"of {target!r} (max_context={limit} tokens); shorten the prompt or lower max_new_tokens")
    draws = getattr(target, "draws", None)
    if callable(draws) and not request.sampling.coupled and request.logprobs is None and draws(request.sampling):
        # the engines draw sampled rows themselves: coupled draws, so a row crosses as one token (dsi.coupling)
        request = replace(request, sampling=replace(request.sampling, coupled=True))
    constraint = request.sampling.constraint
    if constraint is None:
        return request
    from dsi.constraints import bind

    bound = bind(constraint, target)
    ends = request.eos_token_ids | frozenset(bound.table.eos)  # the grammar ends the output with its EOS ids
    if bound is constraint and ends == request.eos_token_ids:
        return request
    return replace(request, sampling=replace(request.sampling, constraint=bound), eos_token_ids=ends)


def check_score(tokens: object, first: object, target: object) -> list[int]:
    """``decoder.score``'s arguments checked before any forward: ``tokens`` ids of ``target``'s vocabulary (as a
    list), ``first`` (the first prefix length scored) an integer in ``[1, len(tokens)]``."""
    vocab = getattr(target, "vocab_size", None)
    ids = check_token_ids(tokens, vocab if isinstance(vocab, int) else None, "tokens")
    if not (isinstance(first, int) and not isinstance(first, bool) and 1 <= first <= len(ids)):
        raise ConfigError(f"first={first!r} must be an integer in [1, len(tokens)={len(ids)}] (the first prefix "
                          "length whose next-token row is scored)")
    return ids


@contextmanager
def model_errors(role: str) -> Iterator[None]:
    """Raise a model's own exception (not one of dsi's) as a :class:`~dsi.errors.WorkerError` naming
    ``role`` ("target", "drafter"), the cause chained: what DSI's workers report for the same failure."""
    try:
        yield
    except DSIError:
        raise
    except Exception as exc:
        raise WorkerError(f"the {role} failed: {type(exc).__name__}: {exc}") from exc


class DecoderLifecycle:
    """One request at a time, and closing once (see the module doc). A decoder calls
    ``super().__init__()``, runs a request in ``_generate`` (``generate`` gives it its turn) and each
    ``score`` inside :meth:`_turn`, and releases its workers in ``_release``."""

    method: str

    def __init__(self) -> None:
        self._turn_lock = threading.Lock()
        self._owner: int | None = None  # the thread whose request runs now
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    @contextmanager
    def _turn(self, abort: threading.Event | None = None) -> Iterator[None]:
        """Wait for the decoder (serialising calls from several threads), then run the call."""
        self._refuse_reentry("generate() or score()")
        while not self._turn_lock.acquire(timeout=_WAIT_POLL_S):
            if abort is not None and abort.is_set():
                raise GenerationAborted("generation aborted by the caller while it waited for the decoder "
                                        "(another request was running on it)")
        try:
            if self._closed:
                raise DecoderClosed(f"this {self.method} decoder is closed; build a new one (dsi.build_decoder)")
            self._owner = threading.get_ident()
            yield
        finally:
            self._owner = None
            self._turn_lock.release()

    def generate(self, request: Request, on_tokens: TokenCallback | None = None,
                 abort: threading.Event | None = None) -> GenerationResult:
        """Run ``request`` once the decoder is free (:meth:`_generate`, the method's own)."""
        with self._turn(abort):
            return self._generate(request, on_tokens, abort)

    def _generate(self, request: Request, on_tokens: TokenCallback | None,
                  abort: threading.Event | None) -> GenerationResult:
        raise NotImplementedError

    def close(self) -> None:
        """Wait for the running request to end, then release the workers (once)."""
        self._refuse_reentry("close()")
        with self._turn_lock:
            if self._closed:
                return
            self._closed = True
            self._release()

    def _refuse_reentry(self, call: str) -> None:
        if self._owner == threading.get_ident():
            raise ConfigError(f"{call} was called on this {self.method} decoder from inside its own running "
                              "request (its on_tokens callback); it would wait for itself. Use another decoder, "
                              "or call it after generate() returns")

    def _release(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
