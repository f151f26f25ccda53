"""Synthetic target/drafter pairs with a chosen acceptance rate, for tests and benchmarks.

The target's logits are a seeded pseudo-random function of the whole context. For each context
the drafter either copies the target's logits exactly (with probability ``acceptance``, decided
by a hash of the context, so the same context always gets the same answer) or shifts them by
one token, which moves the argmax elsewhere. Hence the greedy acceptance rate is
``acceptance`` in expectation; in sampling mode it is a little higher (the shifted distribution
still overlaps the target's).

Both are plain picklable callables wrapped in :class:`CallableLM`, so they also run in other
processes. Optional ``*_ttft`` / ``*_tpot`` arguments wrap them in :class:`WithLatency`.
"""

from __future__ import annotations

import numpy as np

from dsi.errors import ConfigError
from dsi.models.base import check_int
from dsi.models.callable import CallableLM
from dsi.models.latency import WithLatency

_MASK = (1 << 63) - 1


def _context_key(context: tuple[int, ...]) -> int:
    return hash(context) & _MASK  # ints and tuples of ints hash identically in every process


class SyntheticTarget:
    """``next_logits`` of a synthetic target: Gaussian logits seeded by (seed, context)."""

    def __init__(self, vocab_size: int, seed: int, sharpness: float = 2.5) -> None:
        self.vocab_size = vocab_size
        self.seed = seed
        self.sharpness = sharpness

    def __call__(self, context: tuple[int, ...]) -> np.ndarray:
        rng = np.random.default_rng([self.seed, _context_key(context)])
        return self.sharpness * rng.standard_normal(self.vocab_size)  # [V]


class SyntheticDrafter:
    """``next_logits`` of a drafter that agrees with ``target`` with probability ``acceptance``."""

    def __init__(self, target: SyntheticTarget, acceptance: float, seed: int) -> None:
        self.target = target
        self.acceptance = acceptance
        self.seed = seed

    def agrees(self, context: tuple[int, ...]) -> bool:
        rng = np.random.default_rng([self.seed, 1, _context_key(context)])
        return bool(rng.random() < self.acceptance)

    def __call__(self, context: tuple[int, ...]) -> np.ndarray:
        logits = self.target(context)  # [V]
        if self.agrees(context):
            return logits
        return np.roll(logits, 1)  # argmax moves to the next token id


def synthetic_pair(
    acceptance: float,
    *,
    vocab_size: int = 32,
    seed: int = 0,
    target_ttft: float | None = None,
    target_tpot: float | None = None,
    drafter_ttft: float | None = None,
    drafter_tpot: float | None = None,
    target_cv: float = 0.0,
):
    """Build ``(target, drafter)`` over ``vocab_size`` tokens with greedy acceptance ``acceptance``.

    Latencies in seconds: give ``*_tpot`` (and optionally ``*_ttft``, default equal to tpot) to
    wrap a model in :class:`WithLatency`; ``target_cv > 0`` makes every target forward's latency
    random (lognormal, mean ``target_tpot``, coefficient of variation ``target_cv``).
    """
    if not isinstance(acceptance, int | float) or isinstance(acceptance, bool) or not 0.0 <= acceptance <= 1.0:
        raise ConfigError(f"acceptance={acceptance!r} must be a number in [0, 1]")
    vocab_size = check_int(vocab_size, "vocab_size", 2)
    seed = check_int(seed, "seed", 0)  # numpy seeds the generators with it: a non-negative integer
    target_fn = SyntheticTarget(vocab_size, seed)
    drafter_fn = SyntheticDrafter(target_fn, float(acceptance), seed + 1)
    target = CallableLM(target_fn, vocab_size, name=f"synthetic-target(seed={seed})")
    drafter = CallableLM(drafter_fn, vocab_size, name=f"synthetic-drafter(a={acceptance})")
    if target_tpot is not None:
        target = WithLatency(target, target_tpot if target_ttft is None else target_ttft, target_tpot,
                             cv=target_cv, seed=seed)
    if drafter_tpot is not None:
        drafter = WithLatency(drafter, drafter_tpot if drafter_ttft is None else drafter_ttft, drafter_tpot)
    return target, drafter
