"""The law and the draw over a whole vocabulary, computed in place and in two levels (dsi.sampling), against
the plain expressions they replace: bitwise the same laws, the same tokens."""

from __future__ import annotations

import numpy as np
import pytest

from dsi.errors import ModelError
from dsi.sampling import SAMPLE_BLOCK, SamplingParams, _distribution, process_logits, residual, sample_from


def plain_distribution(row: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The law as plain numpy expressions, each a fresh array (what _distribution computed before)."""
    row = np.asarray(row, dtype=np.float64)
    if np.isposinf(row).any():
        row = np.where(np.isposinf(row), 0.0, -np.inf)
    if params.greedy:
        probs = np.zeros_like(row)
        probs[int(np.argmax(row))] = 1.0
        return probs
    with np.errstate(over="ignore", under="ignore"):
        scores = row / params.temperature
        if not np.isfinite(scores.max()):
            scores = (row - row.max()) / params.temperature
        if params.min_p > 0.0:
            scores = np.where(scores - scores.max() < np.log(params.min_p), -np.inf, scores)
        if params.top_k and params.top_k < scores.size:
            kth = np.partition(scores, -params.top_k)[-params.top_k]
            scores = np.where(scores < kth, -np.inf, scores)
        scores = scores - scores.max()
        probs = np.exp(scores)
    probs /= probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(-row, kind="stable")
        cumulative = np.cumsum(probs[order])
        keep_count = int(np.searchsorted(cumulative, params.top_p, side="left")) + 1
        mask = np.zeros(probs.size, dtype=bool)
        mask[order[:keep_count]] = True
        probs = np.where(mask, probs, 0.0)
        probs /= probs.sum()
    return probs


def running_sum_draw(probs: np.ndarray, u: float) -> int:
    """The inverse CDF by one running sum over every id (what sample_from computed before)."""
    cdf = np.cumsum(probs)
    index = min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), probs.size - 1)
    while probs[index] <= 0.0:
        index -= 1
    return index


SETTINGS = [
    SamplingParams(temperature=0.7, seed=1),
    SamplingParams(temperature=1.3, seed=1, top_k=5),
    SamplingParams(temperature=1.0, seed=1, top_p=0.8),
    SamplingParams(temperature=0.9, seed=1, min_p=0.05),
    SamplingParams(temperature=0.5, seed=1, top_k=40, top_p=0.9, min_p=0.01),
    SamplingParams(temperature=1e-300, seed=1),  # row / T overflows: the shifted form
    SamplingParams(),  # greedy
]


@pytest.mark.parametrize("params", SETTINGS, ids=lambda p: repr(p)[:60])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_in_place_law_is_bitwise_the_plain_one(params, dtype):
    rng = np.random.default_rng(3)
    for size in (7, 1000, 49_152):
        for _ in range(3):
            row = (rng.standard_normal(size) * 4).astype(dtype)
            row[rng.integers(0, size, 3)] = row.max()  # ties at the top
            assert np.array_equal(_distribution(row, params), plain_distribution(row, params))
            assert np.array_equal(process_logits(row, params), plain_distribution(row, params))
        edge = rng.standard_normal(size).astype(dtype)
        edge[:2] = np.inf  # +inf logits share the mass
        edge[5] = -np.inf
        assert np.array_equal(_distribution(edge, params), plain_distribution(edge, params))


def test_the_in_place_law_leaves_the_callers_row_alone():
    row = np.linspace(-3.0, 3.0, 50)
    kept = row.copy()
    for params in SETTINGS:
        _distribution(row, params)
        process_logits(row, params)
    assert np.array_equal(row, kept)


def test_residual_is_the_plain_expression():
    rng = np.random.default_rng(5)
    p, q = rng.dirichlet(np.ones(3000)), rng.dirichlet(np.ones(3000))
    plain = np.maximum(p - q, 0.0)
    assert np.array_equal(residual(p, q), plain / plain.sum())
    assert residual(p, p) is p  # no mass left: the target's own law


@pytest.mark.parametrize("size", [3, SAMPLE_BLOCK - 1, SAMPLE_BLOCK, SAMPLE_BLOCK + 1, 5 * SAMPLE_BLOCK + 17, 151_936])
def test_the_two_level_draw_gives_the_running_sums_token(size):
    rng = np.random.default_rng(size)
    for trial in range(4):
        probs = rng.dirichlet(np.full(size, 0.3 if trial % 2 else 1.0))
        if trial >= 2 and size > 2 * SAMPLE_BLOCK:
            probs[SAMPLE_BLOCK: 2 * SAMPLE_BLOCK] = 0.0  # a whole block without mass
            probs[-50:] = 0.0  # and a tail without mass
        for u in np.concatenate([rng.random(300), [0.0, 1e-12, 0.5, 1.0 - 1e-12]]):
            got = sample_from(probs, float(u))
            assert got == running_sum_draw(probs, float(u))
            assert probs[got] > 0.0


def test_the_two_level_draw_never_returns_a_token_without_mass():
    probs = np.zeros(3 * SAMPLE_BLOCK)
    probs[[0, SAMPLE_BLOCK + 3, 3 * SAMPLE_BLOCK - 1]] = [0.2, 0.5, 0.3]
    seen = {sample_from(probs, float(u)) for u in np.linspace(0.0, 1.0 - 1e-15, 999)}
    assert seen == {0, SAMPLE_BLOCK + 3, 3 * SAMPLE_BLOCK - 1}
    assert sample_from(probs, 0.1999) == 0 and sample_from(probs, 0.2001) == SAMPLE_BLOCK + 3


@pytest.mark.parametrize("bad", [np.zeros(5000), np.array([0.5, -0.1, 0.6]), np.array([0.5, np.nan, 0.5]),
                                 np.full(4, np.inf)])
def test_the_two_level_draw_refuses_rows_without_a_law(bad):
    with pytest.raises(ModelError, match="cannot sample from a distribution"):
        sample_from(bad, 0.3)
