"""Log-probabilities of generated tokens: which distribution they come from, and the top N of a row.

A committed token's log-probability is read from the row that decided it (a verification row for
an accepted draft or a correction, the target's own row for a bonus token), so it is the same
number non-SI would report at that position, whatever the method, the window or the number of
servers. Two distributions can be reported (vLLM's ``logprobs_mode``):

- ``"raw"`` (vLLM's default, ``raw_logprobs``): ``log_softmax`` of the target's logits as the model
  gave them, before any processing.
- ``"processed"``: of the law the token was drawn from: for sampling the processed distribution
  (penalties, bias, temperature, min_p, top-k, top-p: ``log p``, -inf where filtered out); for greedy
  decoding ``log_softmax`` of the logits after the processors that precede temperature (penalties,
  bias, min_tokens), whose argmax greedy decoding takes.

Rows are kept as float32 values and a log-normaliser (:class:`LogprobRows`: what travels from a
remote server, with no full-vocabulary subtraction); entries are plain Python numbers. A row read
where it was made (a GPU: :class:`LogprobsRead`) may instead carry only its top N and the tokens a
decision can commit there (:class:`TopLogprobs`, in :class:`ReadLogprobs`). Nothing here knows
about models, threads or engines.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dsi.errors import ConfigError, ModelError
from dsi.sampling import (
    BonusRead,
    ChainRead,
    GreedyRead,
    LastRowRead,
    Prefix,
    SamplingParams,
    process_rows,
    shape_rows,
)

LOGPROBS_MODES = ("raw", "processed")


def check_mode(mode: str) -> str:
    if mode not in LOGPROBS_MODES:
        raise ConfigError(f"logprobs_mode={mode!r} must be one of {', '.join(map(repr, LOGPROBS_MODES))}")
    return mode


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and the ``top`` most likely tokens of its row
    (``(id, logprob)``, most likely first; ties in id order)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def to_dict(self) -> dict:
        return {"token": self.token, "logprob": self.logprob, "top": [list(pair) for pair in self.top]}


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """``log_softmax`` over the last axis in float64 (-inf stays -inf; +inf rows take their limit)."""
    x = np.asarray(logits, dtype=np.float64)
    if np.isposinf(x).any():
        x = np.where(np.isposinf(x), 0.0, -np.inf)
    top = x.max(axis=-1, keepdims=True)
    with np.errstate(under="ignore", divide="ignore"):
        return x - top - np.log(np.exp(x - top).sum(axis=-1, keepdims=True))


@dataclass(frozen=True)
class LogprobRows:
    """Log-probability rows ``values[j] - lse[j]`` (``[n, V]``), kept as float32 values and their
    float64 log-normaliser: an entry reads a row at a few tokens only, so the subtraction (and, for
    raw rows, any copy of the logits) is never made for the whole vocabulary. ``rows[j]`` is the
    ``(values [V], lse)`` pair :func:`entry` takes."""

    values: np.ndarray  # [n, V] float32
    lse: np.ndarray  # [n] float64

    def __len__(self) -> int:
        return len(self.lse)

    def __getitem__(self, j: int) -> tuple[np.ndarray, float]:
        return self.values[j], float(self.lse[j])

    def dense(self) -> np.ndarray:
        """The log-probabilities themselves, ``[n, V]`` float64 (for tests and checks)."""
        return self.values.astype(np.float64) - self.lse[:, None]


def raw_rows(values: np.ndarray) -> LogprobRows:
    """Rows of logits ``[n, V]`` as :class:`LogprobRows` (log-softmax: lse = logsumexp): the raw mode."""
    x = np.asarray(values, dtype=np.float32)
    top = x.max(axis=-1)  # [n]
    limit = np.isposinf(top)  # [n]: the softmax's limit in those rows: their +inf logits share the mass
    if limit.any():
        x = np.where(limit[:, None], np.where(np.isposinf(x), np.float32(0.0), np.float32(-np.inf)), x)
        top = x.max(axis=-1)
    total = np.empty(len(x))  # [n] float64, each >= 1
    shifted = np.empty(x.shape[-1], dtype=np.float32)  # one buffer for every row: no [n, V] temporaries
    with np.errstate(under="ignore"):
        for j, row in enumerate(x):
            np.subtract(row, top[j], out=shifted)
            total[j] = np.exp(shifted, out=shifted).sum(dtype=np.float64)
    return LogprobRows(x, top.astype(np.float64) + np.log(total))


def logprob_rows(logits: np.ndarray, params: SamplingParams, tokens: Sequence[int], prompt_len: int,
                 stop_ids: frozenset[int], mode: str, probs: np.ndarray | None = None) -> LogprobRows:
    """The log-probability rows of the last ``n`` rows of a forward over ``tokens`` (``logits``
    ``[n, V]``, row j after ``tokens[: len(tokens) - n + 1 + j]``), in ``mode``. ``probs``: the
    processed rows if the caller has them (sampling), to save processing them again."""
    if mode == "raw":
        return raw_rows(logits)
    if not params.greedy:
        law = probs if probs is not None else process_rows(logits, params, tokens, prompt_len, stop_ids)
        with np.errstate(divide="ignore"):
            return LogprobRows(np.log(np.asarray(law, dtype=np.float32)), np.zeros(len(law)))
    return raw_rows(shape_rows(logits, params, tokens, prompt_len, stop_ids))


def logprob_row(logits: np.ndarray, params: SamplingParams, prefix: Prefix, mode: str,
                probs: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """:func:`logprob_rows` of one row ``[V]`` that follows ``prefix.tokens`` (``probs``: its processed law)."""
    return logprob_rows(np.asarray(logits)[None], params, prefix.tokens, prefix.prompt_len, prefix.stop_ids, mode,
                        None if probs is None else probs[None])[0]


@dataclass(frozen=True)
class TopLogprobs:
    """What a log-probability row read where it was made sends of itself: its most likely tokens ``(id,
    logprob)`` (most likely first, ties in id order: :func:`top_ids`), and the log-probabilities of the tokens a
    decision can commit at that row (``known``: the row's draft where it is accepted, a greedy row's argmax,
    a drawn token)."""

    top: tuple[tuple[int, float], ...]
    known: dict[int, float]

    def logprob(self, token: int) -> float:
        if token not in self.known:
            raise ModelError(f"the target server sent log-probabilities of tokens {sorted(self.known)} at this row, "
                             f"not of the token {token} committed there: the engine and the server disagree on a "
                             "decision")
        return self.known[token]


@dataclass(frozen=True)
class ReadLogprobs:
    """The log-probability rows of a task read where they were made: each a :class:`TopLogprobs`, or where a
    token the server cannot know is committed (a correction or a bonus drawn by the engine from the law it
    sent), the whole row ``(values [V], lse)``. ``rows[j]`` is what :func:`entry` takes."""

    rows: tuple[TopLogprobs | tuple[np.ndarray, float], ...]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, j: int) -> TopLogprobs | tuple[np.ndarray, float]:
        return self.rows[j]


@dataclass(frozen=True)
class LogprobsRead:
    """A task's rows read with their log-probabilities: ``decisions`` (a :class:`~dsi.sampling.ChainRead`,
    :class:`~dsi.sampling.GreedyRead` or :class:`~dsi.sampling.BonusRead`: what the rows give without logprobs)
    and the log-probability rows in ``mode``, for entries of ``top`` most likely tokens. On the host: every
    row, whole (:func:`logprob_rows`); on a device (:func:`dsi.models.hf.device_laws.with_logprobs`): only each
    row's top and the tokens its decision can commit cross (:class:`ReadLogprobs`), a row whole only where the
    engine draws the token (a sampled chain's row whose law it reads)."""

    decisions: ChainRead | GreedyRead | BonusRead
    mode: str
    top: int

    @property
    def on_device(self) -> bool:
        return self.decisions.on_device

    def __call__(self, logits: np.ndarray) -> tuple[object, LogprobRows]:
        d = self.decisions
        rows = np.asarray(logits)[-1:] if isinstance(d, LastRowRead) else np.asarray(logits)
        return d(logits), logprob_rows(rows, d.params, d.tokens, d.prompt_len, d.stop_ids, self.mode)


def entry(row: tuple[np.ndarray, float] | TopLogprobs, token: int, top: int) -> TokenLogprob:
    """The :class:`TokenLogprob` of ``token`` in the log-probability row ``(values [V], lse)`` (or a
    :class:`TopLogprobs`), with its ``top`` most likely tokens (``top`` 0: none)."""
    if isinstance(row, TopLogprobs):
        if top > len(row.top):
            raise ModelError(f"the target server sent {len(row.top)} most likely tokens of a row; {top} are asked")
        return TokenLogprob(int(token), row.logprob(int(token)), row.top[:top])
    values, lse = np.asarray(row[0]), row[1]
    best = tuple((i, float(values[i]) - lse) for i in top_ids(values, top))
    return TokenLogprob(int(token), float(values[token]) - lse, best)


def top_ids(values: np.ndarray, n: int) -> list[int]:
    """The ids of the ``n`` largest of ``values`` ``[V]``, largest first, ties in id order (also at the
    n-th: every id tied with it is considered, the lower ids kept); ``n`` 0: none."""
    n = min(n, values.size)
    if n <= 0:
        return []
    kth = np.partition(values, values.size - n)[values.size - n]  # the n-th largest value
    return likeliest(values, np.flatnonzero(values >= kth), n)  # every token tied with it too, then ids break ties


def likeliest(values: np.ndarray, candidates: np.ndarray, n: int) -> list[int]:
    """The ``n`` ids of ``candidates`` with the largest ``values`` ``[V]``, largest first, ties in id order."""
    return sorted((int(i) for i in candidates), key=lambda i: (-float(values[i]), i))[:n]
