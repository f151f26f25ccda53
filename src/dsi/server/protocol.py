"""The OpenAI wire format of ``dsi serve``: request and response models (pydantic v2).

Requests are parsed from the raw body with :func:`parse_request` (:func:`load_json`, then
:func:`validate_request` in strict mode: ``"3"`` is not an integer, ``true`` is not a number)
and forbid unknown fields: an option we do not
implement is a 400 naming it, never a silent ignore. Options of the OpenAI API that we support
only at their default value (``best_of``, ``suffix``, ...) are declared and
checked by :func:`unsupported_option`; fields that do not change generation (``user``, and
``store`` / ``metadata`` of OpenAI's stored completions) are accepted and ignored. vLLM's
``/tokenize`` and ``/detokenize`` requests are here too. Responses follow the OpenAI objects and
add a ``dsi`` object with the run's speculation statistics.

Status codes: malformed JSON (or not UTF-8, or nested too deep) or an unsupported option -> 400;
a well-formed body whose fields have the wrong type or range (numbers that are not finite, more
than 16 stop strings or one over 1000 characters) -> 422; both name the field in ``error.param``.
A completion's ``prompt`` may be a batch (a list of strings or of token-id lists), as in OpenAI's
API: :attr:`_GenerationRequest.num_jobs` counts the generations a request may need.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_SEED = 2**63 - 1
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000  # text that could begin a stop string is held back and searched at each token
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_STOP_TOKEN_IDS = 64
MAX_CHOICES = 16  # n: each choice is a generation of its own
MAX_TOOLS = 128  # OpenAI's limit
MAX_METADATA_ENTRIES, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's limits


class APIError(Exception):
    """An error answered in the OpenAI format ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - the OpenAI field name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ---- requests ------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    """OpenAI's ``response_format.json_schema``."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    json_schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs``: one of these."""

    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _GenerationRequest(_Strict):
    """Fields shared by completions and chat completions. ``None`` means the server default."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)  # 0: completions with echo only (scores the prompt)
    temperature: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=-1)  # extension (vLLM): 0 or -1 disable it
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = Field(default=None, json_schema_extra={"anyOf": [  # what _check_stop allows
        {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
        {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
         "maxItems": MAX_STOP_STRINGS}, {"type": "null"}]})
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user identifier; it does not change generation
    # OpenAI's stored completions (some SDK integrations send them): accepted and ignored, nothing is stored
    store: bool | None = None
    metadata: dict[str, str] | None = Field(default=None, json_schema_extra={"anyOf": [{  # _check_metadata's limits
        "type": "object", "maxProperties": MAX_METADATA_ENTRIES, "propertyNames": {"maxLength": MAX_METADATA_KEY_CHARS},
        "additionalProperties": {"type": "string", "maxLength": MAX_METADATA_VALUE_CHARS}}, {"type": "null"}]})
    # logit processing (dsi.sampling.SamplingParams: exact under speculation)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None  # token id (as a string, JSON's keys) -> bias in [-100, 100]
    # vLLM's extensions
    repetition_penalty: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0, allow_inf_nan=False)
    min_tokens: int | None = Field(default=None, ge=0)
    stop_token_ids: list[int] | None = Field(default=None, json_schema_extra={"anyOf": [  # _check_stop_token_ids'
        {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": MAX_STOP_TOKEN_IDS},
        {"type": "null"}]})
    ignore_eos: bool | None = None
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:{id}", not their text
    # choices, each sampled independently; more than MAX_CHOICES is a 400 (unsupported_option)
    n: int | None = Field(default=None, ge=1, json_schema_extra={"anyOf": [
        {"type": "integer", "minimum": 1, "maximum": MAX_CHOICES}, {"type": "null"}]})
    # structured output (dsi.constraints; one of these at most): OpenAI's, vLLM's (and its older guided_*), llama.cpp's
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    grammar: str | None = None  # llama.cpp's: GBNF
    json_schema: dict | None = None  # llama.cpp's

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        return value

    @field_validator("metadata")
    @classmethod
    def _check_metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return value
        if len(value) > MAX_METADATA_ENTRIES:
            raise ValueError(f"at most {MAX_METADATA_ENTRIES} metadata entries are allowed, got {len(value)}")
        key = next((k for k in value if len(k) > MAX_METADATA_KEY_CHARS), None)
        if key is not None:
            raise ValueError(f"a metadata key may have at most {MAX_METADATA_KEY_CHARS} characters, got {len(key)}")
        long = next((v for v in value.values() if len(v) > MAX_METADATA_VALUE_CHARS), None)
        if long is not None:
            raise ValueError(f"a metadata value may have at most {MAX_METADATA_VALUE_CHARS} characters, "
                             f"got {len(long)}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is not None and len(value) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_ENTRIES} logit_bias entries are allowed, got {len(value)}")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_token_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and len(value) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got {len(value)}")
        if value is not None and any(t < 0 for t in value):
            raise ValueError(f"stop_token_ids must be token ids (integers >= 0), got {min(value)}")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def batch_size(self) -> int:
        """How many prompts the request holds (a chat: one)."""
        return 1

    @property
    def num_jobs(self) -> int:
        """The most generations the request can need at once: each prompt's ``n`` choices (a prompt's greedy
        choices share one run, so it may need fewer). The one count that limits on queued work compare."""
        return self.batch_size() * (self.n or 1)


class CompletionRequest(_GenerationRequest):
    # a string, token ids, or a batch (strings, or token-id lists): checked by _check_prompt, described here
    prompt: str | list = Field(json_schema_extra={"anyOf": [
        {"type": "string"}, {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
        {"type": "array", "items": {"type": "string"}, "minItems": 1},
        {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
         "minItems": 1}]})
    echo: bool = False
    best_of: int | None = Field(default=None, json_schema_extra={"anyOf": [{"const": 1}, {"type": "null"}]})  # 1 only
    logprobs: int | None = Field(default=None, ge=0)  # the top N per generated token (capped by --max-logprobs)
    suffix: str | None = Field(default=None, json_schema_extra={"anyOf": [{"type": "null"}]})  # not supported
    # vLLM's extension: the top N log-probabilities at every prompt position (-1: the whole vocabulary)
    prompt_logprobs: int | None = Field(default=None, ge=-1)
    # dsi's extension: the first position whose prompt logprobs are wanted (earlier ones are null);
    # a dsi client verifying on this server asks only for its window's rows, and the slot's cache
    # holds the rest
    prompt_logprobs_from: int | None = Field(default=None, ge=1)

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: str | list) -> str | list:
        if isinstance(value, str) or not value:  # an empty prompt is a 400 (empty_prompt) once tokenised
            return value
        if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return value
        if all(isinstance(p, str) for p in value):
            return value
        if all(isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in value):
            return value
        raise ValueError("prompt must be a string, a list of token ids, or a batch: a list of strings or of token-id "
                         "lists")

    def batch_size(self) -> int:
        """How many prompts the request holds (a list of strings or of id lists is a batch)."""
        return len(self.prompts())

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each text or token ids: one, or a batch's (a batch of one is unwrapped)."""
        if isinstance(self.prompt, str) or not self.prompt or not isinstance(self.prompt[0], str | list):
            return [self.prompt]
        return list(self.prompt)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    """A call an assistant made earlier in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


_HAS_CONTENT = {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}}


class ChatMessage(_Strict):
    # what _check_roles checks, for the OpenAPI document: a tool's answer names its call, tool calls are an
    # assistant's, and a message has content unless it is an assistant's with tool calls
    model_config = ConfigDict(json_schema_extra={"allOf": [
        {"if": {"properties": {"role": {"const": "tool"}}}, "then": {"required": ["tool_call_id"], "properties": {
            "tool_call_id": {"type": "string"}}}},
        {"if": {"properties": {"role": {"const": "assistant"}}},
         "then": {"anyOf": [_HAS_CONTENT, {"required": ["tool_calls"], "properties": {
             "tool_calls": {"type": "array", "minItems": 1}}}]},
         "else": {**_HAS_CONTENT, "properties": {**_HAS_CONTENT["properties"], "tool_calls": {"type": "null"}}}}]})

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None: an assistant's message of tool calls only
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool's answer: the call it answers

    @model_validator(mode="after")
    def _check_roles(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls belong to assistant messages, not {self.role} ones")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)

    def template_message(self) -> dict[str, Any]:
        """The message as chat templates read it: an earlier call's arguments as an object where they parse
        (templates write them with ``tojson``), as vLLM gives them."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": _parsed(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _parsed(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):  # not JSON, a number of over 4300 digits, nested too deep: the text
        return arguments


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments (None: no arguments)
    strict: bool | None = None


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class _Chat:
    """What a chat template reads of a request with ``messages`` and ``tools``."""

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_message() for m in self.messages]

    def template_tools(self) -> list[dict] | None:
        """The tools as chat templates read them (None: no tools)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None


class ChatCompletionRequest(_Chat, _GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0)
    # tool calls (server/tools.py): "required" or a named function constrain the output to a call
    tools: list[ChatTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeCompletionRequest(_Strict):
    """vLLM's ``POST /tokenize`` of a text prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # as /v1/completions tokenises a prompt (the tokenizer's BOS...)
    return_token_strs: bool = Field(default=False, json_schema_extra={"const": False})  # vLLM's; only false


class TokenizeChatRequest(_Chat, _Strict):
    """vLLM's ``POST /tokenize`` of a chat: the chat template applied to ``messages``."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True  # as /v1/chat/completions renders it
    continue_final_message: bool = Field(default=False, json_schema_extra={"const": False})  # vLLM's; only false
    add_special_tokens: bool = False  # on top of the template's own (vLLM's default: none)
    return_token_strs: bool = Field(default=False, json_schema_extra={"const": False})
    tools: list[ChatTool] | None = Field(default=None, max_length=MAX_TOOLS)  # rendered by the template


class DetokenizeRequest(_Strict):
    """vLLM's ``POST /detokenize``: the text of token ids."""

    model: str | None = None
    tokens: list[int]


def _param(loc: tuple) -> str | None:
    """A dotted field path from a pydantic error location, without union-member tags."""
    parts = []
    for item in loc:
        if isinstance(item, int):
            parts.append(str(item))
        elif isinstance(item, str) and "[" not in item and item not in ("str", "int", "float", "bool") \
                and not item[:1].isupper():
            parts.append(item)
    return ".".join(parts) or None


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # "\\uD800" to "\\uDFFF" in the JSON text
_SURROGATE = re.compile("[\ud800-\udfff]")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _has_surrogate(value: Any) -> bool:
    """Whether a string in ``value`` (a parsed body) holds a surrogate; a loop, not a recursion: a value
    nested as deep as the parser allows would exceed Python's recursion limit here."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and _SURROGATE.search(item) is not None:
                return True
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


class TooManyNumbers(APIError):
    """400: the body holds more numbers than ``max_numbers`` (a token-id prompt beyond the context)."""

    def __init__(self, limit: int) -> None:
        super().__init__(400, f"the body has more than {limit} numbers: a token-id prompt may not be longer than "
                              "the model's context", param="prompt", code="context_length_exceeded")


def _counting(convert: Any, limit: int, counter: list[int]) -> Any:
    def parse(text: str) -> Any:
        counter[0] += 1
        if counter[0] > limit:
            raise TooManyNumbers(limit)
        return convert(text)

    return parse


def load_json(body: bytes | bytearray, max_numbers: int | None = None) -> dict:
    """The JSON object of a body, or :class:`APIError` 400 (not UTF-8, not JSON, not an object).

    Standard JSON only: no ``NaN`` / ``Infinity``, no unpaired surrogate escapes (no tokenizer
    could take them), numbers of at most 4300 digits, nesting within Python's recursion limit.
    With ``max_numbers``, parsing stops (:class:`TooManyNumbers`) at the number after that many,
    so that a huge token-id list costs no more than a valid one. Memory: the body is decoded,
    then released if the caller holds no other reference to it, so at most two body-sized
    objects are alive at once for a text prompt (``pydantic``'s own JSON parser holds about four).
    """
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"invalid JSON body: not UTF-8 ({exc.reason} at byte {exc.start})",
                       code="invalid_json") from None
    del body
    try:
        numbers: dict[str, Any] = {}
        if max_numbers is not None:
            counter = [0]
            numbers = {"parse_int": _counting(int, max_numbers, counter),
                       "parse_float": _counting(float, max_numbers, counter)}
        value = json.loads(text, parse_constant=_no_constant, **numbers)
    except TooManyNumbers:
        raise
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, huge numbers, NaN; deep nesting
        raise APIError(400, f"invalid JSON body: {str(exc) or type(exc).__name__}", code="invalid_json") from None
    if not isinstance(value, dict):
        raise APIError(400, f"invalid JSON body: expected a JSON object, got {type(value).__name__}",
                       code="invalid_json")
    if _SURROGATE_ESCAPE.search(text) is not None and _has_surrogate(value):
        raise APIError(400, "invalid JSON body: a string has an unpaired surrogate (\\uD800-\\uDFFF)",
                       code="invalid_json")
    return value


def parse_request(model: type[_Strict], body: bytes | bytearray) -> Any:
    """Parse a JSON body into ``model``; raise :class:`APIError` (400 or 422) naming the field."""
    return validate_request(model, load_json(body))


def validate_request(model: type[_Strict], value: dict) -> Any:
    """``value`` (a parsed JSON object) as ``model``, strictly; :class:`APIError` 400 or 422 naming the field."""
    try:
        return model.model_validate(value, strict=True)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
    for err in errors:
        if err["type"] == "extra_forbidden":
            name = _param(err["loc"])
            raise APIError(400, f"unsupported parameter {name!r}: dsi serve does not implement it",
                           param=name, code="unsupported_parameter")
    first = _param(errors[0]["loc"])
    seen: dict[str | None, str] = {}
    for err in errors:
        seen.setdefault(_param(err["loc"]), err["msg"])
    message = "; ".join(f"{name}: {msg}" if name else msg for name, msg in list(seen.items())[:4])
    raise APIError(422, f"invalid request: {message}", param=first, code="invalid_value")


def unsupported_option(request: _GenerationRequest) -> APIError | None:
    """A 400 for an OpenAI option set to a value dsi serve does not implement, else None."""
    checks: list[tuple[str, bool, str]] = [
        ("n", request.n is not None and request.n > MAX_CHOICES, f"n={request.n}: at most {MAX_CHOICES} choices "
         "per request"),
        ("max_tokens", request.max_tokens == 0 and not getattr(request, "echo", False),
         "max_tokens=0 is allowed only with echo=true on /v1/completions (it scores the prompt and generates nothing)"),
    ]
    if isinstance(request, CompletionRequest):
        checks += [
            ("stream", request.max_tokens == 0 and request.stream, "max_tokens=0 (scoring the prompt) with stream=true "
             "is not supported"),
            ("best_of", request.best_of not in (None, 1), "best_of > 1 is not supported"),
            ("suffix", request.suffix is not None, "suffix (insertion) is not supported"),
        ]
    if isinstance(request, ChatCompletionRequest):
        checks += [
            ("top_logprobs", request.top_logprobs is not None and not request.logprobs,
             "top_logprobs needs logprobs: true"),
        ]
    for param, bad, message in checks:
        if bad:
            return APIError(400, message, param=param, code="unsupported_parameter")
    return None


# ---- responses -----------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class DSIInfo(BaseModel):
    """Speculation statistics of one request (the ``dsi`` object of every response)."""

    method: str
    acceptance_rate: float
    mean_accepted_length: float
    drafted_tokens: int
    accepted_tokens: int
    rejections: int
    verify_tasks: int
    preempted_tasks: int
    cancelled_tasks: int
    wasted_target_s: float
    target_utilisation: float
    num_target_servers: int
    lookahead: int | str | None  # k, or "auto" (event-driven windows); null for non-SI (it drafts nothing)
    mean_window: float  # drafts per verification window, on average
    auto: dict | None = None  # method="auto": what was picked and why
    load: dict | None = None  # speculation chosen by load: the way picked, the load it saw, and why
    queue_time_s: float
    time_to_first_token_s: float | None  # null: no token was generated (max_tokens=0 scores the prompt only)
    wall_time_s: float


class CompletionChoice(BaseModel):
    """A completion; with ``prompt_logprobs`` asked, the app adds vLLM's ``prompt_logprobs`` list to it
    (one entry per prompt position: null, or token id -> ``{logprob, rank, decoded_token}``), built
    as plain JSON because a whole-vocabulary row has one entry per token."""

    index: int = 0
    text: str
    logprobs: dict | None = None  # server/logprobs.completion_logprobs
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    dsi: DSIInfo | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None: the answer is tool calls
    tool_calls: list[dict] | None = None  # server/tools.py; left out when None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: dict | None = None  # server/logprobs.chat_logprobs
    finish_reason: str


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    dsi: DSIInfo | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict] | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: dict | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    dsi: DSIInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dsi"
    max_model_len: int | None = None
    dsi: dict[str, Any] = Field(default_factory=dict)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def dump(obj: BaseModel) -> dict:
    """JSON-ready dict of a response object; top-level ``usage`` / ``dsi`` left out when unset."""
    data = obj.model_dump(mode="json")
    for key in ("usage", "dsi"):
        if key in data and data[key] is None:
            del data[key]
    if isinstance(obj, ChatCompletionChunk):
        for choice in data["choices"]:
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    if isinstance(obj, ChatCompletionResponse):
        for choice in data["choices"]:
            if choice["message"]["tool_calls"] is None:
                del choice["message"]["tool_calls"]
    return data


def _grammar(text: str) -> Any:
    """A grammar field's text as a :class:`~dsi.constraints.Constraint`: GBNF (llama.cpp's, and the EBNF vLLM's
    xgrammar takes) where its rules are written ``name ::= ...``, else llguidance's Lark."""
    from dsi.constraints import Constraint

    return Constraint.grammar(text, syntax="gbnf" if "::=" in text else "lark")


def made_constraint(param: str, make: Any, *args: Any) -> tuple[Any, str]:
    """``make(*args)``, a constraint, and the field it came from; a 400 naming that field (and quoting the
    library) for one that does not parse."""
    from dsi.errors import ConfigError

    try:
        return make(*args), param
    except ConfigError as exc:
        raise APIError(400, str(exc), param=param, code="invalid_value") from exc


def request_constraint(request: _GenerationRequest) -> tuple[Any, str] | None:
    """The structured-output constraint a request asks for, and the field that asked (None: plain text); a 400 for
    two at once, for an incomplete one, or for one that does not parse (naming its field)."""
    from dsi.constraints import Constraint

    found: list[tuple[Any, str]] = []
    rf = request.response_format
    if rf is not None and rf.type == "json_object":
        found.append(made_constraint("response_format", Constraint.json_object))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.json_schema_ is None:
            raise APIError(400, "response_format {'type': 'json_schema'} needs json_schema.schema",
                           param="response_format", code="invalid_value")
        found.append(made_constraint("response_format", Constraint.json_schema, rf.json_schema.json_schema_))
    so = request.structured_outputs
    if so is not None:
        given = [(k, v) for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                     ("grammar", so.grammar), ("json_object", so.json_object or None))
                 if v is not None]
        if len(given) != 1:
            raise APIError(400, f"structured_outputs needs exactly one of json, regex, choice, grammar, json_object; "
                                f"got {[k for k, _ in given] or 'none'}", param="structured_outputs",
                           code="invalid_value")
        kind, value = given[0]
        make = {"json": Constraint.json_schema, "regex": Constraint.regex, "choice": Constraint.choice,
                "grammar": _grammar, "json_object": lambda _: Constraint.json_object()}[kind]
        found.append(made_constraint("structured_outputs", make, value))
    for name, make in (("guided_json", Constraint.json_schema), ("guided_regex", Constraint.regex),
                       ("guided_choice", Constraint.choice), ("guided_grammar", _grammar),
                       ("grammar", lambda g: Constraint.grammar(g, syntax="gbnf")),
                       ("json_schema", Constraint.json_schema)):
        value = getattr(request, name)
        if value is not None:
            found.append(made_constraint(name, make, value))
    if len(found) > 1:
        raise APIError(400, f"give one structured-output constraint, not {len(found)}: "
                            f"{', '.join(name for _, name in found)}", param=found[1][1], code="invalid_value")
    return found[0] if found else None
