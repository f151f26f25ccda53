"""SI's lookahead chosen per window by goodput under load (dsi.engine.goodput): the rule on given measurements, and SI
with it: every window's k may differ, and the output is the fixed-k output (greedy and seeded sampling)."""

from __future__ import annotations

import pytest

import dsi
from dsi.engine.api import make_request
from dsi.engine.goodput import EXPLORE_EVERY, LookaheadByLoad, expected_tokens
from tests.conftest import random_lm

VOCAB = 40
PROMPT = (3, 1, 4, 1, 5)


def measured(policy: LookaheadByLoad, base_s: float, per_position_s: float, draft_s: float, acceptance: float,
             xs=(2, 5, 9, 20, 40)) -> LookaheadByLoad:
    """``policy`` fed verifications on the line ``base_s + per_position_s * x``, drafts of ``draft_s`` and decisions
    at ``acceptance``."""
    for x in xs * 4:
        policy.observe_verification(x, 1, base_s + per_position_s * x)
    policy.observe_drafts(10, 10 * draft_s)
    kept = round(10 * acceptance)
    for _ in range(20):  # windows of 10 decisions at that rate
        policy.observe_decisions(kept, 0)
        policy.observe_decisions(0, 10 - kept)
    return policy


def test_expected_tokens_per_window():
    assert expected_tokens(0, 0.8) == pytest.approx(1.0)
    assert expected_tokens(4, 0.8) == pytest.approx(sum(0.8 ** i for i in range(5)))
    assert expected_tokens(6, 0.0) == pytest.approx(1.0)  # nothing accepted: the correction alone


def test_the_latency_line_is_recovered_from_the_verifications():
    policy = measured(LookaheadByLoad(8), 0.007, 0.000035, 0.001, 0.8)
    base, slope = policy.line()
    assert base == pytest.approx(0.007, rel=1e-6) and slope == pytest.approx(0.000035, rel=1e-6)
    flat = LookaheadByLoad(8)
    for _ in range(5):
        flat.observe_verification(5, 1, 0.01)  # one x only: no slope can be measured, none is assumed
    assert flat.line() == pytest.approx((0.01, 0.0))


def test_before_every_input_is_measured_it_takes_the_largest_lookahead():
    policy = LookaheadByLoad(6)
    assert policy.choose() == 6
    policy.observe_verification(4, 1, 0.01)
    assert policy.choose() == 6  # no drafter step nor acceptance yet


def chosen(policy: LookaheadByLoad, running: int, windows: int = EXPLORE_EVERY - 1) -> set[int]:
    """The lookaheads of ``windows`` windows at ``running`` requests (none of them a window that explores)."""
    policy._running = lambda: running
    policy.windows = 0
    return {policy.choose() for _ in range(windows)}


def test_the_lookahead_falls_as_the_load_grows_to_plain_steps():
    """A GPU-like engine (a 7 ms step, 35 us a position), a 1 ms drafter, acceptance 0.8: a long window alone, a
    shorter one as the running requests' positions make each step slower, and none once they dominate it."""
    policy = measured(LookaheadByLoad(8), 0.007, 0.000035, 0.001, 0.8)
    picks = [chosen(policy, running) for running in (1, 8, 32, 256, 4096)]
    assert all(len(p) == 1 for p in picks)
    ks = [p.pop() for p in picks]
    assert ks == sorted(ks, reverse=True) and ks[0] >= 3 and ks[0] > ks[2] and ks[-1] == 0
    for running, k in zip((1, 8, 32, 256, 4096), ks, strict=True):  # each is the best rate at its load
        rates = {j: policy.rate(j, running, policy.acceptance()) for j in range(9)}
        assert rates[k] == max(rates.values())


def test_a_request_that_rejects_more_than_the_server_gets_shorter_windows():
    policy = measured(LookaheadByLoad(8), 0.007, 0.000035, 0.001, 0.8)
    policy._running = lambda: 1
    server_k = policy.choose()
    assert policy.choose(accepted=2, decided=40) < server_k  # its own acceptance: 0.05
    server = policy.accepted / policy.decided
    assert policy.acceptance(2, 40) == pytest.approx((2 + 8 * server) / (40 + 8))


def test_every_eighth_window_takes_a_neighbour_so_the_slope_stays_measurable():
    policy = measured(LookaheadByLoad(8), 0.007, 0.000035, 0.001, 0.8)
    policy._running = lambda: 8
    best = chosen(policy, 8).pop()
    policy.windows = 0
    assert 0 < best < 8
    picks = [policy.choose() for _ in range(4 * EXPLORE_EVERY)]
    off = [i for i, k in enumerate(picks) if k != best]
    assert off == [EXPLORE_EVERY * j - 1 for j in range(1, 5)]
    assert {picks[i] for i in off} == {best - 1, best + 1}


def test_bad_largest_lookahead_is_refused():
    with pytest.raises(ValueError, match="max_lookahead=0 must be an integer >= 1"):
        LookaheadByLoad(0)


class Varying(LookaheadByLoad):
    """A lookahead that moves every window (0 .. max): what load would do to the windows of a request."""

    def __init__(self, max_lookahead: int) -> None:
        super().__init__(max_lookahead)
        self.picks: list[int] = []

    def choose(self, accepted: int = 0, decided: int = 0) -> int:
        k = (len(self.picks) * 3) % (self.max_lookahead + 1)
        self.picks.append(k)
        return k


def test_si_with_a_lookahead_that_moves_each_window_gives_the_fixed_lookahead_greedy_tokens(no_thread_leak):
    target, drafter = random_lm(VOCAB, seed=7, sharpness=3.0), random_lm(VOCAB, seed=8, sharpness=3.0)
    request = make_request(PROMPT, 24, None, None, VOCAB)
    with dsi.build_decoder(target=target, drafter=drafter, method="si", lookahead=4) as fixed:
        expected = fixed.generate(request).tokens
    with dsi.build_decoder(target=target, drafter=drafter, method="si", lookahead=4) as moving:
        moving.policy = policy = Varying(4)
        result = moving.generate(request)
    assert result.tokens == expected
    assert len(set(policy.picks)) == 5  # every k from 0 to 4 was taken
    assert sum(result.stats.extra["lookaheads"].values()) == len(policy.picks)
    assert policy.windows == 0 and policy.line() is not None  # it measured the windows it did not choose


def test_sampled_si_with_a_lookahead_that_moves_each_window_keeps_the_targets_law(no_thread_leak):
    """Chi-square over the 3-token sequences of requests (a seed each) against the target's exact law, every
    window's k moving."""
    from scipy.stats import chisquare

    from tests.conftest import exact_sequence_law

    vocab, prompt, length, samples = 6, (1, 2), 3, 1500
    target, drafter = random_lm(vocab, seed=3, sharpness=1.0), random_lm(vocab, seed=4, sharpness=1.0)
    law = exact_sequence_law(target, prompt, length, dsi.SamplingParams(temperature=1.0))
    index = {seq: i for i, seq in enumerate(law)}
    counts = [0] * len(law)
    with dsi.build_decoder(target=target, drafter=drafter, method="si", lookahead=3) as decoder:
        decoder.policy = policy = Varying(3)
        for seed in range(samples):  # a seed a request, as a server draws one for a request without
            out = decoder.generate(make_request(prompt, length, dsi.SamplingParams(temperature=1.0, seed=seed),
                                                None, vocab))
            counts[index[tuple(out.tokens)]] += 1
    expected = [p * samples for p in law.values()]
    assert chisquare(counts, expected).pvalue > 1e-3
    assert len(set(policy.picks)) == 4


def test_si_feeds_the_policy_what_it_measured(no_thread_leak):
    target, drafter = random_lm(VOCAB, seed=7, sharpness=3.0), random_lm(VOCAB, seed=7, sharpness=3.0)
    with dsi.build_decoder(target=target, drafter=drafter, method="si", lookahead=3) as decoder:
        decoder.policy = policy = LookaheadByLoad(3)
        result = decoder.generate(make_request(PROMPT, 20, None, None, VOCAB))
    snapshot = policy.snapshot()
    assert snapshot["acceptance"] == pytest.approx(1.0)  # the drafter is the target: every draft kept
    assert snapshot["draft_s"] > 0 and snapshot["latency_line_s"]["base"] > 0
    assert snapshot["windows"] == sum(result.stats.extra["lookaheads"].values())
