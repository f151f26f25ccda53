"""The offline simulator (docs/simulator.md section 1): reference means, the spec loops, invariants, errors."""

from __future__ import annotations

import numpy as np
import pytest

from dsi.errors import ConfigError
from dsi.sim.analytic import dsi_lower_bound
from dsi.sim.offline import (
    min_lookahead,
    reference_dsi,
    reference_si,
    required_sp,
    required_sp_array,
    sample_stream,
    simulate_many,
    simulate_offline,
)


# ---- the authors' published means --------------------------------------------------------------
def test_legacy_stream_reproduces_the_authors_means_exactly():
    r = simulate_offline(0.1, 0.9, 5, tokens=1000, repeats=5, seed=42, rng="legacy")
    assert r.mean("si") == pytest.approx(322.24, abs=1e-9)
    assert r.mean("dsi") == pytest.approx(219.18, abs=1e-9)
    assert r.mean("nonsi") == 1000.0


def test_default_stream_lands_within_two_percent_of_the_authors_means():
    r = simulate_offline(0.1, 0.9, 5, tokens=1000, repeats=5, seed=42)
    assert r.mean("si") == pytest.approx(322.24, rel=0.02)
    assert r.mean("dsi") == pytest.approx(219.18, rel=0.02)


# ---- the fast path equals the plain loops of section 5 -------------------------------------------
@pytest.mark.parametrize("rng", ["legacy", "pcg64"])
@pytest.mark.parametrize(
    ("c", "a", "k", "tokens"),
    [(0.1, 0.9, 5, 300), (0.5, 0.3, 1, 50), (0.05, 0.7, 10, 123), (1.0, 0.99, 3, 40), (0.2, 0.0, 4, 30),
     (0.2, 1.0, 4, 30), (0.9, 0.5, 7, 8), (0.3, 0.6, 2, 1)],
)  # fmt: skip
def test_vectorised_simulator_equals_reference_loops(rng, c, a, k, tokens):
    repeats = 4
    samples = sample_stream(a, k, tokens=tokens, repeats=repeats, seed=7, rng=rng)  # [R, S]
    si, dsi = simulate_many([c], [a], [k], tokens=tokens, repeats=repeats, seed=7, rng=rng)
    for r in range(repeats):
        assert si[0, r] == pytest.approx(reference_si(iter(samples[r]), c, k, tokens), abs=1e-9)
        assert dsi[0, r] == pytest.approx(reference_dsi(iter(samples[r]), c, k, tokens), abs=1e-9)


def test_a_configuration_gives_the_same_result_alone_or_in_a_batch():
    alone_si, alone_dsi = simulate_many([0.3], [0.7], [4], tokens=200, repeats=3, seed=5)
    c = np.array([0.1, 0.3, 0.9, 0.3])
    a = np.array([0.2, 0.7, 0.95, 0.1])
    k = np.array([9, 4, 1, 2])
    si, dsi = simulate_many(c, a, k, tokens=200, repeats=3, seed=5)
    np.testing.assert_array_equal(si[1], alone_si[0])
    np.testing.assert_array_equal(dsi[1], alone_dsi[0])


def test_same_seed_same_costs_and_different_seed_different_costs():
    a = simulate_offline(0.2, 0.8, 3, tokens=300, repeats=3, seed=1)
    b = simulate_offline(0.2, 0.8, 3, tokens=300, repeats=3, seed=1)
    c = simulate_offline(0.2, 0.8, 3, tokens=300, repeats=3, seed=2)
    np.testing.assert_array_equal(a.dsi, b.dsi)
    assert not np.array_equal(a.dsi, c.dsi)


def test_acceptance_extremes_have_closed_forms():
    S, k, c = 100, 4, 0.2

    def si_cost(lefts):  # one SI iteration at each number of tokens left
        return sum(min(k, left - 1) * c + 1 for left in lefts)

    r0 = simulate_offline(c, 0.0, k, tokens=S, repeats=2, sp=None)
    assert np.all(r0.dsi == pytest.approx(S))  # every segment: 1 token at cost T
    assert np.all(r0.si == pytest.approx(si_cost(range(S, 0, -1))))  # 1 token per iteration
    r1 = simulate_offline(c, 1.0, k, tokens=S, repeats=2, sp=None)
    assert np.all(r1.dsi == pytest.approx((S - 1) * c + 1))  # one segment: all drafts, one target call
    assert np.all(r1.si == pytest.approx(si_cost(range(S, 0, -(k + 1)))))  # k + 1 tokens per iteration


# ---- invariants over a grid ---------------------------------------------------------------------
C = [0.01, 0.05, 0.2, 0.5, 0.9, 1.0]
A = [0.01, 0.3, 0.6, 0.9, 0.99]
K = [1, 2, 5, 10, 20]


def test_invariants_per_repeat_over_a_grid():
    cc, aa, kk = (g.ravel() for g in np.meshgrid(C, A, K, indexing="ij"))
    S = 400
    si, dsi = simulate_many(cc, aa, kk, tokens=S, repeats=4, seed=3)  # [N, R]
    valid = required_sp_array(cc, 1.0, kk) <= 7
    assert np.all(dsi[valid] <= si[valid] + 1e-9), "DSI slower than SI in some repeat"
    assert np.all(dsi <= S + 1e-9), "DSI slower than non-SI"
    lower = np.array([dsi_lower_bound(c, int(k), S) for c, k in zip(cc, kk, strict=True)])
    assert np.all(dsi >= lower[:, None] - 1e-9)
    assert np.all(si >= S / (kk[:, None] + 1) - 1e-9)  # SI commits at most k + 1 tokens per target call


# ---- Equation 1 ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("c", "T", "k", "sp"), [(0.1, 1, 5, 2), (0.5, 1, 1, 2), (0.01, 2, 10, 20), (0.011, 1, 10, 10), (1 / 7, 1, 1, 7)]
)
def test_equation1_examples(c, T, k, sp):
    assert required_sp(c, T, k) == sp
    assert required_sp_array(np.array([c]), T, np.array([k]))[0] == sp


def test_min_lookahead_is_equation1_solved_for_k():
    assert min_lookahead(0.1, 1.0, 7) == 2
    assert min_lookahead(1 / 7, 1.0, 7) == 1
    for c in (0.013, 0.07, 0.3):
        k = min_lookahead(c, 1.0, 7)
        assert required_sp(c, 1.0, k) <= 7 < required_sp(c, 1.0, k - 1) if k > 1 else True


# ---- errors -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(c=1.0, a=0.5, lookahead=2), "c=1.0 must be in (0, 1)"),
        (dict(c=1.5, a=0.5, lookahead=2), "c=1.5 must be in (0, 1)"),
        (dict(c=0.0, a=0.5, lookahead=2), "c=0.0 must be in (0, 1)"),
        (dict(c=-0.1, a=0.5, lookahead=2), "c=-0.1 must be in (0, 1)"),
        (dict(c=0.1, a=1.2, lookahead=2), "a=1.2 must be in [0, 1]"),
        (dict(c=0.1, a=-0.1, lookahead=2), "a=-0.1 must be in [0, 1]"),
        (dict(c=0.1, a=0.5, lookahead=0), "lookahead=0 must be an integer >= 1"),
        (dict(c=0.1, a=0.5, lookahead=2, tokens=0), "tokens=0 must be an integer >= 1"),
        (dict(c=0.1, a=0.5, lookahead=2, repeats=0), "repeats=0 must be an integer >= 1"),
        (dict(c=0.1, a=0.5, lookahead=2, rng="mt"), "rng='mt' must be one of pcg64, legacy"),
        (dict(c=0.1, a=0.5, lookahead=1, sp=7), "Equation 1 needs sp >= ceil(T / (k c)) = 10"),
    ],
)
def test_errors_name_the_value_and_what_is_allowed(kwargs, message):
    with pytest.raises(ConfigError) as info:
        simulate_offline(**kwargs)
    assert message in str(info.value)


def test_equation1_error_also_gives_the_minimal_lookahead():
    with pytest.raises(ConfigError, match=r"lookahead >= 2 with sp=7"):
        simulate_offline(0.1, 0.5, 1, sp=7)
    simulate_offline(0.1, 0.5, 1, sp=10, tokens=20)  # exactly Equation 1: fine
