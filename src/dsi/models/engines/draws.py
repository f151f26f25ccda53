"""Sampled rows drawn inside the engine: the requests and answers of dsi_vllm's processor (:mod:`dsi.coupling`).

An engine that runs ``dsi_vllm.processor:CoupledDraws`` answers a prompt whose ``vllm_xargs`` carry a draw's
arguments (:mod:`dsi_vllm.protocol`: the request's seed, temperature, top-k, top-p and min_p) with the coupled
draw of the row after it: a token, where the standard rule needs the target's probability of each draft and a
whole row (152k numbers with Qwen's vocabulary) for a rejection's residual. A verification of ``n`` rows is one
``/v1/completions`` request whose ``prompt`` is the batch of the ``n`` prefixes (:mod:`dsi.models.engines.prefixes`:
read from the engine's prefix cache), ``max_tokens: 1``, ``temperature: 0`` (vLLM's argmax of the processor's
one-hot row), ``logprobs: 0`` and ``return_tokens_as_token_ids``: choice ``i``'s ``logprobs.tokens[0]`` is the draw
at prefix ``i``, as ``token_id:N``. (``return_token_ids`` would name it too, but echoes each choice's prompt ids:
an answer growing with the context.)
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from dsi.models.engines.prefixes import choices_by_prompt
from dsi_vllm.protocol import MIN_P, PROBE, SEED, TEMPERATURE, TOP_K, TOP_P

__all__ = ["PROBE", "args", "draw_tokens"]

_TOKEN_ID = re.compile(r"token_id:([0-9]{1,10})")


def args(params: Any) -> dict:
    """The ``vllm_xargs`` of a draw with the sampling ``params`` (a :class:`~dsi.sampling.SamplingParams`)."""
    return {SEED: int(params.seed), TEMPERATURE: float(params.temperature), TOP_K: int(params.top_k),
            TOP_P: float(params.top_p), MIN_P: float(params.min_p)}


def draw_tokens(conn: Any, url: str, model: str, prompts: Sequence[Sequence[int]], xargs: dict, role: str = "target",
                cancel: Any = None) -> list[int]:
    """The engine's draw after each of ``prompts`` (one request; ``conn``: a
    :class:`~dsi.models.engines.target.Connection`), in prompt order. An answer of another shape (another model, a
    choice missing or twice, no token, a token that is no id) is a :class:`~dsi.errors.ServerLost`, as garbage
    from any engine is (:func:`~dsi.models.engines.prefixes.choices_by_prompt`); a refusal is the connection's
    :class:`~dsi.models.engines.target.EngineRefused`. An id outside the vocabulary is checked by the caller."""
    # one prompt goes as a list of ids (a batch of one is still a batch to a gateway that refuses batches)
    prompt = list(prompts[0]) if len(prompts) == 1 else [list(p) for p in prompts]
    payload = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
               "logprobs": 0, "return_tokens_as_token_ids": True, "vllm_xargs": xargs}
    answer = conn.request("POST", "/completions", payload, cancel)
    return choices_by_prompt(answer, url, model, len(prompts), "a draw", _drawn_token,
                             "logprobs.tokens of one 'token_id:N'", role)


def _drawn_token(choice: dict) -> int | None:
    """A choice's one generated token id (its ``logprobs.tokens``, ``["token_id:N"]``), or None."""
    logprobs = choice.get("logprobs")
    tokens = logprobs.get("tokens") if isinstance(logprobs, dict) else None
    if not isinstance(tokens, list) or len(tokens) != 1 or not isinstance(tokens[0], str):
        return None
    match = _TOKEN_ID.fullmatch(tokens[0])
    return int(match.group(1)) if match else None
