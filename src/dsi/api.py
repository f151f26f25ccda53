"""The public entry points: :func:`generate` for one call, :func:`build_decoder` to keep workers.

This is the one place that knows ``method="auto"``: it asks :mod:`dsi.evaluate.autotune` which of
the engine's methods is fastest here (measured once, cached), then builds that decoder with the
engine's own builder (:func:`dsi.engine.api.build_decoder`). Every other method goes straight to
the engine's builder. So the layers stay one-way: ``dsi.api -> dsi.evaluate -> dsi.engine``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from dsi.engine import api as engine
from dsi.engine.api import Decoder, make_request  # noqa: F401 - make_request: public (dsi.make_request)
from dsi.engine.config import METHODS, DecoderConfig  # noqa: F401 - METHODS: the public list of methods
from dsi.engine.request import TokenCallback
from dsi.engine.result import GenerationResult
from dsi.models.base import LanguageModel
from dsi.models.determinism import set_deterministic
from dsi.sampling import SamplingParams



def build_decoder(*, target: LanguageModel, drafter: LanguageModel | None = None,
                  config: DecoderConfig | None = None, target_tokenizer: object = None,
                  drafter_tokenizer: object = None, **options: object) -> Decoder:
    """A decoder that keeps its workers (threads, caches) across requests; ``close()`` it (or use it in a
    ``with`` block).

    Its options are the fields of :class:`~dsi.engine.config.DecoderConfig`, given as keyword arguments
    (``method="dsi"``, ``lookahead=5``, ``num_target_servers``, ``transport``, ``transport_options``,
    ``max_window``, ``draft_tree``, ``vocab_mode``, ``merges``, ``deterministic``, ``target_servers``,
    ``drafter_server``, ``auto_options``) or as a ``config`` they then change; an unknown option is refused,
    naming the known ones. ``DecoderConfig`` documents each. ``target_tokenizer`` / ``drafter_tokenizer``:
    the tokenizers of a drafter of another vocabulary, where the models carry none."""
    config = DecoderConfig.of(config, options)
    if config.method != "auto":
        return engine.build_decoder(target=target, drafter=drafter, config=config,
                                    target_tokenizer=target_tokenizer, drafter_tokenizer=drafter_tokenizer)
    if config.deterministic is not None:  # before the choice measures (the engine's builder does it otherwise)
        set_deterministic([target, drafter], config.deterministic)
    target, num_target_servers, transport, transport_options = engine.engine_placement(
        target, config.target_servers, config.num_target_servers, config.transport, config.transport_options)
    drafter = engine.drafter_placement(drafter, config.drafter_server, config.method)
    if drafter is not None:
        drafter = engine.bridge(target, drafter, config.vocab_mode, target_tokenizer, drafter_tokenizer,
                                config.merges)
    engine.check_placement(num_target_servers, transport)
    from dsi.evaluate.autotune import build_auto_decoder  # measures with the engine: imported on use

    return build_auto_decoder(
        target=engine.check_model(target, "target"), drafter=drafter, transport=transport,
        transport_options=transport_options, num_target_servers=num_target_servers,
        tune_options=config.auto_options,
    )


def build_chosen_decoder(choice, *, target: LanguageModel, drafter: LanguageModel | None,
                         transport: str = "threads", transport_options: dict | None = None) -> Decoder:
    """The decoder of a choice ``method="auto"`` made before (a decoder's ``choice``), built without
    measuring or reading the cache again; a non-SI choice needs no drafter (None)."""
    from dsi.evaluate.autotune import decoder_for_choice

    return decoder_for_choice(choice, target=target, drafter=drafter, transport=transport,
                              transport_options=transport_options)


def generate(
    *,
    target: LanguageModel,
    drafter: LanguageModel | None = None,
    prompt: Sequence[int],
    max_new_tokens: int,
    sampling: SamplingParams | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    on_tokens: TokenCallback | None = None,
    abort: threading.Event | None = None,
    logprobs: int | None = None,
    logprobs_mode: str = "raw",
    config: DecoderConfig | None = None,
    target_tokenizer: object = None,
    drafter_tokenizer: object = None,
    **options: object,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens after ``prompt`` with non-SI, SI, DSI or ``"auto"``.

    Greedy output (``temperature=0``) is token for token the target's own greedy output;
    sampled output has exactly the target's distribution, and for a fixed seed it is the same
    for any number of target servers and any timing. ``on_tokens`` receives each committed
    token as it is committed (streaming). The decoder's options (``method``, ``lookahead``, ...) are
    :func:`build_decoder`'s, as keyword arguments or a ``config``.
    Workers are started for this call and stopped before it returns; use :func:`build_decoder`
    to keep them across calls. ``logprobs`` (N >= 0): the result's ``logprobs`` hold each new
    token's log-probability and the N most likely tokens of the row that decided it, the numbers
    non-SI reports (``logprobs_mode`` ``"raw"``, vLLM's default, or ``"processed"``: :mod:`dsi.logprobs`);
    ``on_tokens`` then also gets them.
    """
    decoder = build_decoder(target=target, drafter=drafter, config=config, target_tokenizer=target_tokenizer,
                            drafter_tokenizer=drafter_tokenizer, **options)
    return engine.run_once(decoder, prompt, max_new_tokens, vocab_size=target.vocab_size, sampling=sampling,
                           eos_token_id=eos_token_id, on_tokens=on_tokens, abort=abort, logprobs=logprobs,
                           logprobs_mode=logprobs_mode)
