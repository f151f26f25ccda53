"""The engine's builder: :func:`build_decoder` for a concrete method (non-SI, SI or DSI), and
:func:`make_request` for a request's arguments.

Everything a caller passes is validated here, once, with errors that name the value and what
is allowed; the engines below assume valid input. ``method="auto"`` is not the engine's: it
measures the engine's methods (:mod:`dsi.evaluate.autotune`) and is offered by the public entry
:func:`dsi.build_decoder` / :func:`dsi.generate` (:mod:`dsi.api`), which builds its pick here.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Protocol

from dsi.allocator import tune_allocator
from dsi.engine.ar import AutoregressiveDecoder
from dsi.engine.config import DEFAULT_TARGET_SERVERS, DecoderConfig, check_placement
from dsi.engine.dsi import DSIDecoder
from dsi.engine.request import Request, TokenCallback, check_request
from dsi.engine.result import GenerationResult
from dsi.engine.si import SpeculativeDecoder
from dsi.engine.trees import priced_shape
from dsi.errors import ConfigError, require
from dsi.models.base import LanguageModel
from dsi.models.determinism import set_deterministic
from dsi.models.vocab.bridge import VOCAB_MODES, bridge_drafter
from dsi.sampling import SamplingParams
from dsi.transport import make_pool
from dsi.trees import least_floor


class Decoder(Protocol):
    """What every decoder offers; one request at a time, calls from several threads serialised, closing
    once, usable as a context manager (the contract: :mod:`dsi.engine.lifecycle`)."""

    method: str

    def generate(
        self, request: Request, on_tokens: TokenCallback | None = None, abort: threading.Event | None = None
    ) -> GenerationResult: ...

    def __enter__(self) -> Decoder: ...

    def __exit__(self, *exc: object) -> None: ...

    def healthy(self) -> bool:
        """Whether the decoder can serve another request (after a failed one, a server rebuilds it
        only when not)."""
        ...

    def close(self) -> None: ...


def check_model(model: object, role: str) -> LanguageModel:
    if not (hasattr(model, "new_session") and hasattr(model, "vocab_size")):
        raise ConfigError(
            f"{role}={model!r} is not a language model (needs vocab_size and new_session(); "
            "wrap a next-token function in dsi.models.CallableLM)"
        )
    return model  # type: ignore[return-value]


def engine_placement(target: object, target_servers: object, num_target_servers: object, transport: object,
                     transport_options: dict | None) -> tuple[LanguageModel, int, str, dict]:
    """Where the target servers run: ``(target, num_target_servers, transport, transport_options)``.

    Without ``target_servers``: as given (``num_target_servers`` None means 2). With a list of engine
    URLs (vLLM or ``dsi serve``, :mod:`dsi.models.engines.target`): the target becomes an
    :class:`~dsi.models.engines.target.EngineTarget` over them (the local ``target`` is its reference: the
    vocabulary, the tokenizer and a canary check), and the servers are threads of this process, server
    i talking to URL ``i % len(urls)``; ``num_target_servers`` None means one per URL (more puts several
    requests on an engine at once)."""
    if target_servers is None:
        return (target, DEFAULT_TARGET_SERVERS if num_target_servers is None else num_target_servers,  # type: ignore[return-value]
                transport, dict(transport_options or {}))
    from dsi.models.engines.target import EngineTarget  # network code: imported on use

    require(transport == "threads", f"transport={transport!r}: with target_servers the engines are the target "
                                    "servers (threads of this process talk to them); leave transport as 'threads'")
    options = dict(transport_options or {})
    require("devices" not in options, "transport_options['devices'] cannot be set with target_servers "
                                      "(server i talks to target_servers[i % len(target_servers)])")
    if isinstance(target, EngineTarget):
        engines = target
        require(target_servers in (True, list(engines.urls), tuple(engines.urls)),
                f"target_servers={target_servers!r} differ from the EngineTarget's {list(engines.urls)}")
    else:
        require(target_servers is not True, "target_servers=True needs target= an EngineTarget")
        engines = EngineTarget(target_servers, reference=check_model(target, "target"))  # type: ignore[arg-type]
    options["devices"] = list(engines.urls)
    return engines, len(engines.urls) if num_target_servers is None else num_target_servers, "threads", options  # type: ignore[return-value]


def drafter_placement(drafter: object, drafter_server: object, method: str) -> LanguageModel | None:
    """Where the drafter runs: here (``drafter`` as given, without ``drafter_server``), or on the engine at
    ``drafter_server`` (vLLM or ``dsi serve``, :mod:`dsi.models.engines.drafter`): ``drafter`` becomes an
    :class:`~dsi.models.engines.drafter.EngineDrafter` whose reference it is."""
    if drafter_server is None:
        return drafter  # type: ignore[return-value]
    require(method != "ar", f"drafter_server={drafter_server!r} with method='ar': non-SI drafts nothing; drop it")
    from dsi.models.engines.drafter import drafter_engine  # network code: imported on use

    return drafter_engine(drafter, drafter_server)  # type: ignore[arg-type]


def bridge(target: object, drafter: object, vocab_mode: str, target_tokenizer: object = None,
           drafter_tokenizer: object = None, merges: int | str = "auto") -> LanguageModel:
    """The drafter as the engine sees it, over the target's ids (:mod:`dsi.models.vocab.bridge`; ``merges``:
    :mod:`dsi.models.vocab.merges`)."""
    require(vocab_mode in VOCAB_MODES, f"vocab_mode={vocab_mode!r} must be one of {', '.join(VOCAB_MODES)}")
    return bridge_drafter(check_model(target, "target"), check_model(drafter, "drafter"), vocab_mode,
                          target_tokenizer=target_tokenizer, drafter_tokenizer=drafter_tokenizer, merges=merges)


def build_decoder(*, target: LanguageModel, drafter: LanguageModel | None = None,
                  config: DecoderConfig | None = None, target_tokenizer: object = None,
                  drafter_tokenizer: object = None, **options: object) -> Decoder:
    """A decoder of ``config.method`` (``"dsi"``, ``"si"`` or ``"ar"``) that keeps its workers (threads,
    caches) across requests; ``close()`` it. ``config`` (a :class:`~dsi.engine.config.DecoderConfig`) with
    ``options`` (its fields as keyword arguments) applied; :func:`dsi.build_decoder` documents them and also
    offers ``method="auto"``."""
    config = DecoderConfig.of(config, options)
    if config.method == "auto":
        raise ConfigError("method='auto' is chosen above the engine (it measures the engine's methods): "
                          "use dsi.build_decoder or dsi.generate")
    method = config.method
    tune_allocator()  # vocabulary-sized laws on fresh heap pages cost as much as their arithmetic
    if config.deterministic is not None:
        set_deterministic([target, drafter], config.deterministic)
    drafter = drafter_placement(drafter, config.drafter_server, method)
    if drafter is not None and method != "ar":
        drafter = bridge(target, drafter, config.vocab_mode, target_tokenizer, drafter_tokenizer, config.merges)
    target, num_target_servers, transport, transport_options = engine_placement(
        target, config.target_servers, config.num_target_servers, config.transport, config.transport_options)
    check_placement(num_target_servers, transport)
    target = check_model(target, "target")
    if method == "ar":
        return AutoregressiveDecoder(target)
    if drafter is None:
        raise ConfigError(f"method={method!r} needs a drafter model")
    shape = priced_shape(config.tree_shape, target, drafter, transport, transport_options, least_floor(method))
    if method == "si":
        return SpeculativeDecoder(target, drafter, config.lookahead, shape)
    pool_options = dict(transport_options or {})
    return DSIDecoder(
        drafter, config.lookahead,
        lambda on_event: make_pool(transport, target, num_target_servers, on_event, **pool_options),
        max_window=config.max_window, target=target, liveness=pool_options.get("liveness"), draft_tree=shape,
    )


def make_request(
    prompt: Sequence[int],
    max_new_tokens: int,
    sampling: SamplingParams | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    vocab_size: int | None = None,
    logprobs: int | None = None,
    logprobs_mode: str = "raw",
) -> Request:
    """A :class:`~dsi.engine.request.Request` for a decoder's ``generate``, checked now as the decoder would
    check it (:func:`~dsi.engine.request.check_request`): :func:`dsi.generate`'s request arguments, and the
    target's ``vocab_size`` to check the ids against (None: the decoder checks them when it receives it).
    ``logprobs``: report each new token's log-probability and the ``logprobs`` most likely tokens of its row
    (None: no logprobs; 0: only the token's), in ``logprobs_mode`` (``"raw"`` or ``"processed"``:
    :mod:`dsi.logprobs`)."""
    request = Request(prompt, max_new_tokens, sampling, eos_token_id, logprobs, logprobs_mode)  # type: ignore[arg-type]
    return check_request(request, vocab_size)


def run_once(
    decoder: Decoder,
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    vocab_size: int,
    sampling: SamplingParams | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    on_tokens: TokenCallback | None = None,
    abort: threading.Event | None = None,
    logprobs: int | None = None,
    logprobs_mode: str = "raw",
) -> GenerationResult:
    """Run one request on ``decoder``, then close it (whatever happens)."""
    try:
        request = make_request(prompt, max_new_tokens, sampling, eos_token_id, vocab_size, logprobs, logprobs_mode)
        return decoder.generate(request, on_tokens, abort)
    finally:
        decoder.close()
