"""The OpenAPI document of ``dsi serve`` (``GET /openapi.json``) and its Swagger UI page (``GET /docs``).

Requests are parsed by hand from raw bodies (:mod:`~dsi.server.protocol`), so FastAPI's automatic
schema knows nothing of them; this module writes the document instead: one entry of
:data:`ROUTES` per route of the app, its request body the JSON schema of the pydantic model that
parses it (unknown fields refused: ``additionalProperties: false``), narrowed to what the served
model allows (token ids below its vocabulary, ``max_tokens`` within its context, logprobs within
``--max-logprobs``), the API key where one is set, and every error in OpenAI's shape
``{"error": {message, type, param, code}}``. Tests keep it true: every route of the app is in the
document and the other way round, examples the schemas accept are served, fields they leave out
are refused, and a schema-driven fuzzer (schemathesis) finds no 5xx.

Does not know: how a request is checked beyond its model (the preparation step), or the engine.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from dsi import __version__
from dsi.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)

log = logging.getLogger(__name__)

REF = "#/components/schemas/{model}"

ERROR_SCHEMA = {
    "type": "object", "required": ["error"], "additionalProperties": False,
    "description": "OpenAI's error object: every error of dsi serve has this shape.",
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"], "additionalProperties": False,
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}

ERRORS = {  # status -> when
    400: "invalid JSON, an unsupported option, a prompt beyond the context, a token id beyond the vocabulary",
    401: "missing or invalid API key (send 'Authorization: Bearer <key>')",
    404: "another model than the one served",
    413: "a body over --max-body-bytes",
    415: "a body that is not application/json",
    422: "a field of the wrong type or range",
    429: "the queue is full (Retry-After says when to retry)",
    500: "an internal error (its type and a reference to the server log; no traceback)",
    503: "the server is shutting down",
}
BODY_ERRORS = (400, 404, 413, 415, 422, 429, 500, 503)  # of a route with a JSON body


@dataclass(frozen=True)
class Route:
    """What the document says of one route."""

    summary: str
    body: tuple[type[BaseModel], ...] = ()  # the models that parse its JSON body (several: one of them)
    response: type[BaseModel] | dict | None = None  # its 200 answer: a model, a JSON schema, or None (any JSON)
    auth: bool = True  # behind the API key, where one is set
    stream: bool = False  # answers server-sent events with stream=true
    media_type: str = "application/json"  # of its 200 answer
    errors: tuple[int, ...] = ()


_TOKENIZE_RESPONSE = {"type": "object", "required": ["count", "max_model_len", "tokens"],
                      "properties": {"count": {"type": "integer"}, "max_model_len": {"type": ["integer", "null"]},
                                     "tokens": {"type": "array", "items": {"type": "integer"}}}}
_TOKENIZER_INFO = {"type": "object", "additionalProperties": True, "required": ["tokenizer_class"],
                   "description": "the tokenizer's configuration, as vLLM gives it (its tokenizer_config less paths)",
                   "properties": {name: {"type": "string"} for name in (
                       "tokenizer_class", "eos_token", "bos_token", "pad_token", "unk_token", "chat_template")}}

ROUTES: dict[tuple[str, str], Route] = {
    ("post", "/v1/completions"): Route(
        "OpenAI's completions: a prompt (text or token ids) or a batch of them; prompt k's choice i is choice "
        "k * n + i", (CompletionRequest,), CompletionResponse, stream=True, errors=BODY_ERRORS),
    ("post", "/v1/chat/completions"): Route(
        "OpenAI's chat completions (tools, structured output)", (ChatCompletionRequest,), ChatCompletionResponse,
        stream=True, errors=BODY_ERRORS),
    ("get", "/v1/models"): Route("OpenAI's model list: the one served model", response=ModelList),
    ("get", "/v1/models/{model_id}"): Route("OpenAI's model card of the served model", response=ModelCard,
                                            errors=(404,)),
    ("post", "/tokenize"): Route(
        "vLLM's: the token ids of a prompt, or (with messages) of a chat as its template renders it",
        (TokenizeCompletionRequest, TokenizeChatRequest), _TOKENIZE_RESPONSE, errors=BODY_ERRORS),
    ("post", "/detokenize"): Route("vLLM's: the text of token ids", (DetokenizeRequest,), {
        "type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}, errors=BODY_ERRORS),
    ("get", "/tokenizer_info"): Route("vLLM's: the tokenizer's special tokens and chat template (lm-eval's remote "
                                      "tokenizer reads it)", response=_TOKENIZER_INFO),
    ("get", "/version"): Route("vLLM's: dsi's version", response={
        "type": "object", "required": ["version"], "properties": {"version": {"type": "string"}}}, auth=False),
    ("get", "/health"): Route("Whether the server serves ('ok'; 'degraded': fewer target servers in service than "
                              "configured; 503 'unavailable': starting, shutting down, or none in service), its slots, "
                              "queue and target servers", response={"type": "object"}, auth=False, errors=(503,)),
    ("get", "/metrics"): Route("Prometheus metrics", response={"type": "string"}, auth=False,
                               media_type="text/plain"),
    ("get", "/openapi.json"): Route("This document", response={"type": "object"}, auth=False),
    ("get", "/docs"): Route("Swagger UI over this document", response={"type": "string"}, auth=False,
                            media_type="text/html"),
}


def route_keys(app: Any) -> set[tuple[str, str]]:
    """``(method, path)`` of every route of ``app``, paths as OpenAPI writes them (``{id:path}`` -> ``{id}``)."""
    keys = set()
    for route in app.routes:
        methods = getattr(route, "methods", None) or ()
        for method in methods:
            if method != "HEAD":
                keys.add((method.lower(), re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path)))
    return keys


@dataclass(frozen=True)
class Served:
    """What the served model allows, to narrow the schemas: ids below ``vocab_size``, ``max_tokens`` below
    ``max_context``, logprobs up to ``max_logprobs`` (-1: no cap)."""

    vocab_size: int
    max_context: int | None
    max_logprobs: int
    api_key: bool


def document(app: Any, served: Served) -> dict[str, Any]:
    """The OpenAPI 3.1 document of ``app``'s routes (one not in :data:`ROUTES` gets a bare entry, and a warning)."""
    models = sorted({m for r in ROUTES.values() for m in r.body} |
                    {r.response for r in ROUTES.values() if isinstance(r.response, type)}, key=lambda m: m.__name__)
    _, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF)
    schemas = defs.get("$defs", {})
    for name in ("CompletionRequest", "ChatCompletionRequest", "TokenizeCompletionRequest", "TokenizeChatRequest",
                 "DetokenizeRequest"):
        _narrow(name, schemas[name], served)
    schemas["Error"] = ERROR_SCHEMA
    paths: dict[str, dict[str, Any]] = {}
    for method, path in sorted(route_keys(app)):
        route = ROUTES.get((method, path))
        if route is None:
            log.warning("dsi serve: the route %s %s has no entry in dsi.server.openapi.ROUTES", method.upper(), path)
            route = Route(f"{method.upper()} {path}")
        paths.setdefault(path, {})[method] = _operation(method, path, route, served)
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "dsi serve", "version": __version__,
                 "description": "OpenAI-compatible completions and chat over Distributed Speculative Inference "
                                "(lossless), with vLLM's tokenizer routes. Unknown fields are refused (400), not "
                                "ignored, and types are strict: integers are written without a fraction (2, not "
                                "2.0), booleans are true or false, never strings or numbers."},
        "paths": paths,
        "components": {"schemas": schemas},
    }
    if served.api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc


def _operation(method: str, path: str, route: Route, served: Served) -> dict[str, Any]:
    name = re.sub(r"\W+", "_", f"{method}{path}").strip("_")
    op: dict[str, Any] = {"summary": route.summary, "operationId": name}
    if path == "/v1/models/{model_id}":
        op["parameters"] = [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    if route.body:
        refs = [{"$ref": REF.format(model=m.__name__)} for m in route.body]
        op["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": refs[0] if len(refs) == 1 else {"anyOf": refs}}}}
    response = route.response
    schema = {"$ref": REF.format(model=response.__name__)} if isinstance(response, type) else response or {}
    content = {route.media_type: {"schema": schema}}
    if route.stream:
        content["text/event-stream"] = {"schema": {  # one event (OpenAPI 3.1: the schema of a stream's items)
            "type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}, "description": (
                "with stream=true, each event: 'data: {chunk}' (a chunk of the answer, each choice's index in it), "
                "an error object if the request fails midway, then 'data: [DONE]'")}}
    responses: dict[str, Any] = {"200": {"description": "OK", "content": content}}
    statuses = set(route.errors) | ({401} if route.auth and served.api_key else set())
    for status in sorted(statuses):
        responses[str(status)] = {"description": ERRORS[status], "content": {"application/json": {
            "schema": {"$ref": REF.format(model="Error")}}}}
    op["responses"] = responses
    if served.api_key:
        op["security"] = [{"bearer": []}] if route.auth else []
    return op


def _narrow(name: str, schema: dict[str, Any], served: Served) -> None:
    """Narrow a request schema to the served model (in place)."""
    props = schema.get("properties", {})
    ids = {"maximum": served.vocab_size - 1}
    for field in ("prompt", "tokens", "stop_token_ids"):
        if field in props:
            _bound(props[field], ids)
    if served.max_context is not None:
        for field in ("max_tokens", "max_completion_tokens"):
            if field in props:
                _bound(props[field], {"maximum": served.max_context - 1})
        if "prompt_logprobs_from" in props:
            _bound(props["prompt_logprobs_from"], {"maximum": served.max_context})
    if served.max_logprobs != -1:  # and prompt_logprobs=-1 (the whole vocabulary) is over the cap
        for field in ("logprobs", "top_logprobs", "prompt_logprobs"):
            if field in props:
                _bound(props[field], {"minimum": 0, "maximum": served.max_logprobs})


def _bound(schema: Any, limits: dict[str, int]) -> None:
    """Set ``limits`` on every integer schema within ``schema`` (through anyOf and array items)."""
    if not isinstance(schema, dict):
        return
    if schema.get("type") == "integer":
        schema.update(limits)
    for branch in schema.get("anyOf", ()):
        _bound(branch, limits)
    _bound(schema.get("items"), limits)


def swagger_page(openapi_url: str) -> str:
    """The Swagger UI page over ``openapi_url`` (its scripts come from a CDN, as FastAPI's page)."""
    from fastapi.openapi.docs import get_swagger_ui_html

    return get_swagger_ui_html(openapi_url=openapi_url, title="dsi serve - Swagger UI").body.decode()
