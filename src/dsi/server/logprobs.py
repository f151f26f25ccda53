"""Log-probabilities in the shape vLLM's OpenAI server returns them, from a target's logit rows.

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

FLOOR = -9999.0  # what a log-probability of -inf is sent as


def log_softmax(row: np.ndarray) -> np.ndarray:
    """``log(softmax(row))`` in float64."""
    row = np.asarray(row, np.float64)
    top = row.max()
    return row - (top + np.log(np.exp(row - top).sum()))


def position_entry(logits: np.ndarray, actual: int | None, n: int,
                   decode: Callable[[int], str] | None) -> dict[str, dict]:
    """One position: the top ``n`` tokens of ``logits`` (all with -1) and ``actual``, by token id."""
    lp = log_softmax(logits)
    vocab = lp.shape[0]
    if n == -1 or n >= vocab:
        order = np.argsort(-lp, kind="stable")
        ranks = np.empty(vocab, np.int64)
        ranks[order] = np.arange(1, vocab + 1)
        values = np.maximum(lp, FLOOR).tolist()
        ranks_list = ranks.tolist()
        return {str(i): {"logprob": values[i], "rank": ranks_list[i], "decoded_token": None} for i in range(vocab)}
    ids = [] if n == 0 else np.argpartition(-lp, n - 1)[:n]
    ids = sorted((int(i) for i in ids), key=lambda i: (-lp[i], i))
    if actual is not None and actual not in ids:
        ids.append(int(actual))
    out = {}
    for i in ids:
        rank = int((lp > lp[i]).sum()) + 1
        out[str(i)] = {"logprob": max(float(lp[i]), FLOOR), "rank": rank,
                       "decoded_token": decode(i) if decode is not None else None}
    return out


def prompt_logprobs(rows: np.ndarray, prompt: Sequence[int], first: int, n: int,
                    decode: Callable[[int], str] | None) -> list[dict | None]:
    """The ``prompt_logprobs`` list of a prompt: ``rows[j]`` is the target's logits after
    ``prompt[: first + j]`` for ``first + j < len(prompt)``; positions before ``first`` are null."""
    out: list[dict | None] = [None] * len(prompt)
    for p in range(first, len(prompt)):
        out[p] = position_entry(rows[p - first], int(prompt[p]), n, decode)
    return out
