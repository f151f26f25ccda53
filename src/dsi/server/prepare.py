"""From a request body to a validated engine request: parse, check, tokenise. Off the event loop.

:class:`Preparer` runs on the server's preparation threads, so that parsing a large body and
tokenising a long prompt never stall ``/health`` or the streams of running requests. Every
check is made against the *target* (its vocabulary and its context; the drafter's limits are the
engine's business), cheapest first and before anything is decoded:

1. the JSON body against the OpenAI schema (400 / 422), unsupported options (400), the model name
   (404); parsing stops at once in a body with more numbers than a token-id prompt filling the
   context could have (400);
2. ``max_tokens`` against the context, before the prompt is looked at;
3. a token-id prompt: its length, then every id against the vocabulary (400), and only then is
   it decoded (for ``echo``); a text prompt or chat is tokenised within the room the context
   leaves (:func:`dsi.server.codec.encode_within` gives up early on a prompt far too long);
4. the exact prompt length with ``max_tokens`` (400 ``context_length_exceeded``), ``min_tokens``
   against ``max_tokens`` (400, as vLLM), sampling parameters (422).

The result, a :class:`Prepared`, holds only what the request needs afterwards: not the body,
nor the prompt text (unless it is echoed). vLLM's ``/tokenize`` and ``/detokenize`` are answered
here too (:meth:`Preparer.tokenize`, :meth:`Preparer.detokenize`), with the same checks: the
context bounds the work, and ids are checked against the vocabulary before anything decodes them.
Does not know: HTTP, the queue, the engine slots.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from dsi.constraints import Constraint
from dsi.engine.api import make_request
from dsi.engine.request import Request
from dsi.errors import ConfigError
from dsi.sampling import SamplingParams, choice_seed
from dsi.server.codec import Codec, PromptTooLong
from dsi.server.config import ServeConfig
from dsi.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    load_json,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_TOKEN_IDS,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TooManyNumbers,
    made_constraint,
    request_constraint,
    unsupported_option,
    validate_request,
)
from dsi.server.tools import ToolCalling, tool_calling


# numbers a body may hold besides its token ids: the options, a full logit_bias and stop_token_ids
MAX_OPTION_NUMBERS = 64 + MAX_LOGIT_BIAS_ENTRIES + MAX_STOP_TOKEN_IDS
# SamplingParams' logit processors a request may set (None: not sent)
_PROCESSING = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_p", "min_tokens",
               "stop_token_ids", "ignore_eos")


@dataclass(frozen=True)
class PromptScoring:
    """What a request asks of its prompt's own rows (one forward of the target over the prompt)."""

    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: top N per position (-1: every token); None: not asked
    first: int = 1  # the first position of prompt_logprobs computed (dsi's prompt_logprobs_from)
    echo_logprobs: int | None = None  # echo with logprobs: the top N of each echoed prompt token; None: not asked
    generate: bool = True  # False: max_tokens=0 with echo, the prompt is scored and nothing generated

    @property
    def from_position(self) -> int:
        """The first prompt position whose row the forward must give (echo needs every one)."""
        return 1 if self.echo_logprobs is not None else self.first


@dataclass(frozen=True)
class Prepared:
    """A request ready for the queue."""

    request: Request  # prompt ids, max_new_tokens, sampling, EOS ids
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    echo: str = ""  # the prompt text to echo (completions with echo=true)
    scoring: PromptScoring | None = None  # prompt_logprobs, echo with logprobs, max_tokens=0; None: none asked
    token_ids_as_names: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:{id}"
    n: int = 1  # choices: choice i samples with dsi.sampling.choice_seed(seed, i)
    tool_calling: ToolCalling | None = None  # the answer is tool calls (server/tools.py)
    # a sampled request given a seed (by the client or the server's --seed): it runs the configured way, never one
    # chosen by load, so the seed gives the same tokens whatever the load (dsi.server.load_choice)
    seeded: bool = False
    # a batch of prompts (completions): each prompt's own Prepared, the fields above being the first's
    batch: tuple[Prepared, ...] = ()

    def choice_requests(self) -> list[Request]:
        """The request of each choice of this prompt. Greedy choices are one request: its output is every choice's."""
        if self.n == 1 or self.request.sampling.greedy:
            return [self.request]
        sampling = self.request.sampling
        return [replace(self.request, sampling=replace(sampling, seed=choice_seed(sampling.seed, i)))
                for i in range(self.n)]

    @property
    def prompts(self) -> tuple[Prepared, ...]:
        """Each prompt's Prepared: a batch's, or this one."""
        return self.batch or (self,)

    @property
    def choices(self) -> int:
        """Choices answered: ``n`` per prompt; prompt k's choice i is choice ``k * n + i`` (vLLM's numbering)."""
        return len(self.prompts) * self.n

    def jobs(self) -> list[Prepared]:
        """What each job runs: every prompt's choice requests, in choice order."""
        return [replace(p, request=r) for p in self.prompts for r in p.choice_requests()]

    @property
    def num_jobs(self) -> int:
        """How many jobs :meth:`jobs` makes (at most the request's ``num_jobs``: greedy choices share one)."""
        return sum(len(p.choice_requests()) for p in self.prompts)

    def choice_jobs(self) -> list[int]:
        """For each choice, the index in :meth:`jobs` of the job that answers it."""
        owners: list[int] = []
        first = 0  # the index of this prompt's first job
        for p in self.prompts:
            runs = len(p.choice_requests())
            owners += [first + (i if runs > 1 else 0) for i in range(p.n)]
            first += runs
        return owners

    def prompt_of(self, choice: int) -> Prepared:
        """The Prepared of the prompt that ``choice`` answers."""
        return self.prompts[choice // self.n]

    @property
    def prompt_tokens(self) -> int:
        """The prompts' tokens (each prompt once, however many choices it has: vLLM's usage)."""
        return sum(len(p.request.prompt) for p in self.prompts)


def check_min_tokens(min_tokens: int | None, max_tokens: int, param: str, sent: bool = True) -> None:
    """400 naming both values if ``min_tokens`` asks for more tokens than ``max_tokens`` allows (vLLM
    refuses it too); ``sent``: whether the request gave ``param`` (else it is the server's default)."""
    if min_tokens is not None and min_tokens > max_tokens:
        given = f"{param}={max_tokens}" + ("" if sent else " (this server's default, clipped to the context)")
        raise APIError(400, f"min_tokens={min_tokens} must be <= {given}: lower min_tokens or raise {param}",
                       param="min_tokens", code="invalid_value")


def check_jobs(jobs: int, config: ServeConfig, n: int = 1, prompts: int = 1) -> None:
    """400 for a request that needs more ``jobs`` at once (generations: ``prompts`` x ``n`` choices, a
    prompt's greedy choices being one) than the server can ever hold: ``max_concurrent`` running plus
    ``max_queue`` waiting. Such a request could never be admitted, so a 429 would be retried forever."""
    limit = config.max_concurrent + config.max_queue
    if jobs <= limit:
        return
    asked = f"n={n}" if prompts == 1 else f"{prompts} prompts x n={n}"
    fewer = "lower n" if prompts == 1 else "send fewer prompts per request or lower n"
    raise APIError(400, f"{asked} needs {jobs} generations at once, more than this server can ever hold: "
                        f"max_concurrent + max_queue = {config.max_concurrent} + {config.max_queue} = {limit} "
                        f"(dsi serve --max-concurrent, --max-queue); {fewer}",
                   param="n" if n > 1 else "prompt", code="invalid_value")


class Preparer:
    """Checks requests against the served model: its name, the target's vocabulary and context, and
    the sampling options against what the drafter can serve exactly (``check_sampling``: e.g. a
    drafter of another vocabulary in string mode serves greedy requests only)."""

    def __init__(self, config: ServeConfig, codec: Codec, vocab_size: int, max_context: int | None,
                 check_sampling: Callable[[SamplingParams], None] | None = None,
                 constrain: Callable[[Any], Any] | None = None) -> None:
        self.check_sampling = check_sampling
        self.constrain = constrain  # a Constraint -> bound to the target's vocabulary (dsi.constraints.bind)
        self.config = config
        self.codec = codec
        self.vocab_size = vocab_size
        self.max_context = max_context
        # numbers a valid body may hold: a token-id prompt filling the context, and the options
        self._max_numbers = None if max_context is None else max_context + MAX_OPTION_NUMBERS
        # a completion's: a batch of such prompts, one for each job the server can hold at once
        self._max_completion_numbers = None if max_context is None else \
            max_context * (config.max_concurrent + config.max_queue) + MAX_OPTION_NUMBERS

    # ---- the two endpoints -------------------------------------------------------------------
    def completion(self, body: list[bytearray]) -> Prepared:
        """``body``: a one-item list holding the raw body; it is emptied, so the body is freed once parsed."""
        req: CompletionRequest = validate_request(CompletionRequest,
                                                  load_json(body.pop(), self._max_completion_numbers))
        self._check_common(req)
        room = self._room(req.max_tokens, "max_tokens")
        prompts = req.prompts()
        if (req.n or 1) == 1:  # a job per prompt: a batch the server could never hold is refused before tokenising
            check_jobs(len(prompts), self.config, 1, len(prompts))
        if len(prompts) == 1:
            return self._completion_prompt(req, prompts[0], room)
        parts = []
        for k, prompt in enumerate(prompts):  # a batch: each prompt as if sent alone
            try:
                parts.append(self._completion_prompt(req, prompt, room))
            except APIError as exc:
                if exc.param != "prompt" and exc.code != "context_length_exceeded":
                    raise  # about the request, not this prompt
                raise APIError(exc.status, f"prompt[{k}] of the batch: {exc.message}", type=exc.type, param=exc.param,
                               code=exc.code, headers=exc.headers) from None
        return replace(parts[0], batch=tuple(parts))

    def _completion_prompt(self, req: CompletionRequest, prompt: str | list[int], room: int | None) -> Prepared:
        """One prompt of a completion request, tokenised (a text) or checked (ids) within ``room``."""
        max_tokens, param = req.max_tokens, "max_tokens"
        if isinstance(prompt, str):
            ids = self._encode(self.codec.encode, prompt, room, max_tokens, param, "prompt")
            echo = prompt if req.echo else ""
        else:
            ids = self._check_ids(prompt, room, max_tokens, param)
            echo = self.codec.decode(ids) if req.echo else ""  # only valid ids reach the decoder
        # max_tokens=0 (echo only) scores the prompt: the request itself is made for one token, never generated
        prepared = self._prepared(req, ids, 1 if max_tokens == 0 else max_tokens, param, "prompt", echo)
        if req.prompt_logprobs is None and req.prompt_logprobs_from is not None:
            raise APIError(400, "prompt_logprobs_from needs prompt_logprobs", param="prompt_logprobs_from")
        echo_logprobs = req.logprobs if req.echo else None
        if req.prompt_logprobs is None and echo_logprobs is None and max_tokens != 0:
            return prepared
        asked = "prompt_logprobs" if req.prompt_logprobs is not None else "echo with logprobs"
        if prepared.n > 1 and (req.prompt_logprobs is not None or echo_logprobs is not None):
            raise APIError(400, f"{asked} with n > 1 is not supported: ask them with n = 1", param="n",
                           code="unsupported_parameter")
        if req.stream and echo_logprobs is not None:
            raise APIError(400, "echo with logprobs and stream=true is not supported: ask for the prompt's logprobs "
                                "without streaming", param="stream", code="unsupported_parameter")
        n = None if req.prompt_logprobs is None else self._check_prompt_logprobs(req, len(ids))
        return replace(prepared, scoring=PromptScoring(n, req.prompt_logprobs_from or 1, echo_logprobs,
                                                       generate=max_tokens != 0))

    def _check_prompt_logprobs(self, req: CompletionRequest, length: int) -> int:
        n, cap = req.prompt_logprobs, self.config.max_logprobs
        if cap != -1 and (n == -1 or n > cap):
            asked = "the whole vocabulary (-1)" if n == -1 else str(n)
            raise APIError(400, f"prompt_logprobs={n}: asked for {asked} per position, more than this server allows "
                                f"({cap}; start it with --max-logprobs -1 to allow the whole vocabulary)",
                           param="prompt_logprobs", code="invalid_value")
        if req.stream:
            raise APIError(400, "prompt_logprobs with stream=true is not supported", param="stream",
                           code="unsupported_parameter")
        if req.prompt_logprobs_from is not None and req.prompt_logprobs_from > length:
            raise APIError(400, f"prompt_logprobs_from={req.prompt_logprobs_from} is beyond the prompt of {length} "
                                f"tokens (allowed: 1..{length})", param="prompt_logprobs_from", code="invalid_value")
        return n

    def chat(self, body: list[bytearray]) -> Prepared:
        """Like :meth:`completion`, for a chat completion."""
        req: ChatCompletionRequest = validate_request(ChatCompletionRequest, load_json(body.pop(), self._max_numbers))
        self._check_common(req)
        max_tokens = req.max_new_tokens()
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        room = self._room(max_tokens, param)
        calling = tool_calling(req)  # checked before the prompt is tokenised
        tools = req.template_tools()
        ids = self._encode(lambda messages, limit: self.codec.encode_chat(messages, limit, tools=tools),
                           req.template_messages(), room, max_tokens, param, "messages")
        return self._prepared(req, ids, max_tokens, param, "messages", "", calling)

    # ---- vLLM's tokenizer endpoints ----------------------------------------------------------
    def tokenize(self, body: list[bytearray]) -> dict:
        """vLLM's ``/tokenize``: ``{"count", "max_model_len", "tokens"}`` of a prompt or (with ``messages``)
        a chat, tokenised as the generation endpoints tokenise them; longer than the context: 400."""
        value = load_json(body.pop(), self._max_numbers)
        chat = "messages" in value
        req = validate_request(TokenizeChatRequest if chat else TokenizeCompletionRequest, value)
        self._check_model(req.model)
        if req.return_token_strs:
            raise APIError(400, "return_token_strs is not supported: ask /detokenize for the text of the ids",
                           param="return_token_strs", code="unsupported_parameter")
        if chat and req.continue_final_message:
            raise APIError(400, "continue_final_message is not supported", param="continue_final_message",
                           code="unsupported_parameter")
        prompt_param = "messages" if chat else "prompt"
        limit = self.max_context
        try:
            if chat:
                ids = self.codec.encode_chat(req.template_messages(), limit,
                                             add_generation_prompt=req.add_generation_prompt,
                                             add_special_tokens=req.add_special_tokens, tools=req.template_tools())
            else:
                ids = self.codec.encode(req.prompt, limit, add_special_tokens=req.add_special_tokens)
        except PromptTooLong as exc:
            has = f"{exc.count} tokens" if exc.exact else f"at least {exc.count} tokens"
            raise APIError(400, f"the prompt of {has} exceeds the model's context of {limit} tokens (max_model_len)",
                           param=prompt_param, code="context_length_exceeded") from None
        except ConfigError as exc:
            raise APIError(400, str(exc), param=prompt_param) from exc
        return {"count": len(ids), "max_model_len": self.max_context, "tokens": ids}

    def detokenize(self, body: list[bytearray]) -> dict:
        """vLLM's ``/detokenize``: ``{"prompt"}``, the text of ``tokens`` (special tokens written out, as
        vLLM does). Every id is checked against the vocabulary first (400): none reaches the tokenizer."""
        try:
            req = validate_request(DetokenizeRequest, load_json(body.pop(), self._max_numbers))
        except TooManyNumbers:
            raise APIError(400, f"tokens: more ids than the model's context of {self.max_context} tokens",
                           param="tokens", code="context_length_exceeded") from None
        self._check_model(req.model)
        ids, ctx, vocab = req.tokens, self.max_context, self.vocab_size
        if ctx is not None and len(ids) > ctx:
            raise APIError(400, f"tokens: {len(ids)} ids, more than the model's context of {ctx} tokens",
                           param="tokens", code="context_length_exceeded")
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens[{bad}]={ids[bad]} is outside the vocabulary [0, {vocab})",
                           param="tokens", code="invalid_value")
        return {"prompt": self.codec.decode(ids, skip_special_tokens=False)}

    # ---- checks, cheapest first --------------------------------------------------------------
    def _check_common(self, req: Any) -> None:
        error = unsupported_option(req)
        if error is not None:
            raise error
        self._check_model(req.model)

    def _check_model(self, model: str | None) -> None:
        name = self.config.model_name
        if model is not None and model != name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {name!r}",
                           param="model", code="model_not_found")

    def _room(self, max_tokens: int | None, param: str) -> int | None:
        """The most prompt tokens the context leaves (None: no known context)."""
        ctx = self.max_context
        if ctx is None:
            return None
        if max_tokens is not None and max_tokens >= ctx:
            raise APIError(400, f"{param}={max_tokens} leaves no room for a prompt in the model's context of "
                                f"{ctx} tokens; lower {param}", param=param, code="context_length_exceeded")
        return ctx - (max_tokens or 1)

    def _too_long(self, count: int, exact: bool, max_tokens: int | None, param: str, prompt_param: str) -> APIError:
        ctx = self.max_context
        has = f"{count} tokens" if exact else f"at least {count} tokens"
        if max_tokens is None:
            return APIError(400, f"the prompt of {has} fills the model's context of {ctx} tokens",
                            param=prompt_param, code="context_length_exceeded")
        if count >= ctx:  # the prompt alone leaves no room: it is what to change, whatever max_tokens is
            return APIError(400, f"the prompt of {has} alone fills the model's context of {ctx} tokens "
                                 f"({param}={max_tokens} asked for more); shorten the prompt",
                            param=prompt_param, code="context_length_exceeded")
        return APIError(400, f"the prompt of {has} + {param}={max_tokens} exceeds the model's context of "
                             f"{ctx} tokens; shorten the prompt or lower {param}",
                        param=param, code="context_length_exceeded")

    def _encode(self, encode: Callable[..., list[int]], prompt: Any, room: int | None, max_tokens: int | None,
                param: str, prompt_param: str) -> list[int]:
        try:
            return encode(prompt, room)
        except PromptTooLong as exc:
            raise self._too_long(exc.count, exc.exact, max_tokens, param, prompt_param) from None
        except ConfigError as exc:
            raise APIError(400, str(exc), param=prompt_param) from exc

    def _check_ids(self, ids: list[int], room: int | None, max_tokens: int | None, param: str) -> list[int]:
        if room is not None and len(ids) > room:
            raise self._too_long(len(ids), True, max_tokens, param, "prompt")
        vocab = self.vocab_size
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"prompt[{bad}]={ids[bad]} is outside the vocabulary [0, {vocab})",
                           param="prompt", code="invalid_prompt")
        return ids

    def _constraint(self, req: Any, calling: ToolCalling | None) -> Any:
        """The request's structured-output constraint (``calling``: its tool calls'), bound to the target's
        vocabulary (compiled: a schema or grammar the library refuses is a 400 quoting it); None for plain text."""
        asked = request_constraint(req)
        if calling is not None:
            if asked is not None:
                raise APIError(400, f"tool_choice={req.tool_choice if isinstance(req.tool_choice, str) else 'a function'}"
                                    f" constrains the output to tool calls; it cannot be combined with {asked[1]}",
                               param=asked[1], code="invalid_value")
            asked = made_constraint("tools", Constraint.json_schema, calling.schema)
        if asked is None:
            return None
        constraint, param = asked
        if self.constrain is None:
            raise APIError(400, "this server cannot constrain its output: the target has no tokenizer",
                           param=param, code="unsupported_parameter")
        try:
            return self.constrain(constraint)
        except ConfigError as exc:
            raise APIError(400, str(exc), param=param, code="invalid_value") from exc

    def _sampling(self, req: Any, calling: ToolCalling | None) -> SamplingParams:
        c = self.config
        top_k = c.top_k if req.top_k is None else max(0, req.top_k)
        seed = req.seed if req.seed is not None else (c.seed if c.seed is not None else secrets.randbits(63))
        constraint = self._constraint(req, calling)
        try:
            processing = {name: getattr(req, name) for name in _PROCESSING if getattr(req, name) is not None}
            if constraint is not None:
                processing["constraint"] = constraint
            params = SamplingParams(
                temperature=c.temperature if req.temperature is None else float(req.temperature),
                top_k=top_k, top_p=c.top_p if req.top_p is None else float(req.top_p), seed=seed, **processing,
            )
            if self.check_sampling is not None:
                self.check_sampling(params)
            return params
        except ConfigError as exc:
            param = next((name for name in _PROCESSING if str(exc).startswith(name)), None)
            raise APIError(422, str(exc), param=param, code="invalid_value") from exc

    def _logprobs(self, req: Any) -> int | None:
        """The top N of each generated token's logprobs (None: not asked), within ``--max-logprobs``."""
        if isinstance(req, CompletionRequest):
            n, param = req.logprobs, "logprobs"
        else:
            n, param = ((req.top_logprobs or 0) if req.logprobs else None), "top_logprobs"
        cap = self.config.max_logprobs
        if n is not None and cap != -1 and n > cap:
            raise APIError(400, f"{param}={n} is more than this server allows ({cap}; see --max-logprobs)",
                           param=param, code="invalid_value")
        if n is not None and n > self.vocab_size:  # --max-logprobs -1: the whole vocabulary at most
            raise APIError(400, f"{param}={n} is more than the vocabulary's {self.vocab_size} tokens",
                           param=param, code="invalid_value")
        return n

    def _prepared(self, req: Any, ids: list[int], max_tokens: int | None, param: str, prompt_param: str,
                  echo: str, calling: ToolCalling | None = None) -> Prepared:
        if not ids:
            raise APIError(400, "the prompt has no tokens", param=prompt_param, code="empty_prompt")
        ctx = self.max_context
        if max_tokens is None:  # the default, clipped to the room the prompt leaves
            max_tokens = self.config.max_tokens if ctx is None else min(self.config.max_tokens, ctx - len(ids))
            if max_tokens < 1:
                raise self._too_long(len(ids), True, None, param, prompt_param)
        elif ctx is not None and len(ids) + max_tokens > ctx:
            raise self._too_long(len(ids), True, max_tokens, param, prompt_param)
        # max_tokens=0 (echo, scoring the prompt) reaches here as 1: the request is made for one token
        generated = 0 if req.max_tokens == 0 else max_tokens
        check_min_tokens(req.min_tokens, generated, param, sent=getattr(req, param) is not None)
        sampling = self._sampling(req, calling)
        logprobs = self._logprobs(req)
        try:
            request = make_request(ids, max_tokens, sampling, self.codec.eos_token_ids or None, self.vocab_size,
                                   logprobs, self.config.logprobs_mode)
        except ConfigError as exc:
            option = next((name for name in ("logit_bias", "stop_token_ids") if str(exc).startswith(name)), None)
            if option is not None:  # a token id outside the vocabulary
                raise APIError(400, str(exc), param=option, code="invalid_value") from exc
            raise APIError(400, str(exc), param=prompt_param, code="invalid_prompt") from exc
        seeded = not sampling.greedy and (req.seed is not None or self.config.seed is not None)
        return Prepared(request, stop=req.stop_strings(), stream=req.stream, include_usage=req.include_usage(),
                        echo=echo, token_ids_as_names=req.return_tokens_as_token_ids, n=req.n or 1,
                        tool_calling=calling, seeded=seeded)
