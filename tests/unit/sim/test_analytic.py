"""Closed forms and exact expectations against both simulators (seeded, deterministic)."""

from __future__ import annotations

import numpy as np
import pytest

from dsi.sim import analytic
from dsi.sim.events import simulate
from dsi.sim.offline import sample_stream, simulate_many, simulate_offline

Z = 4.0  # tolerance in standard errors (seeded: deterministic, and wide enough to be robust)


def test_si_tokens_per_iteration_closed_form_against_the_sample_stream():
    for a, k in ((0.9, 5), (0.5, 1), (0.3, 10), (0.99, 3)):
        n = sample_stream(a, k, tokens=20000, repeats=1, seed=3, rng="pcg64")[0]  # accepted drafts
        expected = analytic.si_expected_tokens_per_iteration(a, k)
        se = np.std(n + 1) / np.sqrt(n.size)
        assert abs(np.mean(n + 1) - expected) < Z * se
    assert analytic.si_expected_tokens_per_iteration(1.0, 4) == 5.0
    assert analytic.si_expected_tokens_per_iteration(0.0, 4) == 1.0


def test_nonsi_and_renewal_closed_forms():
    assert analytic.nonsi_time(1000) == 1000.0
    assert analytic.nonsi_time(10, 2.0, 5.0) == 23.0
    # the renewal estimate ignores end effects: close to the exact value for long runs
    exact = analytic.si_expected_time(0.1, 0.9, 5, 5000)
    assert analytic.si_time_renewal(0.1, 0.9, 5, 5000) == pytest.approx(exact, rel=0.002)


CONFIGS = [(0.1, 0.9, 5, 300), (0.3, 0.5, 2, 120), (0.05, 0.7, 10, 200), (0.5, 0.2, 1, 80), (0.2, 0.95, 8, 150)]


@pytest.mark.parametrize(("c", "a", "k", "S"), CONFIGS)
def test_offline_monte_carlo_matches_the_exact_expectations(c, a, k, S):
    si, dsi = simulate_many([c], [a], [k], tokens=S, repeats=1500, seed=8)
    for samples, exact in ((si[0], analytic.si_expected_time(c, a, k, S)),
                           (dsi[0], analytic.offline_dsi_expected_time(c, a, k, S))):  # fmt: skip
        se = samples.std(ddof=1) / np.sqrt(samples.size)
        assert abs(samples.mean() - exact) < Z * se + 1e-9


@pytest.mark.parametrize(("c", "a", "k", "S"), CONFIGS)
def test_event_monte_carlo_matches_the_exact_expectations(c, a, k, S):
    kw = dict(target_tpot=1.0, drafter_tpot=c, lookahead=k, tokens=S, acceptance=a, repeats=150, seed=5)
    for method, exact in (("dsi", analytic.event_dsi_expected_time(c, a, k, S)),
                          ("si", analytic.si_expected_time(c, a, k, S))):  # fmt: skip
        r = simulate(method, num_servers=None, **kw)
        se = r.std / np.sqrt(len(r.runs))
        assert abs(r.mean - exact) < Z * se + 1e-9


@pytest.mark.parametrize(("c", "a", "k"), [(0.05, 0.6, 8), (0.02, 0.8, 20), (0.1, 0.5, 5)])
def test_offline_and_event_simulators_agree_where_their_accounting_coincides(c, a, k):
    # here a^k is small, so rejections at a multiple of k (the deliberate difference) are rare
    S = 200
    off = simulate_offline(c, a, k, tokens=S, repeats=1000, seed=1, sp=None)
    ev = simulate("dsi", target_tpot=1.0, drafter_tpot=c, lookahead=k, num_servers=None, tokens=S,
                  acceptance=a, repeats=150, seed=2)  # fmt: skip
    se = np.hypot(off.dsi.std() / np.sqrt(off.repeats), ev.std / np.sqrt(len(ev.runs)))
    assert abs(off.mean("dsi") - ev.mean) < Z * se + 0.01 * off.mean("dsi")
    ev_si = simulate("si", target_tpot=1.0, drafter_tpot=c, lookahead=k, tokens=S, acceptance=a, repeats=150, seed=2)
    se = np.hypot(off.si.std() / np.sqrt(off.repeats), ev_si.std / np.sqrt(len(ev_si.runs)))
    assert abs(off.mean("si") - ev_si.mean) < Z * se


@pytest.mark.parametrize(("c", "a", "k"), [(0.1, 0.9, 5), (0.2, 0.7, 3), (0.3, 0.4, 2)])
def test_offline_minus_event_is_the_documented_difference(c, a, k):
    # the offline model charges one window more when a segment's rejection falls on a window
    # boundary; the exact expectations quantify it and the Monte Carlo difference matches
    S = 200
    off = simulate_offline(c, a, k, tokens=S, repeats=1000, seed=1, sp=None)
    ev = simulate("dsi", target_tpot=1.0, drafter_tpot=c, lookahead=k, num_servers=None, tokens=S,
                  acceptance=a, repeats=150, seed=2)  # fmt: skip
    gap = analytic.offline_dsi_expected_time(c, a, k, S) - analytic.event_dsi_expected_time(c, a, k, S)
    assert gap > 0.02 * off.mean("dsi")  # a real, not negligible, difference
    se = np.hypot(off.dsi.std() / np.sqrt(off.repeats), ev.std / np.sqrt(len(ev.runs)))
    assert abs((off.mean("dsi") - ev.mean) - gap) < Z * se


@pytest.mark.parametrize(("c", "p"), [(0.1, 0.9), (0.3, 0.6), (0.6, 0.95), (0.05, 0.3)])
def test_event_dsi_with_lookahead_one_meets_proposition_1(c, p):
    N = 120
    bound = analytic.proposition1_bound(c, 1.0, p, N)
    exact = analytic.event_dsi_expected_time(c, p, 1, N)
    assert exact <= bound + 1e-9
    assert exact == pytest.approx(bound, rel=0.01)  # the bound is tight for k = 1
    r = simulate("dsi", target_tpot=1.0, drafter_tpot=c, lookahead=1, num_servers=None, tokens=N,
                 acceptance=p, repeats=60, seed=3)  # fmt: skip
    assert r.mean < bound + Z * r.std / np.sqrt(len(r.runs))


@pytest.mark.parametrize(("c", "a", "k"), [(0.1, 0.9, 5), (0.2, 0.5, 2), (0.5, 0.99, 1), (0.9, 0.3, 1)])
def test_expected_dsi_is_at_most_si_and_non_si(c, a, k):
    S = 300
    for dsi_time in (analytic.offline_dsi_expected_time(c, a, k, S), analytic.event_dsi_expected_time(c, a, k, S)):
        assert dsi_time <= analytic.si_expected_time(c, a, k, S) + 1e-9
        assert dsi_time <= analytic.nonsi_time(S) + 1e-9
        assert dsi_time >= analytic.dsi_lower_bound(c, k, S) - 1e-9
