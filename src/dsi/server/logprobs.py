"""Log-probabilities in the shapes the OpenAI / vLLM servers return them.

- ``logprobs`` of generated tokens (from :class:`dsi.logprobs.TokenLogprob` entries):
  :func:`completion_logprobs` (the legacy completions object: ``tokens``, ``token_logprobs``,
  ``top_logprobs``, ``text_offset``) and :func:`chat_logprobs` (``content``: one object per token
  with ``token``, ``logprob``, ``bytes``, ``top_logprobs``); with ``echo``, the prompt's own tokens
  first (:func:`echo_logprobs`). Tokens are named by their text, or with vLLM's
  ``return_tokens_as_token_ids`` as ``token_id:{id}`` (:func:`token_id_name`).

``prompt_logprobs`` (vLLM's extension of ``/v1/completions``): for every prompt position p >= 1, the
target's log-softmax after the first p tokens, as a dict token id -> ``{logprob, rank,
decoded_token}`` holding the top N entries plus the token actually at p (rank 1 is the most likely;
N = -1: the whole vocabulary, without decoded text). Position 0 has nothing before it: null. These
are raw log-probabilities (no temperature, top-k or top-p), as in vLLM. ``-inf`` becomes -9999.0, as
JSON has no infinity.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from dsi.logprobs import TokenLogprob, log_softmax, raw_rows, top_ids

FLOOR = -9999.0  # what a log-probability of -inf is sent as


def position_entry(logits: np.ndarray, actual: int | None, n: int,
                   decode: Callable[[int], str] | None) -> dict[str, dict]:
    """One position: the top ``n`` tokens of ``logits`` (all with -1) and ``actual``, by token id."""
    vocab = np.shape(logits)[-1]
    if n == -1 or n >= vocab:
        lp = log_softmax(logits)
        order = np.argsort(-lp, kind="stable")
        ranks = np.empty(vocab, np.int64)
        ranks[order] = np.arange(1, vocab + 1)
        values = np.maximum(lp, FLOOR).tolist()
        ranks_list = ranks.tolist()
        return {str(i): {"logprob": values[i], "rank": ranks_list[i], "decoded_token": None} for i in range(vocab)}
    # a few entries of a row: its normaliser once (float32 values, float64 sum), no [V] log-softmax
    row, lse = raw_rows(np.asarray(logits)[None])[0]
    ids = top_ids(row, n)  # most likely first, ties in id order
    values = [float(row[i]) - lse for i in ids]
    out = {}
    for j, i in enumerate(ids):  # anything more likely than a top token is itself among the ones before it
        rank = 1 + sum(1 for v in values[:j] if v > values[j])
        out[str(i)] = {"logprob": max(values[j], FLOOR), "rank": rank,
                       "decoded_token": decode(i) if decode is not None else None}
    if actual is not None and str(actual) not in out:
        out[str(actual)] = {"logprob": max(float(row[actual]) - lse, FLOOR),
                            "rank": int((row > row[actual]).sum()) + 1,
                            "decoded_token": decode(actual) if decode is not None else None}
    return out


def prompt_logprobs(rows: np.ndarray, prompt: Sequence[int], first: int, n: int,
                    decode: Callable[[int], str] | None) -> list[dict | None]:
    """The ``prompt_logprobs`` list of a prompt: ``rows[j]`` is the target's logits after
    ``prompt[: first + j]`` for ``first + j < len(prompt)``; positions before ``first`` are null."""
    out: list[dict | None] = [None] * len(prompt)
    for p in range(first, len(prompt)):
        out[p] = position_entry(rows[p - first], int(prompt[p]), n, decode)
    return out


def _logprob(value: float) -> float:
    return max(value, FLOOR)


def completion_logprobs(entries: Sequence[TokenLogprob], decode: Callable[[int], str], offset: int = 0,
                        text: Callable[[int], str] | None = None) -> dict:
    """The completions ``logprobs`` object of ``entries``, naming tokens by ``decode``; ``offset``:
    where the first token's text starts (after an echoed prompt, or the tokens streamed before).
    Offsets add up each token's own text (``text``, default ``decode``: they index the choice's
    text also where tokens are named by id), as vLLM's do: a token holding part of a UTF-8
    character counts as its one U+FFFD."""
    text = text or decode
    tokens, offsets = [], []
    for e in entries:
        offsets.append(offset)
        tokens.append(decode(e.token))
        offset += len(text(e.token))
    return {
        "tokens": tokens,
        "token_logprobs": [_logprob(e.logprob) for e in entries],
        "top_logprobs": [{decode(i): _logprob(v) for i, v in e.top} for e in entries],
        "text_offset": offsets,
    }


def echo_logprobs(prompt: Sequence[int], entries: Sequence[TokenLogprob], decode: Callable[[int], str],
                  text: Callable[[int], str] | None = None) -> dict:
    """The completions ``logprobs`` object of an echoed prompt (``echo`` with ``logprobs``): position 0
    has no row before it, so its ``token_logprobs`` and ``top_logprobs`` are null, as in vLLM and
    OpenAI; ``entries``: positions 1.. (raw log-probabilities, as prompt logprobs always are);
    ``decode`` and ``text`` as in :func:`completion_logprobs`."""
    head = decode(prompt[0])
    rest = completion_logprobs(entries, decode, len((text or decode)(prompt[0])), text)
    return {"tokens": [head, *rest["tokens"]], "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]], "text_offset": [0, *rest["text_offset"]]}


def joined_logprobs(first: dict, then: dict) -> dict:
    """Two completions ``logprobs`` objects one after the other (the echoed prompt, then the completion)."""
    return {key: first[key] + then[key] for key in first}


def token_id_name(token: int) -> str:
    """How vLLM's ``return_tokens_as_token_ids`` names a token in logprobs."""
    return f"token_id:{token}"


def chat_logprobs(entries: Sequence[TokenLogprob], decode: Callable[[int], str]) -> dict:
    """The chat ``logprobs`` object of ``entries`` (``bytes``: the UTF-8 of each token's text)."""

    def item(token: int, value: float) -> dict:
        piece = decode(token)
        return {"token": piece, "logprob": _logprob(value), "bytes": list(piece.encode("utf-8"))}

    return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(i, v) for i, v in e.top]}
                        for e in entries]}
