"""The law and the draw over a whole vocabulary, computed in place and in two levels (dsi.sampling), against
the plain expressions they replace: bitwise the same laws, the same tokens; and the float32 law against the
float64 softmax it rounds."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from dsi.errors import ModelError
from dsi.sampling import SAMPLE_BLOCK, SamplingParams, _distribution, process_logits, residual, sample_from


def plain_distribution(row: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The float32 law as plain numpy expressions, each a fresh array."""
    row = np.asarray(row)
    if np.isposinf(row).any():
        row = np.where(np.isposinf(row), 0.0, -np.inf)
    if params.greedy:
        probs = np.zeros(row.shape, dtype=np.float32)
        probs[int(np.argmax(row))] = 1.0
        return probs
    with np.errstate(over="ignore", under="ignore"):
        shifted = (row - row.max()).astype(np.float32)
        if 1.0 / params.temperature <= np.finfo(np.float32).max:
            scores = shifted * np.float32(1.0 / params.temperature) if params.temperature != 1.0 else shifted
        else:
            scores = (shifted.astype(np.float64) / params.temperature).astype(np.float32)
        if params.min_p > 0.0:
            scores = np.where(scores < np.log(params.min_p), np.float32(-np.inf), scores)
        if params.top_k and params.top_k < scores.size:
            kth = np.partition(scores, -params.top_k)[-params.top_k]
            scores = np.where(scores < kth, np.float32(-np.inf), scores)
        probs = np.exp(scores)
    probs = probs / probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(-row, kind="stable")
        cumulative = np.cumsum(probs[order].astype(np.float64))
        keep_count = int(np.searchsorted(cumulative, params.top_p, side="left")) + 1
        mask = np.zeros(probs.size, dtype=bool)
        mask[order[:keep_count]] = True
        probs = np.where(mask, probs, np.float32(0.0))
        probs = probs / probs.sum()
    return probs


def float64_softmax(row: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The processed law in float64 (temperature and min_p only), as a reference for the float32 one."""
    scores = (np.asarray(row, dtype=np.float64) - np.max(row)) / params.temperature
    if params.min_p > 0.0:
        scores = np.where(scores < np.log(params.min_p), -np.inf, scores)
    probs = np.exp(scores)
    return probs / probs.sum()


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


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=1.0, seed=1),
                                    SamplingParams(temperature=0.9, seed=1, min_p=0.05)], ids=repr)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_float32_law_is_the_float64_softmax_within_float32_rounding(params, dtype):
    rng = np.random.default_rng(11)
    for size in (5, 4096, 151_936):
        row = (rng.standard_normal(size) * 3).astype(dtype)
        law, exact = _distribution(row, params), float64_softmax(row, params)
        assert law.dtype == np.float32
        assert np.array_equal(law > 0, exact > 0)  # the same support
        big = exact > 1e-30  # float32's normal range (smaller ones may round to subnormals)
        # float32 rounds the exponent's argument: a relative error of about 2**-24 * |log p| (and a few ulps)
        bound = (8 + np.abs(np.log(exact[big]))) * 2.0 ** -23
        assert (np.abs(law[big] - exact[big]) <= bound * exact[big]).all()
        assert abs(float(law.sum(dtype=np.float64)) - 1.0) < 1e-5


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


def full_sort_nucleus(row: np.ndarray, law: np.ndarray, top_p: float) -> np.ndarray:
    """top-p's kept ids by a sort of the whole vocabulary (what _distribution did before)."""
    order = np.argsort(-row, kind="stable")
    cumulative = np.cumsum(law[order], dtype=np.float64)
    return order[: int(np.searchsorted(cumulative, top_p, side="left")) + 1]


def nucleus_rows(rng: np.random.Generator, size: int):
    """Rows top-p must get right: peaked (the first candidates suffice), flat (they fall short, more are sorted),
    bf16-like (many exact ties, also across the last candidate), with -inf entries, and small vocabularies."""
    yield (rng.standard_normal(size) * 8).astype(np.float32)  # peaked
    yield (rng.standard_normal(size) * 0.5).astype(np.float32)  # flat: most ids in the nucleus
    yield np.round(rng.standard_normal(size) * 4, 1).astype(np.float32)  # ties everywhere
    tied = np.full(size, -2.0, dtype=np.float32)
    tied[: size // 3] = 1.0  # a third of the ids tied at the top, across NUCLEUS_FIRST
    yield tied
    masked = (rng.standard_normal(size) * 3).astype(np.float64)
    masked[rng.random(size) < 0.9] = -np.inf  # constraints and min_tokens leave few ids
    masked[size // 2] = 0.0  # (a checked row has one)
    yield masked


@pytest.mark.parametrize("size", [3, 1000, 5000, 151_936])
@pytest.mark.parametrize("top_p", [1e-9, 0.3, 0.9, 0.999, 1.0 - 1e-12])
def test_top_p_keeps_the_ids_a_sort_of_the_whole_vocabulary_keeps(size, top_p):
    from dsi.sampling import nucleus

    rng = np.random.default_rng(size)
    for row in nucleus_rows(rng, size):
        law = _distribution(row, SamplingParams(temperature=0.8, seed=1))
        got, want = nucleus(row, law, top_p), full_sort_nucleus(row, law, top_p)
        assert np.array_equal(got, want), (size, top_p, got.size, want.size)
        # and the law top-p makes of them, bit for bit
        params = SamplingParams(temperature=0.8, seed=1, top_p=top_p)
        assert np.array_equal(_distribution(row, params), plain_distribution(row, params))
        # after top-k or min_p, whose few ids of positive mass are the candidates
        for filtered in (SamplingParams(temperature=0.8, seed=1, top_k=40), SamplingParams(temperature=0.8, seed=1,
                                                                                         min_p=0.05)):
            law = _distribution(row, filtered)
            assert np.array_equal(nucleus(row, law, top_p, few=True), full_sort_nucleus(row, law, top_p))
            params = replace(filtered, top_p=top_p)
            assert np.array_equal(_distribution(row, params), plain_distribution(row, params))


def _sizes_given_to(monkeypatch, name: str) -> list[int]:
    """The sizes of the arrays dsi.sampling passes to ``np.<name>`` from now on (the function still runs)."""
    import dsi.sampling

    sizes = []
    real = getattr(np, name)

    def counting(a, *args, **kwargs):
        sizes.append(np.asarray(a).size)
        return real(a, *args, **kwargs)

    monkeypatch.setattr(dsi.sampling.np, name, counting)
    return sizes


def test_top_p_sorts_only_the_likeliest_ids_of_a_peaked_row(monkeypatch):
    import dsi.sampling

    sorted_sizes = _sizes_given_to(monkeypatch, "argsort")
    row = (np.random.default_rng(0).standard_normal(151_936) * 8).astype(np.float32)
    law = _distribution(row, SamplingParams(temperature=1.0, seed=1, top_p=0.95))
    assert sorted_sizes and max(sorted_sizes) <= dsi.sampling.NUCLEUS_FIRST
    assert 0 < np.count_nonzero(law) < dsi.sampling.NUCLEUS_FIRST


def _top_k_rows(rng: np.random.Generator, size: int):
    """Rows top-k meets: peaked, ties at the k-th across groups of ids, few finite entries, one value."""
    yield (rng.standard_normal(size) * 8).astype(np.float32)
    tied = (rng.standard_normal(size) * 2).astype(np.float32)
    tied[rng.choice(size, 60, replace=False)] = 9.0  # 60 ids tied at the top, in many residue groups
    yield tied
    few = np.full(size, -np.inf, dtype=np.float32)
    few[rng.choice(size, 7, replace=False)] = rng.standard_normal(7).astype(np.float32)
    yield few
    yield np.zeros(size, dtype=np.float32)


@pytest.mark.parametrize("size", [1000, 8192, 151_936])
@pytest.mark.parametrize("k", [1, 5, 20, 60, 256, 257, 1024])
def test_top_k_selects_what_a_partition_of_the_whole_row_selects(size, k):
    from dsi.sampling import _top_k

    rng = np.random.default_rng(size + k)
    for row in _top_k_rows(rng, size):
        if k >= size:
            continue
        ids, values = _top_k(row, k)
        kth = np.partition(row, -k)[-k]
        want = np.flatnonzero(row >= kth)  # ties with the k-th kept
        assert np.array_equal(ids, want) and np.array_equal(values, row[want]), (size, k)


def test_top_k_partitions_only_the_few_scores_above_its_bound(monkeypatch):
    import dsi.sampling

    sizes = _sizes_given_to(monkeypatch, "partition")
    row = (np.random.default_rng(0).standard_normal(151_936) * 8).astype(np.float32)
    law = _distribution(row, SamplingParams(temperature=0.7, seed=1, top_k=20, top_p=0.8))
    assert sizes and max(sizes) <= dsi.sampling.TOP_K_GROUPS  # the groups' maxima, then the few above their bound
    assert 0 < np.count_nonzero(law) <= 20
