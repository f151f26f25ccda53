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

from dsi.errors import ConfigError, require

_MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. ``temperature == 0`` means greedy (argmax) decoding.

    ``top_k == 0`` disables top-k; ``top_p == 1.0`` disables nucleus filtering. The same
    processing is applied to target and drafter distributions, which keeps sampling lossless
    with respect to the processed target distribution.
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


def process_logits(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Turn one logit row into the sampling distribution: temperature, then top-k, then top-p.

    ``logits``: ``[vocab_size]``. Returns float64 probabilities ``[vocab_size]`` summing to 1.
    In greedy mode returns the one-hot distribution of ``argmax(logits)`` (first index on ties).
    """
    row = np.asarray(logits, dtype=np.float64)  # [V]
    if params.greedy:
        probs = np.zeros_like(row)
        probs[int(np.argmax(row))] = 1.0
        return probs
    scores = row / params.temperature  # [V]
    if params.top_k and params.top_k < scores.size:
        kth = np.partition(scores, -params.top_k)[-params.top_k]
        scores = np.where(scores < kth, -np.inf, scores)  # ties with the k-th are kept
    scores = scores - scores.max()
    probs = np.exp(scores)
    probs /= probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")  # [V], most likely first
        cumulative = np.cumsum(probs[order])
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        keep_count = int(np.searchsorted(cumulative, params.top_p, side="left")) + 1
        mask = np.zeros(probs.size, dtype=bool)
        mask[order[:keep_count]] = True
        probs = np.where(mask, probs, 0.0)
        probs /= probs.sum()
    return probs


def sample_from(probs: np.ndarray, u: float) -> int:
    """Inverse-CDF sample from ``probs`` ([V], non-negative, positive sum) with uniform ``u``."""
    cdf = np.cumsum(probs)  # [V]
    index = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    index = min(index, probs.size - 1)
    while probs[index] <= 0.0:  # guard against landing on a zero-mass token by rounding
        index -= 1
    return index


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``normalize(max(0, p - q))``, the law of the correction token ([V] each).

    If ``p <= q`` everywhere (so a rejection had probability 0), falls back to ``p``.
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
        return int(np.argmax(logits)), None
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
    ``min(1, p[draft] / q[draft])``, otherwise draw the correction from the residual.
    """
    if params.greedy:
        best = int(np.argmax(p))
        return Decision(best, best == draft)
    if q is None:
        raise ConfigError("sampling decisions need the drafter distribution q")
    q_x = q[draft]
    ratio = 1.0 if q_x <= 0.0 else p[draft] / q_x
    if uniform(params.seed, position, Purpose.ACCEPT) < ratio:
        return Decision(draft, True)
    correction = sample_from(residual(p, q), uniform(params.seed, position, Purpose.RESIDUAL))
    return Decision(correction, False)


def bonus(p: np.ndarray, params: SamplingParams, position: int) -> int:
    """The target's own token at ``position`` (no draft to test): argmax or a sample from ``p``."""
    if params.greedy:
        return int(np.argmax(p))
    return sample_from(p, uniform(params.seed, position, Purpose.BONUS))
