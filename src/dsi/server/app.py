"""The FastAPI app of ``dsi serve``: OpenAI-compatible completions and chat over DSI decoders.

:func:`create_app` takes already-loaded models and a :class:`ServeConfig`; the app builds
``max_concurrent`` decoders at startup (lifespan) and closes them at shutdown, after cancelling
whatever is still queued or running. Endpoints: ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (both with server-sent-event streaming), vLLM's ``POST /tokenize``,
``POST /detokenize``, ``GET /tokenizer_info`` and ``GET /version``, ``GET /health``, ``GET /metrics``
(Prometheus), ``GET /openapi.json`` and its Swagger UI ``GET /docs`` (:mod:`~dsi.server.openapi`). With an
API key, the ``/v1`` endpoints and the tokenizer's need ``Authorization: Bearer <key>``; ``/health``,
``/metrics``, ``/version`` and the API's description stay open (bind to loopback or put them behind your proxy).

At shutdown (:mod:`~dsi.server.runner`), requests still running when the grace period ends are
aborted (:meth:`ServerState.abort_running`), and each handler answers for itself: a stream ends
with a chunk per unfinished choice (``finish_reason: "abort"``, as vLLM), an ``error`` event and
``[DONE]``; a plain request gets a 503 JSON error. No connection is cut mid-message.

What one request may cost is bounded before it reaches the queue: its body (413 over
``max_body_bytes``, :mod:`~dsi.server.limits`), how many requests are being read and tokenised
at once (``max_queue + max_concurrent``, beyond that 429), and its prompt (checked against the
target's context while it is tokenised). Parsing, tokenising and every check run on a small pool
of preparation threads (:mod:`~dsi.server.prepare`), never on the event loop. No answer carries a
local path or a traceback: a 500 names the error's type and a reference to the server log.

Does not know: how models are loaded (the CLI does it) or how decoding works (the engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsi import __version__
from dsi.api import build_chosen_decoder, build_decoder
from dsi.engine.goodput import LookaheadByLoad
from dsi.engine.si import SpeculativeDecoder
from dsi.errors import ConfigError
from dsi.models.base import LanguageModel
from dsi.models.loading import release
from dsi.models.vocab.bridge import bridge_drafter
from dsi.server.codec import Codec, HFCodec
from dsi.server.config import ServeConfig
from dsi.server.jobs import Job, Outcome
from dsi.server.load_choice import LoadChooser, LoadChosenDecoder
from dsi.server.limits import BodyLimit, check_json_content_type, content_length, read_body
from dsi.server.logprobs import chat_logprobs, completion_logprobs, echo_logprobs, joined_logprobs, token_id_name
from dsi.server.metrics import CONTENT_TYPE, ServerMetrics
from dsi.server.openapi import Served, swagger_page
from dsi.server.openapi import document as openapi_document
from dsi.server.prepare import Prepared, Preparer, check_jobs
from dsi.server.protocol import (
    APIError,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
    DSIInfo,
    ModelCard,
    ModelList,
    Usage,
    dump,
)
from dsi.server.scheduler import QueueFull, Scheduler, Slot
from dsi.server.scoring import ScoringListener
from dsi.server.tokenizer_info import codec_tokenizer_info

__all__ = ["ServeConfig", "create_app"]

log = logging.getLogger(__name__)

CLIENT_GONE = "client disconnected"
SHUTTING_DOWN = "server shutting down"
UNTIL_POLL_S = 0.05  # how often a shutdown's wait for running requests checks whether to stop waiting
HANDLER_CANCELLED = "request handler cancelled (shutdown timeout)"
ABORTED = "abort"  # finish_reason of a choice cut short by the server (vLLM's word; OpenAI has none)
PREPARE_THREADS = 2  # parse and tokenise two requests at once (the tokenizer itself is serialised)


def target_context(target: LanguageModel, codec: Codec) -> int | None:
    """The most tokens a request may span: the target's context (the codec's, or the target's own
    declared ``max_context``, whichever is smaller). The drafter's limits do not count."""
    limits = [c for c in (codec.max_context, getattr(target, "max_context", None))
              if isinstance(c, int) and not isinstance(c, bool) and c >= 1]
    return min(limits) if limits else None


INLINE_PREPARE_BYTES = 4096  # a request body this small is prepared on the event loop (no thread hand-off)


def _token_id_completion(body: bytes | bytearray) -> bool:
    """Whether a completion body is small (:data:`INLINE_PREPARE_BYTES`) and its prompt token ids (so that
    preparing it tokenises nothing); anything else, invalid JSON included, goes to the preparation threads."""
    if len(body) > INLINE_PREPARE_BYTES:
        return False
    try:
        prompt = json.loads(body).get("prompt")
    except (ValueError, AttributeError, RecursionError):  # (not JSON, not an object, nested too deep: 400 there)
        return False
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    return isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)


class ServerState:
    """Everything one app owns: slots, live jobs, metrics, the preparation threads."""

    def __init__(self, target: LanguageModel, drafter: LanguageModel | None, config: ServeConfig, codec: Codec,
                 free_unused_drafter: bool = False, scoring_socket: socket.socket | None = None) -> None:
        if config.method != "ar" and drafter is None:
            raise ConfigError(f"method={config.method!r} needs a drafter model")
        self.target = target  # the local model: tokenizer, context, and what the engines are checked against
        self.verifier = target  # what the decoders verify with: the target, or the engines serving it
        if config.target_servers:
            from dsi.models.engines.target import EngineTarget

            self.verifier = EngineTarget(config.target_servers, reference=target)
        if drafter is not None and config.method != "ar" and config.drafter_server:  # every slot streams from it
            from dsi.models.engines.drafter import drafter_engine

            drafter = drafter_engine(drafter, config.drafter_server)
        if drafter is not None and config.method != "ar":  # one translation shared by every slot's decoder
            drafter = bridge_drafter(target, drafter, config.vocab_mode, merges=config.merges)
        self.drafter = drafter
        self.choice = None  # with method="auto": what it picked, once the first slot's decoder is built
        # speculation chosen by load (dsi.server.load_choice): one chooser for every slot
        self.chooser = LoadChooser() if config.chooses_by_load else None
        self.lookahead_policy: LookaheadByLoad | None = None  # SI's lookahead by goodput (over engines, by load)
        self.free_unused_drafter = free_unused_drafter
        self.config = config
        self.codec = codec
        self.max_context = target_context(self.verifier, codec)
        drafter_check = getattr(drafter, "check_sampling", None) if config.method != "ar" else None
        self.preparer = Preparer(config, codec, target.vocab_size, self.max_context, drafter_check,
                                 constrain=_constrainer(target))
        self.metrics = ServerMetrics()
        self.scheduler: Scheduler | None = None
        self.jobs: set[Job] = set()
        self.preparing = 0  # requests admitted and not queued yet (body, parse, tokenise)
        self.max_preparing = config.max_queue + config.max_concurrent
        self._prepare_pool: ThreadPoolExecutor | None = None
        self.closing = False
        self.created = int(time.time())
        # the scoring channel (dsi.server.scoring): a dsi verifying here runs its forwards outside HTTP
        self.scoring = ScoringListener(scoring_socket, self) if scoring_socket is not None else None

    def _new_decoder(self) -> object:
        decoder = self._new_speculative_decoder()
        if self.chooser is None or (self.choice is not None and self.choice.method == "ar"):
            return decoder  # nothing to choose: the slots decode plainly, or one way was asked for
        plain = build_decoder(target=self.verifier, method="ar",
                              target_servers=True if self.config.target_servers else None)
        if self.config.target_servers and isinstance(decoder, SpeculativeDecoder):
            # SI over batching engines: each window's lookahead, up to the configured one, by goodput under load
            if self.lookahead_policy is None:
                self.lookahead_policy = LookaheadByLoad(decoder.lookahead, self._running)
            decoder.policy = self.lookahead_policy
        return LoadChosenDecoder(decoder, plain, self.chooser, self._running)

    def _running(self) -> int:
        """Requests running now (the one asking included)."""
        return self.scheduler.running if self.scheduler is not None else 1

    def _new_speculative_decoder(self) -> object:
        c = self.config
        if self.choice is not None:  # method="auto" has chosen: every further slot (and rebuild) is its pick
            return build_chosen_decoder(self.choice, target=self.verifier, drafter=self.drafter,
                                        transport=c.transport, transport_options=self._transport_options())
        # the drafter was bridged (vocab_mode, merges) and the engines connected once, for every slot
        decoder = build_decoder(target=self.verifier, drafter=self.drafter, config=c.decoder.replace(
            vocab_mode="auto", merges="auto", drafter_server=None, target_servers=True if c.target_servers else None))
        self.choice = getattr(decoder, "choice", None)
        if self.choice is not None:
            log.info("method auto picked %s", self.choice.reason)
            if self.choice.method == "ar":  # non-SI: no decoder uses the drafter, none holds it
                if self.free_unused_drafter and self.drafter is not None:
                    release(self.drafter)
                self.drafter = None
        return decoder

    def _transport_options(self) -> dict | None:
        """The options a chosen decoder is built with: over engines, server i talks to URL i % len."""
        if not self.config.target_servers:
            return self.config.transport_options
        return {**(self.config.transport_options or {}), "devices": list(self.verifier.urls)}

    def target_servers(self) -> dict:
        """The target servers, counted for /health and /metrics: the engines of ``--target-servers`` (each
        shared by every slot; a lost one is probed until it passes its start check again), else the slots'
        own (a DSI slot's pool of servers, or the one target an SI or non-SI slot runs in this process)."""
        health = getattr(self.verifier, "health", None)
        if callable(health):
            engines = health()
            return {**engines, "lost": len(engines["lost"])}
        configured = in_service = readmissions = 0
        for slot in self.scheduler.slots if self.scheduler is not None else ():
            pool = getattr(slot.decoder, "pool", None)
            if pool is None:
                configured, in_service = configured + 1, in_service + 1
                continue
            configured += pool.num_servers
            in_service += pool.servers_in_service()
            readmissions += getattr(pool, "readmissions", 0)
        return {"configured": configured, "in_service": in_service, "lost": configured - in_service,
                "readmissions": readmissions}

    def _build_slots(self) -> list[Slot]:
        slots: list[Slot] = []
        try:
            for i in range(self.config.max_concurrent):
                slots.append(Slot(i, self._new_decoder))
        except BaseException:
            for slot in slots:
                slot.close()
            raise
        return slots

    async def start(self) -> None:
        slots = await asyncio.to_thread(self._build_slots)

        def on_change(queued: int, running: int) -> None:
            self.metrics.queue_length.set(queued)
            self.metrics.running.set(running)

        self.scheduler = Scheduler(slots, self.config.max_queue, on_change)
        self._prepare_pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="dsi-serve-prepare")
        self.metrics.slots.set(len(slots))
        if self.scoring is not None:
            self.scoring.start(asyncio.get_running_loop())
        if self.choice is not None:  # the banner said "auto": say what it picked, where the banner went
            print(f"dsi serve: method auto picked {self.choice.label}: {self.choice.reason}", file=sys.stderr,
                  flush=True)
        log.info("dsi serve: %d engine slot(s) ready (%s)", len(slots), self.config.method)

    def drain(self) -> None:
        """Shutdown has begun: refuse new requests (503) and answer the queued ones 503 now."""
        self.closing = True
        for job in list(self.jobs):
            if job.queued:
                job.cancel(SHUTTING_DOWN)

    async def wait_running(self, timeout: float | None, until: Callable[[], bool] | None = None) -> None:
        """Wait up to ``timeout`` seconds for the running requests to end (after :meth:`drain`), or until
        ``until()`` turns true (checked every :data:`UNTIL_POLL_S`: a second Ctrl-C)."""
        jobs = [job for job in self.jobs if not job.done]
        if not jobs:
            return
        if until is not None and until():
            return
        log.warning("dsi serve: shutting down: %d running request(s) may finish %s%s", len(jobs),
                    "with no time limit" if timeout is None else f"within {timeout:g} s",
                    " (Ctrl-C again aborts them now)" if until is not None else "")
        waits = {asyncio.ensure_future(job.wait_finished()) for job in jobs}
        loop = asyncio.get_running_loop()
        end = None if timeout is None else loop.time() + timeout
        pending = waits
        try:
            while pending and not (until is not None and until()):
                left = None if end is None else end - loop.time()
                if left is not None and left <= 0:
                    return
                step = left if until is None else UNTIL_POLL_S if left is None else min(UNTIL_POLL_S, left)
                _, pending = await asyncio.wait(pending, timeout=step)
        finally:
            for wait in waits:
                wait.cancel()

    async def abort_running(self, timeout: float) -> int:
        """Abort the requests still running (after the grace period): each decoder stops within a step,
        and each request's handler then answers (a stream with its last events and ``[DONE]``, a plain
        request with a 503). Waits up to ``timeout`` seconds for the jobs to end; returns how many it aborted."""
        jobs = [job for job in self.jobs if not job.done]
        for job in jobs:
            job.cancel(SHUTTING_DOWN)
        if jobs:
            log.warning("dsi serve: aborting %d request(s) still running at the end of the shutdown grace period",
                        len(jobs))
            await asyncio.wait([asyncio.ensure_future(job.wait_finished()) for job in jobs], timeout=timeout)
        return len(jobs)

    async def stop(self) -> None:
        """Cancel queued and running requests, wait for the slots, close every decoder."""
        self.closing = True
        if self._prepare_pool is not None:
            self._prepare_pool.shutdown(wait=False, cancel_futures=True)
        if self.scoring is not None:  # its forwards stop (their cancel flags), its threads end
            await asyncio.to_thread(self.scoring.close)
        if self.scheduler is None:
            return
        jobs = list(self.jobs)
        for job in jobs:
            job.cancel(SHUTTING_DOWN)
        if jobs:
            _, pending = await asyncio.wait([asyncio.ensure_future(j.wait_finished()) for j in jobs],
                                            timeout=self.config.shutdown_grace_s)
            if pending:
                log.warning("dsi serve: %d request(s) still running at shutdown", len(pending))
        await asyncio.to_thread(self.scheduler.close)
        log.info("dsi serve: all decoders closed")

    # ---- requests ----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closing or self.scheduler is None or self._prepare_pool is None:
            raise APIError(503, "the server is shutting down", type="server_error", code="unavailable")

    def _busy(self, what: str) -> APIError:
        return APIError(429, f"server busy: {what}; retry later", type="rate_limit_error", code="queue_full",
                        headers={"Retry-After": str(self.config.retry_after_s)})

    @contextlib.contextmanager
    def admitted(self) -> Iterator[None]:
        """Count a request from its body to the queue; 429 if ``max_queue + max_concurrent`` are already."""
        self._check_open()
        if self.preparing >= self.max_preparing:
            raise self._busy(f"{self.preparing} requests are being read and tokenised")
        self.preparing += 1
        self.metrics.preparing.set(self.preparing)
        try:
            yield
        finally:
            self.preparing -= 1
            self.metrics.preparing.set(self.preparing)

    async def prepare(self, step: Callable[[list[bytearray]], Any], body: list[bytearray]) -> Any:
        """Run ``step`` (a :class:`Preparer` method) on a preparation thread; a completion of token ids
        in a body of at most :data:`INLINE_PREPARE_BYTES` (what a dsi verifying or drafting on this
        server sends) is prepared here on the event loop instead: it needs no tokenizer, and parsing it
        costs less than the two thread hand-offs would. A body that parses but is nested too deep for
        what reads it next (a schema, tools, a message's tool-call arguments: Python's recursion limit) is
        a 400, as one too deep to parse is."""
        self._check_open()
        try:
            if step == self.preparer.completion and _token_id_completion(body[0]):
                return step(body)
            return await asyncio.get_running_loop().run_in_executor(self._prepare_pool, step, body)
        except RecursionError:
            raise APIError(400, "invalid JSON body: a value is nested too deep to process (Python's recursion "
                                "limit); nest it less deeply", code="invalid_json") from None

    def submit_choices(self, prepared: Prepared) -> list[Job]:
        """Queue one job per request of ``prepared``'s choices, every prompt's in a batch (all or none: 429 if
        the queue cannot take them all; 400 if the server could never hold them all: :func:`check_jobs`), each
        started at once; they run on free slots in parallel."""
        check_jobs(prepared.num_jobs, self.config, prepared.n, len(prepared.prompts))
        jobs: list[Job] = []
        try:
            for part in prepared.jobs():
                jobs.append(self.submit(part))
        except APIError:
            for job in jobs:
                job.cancel(HANDLER_CANCELLED)
            raise
        return jobs

    def submit(self, prepared: Prepared) -> Job:
        """Queue a prepared request (429 if the queue is full) and start it."""
        self._check_open()
        job = Job(prepared.request, self.codec, self.metrics, stop=prepared.stop, stream=prepared.stream,
                  scoring=prepared.scoring, pinned=prepared.seeded)
        try:
            job.start(self.scheduler)
        except QueueFull as exc:
            raise self._busy(str(exc)) from exc
        self.jobs.add(job)
        job.add_done_callback(self.jobs.discard)
        return job


def _dsi_info(outcome: Outcome) -> DSIInfo | None:
    s = outcome.stats
    if s is None:
        return None
    return DSIInfo(
        method=s.method, acceptance_rate=s.acceptance_rate, mean_accepted_length=s.mean_accepted_length,
        drafted_tokens=s.drafted_tokens, accepted_tokens=s.accepted_tokens, rejections=s.rejections,
        verify_tasks=s.verify_tasks, preempted_tasks=s.preempted_tasks,
        cancelled_tasks=s.cancelled_tasks, wasted_target_s=s.wasted_target_s,
        target_utilisation=s.target_utilisation, num_target_servers=s.num_target_servers,
        lookahead=None if s.method == "ar" else s.lookahead,
        mean_window=s.mean_window, auto=s.extra.get("auto"), load=s.extra.get("load"),
        queue_time_s=outcome.queue_time_s, time_to_first_token_s=s.time_to_first_token_s if outcome.tokens else None,
        wall_time_s=s.wall_time_s,
    )


def _usage(prompt_tokens: int, outcomes: list[Outcome]) -> Usage:
    """Usage of a request: its prompt once, the completion tokens of every choice."""
    completion = sum(o.completion_tokens for o in outcomes)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion)


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/tokenizer_info",
             "/version", "/health", "/metrics", "/openapi.json", "/docs")


def _endpoint(path: str) -> str:
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"  # one label for every id: a client cannot grow the metric's label set
    return path if path in ENDPOINTS else "other"


async def _watch_disconnect(request: Request, jobs: list[Job]) -> None:
    """Cancel ``jobs`` (a request's choices) as soon as the client closes the connection."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            for job in jobs:
                job.cancel(CLIENT_GONE)
            return


def _failure(outcome: Outcome, job: Job) -> APIError | None:
    """The error to answer for a job that did not finish normally (None if it did).

    A failed generation is answered with the error's type and the job's id only: its message
    may carry local paths (a model's name is often its directory); the server log has it all.
    """
    if outcome.finish_reason == "error":
        return APIError(500, f"generation failed ({type(outcome.error).__name__}); the server log has the details "
                             f"under job {job.id}", type="server_error", code="generation_failed")
    if outcome.finish_reason == "cancelled":
        if job.cancel_reason == CLIENT_GONE:
            return APIError(499, "client closed the request", code="client_closed_request")
        return APIError(503, f"request cancelled: {job.cancel_reason or SHUTTING_DOWN}", type="server_error",
                        code="unavailable")
    return None


def create_app(
    target: LanguageModel,
    drafter: LanguageModel | None,
    config: ServeConfig,
    *,
    codec: Codec | None = None,
    free_unused_drafter: bool = False,
    scoring_socket: socket.socket | None = None,
) -> FastAPI:
    """An app serving ``target`` (with ``drafter`` unless ``method='ar'``) as ``config.model_name``.

    ``codec`` (tokenise / detokenise / chat template / EOS / context) defaults to the target's
    Hugging Face tokenizer (:class:`HFCodec`). With ``method="auto"`` every slot runs the method it
    picked; when that is non-SI the app lets go of the drafter, and ``free_unused_drafter`` frees its
    weights too (:func:`dsi.models.loading.release`: for a caller that hands the drafter over).
    ``scoring_socket`` (a listening socket, :func:`dsi.server.scoring.bind`): serve the scoring channel
    on it, the fast path of a dsi verifying here (:mod:`dsi.models.engines.scoring_channel`); the model card
    advertises its port.
    """
    state = ServerState(target, drafter, config, codec if codec is not None else HFCodec(target), free_unused_drafter,
                        scoring_socket)
    metrics = state.metrics

    def decode_one(token: int) -> str:
        """One token's text, as logprobs name it."""
        return state.codec.decode([token])

    def token_namer(prepared: Prepared):
        """How a request's logprobs name tokens: by their text, or (vLLM's ``return_tokens_as_token_ids``)
        as ``token_id:{id}``, which a client without the tokenizer reads back exactly."""
        return token_id_name if prepared.token_ids_as_names else decode_one

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="dsi serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.dsi = state

    def count_path(path: str, status: int) -> None:
        metrics.requests.labels(_endpoint(path), str(status)).inc()

    def count(request: Request, status: int) -> None:
        count_path(request.url.path, status)

    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes,
                       on_reject=lambda scope, status: count_path(scope.get("path", ""), status))

    def error_response(request: Request, exc: APIError) -> JSONResponse:
        count(request, exc.status)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{exc.detail}: {request.method} {request.url.path}"
        return error_response(request, APIError(exc.status_code, message, code=code))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        reference = uuid.uuid4().hex[:12]
        log.error("unexpected error %s in %s", reference, request.url.path, exc_info=exc)
        return error_response(request, APIError(
            500, f"internal error ({type(exc).__name__}); the server log has the details under {reference}",
            type="server_error", code="internal_error"))

    def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise APIError(401, "missing or invalid API key: send the header 'Authorization: Bearer <key>'",
                           type="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    async def accept(request: Request, step: Callable[[list[bytearray]], Prepared]) -> tuple[Prepared, list[Job]]:
        """Authorise, read, parse, tokenise and check a generation request, then queue its choices."""
        authorize(request)
        check_json_content_type(request.headers.get("content-type"))
        with state.admitted():
            # the body goes in a list the preparation step empties: once parsed, nothing holds it
            body = [await read_body(request.receive, content_length(request.scope))]
            prepared = await state.prepare(step, body)
            return prepared, state.submit_choices(prepared)

    def choice_outcomes(prepared: Prepared, outcomes: list[Outcome]) -> list[Outcome]:
        """One outcome per choice, from one per job (a prompt's greedy choices share their one job's)."""
        return [outcomes[j] for j in prepared.choice_jobs()]

    async def finish_plain(request: Request, jobs: list[Job]) -> list[Outcome]:
        watcher = asyncio.create_task(_watch_disconnect(request, jobs))
        try:
            outcomes = []
            for job in jobs:
                outcome = await job.outcome()
                error = _failure(outcome, job)
                if error is not None:  # one failed choice fails the request: the others stop
                    raise error
                outcomes.append(outcome)
            return outcomes
        finally:
            watcher.cancel()
            for job in jobs:
                job.cancel(HANDLER_CANCELLED)  # no-op once the job is done

    def stream(request: Request, prepared: Prepared, jobs: list[Job], opening: Callable[[int], list[dict]],
               delta: Callable[[int, str, list | None], dict | None],
               finish: Callable[[int, Outcome, list[Outcome] | None], dict],
               closing: Callable[[list[Outcome]], list[dict]]) -> StreamingResponse:
        """Server-sent events: each choice's ``opening(i)``, a ``delta(i, text, logprob entries)`` chunk (None:
        nothing to send yet) per piece of stable text of choice i (the choices interleave as they run), ``finish(i, outcome,
        usage)`` as each ends (``usage``: every choice's outcome, on the last one, without
        include_usage), then with include_usage ``closing(outcomes)``; or the first error; then ``[DONE]``.
        A request cancelled by the server (shutdown) first ends each unfinished choice: its held-back
        text, then ``finish(i, ...)`` with ``finish_reason`` "abort"; then the error."""
        watcher = asyncio.create_task(_watch_disconnect(request, jobs))
        merged: asyncio.Queue = asyncio.Queue()

        async def forward(job: Job) -> None:
            async for item in job.deltas():
                await merged.put((job, *item))

        index = {job: i for i, job in enumerate(jobs)}
        owners = prepared.choice_jobs()  # choice -> its job's index (greedy: one job, every choice of its prompt)
        served = {j: [i for i, owner in enumerate(owners) if owner == j] for j in range(len(jobs))}

        def aborted(job: Job, outcome: Outcome, done: dict[int, Outcome]) -> Iterator[str]:
            """The last chunks of the choices not finished when ``job`` was cancelled (``done``: by job index)."""
            for i in range(prepared.choices):
                owner = jobs[owners[i]]
                if index[owner] in done:
                    continue
                if owner is job and (outcome.tail or outcome.tail_logprobs) and \
                        (piece := delta(i, outcome.tail, outcome.tail_logprobs)) is not None:
                    yield _sse(piece)
                ended = outcome if owner is job else Outcome(ABORTED, [])
                yield _sse(finish(i, replace(ended, finish_reason=ABORTED), None))

        async def events() -> AsyncIterator[str]:
            status, finished = 200, False
            pumps = [asyncio.create_task(forward(job)) for job in jobs]
            choices = range(prepared.choices)
            try:
                for i in choices:
                    for chunk in opening(i):
                        yield _sse(chunk)
                outcomes: dict[int, Outcome] = {}
                while len(outcomes) < len(jobs):
                    job, kind, payload = await merged.get()
                    mine = served[index[job]]
                    if kind == "text":
                        for i in mine:
                            if (piece := delta(i, *payload)) is not None:
                                yield _sse(piece)
                        continue
                    outcome: Outcome = payload
                    error = _failure(outcome, job)
                    if error is not None:
                        status = error.status
                        if outcome.finish_reason == "cancelled":  # cut short by the server: say so per choice
                            for event in aborted(job, outcome, outcomes):
                                yield event
                        yield _sse(error.body())
                        break
                    outcomes[index[job]] = outcome
                    every = (choice_outcomes(prepared, [outcomes[j] for j in range(len(jobs))])
                             if len(outcomes) == len(jobs) else None)
                    for i in mine:
                        if (outcome.tail or outcome.tail_logprobs) and \
                                (piece := delta(i, outcome.tail, outcome.tail_logprobs)) is not None:
                            yield _sse(piece)
                        # without include_usage, the usage rides on the last choice's final chunk
                        usage = every if every is not None and i == mine[-1] and not prepared.include_usage else None
                        yield _sse(finish(i, outcome, usage))
                else:
                    if prepared.include_usage:  # a last chunk of its own, with no choices (OpenAI's shape)
                        for chunk in closing(every):
                            yield _sse(chunk)
                finished = True
                yield _sse("[DONE]")
            except asyncio.CancelledError:
                status = 499
                raise
            finally:
                watcher.cancel()
                for pump in pumps:
                    pump.cancel()
                if not finished:  # the client went away mid-stream, or shutdown cancelled us
                    status = 499
                for job in jobs:
                    job.cancel(HANDLER_CANCELLED)  # no-op once done; stops the others after an error
                count(request, status)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ---- endpoints ---------------------------------------------------------------------------
    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        sched = state.scheduler
        servers = state.target_servers()
        # serving with fewer target servers than configured is "degraded"; with none, requests would fail
        ok = sched is not None and not state.closing and servers["in_service"] > 0
        status = 200 if ok else 503
        count(request, status)
        return JSONResponse({  # the served name and counts only: never a path or an engine's address (open)
            "status": ("degraded" if servers["in_service"] < servers["configured"] else "ok") if ok else "unavailable",
            "model": config.model_name, "method": running_method()["method"],
            "slots": len(sched.slots) if sched else 0, "running": sched.running if sched else 0,
            "queued": sched.queued if sched else 0, "preparing": state.preparing, "target_servers": servers,
        }, status_code=status)

    @app.get("/metrics")
    async def prometheus_metrics(request: Request) -> Response:
        count(request, 200)
        metrics.set_target_servers(state.target_servers())
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    def running_method() -> dict:
        """What the slots run: the configured method, or once ``method="auto"`` has chosen, its pick."""
        choice = state.choice
        if choice is None:  # non-SI drafts nothing: no lookahead (null, as in each response's dsi object)
            return {"method": config.method, "lookahead": None if config.method == "ar" else config.lookahead,
                    "num_target_servers": config.num_target_servers, "draft_tree": config.draft_tree or "off"}
        return {"method": choice.method, "lookahead": None if choice.method == "ar" else choice.lookahead,
                "num_target_servers": choice.num_target_servers if choice.method == "dsi" else 1,
                "draft_tree": choice.draft_tree or "off", "auto": {"picked": choice.label, "reason": choice.reason}}

    def model_card() -> ModelCard:
        return ModelCard(id=config.model_name, created=state.created, max_model_len=state.max_context, dsi={
            **running_method(), "transport": config.transport, "max_concurrent": config.max_concurrent,
            **({"target_servers": list(config.target_servers)} if config.target_servers else {}),
            **({"drafter_server": config.drafter_server} if config.drafter_server else {}),
            **({"scoring_port": state.scoring.port} if state.scoring is not None else {}),
            # speculation chosen by load: what each way measured at each load level so far
            **({"speculation_by_load": state.chooser.snapshot()} if state.chooser is not None else {}),
            **({"lookahead_by_load": state.lookahead_policy.snapshot()}
               if state.lookahead_policy is not None else {}),
            **({"synthetic": dict(zip(("scenario", "role"), config.synthetic, strict=True))}
               if config.synthetic else {}),
        })

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        authorize(request)
        card = model_card()
        count(request, 200)
        return JSONResponse(dump(ModelList(data=[card])))

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> JSONResponse:
        """One model card, as OpenAI's ``GET /v1/models/{model}`` (the openai client's ``models.retrieve``)."""
        authorize(request)
        if model_id != config.model_name:
            raise APIError(404, f"the model {model_id!r} does not exist; this server serves {config.model_name!r}",
                           param="model", code="model_not_found")
        count(request, 200)
        return JSONResponse(dump(model_card()))

    async def tokenizer_answer(request: Request, step: Callable[[list[bytearray]], dict]) -> JSONResponse:
        """vLLM's /tokenize and /detokenize: authorised, bounded and run like a generation request's preparation."""
        authorize(request)
        check_json_content_type(request.headers.get("content-type"))
        with state.admitted():
            body = [await read_body(request.receive, content_length(request.scope))]
            answer = await state.prepare(step, body)
        count(request, 200)
        return JSONResponse(answer)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        """vLLM's: ``{"prompt"}`` or ``{"messages"}`` -> ``{"count", "max_model_len", "tokens"}``."""
        return await tokenizer_answer(request, state.preparer.tokenize)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        """vLLM's: ``{"tokens"}`` -> ``{"prompt"}``."""
        return await tokenizer_answer(request, state.preparer.detokenize)

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> JSONResponse:
        """vLLM's: the tokenizer's configuration (eos_token, chat_template, ...: server/tokenizer_info.py), what
        lm-eval's remote tokenizer reads before it tokenises through /tokenize and /detokenize."""
        authorize(request)
        answer = codec_tokenizer_info(state.codec)
        count(request, 200)
        return JSONResponse(answer)

    openapi: dict[str, Any] = {}  # the document, made at the first ask (every route is registered by then)

    @app.get("/openapi.json")
    async def openapi_json(request: Request) -> JSONResponse:
        """This server's OpenAPI document (server/openapi.py). Open, as FastAPI's and vLLM's are."""
        if not openapi:
            openapi.update(openapi_document(app, Served(state.preparer.vocab_size, state.max_context,
                                                        config.max_logprobs, config.api_key is not None)))
        count(request, 200)
        return JSONResponse(openapi)

    @app.get("/docs")
    async def docs(request: Request) -> HTMLResponse:
        """Swagger UI over /openapi.json."""
        count(request, 200)
        return HTMLResponse(swagger_page(request.scope.get("root_path", "") + "/openapi.json"))

    @app.get("/version")
    async def version(request: Request) -> JSONResponse:
        """vLLM's ``{"version"}``: here dsi's version. Open, like /health (it tells nothing of the model)."""
        count(request, 200)
        return JSONResponse({"version": __version__})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        prepared, jobs = await accept(request, state.preparer.completion)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        n_prompt = prepared.prompt_tokens  # a batch's: every prompt's
        echoes = [prepared.prompt_of(i).echo for i in range(prepared.choices)]  # each choice's prompt's echo
        name = token_namer(prepared)
        # per choice, where the next token's text_offset starts: the echoed prompt, then its tokens' texts so far
        streamed = [len(echo) for echo in echoes]

        def choice(i: int, text: str, finish: str | None, entries: list | None = None,
                   echoed: list | None = None) -> CompletionChoice:
            logprobs = None
            if entries is not None:
                logprobs = completion_logprobs(entries, name, streamed[i], decode_one)
                streamed[i] += sum(len(decode_one(e.token)) for e in entries)
                if echoed is not None:  # echo with logprobs: the prompt's tokens come first, as in vLLM
                    prompt = prepared.prompt_of(i).request.prompt
                    logprobs = joined_logprobs(echo_logprobs(prompt, echoed, name, decode_one), logprobs)
            return CompletionChoice(index=i, text=text, finish_reason=finish, logprobs=logprobs)

        def response(choices: list[CompletionChoice], outcomes: list[Outcome] | None = None) -> dict:
            return dump(CompletionResponse(
                id=rid, created=created, model=config.model_name, choices=choices,
                usage=_usage(n_prompt, outcomes) if outcomes else None, dsi=_dsi_info(outcomes[0]) if outcomes else None,
            ))

        if prepared.stream:
            return stream(request, prepared, jobs,
                          lambda i: [response([choice(i, echoes[i], None)])] if echoes[i] else [],
                          lambda i, t, entries: response([choice(i, t, None, entries)]),
                          lambda i, outcome, usage: response([choice(i, "", outcome.finish_reason)], usage),
                          lambda outcomes: [response([], outcomes)])  # usage of all choices, dsi of choice 0
        outcomes = choice_outcomes(prepared, await finish_plain(request, jobs))
        count(request, 200)
        answer = response([choice(i, echoes[i] + o.text, o.finish_reason, o.logprobs, o.echo_logprobs)
                           for i, o in enumerate(outcomes)], outcomes)
        for i, o in enumerate(outcomes):  # each prompt's (n is 1 with prompt_logprobs)
            if o.prompt_logprobs is not None:
                answer["choices"][i]["prompt_logprobs"] = o.prompt_logprobs
        return JSONResponse(answer)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        prepared, jobs = await accept(request, state.preparer.chat)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        n_prompt = prepared.prompt_tokens
        name = token_namer(prepared)

        def chunk(i: int | None, delta: ChatDelta | None, finish: str | None, outcomes: list[Outcome] | None = None,
                  entries: list | None = None) -> dict:
            logprobs = None if entries is None else chat_logprobs(entries, name)
            choices = [] if delta is None else [ChatChunkChoice(index=i, delta=delta, finish_reason=finish,
                                                                logprobs=logprobs)]
            return dump(ChatCompletionChunk(
                id=rid, created=created, model=config.model_name, choices=choices,
                usage=_usage(n_prompt, outcomes) if outcomes else None,
                dsi=_dsi_info(outcomes[0]) if outcomes else None,
            ))

        calling = prepared.tool_calling

        def answer(outcome: Outcome) -> tuple[str | None, list[dict] | None, str]:
            """A choice's content, its tool calls, and its finish_reason ("tool_calls" once its calls parse)."""
            calls = None if calling is None else calling.calls(outcome.text)
            if calls is None:
                return outcome.text, None, outcome.finish_reason
            return None, calls, "tool_calls"

        def opening_delta() -> ChatDelta:
            if calling is None:
                return ChatDelta(role="assistant", content="")
            if calling.function is None:  # "required": the calls are known when the list is complete
                return ChatDelta(role="assistant")
            return ChatDelta(role="assistant", tool_calls=[{"index": 0, **calling.opening_call()}])

        def delta_chunk(i: int, text: str, entries: list | None) -> dict | None:
            if calling is None:
                return chunk(i, ChatDelta(content=text), None, entries=entries)
            if calling.function is not None:  # a named function's arguments stream as they come
                return chunk(i, ChatDelta(tool_calls=[{"index": 0, "function": {"arguments": text}}]), None,
                             entries=entries)
            return chunk(i, ChatDelta(), None, entries=entries) if entries else None

        def finish_chunk(i: int, outcome: Outcome, usage: list[Outcome] | None) -> dict:
            content, calls, reason = answer(outcome)
            if calling is None or calling.function is not None:
                return chunk(i, ChatDelta(), reason, usage)
            if calls is None:  # not a list of calls: the text, once
                return chunk(i, ChatDelta(content=content), reason, usage)
            return chunk(i, ChatDelta(tool_calls=[{"index": k, **c} for k, c in enumerate(calls)]), reason, usage)

        if prepared.stream:
            return stream(request, prepared, jobs, lambda i: [chunk(i, opening_delta(), None)], delta_chunk,
                          finish_chunk, lambda outcomes: [chunk(None, None, None, outcomes)])

        outcomes = choice_outcomes(prepared, await finish_plain(request, jobs))
        count(request, 200)
        choices = []
        for i, o in enumerate(outcomes):
            content, calls, reason = answer(o)
            choices.append(ChatChoice(index=i, message=AssistantMessage(content=content, tool_calls=calls),
                                      finish_reason=reason,
                                      logprobs=None if o.logprobs is None else chat_logprobs(o.logprobs, name)))
        return JSONResponse(dump(ChatCompletionResponse(
            id=rid, created=created, model=config.model_name, choices=choices,
            usage=_usage(n_prompt, outcomes), dsi=_dsi_info(outcomes[0]),
        )))

    return app


def _constrainer(target: Any):
    """A function binding a structured-output constraint to ``target``'s vocabulary (its table made at the first
    constrained request, :func:`dsi.constraints.bind`), or None where the target has no vocabulary to read one
    from."""
    if getattr(target, "token_table", None) is None and getattr(target, "tokenizer", None) is None:
        return None
    from dsi.constraints import bind

    return lambda constraint: bind(constraint, target)
