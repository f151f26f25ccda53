"""``GET /openapi.json`` and ``GET /docs``, and the document kept true to the server's checks: the same routes
both ways, auth where the server asks for it, examples the schemas accept are served, fields they do not list
are refused, bodies generated from them pass the request models; then a bounded, derandomized schema-driven
fuzz (schemathesis, positive and negative data) that finds no 5xx and only documented, OpenAI-shaped errors.
On a scripted synthetic target with the tiny tokenizer (method 'ar'), served by uvicorn in a thread."""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

from tests.unit.server.conftest import TokenizerCodec, running_server, scripted_lm  # noqa: E402

pytestmark = pytest.mark.hf  # the tiny tokenizer needs transformers

KEY = "doc-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "scripted"
CONTEXT = 64
BODY_ROUTES = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest",
               "/detokenize": "DetokenizeRequest"}  # /tokenize: one of two (below)
FUZZ_EXAMPLES = 40  # per operation and per mode (positive, negative): about 900 requests


def make_app(tok, api_key=KEY):
    from dsi.server import ServeConfig, create_app

    target = scripted_lm(tok.encode("hello world"), len(tok), tok.eos_token_id)
    config = ServeConfig(method="ar", model_name=MODEL, api_key=api_key, max_tokens=4, max_concurrent=2,
                         max_queue=8, max_logprobs=5)
    return create_app(target, None, config, codec=TokenizerCodec(tok, max_context=CONTEXT))


@pytest.fixture(scope="module")
def served(tiny_tokenizer):
    app = make_app(tiny_tokenizer)
    with running_server(app) as running:
        yield running.url, app


@pytest.fixture(scope="module")
def doc(served):
    r = httpx.get(served[0] + "/openapi.json", timeout=30)  # open, as /health: no key
    assert r.status_code == 200, r.text
    return r.json()


def validator(doc, name):
    """A JSON-schema validator of the document's component ``name`` (its references resolved in the document)."""
    return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": doc["components"]})


def operations(doc):
    return {(method, path): op for path, item in doc["paths"].items() for method, op in item.items()}


def test_openapi_json_and_the_swagger_page_are_served(served, doc):
    url, _ = served
    assert doc["openapi"].startswith("3.1") and doc["info"]["title"] == "dsi serve"
    assert doc["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    page = httpx.get(url + "/docs", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "swagger-ui" in page.text and "/openapi.json" in page.text
    jsonschema.Draft202012Validator.check_schema({"$defs": doc["components"]["schemas"]})


def test_every_route_of_the_app_is_in_the_document_and_the_other_way_round(served, doc):
    from dsi.server.openapi import ROUTES, route_keys

    _, app = served
    assert set(operations(doc)) == route_keys(app) == set(ROUTES)
    for op in operations(doc).values():
        for status, answer in op["responses"].items():
            if status != "200":  # every error documented in OpenAI's shape
                assert answer["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}


def test_the_key_is_declared_exactly_where_the_server_asks_for_it(served, doc):
    url, _ = served
    for (method, path), op in operations(doc).items():
        r = httpx.request(method, url + path.replace("{model_id}", MODEL), json={} if method == "post" else None,
                          timeout=30)
        needs_key = op["security"] == [{"bearer": []}]
        assert (r.status_code == 401) == needs_key, (method, path, r.status_code)
        assert ("401" in op["responses"]) == needs_key
    from dsi.server.openapi import Served, document

    open_doc = document(served[1], Served(100, None, -1, api_key=False))  # a server without a key declares none
    assert "securitySchemes" not in open_doc["components"]
    assert all("security" not in op and "401" not in op["responses"] for op in operations(open_doc).values())


EXAMPLES = [  # each accepted by its schema and served (200)
    ("/v1/completions", {"model": MODEL, "prompt": ["ab", "cd"], "max_tokens": 3, "temperature": 0.7, "top_p": 0.9,
                         "top_k": 5, "seed": 1, "stop": ["\n"], "n": 2, "logprobs": 1, "echo": False,
                         "presence_penalty": 0.1, "frequency_penalty": 0.1, "repetition_penalty": 1.1,
                         "min_p": 0.05, "logit_bias": {"5": 1.0}, "user": "u", "store": False,
                         "metadata": {"k": "v"}, "stop_token_ids": [3], "ignore_eos": False, "best_of": 1,
                         "min_tokens": 1, "return_tokens_as_token_ids": True}),
    ("/v1/completions", {"prompt": [[1, 2], [3]], "max_tokens": 2, "stream": True,
                         "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 0, "echo": True, "logprobs": 1}),
    ("/v1/completions", {"prompt": "hello", "max_tokens": 1, "prompt_logprobs": 2, "prompt_logprobs_from": 1}),
    ("/v1/chat/completions", {"messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}],
        "max_completion_tokens": 3, "logprobs": True, "top_logprobs": 2, "n": 2, "temperature": 1.0, "seed": 3}),
    ("/tokenize", {"prompt": "hello", "add_special_tokens": False, "return_token_strs": False}),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True}),
    ("/detokenize", {"model": MODEL, "tokens": [1, 2, 3]}),
]


@pytest.mark.parametrize("path, body", EXAMPLES, ids=[f"{p}-{i}" for i, (p, _) in enumerate(EXAMPLES)])
def test_examples_the_schemas_accept_are_served(served, doc, path, body):
    url, _ = served
    schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    root = {**schema, "components": doc["components"]}
    jsonschema.Draft202012Validator(root).validate(body)
    r = httpx.post(url + path, json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text


def test_what_the_schemas_refuse_the_server_refuses_too(served, doc):
    url, _ = served
    refused = [  # (path, body): each outside its schema, and refused by the server with a 4xx
        ("/v1/completions", {"prompt": "x", "n": 17}), ("/v1/completions", {"prompt": "x", "best_of": 2}),
        ("/v1/completions", {"prompt": "x", "suffix": "y"}), ("/v1/completions", {"prompt": []}),
        ("/v1/completions", {"prompt": [[1], []]}), ("/v1/completions", {"prompt": [1, 10**6]}),
        ("/v1/completions", {"prompt": "x", "max_tokens": CONTEXT}),
        ("/v1/completions", {"prompt": "x", "logprobs": 6}),
        ("/v1/completions", {"prompt": "x", "stop": [str(i) for i in range(17)]}),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}),
        ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "tool_calls": []}]}),
        ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": []}]}),
        ("/tokenize", {"prompt": "x", "return_token_strs": True}), ("/detokenize", {"tokens": [10**6]}),
    ]
    for path, body in refused:
        schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert not jsonschema.Draft202012Validator({**schema, "components": doc["components"]}).is_valid(body), body
        r = httpx.post(url + path, json=body, headers=AUTH, timeout=30)
        assert 400 <= r.status_code < 500 and set(r.json()["error"]) == {"message", "type", "param", "code"}, body


def test_fields_the_schemas_do_not_list_are_refused_and_those_they_list_are_known(served, doc):
    from dsi.server import protocol

    url, _ = served
    schemas = doc["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest", "TokenizeCompletionRequest", "TokenizeChatRequest",
                 "DetokenizeRequest", "ChatMessage", "StreamOptions", "ResponseFormat", "StructuredOutputs",
                 "ChatTool", "FunctionDefinition", "ToolCall", "TextPart"):
        model = getattr(protocol, name)
        listed = set(schemas[name]["properties"])
        assert listed == {f.alias or key for key, f in model.model_fields.items()}, name
        assert schemas[name]["additionalProperties"] is False, name
    minimal = {"/v1/completions": {"prompt": "x", "max_tokens": 1}, "/v1/chat/completions": {
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}, "/tokenize": {"prompt": "x"},
        "/detokenize": {"tokens": [1]}}
    for path, body in minimal.items():
        r = httpx.post(url + path, json={**body, "frobnicate": 1}, headers=AUTH, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate", r.text
        assert r.json()["error"]["code"] == "unsupported_parameter"
    nested = {"messages": [{"role": "user", "content": "x", "mood": "calm"}]}
    r = httpx.post(url + "/v1/chat/completions", json=nested, headers=AUTH, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.mood", r.text


def _ints(value):
    """``value`` with integral floats as integers: JSON Schema's ``integer`` admits ``2.0``, the server (strict,
    as the document says) does not; that is the one difference between the two, and it is stated."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    if isinstance(value, dict):
        return {k: _ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_ints(v) for v in value]
    return value


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
def test_bodies_generated_from_the_schemas_pass_the_request_models(doc, path):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings

    from dsi.server import protocol
    from dsi.server.protocol import APIError, validate_request

    assert "integers are written without a fraction" in doc["info"]["description"]
    operation = schemathesis.openapi.from_dict(doc)[path]["POST"]

    @settings(max_examples=60, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy())
    def check(case):
        body = _ints(case.body)
        name = BODY_ROUTES.get(path) or ("TokenizeChatRequest" if "messages" in body else "TokenizeCompletionRequest")
        try:
            validate_request(getattr(protocol, name), json.loads(json.dumps(body)))
        except APIError as exc:
            raise AssertionError(f"{path}: the schema accepts {body!r}; the server: {exc.message}") from None

    check()


def test_a_schema_driven_fuzz_finds_no_5xx_and_only_documented_openai_errors(served, doc):
    """schemathesis over every operation, data that fits the schemas and data that does not (malformed types,
    missing and unknown fields): no 5xx, every status documented, every answer matches its schema (errors
    OpenAI-shaped). Derandomized and bounded: the same requests on every run."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode, checks

    url, _ = served
    schema = schemathesis.openapi.from_dict(doc)
    answered = set()
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if mode is GenerationMode.NEGATIVE and operation.method == "get" and "{" not in operation.path:
                continue  # nothing to make invalid: no parameters, no body

            @settings(max_examples=FUZZ_EXAMPLES, derandomize=True, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
            @given(case=operation.as_strategy(generation_mode=mode))
            def fuzz(case):
                response = case.call(base_url=url, headers=AUTH, timeout=60)
                answered.add(response.status_code)
                case.validate_response(response, checks=[
                    checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
                    checks.response_schema_conformance])
                if response.status_code >= 400:
                    error = response.json()["error"]
                    assert set(error) == {"message", "type", "param", "code"} and error["message"]

            fuzz()
    assert {200, 400, 422} <= answered and max(answered) < 500
    r = httpx.get(url + "/health", timeout=10)
    assert r.status_code == 200 and r.json()["running"] == 0
