"""Pure verification math: logit processing, greedy and stochastic acceptance, residual and
bonus sampling, and the counter-based random numbers that make outputs independent of timing.

Notation follows speculative sampling (Leviathan et al. 2023; Chen et al. 2023) and the DSI
paper: ``p`` is the target's next-token distribution, ``q`` the drafter's, ``x`` a draft token.

Glossary:
- accepted token: a draft token ``x`` kept with probability ``min(1, p(x) / q(x))`` (greedy:
  kept iff ``x == argmax p``).
- correction token: drawn from ``normalize(max(0, p - q))`` after a rejection (greedy:
  ``argmax p``).
- bonus token: drawn from ``p`` itself where no draft exists (greedy: ``argmax p``).

Every uniform is a pure function of (seed, absolute token position, purpose), so a fixed seed
gives the same tokens for any number of target servers, transport or arrival order. Nothing
here knows about models, threads or engines.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from dsi.errors import ConfigError, ModelError, require

_MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. ``temperature == 0`` means greedy (argmax) decoding.

    ``top_k == 0`` disables top-k; ``top_p == 1.0`` disables nucleus filtering. The same
    processing is applied to target and drafter distributions, which keeps sampling lossless
    with respect to the processed target distribution.

    Every finite ``temperature > 0`` is sampling, however small: a temperature so small that
    ``logits / temperature`` overflows (e.g. 1e-320) gives the limit of the softmax as the
    temperature goes to 0, all the mass on the largest logits (shared equally by exact ties),
    i.e. greedy decoding up to ties (see :func:`process_logits`). It is not rewritten to 0: target
    and drafter go through the same :func:`process_logits`, so either choice is lossless, and
    keeping it keeps the parameters the caller gave (and their uniform draw among exact ties).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        t, k, p, s = self.temperature, self.top_k, self.top_p, self.seed
        require(
            isinstance(t, int | float) and not isinstance(t, bool) and np.isfinite(t) and t >= 0,
            f"temperature={t!r} must be a finite number >= 0 (0 means greedy)",
        )
        require(
            isinstance(k, int) and not isinstance(k, bool) and k >= 0,
            f"top_k={k!r} must be an integer >= 0 (0 disables top-k)",
        )
        require(
            isinstance(p, int | float) and not isinstance(p, bool) and 0.0 < p <= 1.0,
            f"top_p={p!r} must be in (0, 1] (1 disables nucleus filtering)",
        )
        require(
            isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= _MAX_SEED,
            f"seed={s!r} must be an integer in [0, 2**63 - 1]",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Purpose(IntEnum):
    """What a uniform is used for; part of its key so different uses never share a number."""

    DRAFT = 1  # the drafter samples its token at a position
    ACCEPT = 2  # accept/reject test of a draft token
    RESIDUAL = 3  # correction token after a rejection
    BONUS = 4  # target's own token where no draft exists (also plain decoding)


def uniform(seed: int, position: int, purpose: Purpose) -> float:
    """A uniform number in [0, 1) determined only by (seed, absolute position, purpose)."""
    digest = hashlib.blake2b(
        struct.pack("<QQQ", seed, position, int(purpose)), digest_size=8
    ).digest()
    return (int.from_bytes(digest, "little") >> 11) * (1.0 / 9007199254740992.0)  # 53 bits


def check_logit_row(row: np.ndarray, what: str = "model") -> None:
    """Raise :class:`ModelError` unless ``row`` ([V]) can be turned into a distribution.

    NaN logits (a broken forward: no order, no limit) and rows whose every logit is -inf (no
    token is possible) are refused with the offending ids; +inf logits and huge finite values
    are accepted (:func:`process_logits` takes their limit).
    """
    if row.ndim != 1 or row.size == 0:
        raise ModelError(f"{what} logits have shape {row.shape}; expected one row [vocab_size]")
    nan = np.isnan(row)
    if nan.any():
        ids = np.flatnonzero(nan)
        raise ModelError(f"{what} returned NaN logits at {ids.size} token ids (first {ids[:5].tolist()}); "
                         "a logit must be a number or -inf")
    if not (row > -np.inf).any():
        raise ModelError(f"{what} returned -inf for all {row.size} logits: no token has positive probability")


def process_logits(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Turn one logit row into the sampling distribution: temperature, then top-k, then top-p.

    ``logits``: ``[vocab_size]``. Returns float64 probabilities ``[vocab_size]``: finite,
    non-negative, summing to 1, with positive mass on the first argmax of ``logits``.
    In greedy mode returns the one-hot distribution of ``argmax(logits)`` (first index on ties).

    Extreme values take their limits, never NaN: logits of +inf share all the mass equally (the
    softmax's limit as they grow); a temperature so small that ``logits / temperature``
    overflows gives the limit as the temperature goes to 0 (all mass on the largest logits,
    equally on exact ties), computed as ``(logits - max) / temperature``; logits far below the
    maximum get probability 0. NaN logits, or all -inf, raise :class:`ModelError`
    (:func:`check_logit_row`).
    """
    row = np.asarray(logits, dtype=np.float64)  # [V]
    check_logit_row(row)
    if np.isposinf(row).any():  # the limit as those logits grow: they share the mass equally
        row = np.where(np.isposinf(row), 0.0, -np.inf)
    if params.greedy:
        probs = np.zeros_like(row)
        probs[int(np.argmax(row))] = 1.0
        return probs
    with np.errstate(over="ignore", under="ignore"):
        scores = row / params.temperature  # [V]
        if not np.isfinite(scores.max()):  # overflow: shift first, the maximum becomes exactly 0
            scores = (row - row.max()) / params.temperature
        if params.top_k and params.top_k < scores.size:
            kth = np.partition(scores, -params.top_k)[-params.top_k]
            scores = np.where(scores < kth, -np.inf, scores)  # ties with the k-th are kept
        scores = scores - scores.max()  # [V], <= 0 with 0 at the maximum (a gap past -1.8e308 is -inf)
        probs = np.exp(scores)  # the maximum has 1, so the sum is in [1, V]
    probs /= probs.sum()
    if params.top_p < 1.0:
        # most likely first; ordered by the logits themselves, so probabilities that rounding made
        # equal keep the logits' order (the first argmax always comes first and is always kept)
        order = np.argsort(-row, kind="stable")  # [V]
        cumulative = np.cumsum(probs[order])
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        keep_count = int(np.searchsorted(cumulative, params.top_p, side="left")) + 1
        mask = np.zeros(probs.size, dtype=bool)
        mask[order[:keep_count]] = True
        probs = np.where(mask, probs, 0.0)
        probs /= probs.sum()
    return probs


def sample_from(probs: np.ndarray, u: float) -> int:
    """Inverse-CDF sample from ``probs`` ([V], non-negative, positive sum) with uniform ``u``.

    The token returned always has positive probability. A row with no positive finite mass
    (all zero, negative or NaN entries) raises :class:`ModelError` rather than giving a token.
    """
    cdf = np.cumsum(probs)  # [V]
    if not (np.isfinite(cdf[-1]) and cdf[-1] > 0.0) or (probs < 0.0).any():
        raise ModelError(f"cannot sample from a distribution of total mass {cdf[-1]!r} with "
                         f"{int((probs < 0.0).sum())} negative entries; it needs finite non-negative "
                         "probabilities with a positive sum")
    index = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    index = min(index, probs.size - 1)
    while probs[index] <= 0.0:  # guard against landing on a zero-mass token by rounding
        index -= 1
    return index


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``normalize(max(0, p - q))``, the law of the correction token ([V] each).

    If ``p <= q`` everywhere (so a rejection had probability 0, or rounding left no mass),
    falls back to ``p``: the result always has positive mass, and only on tokens with ``p > 0``.
    """
    r = np.maximum(p - q, 0.0)  # [V]
    total = r.sum()
    if total <= 0.0:
        return p
    return r / total


@dataclass(frozen=True)
class Decision:
    """Outcome of deciding one position: the committed token and whether the draft was kept."""

    token: int
    accepted: bool


def draft_token(q: np.ndarray, params: SamplingParams, position: int) -> int:
    """The drafter's token at absolute ``position`` from its processed distribution ``q``."""
    if params.greedy:
        return int(np.argmax(q))
    return sample_from(q, uniform(params.seed, position, Purpose.DRAFT))


def draft_from_logits(logits: np.ndarray, params: SamplingParams, position: int) -> tuple[int, np.ndarray | None]:
    """The drafter's token at ``position`` from its raw logits ``[V]``, and its processed ``q``.

    Greedy: ``(argmax logits, None)`` (no distribution needed); sampling: a draw from ``q``.
    """
    if params.greedy:
        row = np.asarray(logits)
        check_logit_row(row, "the drafter")
        return int(np.argmax(row)), None
    q = process_logits(logits, params)  # [V]
    return draft_token(q, params, position), q


def decide_greedy(target_token: int, draft: int) -> Decision:
    """Greedy decision from the target's argmax alone: accept iff ``draft == target_token``,
    otherwise the correction is ``target_token`` (what :func:`decide` does with a greedy ``p``)."""
    return Decision(int(target_token), int(target_token) == int(draft))


def decide(
    p: np.ndarray,
    draft: int,
    q: np.ndarray | None,
    params: SamplingParams,
    position: int,
) -> Decision:
    """Accept or reject ``draft`` at absolute ``position`` given target ``p`` and drafter ``q``.

    ``p``, ``q``: processed distributions ``[V]``. Greedy: accept iff ``draft == argmax p``,
    otherwise the correction is ``argmax p``. Sampling: accept with probability
    ``min(1, p[draft] / q[draft])``, otherwise draw the correction from the residual. A draft the
    drafter could not have drawn (``q[draft] == 0``) is accepted iff ``p[draft] > 0``, so the
    committed token always has positive target probability.
    """
    if not (isinstance(draft, int | np.integer) and 0 <= draft < p.size):
        raise ConfigError(f"draft={draft!r} must be a token id in [0, {p.size})")
    if params.greedy:
        best = int(np.argmax(p))
        return Decision(best, best == draft)
    if q is None:
        raise ConfigError("sampling decisions need the drafter distribution q")
    q_x, p_x = q[draft], p[draft]
    ratio = p_x / q_x if q_x > 0.0 else (1.0 if p_x > 0.0 else 0.0)
    if uniform(params.seed, position, Purpose.ACCEPT) < ratio:
        return Decision(draft, True)
    correction = sample_from(residual(p, q), uniform(params.seed, position, Purpose.RESIDUAL))
    return Decision(correction, False)


def bonus(p: np.ndarray, params: SamplingParams, position: int) -> int:
    """The target's own token at ``position`` (no draft to test): argmax or a sample from ``p``."""
    if params.greedy:
        return int(np.argmax(p))
    return sample_from(p, uniform(params.seed, position, Purpose.BONUS))
