"""Seeded chi-square tests: DSI and SI sampling have exactly the target's multi-token law.

Each sample is one generation with its own seed (seeds 0..N-1, fixed, so the test is
deterministic). The expected law of the 3-token continuation is computed exactly from the
target's processed distributions. alpha = 1e-4.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

import dsi
from dsi.engine.api import build_decoder, make_request
from dsi.models import CallableLM
from dsi.models.emulated.synthetic import SyntheticTarget
from tests.conftest import HandOverSchedule, exact_sequence_law, random_lm

ALPHA = 1e-4
N_SAMPLES = 2000  # seeds per test: enough power (the guard below), and the default run stays under 15 min
VOCAB, LENGTH = 3, 3
PROMPT = (1, 0)
SLOW = pytest.mark.slow  # in CI's slow run, to keep the default run under 15 minutes in all


def sample_counts(decoder, params_for_seed, law, eos=None):
    index = {seq: i for i, seq in enumerate(law)}
    counts = np.zeros(len(law))
    for seed in range(N_SAMPLES):
        request = make_request(PROMPT, LENGTH, params_for_seed(seed), eos, VOCAB)
        counts[index[tuple(decoder.generate(request).tokens)]] += 1
    return counts


def _law_cases():
    """Every configuration with both processings. The default run keeps SI with both and two DSI cases: fixed k on
    3 servers with plain temperature and event-driven on one with top-k / top-p; the other DSI cases run in CI's
    slow run (each DSI case costs seconds: 2000 requests through a pool of threads)."""
    default = {("dsi", 2, 3, False), ("dsi", "auto", 1, True)}
    for processing in (dict(temperature=1.0), dict(temperature=0.8, top_k=2, top_p=0.9)):
        for method, lookahead, servers in (("dsi", 1, 2), ("dsi", 2, 3), ("dsi", "auto", 1), ("dsi", "auto", 3),
                                           ("si", 2, 1), ("si", 3, 1)):
            slow = method == "dsi" and (method, lookahead, servers, "top_k" in processing) not in default
            yield pytest.param(method, lookahead, servers, processing, marks=[SLOW] if slow else [])


@pytest.mark.parametrize("method, lookahead, servers, processing", list(_law_cases()))
def test_sampling_matches_the_target_law(method, lookahead, servers, processing, no_thread_leak):
    target = random_lm(VOCAB, seed=21, sharpness=1.0)
    drafter = random_lm(VOCAB, seed=99, sharpness=1.5)  # a poor drafter: many residual draws
    assert_target_law(target, drafter, method, lookahead, servers, processing)


@pytest.mark.parametrize("method, lookahead, servers", [pytest.param("dsi", 2, 1, marks=SLOW), ("dsi", "auto", 2),
                                                       pytest.param("dsi", 2, 3, marks=SLOW), ("si", 2, 1)])
def test_sampling_with_penalties_bias_min_p_and_min_tokens_matches_the_processed_target_law(
        method, lookahead, servers, no_thread_leak):
    """Every row (target and drafter, drafts included in its prefix) is processed with the tokens
    before it; token 2 is EOS, held back for the first two tokens."""
    target = random_lm(VOCAB, seed=21, sharpness=1.0)
    drafter = random_lm(VOCAB, seed=99, sharpness=1.5)
    processing = dict(temperature=0.9, presence_penalty=0.8, frequency_penalty=0.3, repetition_penalty=1.3,
                      logit_bias={1: 0.6}, min_p=0.05, min_tokens=2)
    assert_target_law(target, drafter, method, lookahead, servers, processing, eos=2)


@pytest.mark.parametrize("method, lookahead, servers, tree", [
    pytest.param("dsi", 1, 1, "3", marks=SLOW), pytest.param("dsi", "auto", 3, "auto", marks=SLOW),
    pytest.param("si", 3, 1, "2,2", marks=SLOW), ("si", 3, 1, "auto"), pytest.param("si", 4, 1, "best-first", marks=SLOW),
    pytest.param("si", 3, 1, "branches:0.05", marks=SLOW), pytest.param("dsi", 2, 2, "branches:0.05", marks=SLOW),
])
def test_sampling_with_draft_trees_matches_the_target_law(method, lookahead, servers, tree, no_thread_leak):
    """Tree windows (issue 24): side children followed when the chain's correction is one of them, then
    the target's own token after it (DSI; with ``branches`` the drafter's draft after each side child
    guesses it, and the row after that draft decides the next position where it guessed right), or the
    walk down a tree (SI); penalties make every path's rows differ from the main path's."""
    target = random_lm(VOCAB, seed=21, sharpness=1.0)
    drafter = random_lm(VOCAB, seed=99, sharpness=1.5)
    processing = dict(temperature=0.9, presence_penalty=0.5, repetition_penalty=1.2)
    assert_target_law(target, drafter, method, lookahead, servers, processing, draft_tree=tree)


def assert_target_law(target, drafter, method, lookahead, servers, processing, eos=None, draft_tree=None) -> None:
    """Chi-square of N_SAMPLES seeded generations against the target's exact sequence law."""
    stops = frozenset() if eos is None else frozenset({eos})
    law = exact_sequence_law(target, PROMPT, LENGTH, dsi.SamplingParams(**processing, seed=0), stops)
    decoder = build_decoder(
        target=target, drafter=drafter, method=method, lookahead=lookahead, num_target_servers=servers,
        draft_tree=draft_tree,
    )
    try:
        counts = sample_counts(decoder, lambda s: dsi.SamplingParams(**processing, seed=s), law, eos)
    finally:
        decoder.close()
    expected = np.array(list(law.values())) * N_SAMPLES
    assert counts.sum() == N_SAMPLES
    _, p_value = chisquare(counts, expected)
    assert p_value > ALPHA, f"p={p_value:.2e}: counts {counts} vs expected {np.round(expected, 1)}"


@pytest.mark.parametrize("method, lookahead, servers", [pytest.param("dsi", 2, 2, marks=SLOW), ("dsi", "auto", 2),
                                                       ("si", 2, 1)])
def test_sampling_with_a_drafter_out_of_context_matches_the_target_law(method, lookahead, servers, no_thread_leak):
    """The drafter holds 3 tokens: after the 2-token prompt it drafts positions 2 and 3 at most,
    position 4 is always the target's own (bonus) token. The law is still exactly the target's."""
    target = random_lm(VOCAB, seed=21, sharpness=1.0)
    drafter = CallableLM(SyntheticTarget(VOCAB, 99, 1.5), VOCAB, name="short drafter", max_context=3)
    assert_target_law(target, drafter, method, lookahead, servers, dict(temperature=0.9, top_k=2))


@pytest.mark.parametrize("method, lookahead, servers, tree", [
    ("ar", 1, 1, None), ("si", 2, 1, None), pytest.param("dsi", "auto", 2, None, marks=SLOW),
    pytest.param("dsi", 2, 3, None, marks=SLOW), pytest.param("si", 3, 1, "branches:0.05", marks=SLOW),
])
def test_coupled_draws_match_the_target_law(method, lookahead, servers, tree, no_thread_leak):
    """Coupled draws (dsi.coupling): the drafter and the target draw with the same keyed Gumbel noise and the
    target's draw decides; the law is still exactly the target's, top-p included."""
    target = random_lm(VOCAB, seed=21, sharpness=1.0)
    drafter = None if method == "ar" else random_lm(VOCAB, seed=99, sharpness=1.5)
    assert_target_law(target, drafter, method, lookahead, servers, dict(temperature=0.9, top_p=0.95, coupled=True),
                      draft_tree=tree)


def test_the_chi_square_check_detects_a_biased_sampler():
    """Guard: the same check rejects a sampler that ignores the residual (draft always kept)."""
    target = random_lm(VOCAB, seed=21, sharpness=1.0)
    drafter = random_lm(VOCAB, seed=99, sharpness=1.5)
    params = dsi.SamplingParams(temperature=1.0, seed=0)
    law = exact_sequence_law(target, PROMPT, LENGTH, params)
    biased = exact_sequence_law(drafter, PROMPT, LENGTH, params)  # what "always accept" emits
    rng = np.random.default_rng(0)
    keys = list(law)
    draws = rng.choice(len(keys), size=N_SAMPLES, p=np.array([biased[k] for k in keys]))
    counts = np.bincount(draws, minlength=len(keys))
    _, p_value = chisquare(counts, np.array(list(law.values())) * N_SAMPLES)
    assert p_value < ALPHA


@pytest.mark.parametrize("method, lookahead, servers", [("si", 2, 1), pytest.param("dsi", 2, 2, marks=SLOW)])
def test_sampling_handed_over_between_speculation_and_plain_decoding_matches_the_target_law(
        method, lookahead, servers, no_thread_leak):
    """dsi serve's speculation chosen by load (dsi.server.load_choice) hands a request over at a decided position;
    the next decoder goes on after the committed tokens. Handed over both ways at every position, penalties
    reading the committed tokens as output, the law is still exactly the target's."""
    from dsi.server.load_choice import LoadChosenDecoder

    target = random_lm(VOCAB, seed=21, sharpness=1.0)
    drafter = random_lm(VOCAB, seed=99, sharpness=1.5)
    processing = dict(temperature=0.9, presence_penalty=0.8, repetition_penalty=1.3)
    law = exact_sequence_law(target, PROMPT, LENGTH, dsi.SamplingParams(**processing, seed=0))
    schedule = HandOverSchedule()
    decoder = LoadChosenDecoder(
        build_decoder(target=target, drafter=drafter, method=method, lookahead=lookahead,
                      num_target_servers=servers),
        build_decoder(target=target, method="ar"), schedule, lambda: 1)
    handed = [0, 0]
    try:
        index = {seq: i for i, seq in enumerate(law)}
        counts = np.zeros(len(law))
        for seed in range(N_SAMPLES):
            result = decoder.generate(make_request(PROMPT, LENGTH, dsi.SamplingParams(**processing, seed=seed),
                                                   None, VOCAB))
            counts[index[tuple(result.tokens)]] += 1
            for handoff in result.stats.extra["load"]["handoffs"]:
                handed[handoff["to"] == "speculative"] += 1
    finally:
        decoder.close()
    assert min(handed) > N_SAMPLES / 8  # both ways were handed over to, often
    _, p_value = chisquare(counts, np.array(list(law.values())) * N_SAMPLES)
    assert p_value > ALPHA, f"p={p_value:.2e}: counts {counts} vs expected {np.round(np.array(list(law.values())) * N_SAMPLES, 1)}"
