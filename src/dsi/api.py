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
from dsi.engine.api import Decoder
from dsi.engine.request import TokenCallback
from dsi.engine.result import GenerationResult
from dsi.errors import ConfigError, require
from dsi.models.base import LanguageModel
from dsi.models.determinism import set_deterministic
from dsi.sampling import SamplingParams

METHODS = ("auto", *engine.ENGINE_METHODS)  # "auto": the fastest of the engine's methods here


def build_decoder(
    *,
    target: LanguageModel,
    drafter: LanguageModel | None = None,
    method: str = "dsi",
    lookahead: int | str = 5,
    num_target_servers: int | None = None,
    transport: str = "threads",
    transport_options: dict | None = None,
    max_window: int | None = None,
    auto_options: dict | None = None,
    vocab_mode: str = "auto",
    target_tokenizer: object = None,
    drafter_tokenizer: object = None,
    deterministic: bool | None = None,
    target_servers: object = None,
    draft_tree: object = None,
    drafter_server: str | None = None,
    merges: int | str = "auto",
) -> Decoder:
    """A decoder that keeps its workers (threads, caches) across requests; ``close()`` it.

    ``deterministic``: None keeps the models' own mode (llama.cpp: on, hf: off); True or False switches
    both models (they keep the setting; :mod:`dsi.models.determinism`). In the mode every token is
    computed in a forward of its own, so greedy SI and DSI equal non-SI bit for bit and a seed gives
    the same tokens whatever ran before; a model that has no such mode is refused.

    ``method="auto"`` measures non-SI, SI and DSI on this placement (once; the choice is cached)
    and builds the fastest; ``num_target_servers`` is then the most DSI may use, and
    ``auto_options`` go to :func:`dsi.evaluate.autotune.choose_method` (``cache_dir``, ``refresh``,
    ``tokens``, ``prompt``). The decoder's ``choice`` says what was picked and why; once chosen it
    is exactly the decoder that method builds by hand.

    ``lookahead``: drafts per verification window (k), or ``"auto"`` (DSI only): event-driven
    windows, sent whenever a target server is idle, carrying every draft made since the previous
    window (at most ``max_window``).

    ``target_servers``: a list of engine URLs (``http://host:port/v1``: vLLM OpenAI servers or ``dsi
    serve`` instances serving the target) to verify on instead of servers of this process; ``target``
    is then the local copy they are checked against (vocabulary and a canary forward) and whose
    tokenizer stays local (:mod:`dsi.models.engines`, docs/engines.md). ``num_target_servers``
    defaults to 2, or one per URL.

    ``vocab_mode``: how a drafter's tokens relate to the target's (:mod:`dsi.models.crossvocab`).
    ``"auto"``: the drafter's own tokens when both share one vocabulary, else a drafter of another
    vocabulary drafts through text (string-level for greedy requests, the token intersection for
    sampling); ``"shared"``: one vocabulary required; ``"string"`` / ``"intersection"``: that
    translation. Translating needs both tokenizers: the models' ``tokenizer`` attributes, or
    ``target_tokenizer`` / ``drafter_tokenizer``. Output stays exact in every mode. ``merges`` (a drafter
    of another vocabulary, intersection mode): how many likely shared tokens per position its law extends to
    the target tokens they begin and the drafter spells in two (:mod:`dsi.models.merges`); ``"auto"``: 3
    where the drafter's rows are cheap (an accelerator, a stated low row price), 0 (plain TLI) on a CPU.

    ``draft_tree`` (SI and DSI): spend each window's drafts as a tree instead of a chain (:mod:`dsi.trees`):
    None or ``"off"`` (chains), ``"auto"`` (the chain's drafts with side children where the drafter is
    unsure), ``"branches"`` (SI: those side children go on as the drafter's own drafts, in the same k
    drafter rounds), ``"best-first"`` (SI: an EAGLE-2-style tree of k nodes) or widths per depth
    (``"3,2,1"``). The committed tokens are the chain's for the same seed (DSI), or the target's law with
    the same guarantees (SI): a tree only changes how many tokens a verification commits.

    ``drafter_server``: the URL of an engine serving the drafter (vLLM or ``dsi serve``); its tokens are
    streamed from there, and ``drafter`` is the local copy it is checked against and whose tokenizer
    stays local (:mod:`dsi.models.engine_drafter`, docs/engines.md)."""
    require(method in METHODS, f"method={method!r} must be one of {', '.join(METHODS)}")
    if method == "auto" and draft_tree not in (None, "off"):
        raise ConfigError(f"draft_tree={draft_tree!r} with method='auto': the method choice weighs draft trees itself "
                          "(chains and the trees '2' and 'auto', and picks one); pick method 'si' or 'dsi' "
                          "(--method) to choose the tree yourself")
    if deterministic and target_servers is not None:
        raise ConfigError("deterministic=True cannot hold with target_servers: an engine's rows depend on its own "
                          "batching, which dsi does not control; drop deterministic or the target servers")
    if deterministic is not None:
        set_deterministic([target, drafter], deterministic)
    if deterministic and drafter_server is not None:
        raise ConfigError("deterministic=True cannot hold with drafter_server: an engine's rows depend on its "
                          "own batching, which dsi does not control; drop deterministic or the drafter server")
    target, num_target_servers, transport, transport_options = engine.engine_placement(
        target, target_servers, num_target_servers, transport, transport_options)
    if method != "auto":
        return engine.build_decoder(
            target=target, drafter=drafter, method=method, lookahead=lookahead,
            num_target_servers=num_target_servers, transport=transport, transport_options=transport_options,
            max_window=max_window, vocab_mode=vocab_mode, target_tokenizer=target_tokenizer,
            drafter_tokenizer=drafter_tokenizer, draft_tree=draft_tree, drafter_server=drafter_server,
            merges=merges,
        )
    engine.check_lookahead(method, lookahead, max_window)
    drafter = engine.drafter_placement(drafter, drafter_server, method)
    if drafter is not None:
        drafter = engine.bridge(target, drafter, vocab_mode, target_tokenizer, drafter_tokenizer, merges)
    engine.check_placement(num_target_servers, transport)
    from dsi.evaluate.autotune import build_auto_decoder  # measures with the engine: imported on use

    return build_auto_decoder(
        target=engine.check_model(target, "target"), drafter=drafter, transport=transport,
        transport_options=transport_options, num_target_servers=num_target_servers, tune_options=auto_options,
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
    method: str = "dsi",
    max_new_tokens: int,
    lookahead: int | str = 5,
    max_window: int | None = None,
    num_target_servers: int | None = None,
    sampling: SamplingParams | None = None,
    transport: str = "threads",
    transport_options: dict | None = None,
    auto_options: dict | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    on_tokens: TokenCallback | None = None,
    abort: threading.Event | None = None,
    vocab_mode: str = "auto",
    target_tokenizer: object = None,
    drafter_tokenizer: object = None,
    deterministic: bool | None = None,
    target_servers: object = None,
    logprobs: int | None = None,
    logprobs_mode: str = "raw",
    draft_tree: object = None,
    drafter_server: str | None = None,
    merges: int | str = "auto",
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens after ``prompt`` with non-SI, SI, DSI or ``"auto"``.

    Greedy output (``temperature=0``) is token for token the target's own greedy output;
    sampled output has exactly the target's distribution, and for a fixed seed it is the same
    for any number of target servers and any timing. ``on_tokens`` receives each committed
    token as it is committed (streaming). ``lookahead="auto"`` gives DSI event-driven windows
    (see :func:`build_decoder`, also for ``vocab_mode`` and a drafter with another tokenizer).
    Workers are started for this call and stopped before it returns; use :func:`build_decoder`
    to keep them across calls. ``logprobs`` (N >= 0): the result's ``logprobs`` hold each new
    token's log-probability and the N most likely tokens of the row that decided it, the numbers
    non-SI reports (``logprobs_mode`` ``"raw"``, vLLM's default, or ``"processed"``: :mod:`dsi.logprobs`);
    ``on_tokens`` then also gets them. ``draft_tree``, ``drafter_server``, ``merges``: see :func:`build_decoder`.
    """
    decoder = build_decoder(
        target=target, drafter=drafter, method=method, lookahead=lookahead, num_target_servers=num_target_servers,
        transport=transport, transport_options=transport_options, max_window=max_window,
        auto_options=auto_options, vocab_mode=vocab_mode, target_tokenizer=target_tokenizer,
        drafter_tokenizer=drafter_tokenizer, deterministic=deterministic, target_servers=target_servers,
        draft_tree=draft_tree, drafter_server=drafter_server, merges=merges,
    )
    return engine.run_once(decoder, prompt, max_new_tokens, vocab_size=target.vocab_size, sampling=sampling,
                           eos_token_id=eos_token_id, on_tokens=on_tokens, abort=abort, logprobs=logprobs,
                           logprobs_mode=logprobs_mode)
