"""Deterministic inference: a row's logits as a function of the tokens alone, bitwise.

Why it is needed. A backend's logits for a position depend on how the forward that computed them
was cut: one token or a batch of k + 1, a prompt prefilled at once or in chunks, earlier positions'
KV computed in other batches (quantized llama.cpp kernels take other paths for one token than for
several, and repack their weights for batched products; bf16 matrix products round by blocking).
In SI and DSI the window sizes, the cache hits and the server a window lands on depend on timing and
on earlier requests, so without care the output would too (measured:
docs/results.md#where-the-logits-depend-on-the-cut).

The canonical cut. In deterministic mode a backend computes every token in a forward of its own,
in order: the KV of position i and the row of position i are then computed by the same one-token
forward over the same KV, whatever batch the caller asked for, whatever the session held before
(a cache hit only skips forwards that were computed the same way) and however many threads the caller
gave it. llama.cpp runs the mode without flash attention, whose CPU kernel splits a one-token forward's
KV across the threads past 256 tokens (docs/results.md#past-256-tokens-flash-attention-and-the-thread-count).
transformers runs the mode's CPU forwards on one torch intra-op thread, in the calling thread only: MKL's fp32
products and ATen's kernels may sum in an order that follows the thread count (on an AMD EPYC a tiny fp32 Llama's
rows were 1.2e-7 apart on 1 and 2 threads, a 125M one's 1.7e-6; bf16 agreed there), and the methods of one
comparison do run with different counts (the auto-tuner gives DSI's workers a share of the cores).
The rows are those of one machine: another CPU kind or library build may round differently.
So every window of every method sees exactly non-SI's rows: greedy SI and DSI equal non-SI token for
token, and a seeded request gives the same tokens whatever ran before and however windows were cut.

What it costs: a verification forward over k + 1 tokens is cut into k + 1 one-token forwards. On the
embedded pair on this project's 2-core CPU (llama.cpp) that costs non-SI 4% (its prompt is read a
token at a time), SI 38% and DSI 51% (SI 99% and DSI 88% on a day this machine's one-token forwards were
slower: docs/results.md#what-the-mode-costs); on a GPU, where a verification costs about one forward, far
more. transformers' one intra-op thread on a CPU costs nothing where a worker runs on one thread anyway
(DSI's workers on a 2-core CPU) and nothing for fp32 decoding on the 2-core AMD EPYC (memory-bound);
a bf16 one-token forward of a single worker given 2 threads takes 1.3-1.6x as long there (random
Llamas of 125M and 0.5B parameters: 12-14 -> 18 ms, 44-59 -> 72-76 ms), more where more cores would
have helped. So the mode is opt-in (``deterministic=True``, ``--deterministic``). Without it, no method's
answer depends on what ran before: non-SI and SI start each request from an empty cache
(:func:`start_fresh_unless_deterministic`), and so do DSI's drafter and each of its target servers at
the request's first task there (``VerifyTask.request``, :mod:`dsi.transport.dispatch`). Non-SI's and SI's
forwards then depend on the request alone; DSI's still follow timing within the request (window cuts,
which server a window lands on), so only the mode makes DSI reproducible and greedy SI/DSI equal to
non-SI at near-ties.

Models that are functions of their context by construction (:class:`~dsi.models.CallableLM`,
:class:`~dsi.models.WithLatency` over one, replayed models) are deterministic already.
"""

from __future__ import annotations

from collections.abc import Iterable

from dsi.errors import ConfigError


def check_deterministic(value: object, default: bool) -> bool:
    """``value`` as a bool (None: ``default``), or :class:`ConfigError` naming it."""
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"deterministic={value!r} must be True, False or None (the backend's default)")
    return value


def base_model(model: object) -> object:
    """The model whose forwards produce ``model``'s rows: through the wrappers that declare what they
    wrap (``wrapped_model``: latency emulation, replay, a cross-vocabulary drafter)."""
    while (inner := getattr(model, "wrapped_model", None)) is not None:
        model = inner
    return model


def _pure(model: object) -> bool:
    """Models whose rows are a function of the context by construction (they say so:
    ``deterministic_by_construction``, as :class:`~dsi.models.CallableLM` does)."""
    return getattr(type(model), "deterministic_by_construction", False) is True


def is_deterministic(model: object) -> bool:
    """Whether ``model``'s rows depend on the tokens alone (its backend's mode, or by construction)."""
    base = base_model(model)
    return _pure(base) or bool(getattr(base, "deterministic", False))


def set_deterministic(models: Iterable[object], value: bool) -> None:
    """Switch the deterministic mode of ``models`` (their sessions follow at their next forward).

    Models that are deterministic by construction need no switch; asking for the mode on a model
    that has none is a :class:`ConfigError` naming it."""
    check_deterministic(value, False)
    for model in models:
        if model is None:
            continue
        base = base_model(model)
        if _pure(base):
            continue
        if isinstance(getattr(type(base), "deterministic", None), property):
            base.deterministic = value
        elif value:
            raise ConfigError(f"deterministic=True: {getattr(base, 'name', type(base).__name__)!r} has no "
                              "deterministic mode (the llama.cpp and hf backends have one; a CallableLM is "
                              "deterministic by construction)")


def start_fresh_unless_deterministic(session: object, model: object) -> None:
    """Before a request: without the deterministic mode, empty ``session``'s cache.

    A cached prefix was computed in the cuts of whatever ran before (the last request's prompt as one
    batch, its output a token at a time), which a fresh computation of this request would not repeat;
    starting empty makes the same request give the same tokens whatever ran before (for non-SI and SI,
    whose forwards depend on the request alone), at the price of re-reading the prompt. In the mode
    every cached row is the canonical one, so the cache is kept."""
    if not is_deterministic(model) and session.tokens:
        session.truncate(0)
