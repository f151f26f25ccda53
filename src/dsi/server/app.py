"""The FastAPI app of ``dsi serve``: OpenAI-compatible completions and chat over DSI decoders.

:func:`create_app` takes already-loaded models and a :class:`ServeConfig`; the app builds
``max_concurrent`` decoders at startup (lifespan) and closes them at shutdown, after cancelling
whatever is still queued or running. Endpoints: ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (both with server-sent-event streaming), ``GET /health``,
``GET /metrics`` (Prometheus). With an API key, the ``/v1`` endpoints need
``Authorization: Bearer <key>``; ``/health`` and ``/metrics`` stay open (bind to loopback or put
them behind your proxy).

Does not know: how models are loaded (the CLI does it) or how decoding works (the engine).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsi.engine.api import METHODS, build_decoder, check_lookahead, make_request
from dsi.errors import ConfigError, require
from dsi.models.base import LanguageModel
from dsi.sampling import SamplingParams
from dsi.server.codec import Codec, HFCodec
from dsi.server.jobs import Job, Outcome
from dsi.server.metrics import CONTENT_TYPE, ServerMetrics
from dsi.server.protocol import (
    MAX_SEED,
    APIError,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DSIInfo,
    ModelCard,
    ModelList,
    Usage,
    dump,
    parse_request,
    unsupported_option,
)
from dsi.server.scheduler import QueueFull, Scheduler, Slot

log = logging.getLogger(__name__)

CLIENT_GONE = "client disconnected"
SHUTTING_DOWN = "server shutting down"
HANDLER_CANCELLED = "request handler cancelled (shutdown timeout)"


@dataclass(frozen=True)
class ServeConfig:
    """Engine and server settings. Sampling fields are the defaults of requests that omit them."""

    method: str = "dsi"
    lookahead: int | str = 5  # k, or "auto" (DSI's event-driven windows)
    max_window: int | None = None  # with lookahead="auto": the most drafts per window
    num_target_servers: int = 1  # with method="auto": the most DSI may use
    auto_options: dict | None = None  # method="auto": options of dsi.autotune.choose_method
    transport: str = "threads"
    transport_options: dict | None = None
    max_concurrent: int = 1  # engine slots, each one decoder
    max_queue: int = 64  # requests waiting for a slot; more get 429
    api_key: str | None = None
    model_name: str = "dsi"
    max_tokens: int = 256  # default max_tokens (clipped to the context)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None  # None: a fresh random seed for each request that gives none
    retry_after_s: int = 1
    shutdown_grace_s: float = 5.0  # at shutdown, how long running requests may take to stop

    def __post_init__(self) -> None:
        def positive_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= 1

        require(self.method in METHODS, f"method={self.method!r} must be one of {', '.join(METHODS)}")
        check_lookahead(self.method, self.lookahead, self.max_window)
        require(positive_int(self.num_target_servers), f"num_target_servers={self.num_target_servers!r} must be >= 1")
        require(positive_int(self.max_concurrent), f"max_concurrent={self.max_concurrent!r} must be an integer >= 1")
        require(isinstance(self.max_queue, int) and self.max_queue >= 0,
                f"max_queue={self.max_queue!r} must be an integer >= 0")
        require(positive_int(self.max_tokens), f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        require(self.api_key is None or (isinstance(self.api_key, str) and self.api_key.strip() != ""),
                "api_key must be a non-empty string or None")
        require(bool(self.model_name), "model_name must not be empty")
        require(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed <= MAX_SEED),
                f"seed={self.seed!r} must be None or an integer in [0, 2**63 - 1]")
        SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)  # validates them
        require(positive_int(self.retry_after_s), f"retry_after_s={self.retry_after_s!r} must be an integer >= 1")


class ServerState:
    """Everything one app owns: slots, live jobs, metrics."""

    def __init__(self, target: LanguageModel, drafter: LanguageModel | None, config: ServeConfig, codec: Codec) -> None:
        if config.method != "ar" and drafter is None:
            raise ConfigError(f"method={config.method!r} needs a drafter model")
        self.target = target
        self.drafter = drafter
        self.config = config
        self.codec = codec
        self.metrics = ServerMetrics()
        self.scheduler: Scheduler | None = None
        self.jobs: set[Job] = set()
        self.closing = False
        self.created = int(time.time())

    def _new_decoder(self) -> Any:
        c = self.config
        return build_decoder(
            target=self.target, drafter=self.drafter, method=c.method, lookahead=c.lookahead, max_window=c.max_window,
            num_target_servers=c.num_target_servers, auto_options=c.auto_options, transport=c.transport, transport_options=c.transport_options,
        )

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
        self.metrics.slots.set(len(slots))
        log.info("dsi serve: %d engine slot(s) ready (%s)", len(slots), self.config.method)

    def drain(self) -> None:
        """Shutdown has begun: refuse new requests (503) and answer the queued ones 503 now."""
        self.closing = True
        for job in list(self.jobs):
            if job.queued:
                job.cancel(SHUTTING_DOWN)

    async def stop(self) -> None:
        """Cancel queued and running requests, wait for the slots, close every decoder."""
        self.closing = True
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
    def sampling(self, req: Any) -> SamplingParams:
        c = self.config
        top_k = c.top_k if req.top_k is None else max(0, req.top_k)
        seed = req.seed if req.seed is not None else (c.seed if c.seed is not None else secrets.randbits(63))
        try:
            return SamplingParams(
                temperature=c.temperature if req.temperature is None else float(req.temperature),
                top_k=top_k, top_p=c.top_p if req.top_p is None else float(req.top_p), seed=seed,
            )
        except ConfigError as exc:
            raise APIError(422, str(exc), code="invalid_value") from exc

    def submit(self, req: Any, prompt_ids: list[int], max_tokens: int | None, param: str) -> Job:
        """Validate the generation request, queue it (429 if the queue is full) and start it."""
        if self.closing or self.scheduler is None:
            raise APIError(503, "the server is shutting down", type="server_error", code="unavailable")
        n = len(prompt_ids)
        if n == 0:
            raise APIError(400, "the prompt has no tokens", param="prompt", code="empty_prompt")
        ctx = self.codec.max_context
        if max_tokens is None:
            max_tokens = self.config.max_tokens if ctx is None else min(self.config.max_tokens, ctx - n)
            if max_tokens < 1:
                raise APIError(400, f"the prompt of {n} tokens fills the model's context of {ctx} tokens",
                               param="prompt" if param == "prompt" else "messages", code="context_length_exceeded")
        elif ctx is not None and n + max_tokens > ctx:
            raise APIError(400, f"the prompt of {n} tokens + {param}={max_tokens} exceeds the model's context of "
                                f"{ctx} tokens; shorten the prompt or lower {param}",
                           param=param, code="context_length_exceeded")
        sampling = self.sampling(req)
        try:
            request = make_request(prompt_ids, max_tokens, sampling, self.codec.eos_token_ids or None,
                                   self.target.vocab_size)
        except ConfigError as exc:
            raise APIError(400, str(exc), param="prompt", code="invalid_prompt") from exc
        job = Job(request, self.codec, self.metrics, stop=req.stop_strings(), stream=req.stream)
        try:
            job.start(self.scheduler)
        except QueueFull as exc:
            raise APIError(429, f"server busy: {exc}; retry later", type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(self.config.retry_after_s)}) from exc
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
        target_utilisation=s.target_utilisation, num_target_servers=s.num_target_servers, lookahead=s.lookahead,
        mean_window=s.mean_window, auto=s.extra.get("auto"),
        queue_time_s=outcome.queue_time_s, time_to_first_token_s=s.time_to_first_token_s,
        wall_time_s=s.wall_time_s,
    )


def _usage(prompt_tokens: int, outcome: Outcome) -> Usage:
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=outcome.completion_tokens,
                 total_tokens=prompt_tokens + outcome.completion_tokens)


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def _endpoint(request: Request) -> str:
    path = request.url.path
    return path if path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics") else "other"


async def _watch_disconnect(request: Request, job: Job) -> None:
    """Cancel ``job`` as soon as the client closes the connection."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel(CLIENT_GONE)
            return


def _failure(outcome: Outcome, job: Job) -> APIError | None:
    """The error to answer for a job that did not finish normally (None if it did)."""
    if outcome.finish_reason == "error":
        return APIError(500, f"generation failed: {outcome.error}", type="server_error", code="generation_failed")
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
) -> FastAPI:
    """An app serving ``target`` (with ``drafter`` unless ``method='ar'``) as ``config.model_name``.

    ``codec`` (tokenise / detokenise / chat template / EOS / context) defaults to the target's
    Hugging Face tokenizer (:class:`HFCodec`).
    """
    state = ServerState(target, drafter, config, codec if codec is not None else HFCodec(target))
    metrics = state.metrics

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    app = FastAPI(title="dsi serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.dsi = state

    def count(request: Request, status: int) -> None:
        metrics.requests.labels(_endpoint(request), str(status)).inc()

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
        log.exception("unexpected error in %s", request.url.path)
        return error_response(request, APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                                                type="server_error", code="internal_error"))

    def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise APIError(401, "missing or invalid API key: send the header 'Authorization: Bearer <key>'",
                           type="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    def check_common(req: Any) -> None:
        error = unsupported_option(req)
        if error is not None:
            raise error
        if req.model is not None and req.model != config.model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves {config.model_name!r}",
                           param="model", code="model_not_found")

    def encode(fn: Callable[[Any], list[int]], arg: Any, param: str) -> list[int]:
        try:
            return fn(arg)
        except ConfigError as exc:
            raise APIError(400, str(exc), param=param) from exc

    async def finish_plain(request: Request, job: Job) -> Outcome:
        watcher = asyncio.create_task(_watch_disconnect(request, job))
        try:
            outcome = await job.outcome()
        finally:
            watcher.cancel()
            job.cancel(HANDLER_CANCELLED)  # no-op once the job is done
        error = _failure(outcome, job)
        if error is not None:
            raise error
        return outcome

    def stream(request: Request, job: Job, opening: list[dict], delta: Callable[[str], dict],
               closing: Callable[[Outcome], list[dict]]) -> StreamingResponse:
        watcher = asyncio.create_task(_watch_disconnect(request, job))

        async def events() -> AsyncIterator[str]:
            status, finished = 200, False
            try:
                for chunk in opening:
                    yield _sse(chunk)
                async for kind, payload in job.deltas():
                    if kind == "text":
                        yield _sse(delta(payload))
                        continue
                    outcome: Outcome = payload
                    finished = True
                    if outcome.tail:
                        yield _sse(delta(outcome.tail))
                    error = _failure(outcome, job)
                    if error is None:
                        for chunk in closing(outcome):
                            yield _sse(chunk)
                    else:
                        status = error.status
                        yield _sse(error.body())
                yield _sse("[DONE]")
            except asyncio.CancelledError:
                status = 499
                raise
            finally:
                watcher.cancel()
                if not finished:  # the client went away mid-stream, or shutdown cancelled us
                    status = 499
                    job.cancel(HANDLER_CANCELLED)
                count(request, status)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ---- endpoints ---------------------------------------------------------------------------
    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        sched = state.scheduler
        ok = sched is not None and not state.closing
        status = 200 if ok else 503
        count(request, status)
        return JSONResponse({
            "status": "ok" if ok else "unavailable", "model": config.model_name, "method": config.method,
            "slots": len(sched.slots) if sched else 0, "running": sched.running if sched else 0,
            "queued": sched.queued if sched else 0,
        }, status_code=status)

    @app.get("/metrics")
    async def prometheus_metrics(request: Request) -> Response:
        count(request, 200)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        authorize(request)
        card = ModelCard(id=config.model_name, created=state.created, max_model_len=state.codec.max_context, dsi={
            "method": config.method, "lookahead": config.lookahead, "num_target_servers": config.num_target_servers,
            "transport": config.transport, "max_concurrent": config.max_concurrent,
        })
        count(request, 200)
        return JSONResponse(dump(ModelList(data=[card])))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        authorize(request)
        req: CompletionRequest = parse_request(CompletionRequest, await request.body())
        check_common(req)
        prompt = req.single_prompt()
        if isinstance(prompt, str):
            ids, prompt_text = encode(state.codec.encode, prompt, "prompt"), prompt
        else:
            ids = list(prompt)
            prompt_text = state.codec.decode(ids) if req.echo else ""
        job = state.submit(req, ids, req.max_tokens, "max_tokens")
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        echo = prompt_text if req.echo else ""

        def response(text: str, finish: str | None, outcome: Outcome | None = None, usage: bool = False) -> dict:
            return dump(CompletionResponse(
                id=rid, created=created, model=config.model_name,
                choices=[CompletionChoice(text=text, finish_reason=finish)],
                usage=_usage(len(ids), outcome) if usage else None, dsi=_dsi_info(outcome) if usage else None,
            ))

        if req.stream:
            def closing(outcome: Outcome) -> list[dict]:
                if not req.include_usage():
                    return [response("", outcome.finish_reason, outcome, usage=True)]
                last = response("", None, outcome, usage=True)
                last["choices"] = []
                return [response("", outcome.finish_reason), last]

            return stream(request, job, [response(echo, None)] if echo else [], lambda t: response(t, None), closing)
        outcome = await finish_plain(request, job)
        count(request, 200)
        return JSONResponse(response(echo + outcome.text, outcome.finish_reason, outcome, usage=True))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        authorize(request)
        req: ChatCompletionRequest = parse_request(ChatCompletionRequest, await request.body())
        check_common(req)
        ids = encode(state.codec.encode_chat, req.template_messages(), "messages")
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        job = state.submit(req, ids, req.max_new_tokens(), param)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(delta: ChatDelta | None, finish: str | None, outcome: Outcome | None = None) -> dict:
            choices = [] if delta is None else [ChatChunkChoice(delta=delta, finish_reason=finish)]
            return dump(ChatCompletionChunk(
                id=rid, created=created, model=config.model_name, choices=choices,
                usage=_usage(len(ids), outcome) if outcome else None, dsi=_dsi_info(outcome) if outcome else None,
            ))

        if req.stream:
            def closing(outcome: Outcome) -> list[dict]:
                if not req.include_usage():
                    return [chunk(ChatDelta(), outcome.finish_reason, outcome)]
                return [chunk(ChatDelta(), outcome.finish_reason), chunk(None, None, outcome)]

            opening = [chunk(ChatDelta(role="assistant", content=""), None)]
            return stream(request, job, opening, lambda t: chunk(ChatDelta(content=t), None), closing)
        outcome = await finish_plain(request, job)
        count(request, 200)
        return JSONResponse(dump(ChatCompletionResponse(
            id=rid, created=created, model=config.model_name,
            choices=[ChatChoice(message=AssistantMessage(content=outcome.text), finish_reason=outcome.finish_reason)],
            usage=_usage(len(ids), outcome), dsi=_dsi_info(outcome),
        )))

    return app
