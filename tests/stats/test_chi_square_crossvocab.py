"""Sampling with a drafter of another vocabulary (token-level intersection, TLI) keeps the target's law.

Two small vocabularies that overlap in part: the target's tokens spell {a, b, ab, c}, the drafter's
{b, a, ba, c, d} (other ids; "ab" is the target's own, "ba" and "d" the drafter's own). The drafter's
logits reach the engines through a real :class:`~dsi.models.vocab.bridge.CrossVocabularySession`
(the drafter's law restricted to the shared tokens, -inf elsewhere; with merges, "ab" takes the part
of a's mass the drafter gives b after a: :mod:`dsi.models.vocab.merges`).

(a) Exactly, in float64: the law of the token the decision functions emit at one position (the
draft drawn by :func:`dsi.sampling.draft_from_logits` from that row, then :func:`dsi.sampling.decide`)
is enumerated over the uniforms (the counter-based RNG is patched, as in tests/unit/test_sampling.py)
and equals the target's processed law p, for several p (also with mass on tokens outside the
intersection), temperatures, top-k and top-p.

(b) Seeded chi-square (as tests/stats/test_chi_square.py): N generations with seeds 0..N-1 of SI and
DSI (k = 2 and "auto", 1-3 servers) against the target's exact 3-token law, alpha = 1e-4.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

import dsi.sampling as sampling
from dsi.engine.api import build_decoder, make_request
from dsi.models import CallableLM
from dsi.models.base import forward_rows
from dsi.models.vocab.bridge import CrossVocabularyDrafter
from dsi.sampling import Purpose, SamplingParams, decide, draft_from_logits, process_logits, residual
from tests.conftest import exact_sequence_law, interval_law, random_lm
from tests.tiny_vocab import PiecesTokenizer

ALPHA = 1e-4
N_SAMPLES = 1500
LENGTH = 3
T_TEXTS = ["a", "b", "ab", "c"]  # target ids 0..3
D_TEXTS = ["b", "a", "ba", "c", "d"]  # drafter ids 0..4
SHARED = [0, 1, 3]  # target ids of the intersection (a, b, c); "ab" (2) is the target's alone


def wrapped_drafter(drafter: CallableLM, mode: str = "intersection", d_texts=D_TEXTS,
                    merges: int = 3) -> CrossVocabularyDrafter:
    """The drafter as the engines get it from ``build_decoder`` (through its tokenizers)."""
    from dsi.models.vocab.bridge import bridge_drafter

    target = CallableLM(lambda ctx: np.zeros(len(T_TEXTS)), len(T_TEXTS))
    out = bridge_drafter(target, drafter, mode, target_tokenizer=PiecesTokenizer(T_TEXTS),
                         drafter_tokenizer=PiecesTokenizer(d_texts), merges=merges)
    assert isinstance(out, CrossVocabularyDrafter)
    return out


# ---- (a) the exact law of one decided position ---------------------------------------------------------


def emitted_law(p: np.ndarray, drafter_row: np.ndarray, params: SamplingParams, monkeypatch,
                drafts=SHARED) -> np.ndarray:
    """Exact law of the committed token at one position: the draft drawn from ``drafter_row`` (the
    wrapped drafter's logits in the target's ids) by draft_from_logits, then decide(p, draft, q).

    Every uniform the real functions draw (DRAFT, ACCEPT, RESIDUAL) is enumerated over the
    intervals on which they are constant, by patching the counter-based RNG."""
    current: dict = {}
    monkeypatch.setattr(sampling, "uniform", lambda seed, position, purpose: current[purpose])
    q = process_logits(drafter_row, params)

    def draw(u):
        current[Purpose.DRAFT] = u
        token, q_seen = draft_from_logits(drafter_row, params, 0)
        np.testing.assert_array_equal(q_seen, q)
        return token

    law = np.zeros_like(p)
    for x, mass_x in interval_law(draw, np.cumsum(q)).items():
        assert q[x] > 0 and x in drafts  # drafts are shared tokens only (and merged ones, with merges)
        ratio = min(1.0, p[x] / q[x])
        for lo, hi in ((0.0, ratio), (ratio, 1.0)):
            if hi <= lo:
                continue
            current[Purpose.ACCEPT] = (lo + hi) / 2

            def decided(u, x=x):
                current[Purpose.RESIDUAL] = u
                return decide(p, int(x), q, params, 0).token

            for token, mass in interval_law(decided, np.cumsum(residual(p, q))).items():
                law[token] += mass_x * (hi - lo) * mass
    return law


PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=2.0),
    SamplingParams(temperature=1.0, top_k=2),
    SamplingParams(temperature=0.8, top_p=0.7),
    SamplingParams(temperature=1.3, top_k=3, top_p=0.9),
]
TARGET_ROWS = {
    "spread": np.log([0.3, 0.2, 0.4, 0.1]),
    "mostly off the intersection": np.log([0.05, 0.05, 0.85, 0.05]),
    "only off the intersection": np.array([-np.inf, -np.inf, 0.0, -np.inf]),
    "no mass on a": np.array([-np.inf, 1.0, 0.5, -1.0]),
    "random": np.random.default_rng(5).normal(size=4) * 2,
}
DRAFTER_ROWS = {
    "spread": np.log([0.3, 0.3, 0.2, 0.1, 0.1]),  # b, a, ba, c, d
    "mostly its own tokens": np.log([0.02, 0.03, 0.5, 0.05, 0.4]),
    "sure of b": np.array([5.0, -2.0, 0.0, -3.0, 1.0]),
    "random": np.random.default_rng(6).normal(size=5) * 2,
}


@pytest.mark.parametrize("merges", [0, 3])
@pytest.mark.parametrize("params", PARAMS, ids=repr)
@pytest.mark.parametrize("target_case", list(TARGET_ROWS))
@pytest.mark.parametrize("drafter_case", list(DRAFTER_ROWS))
def test_one_position_emits_exactly_the_target_law(params, target_case, drafter_case, merges, monkeypatch):
    drafter_row = DRAFTER_ROWS[drafter_case]
    wrapped = wrapped_drafter(CallableLM(lambda ctx: drafter_row, len(D_TEXTS)), merges=merges)
    row = forward_rows(wrapped.new_session(), [0, 3, 2], 1)[-1]  # the session's row after "acab"  # [4]
    assert row.shape == (4,)
    if merges:
        np.testing.assert_allclose(row, merged_row(drafter_row), rtol=1e-12)
    else:
        assert np.isneginf(row[2])
        np.testing.assert_array_equal(row[SHARED], drafter_row[[1, 0, 3]])  # a, b, c in the drafter's ids
    p = process_logits(TARGET_ROWS[target_case], params)
    law = emitted_law(p, row, params, monkeypatch, drafts=(0, 1, 2, 3) if merges else SHARED)
    # exact to the float32 laws' own rounding (each sums to 1 within 1e-7: dsi.sampling.LAW_DTYPE; a law that
    # sums to 1 composes exactly, tests/unit/test_logit_processors.py), far inside any chi-square's reach
    np.testing.assert_allclose(law, p, rtol=0, atol=1e-6)


def merged_row(drafter_row: np.ndarray) -> np.ndarray:
    """The merged intersection logits (target ids a, b, ab, c) of a drafter whose row is ``drafter_row``
    after every context: "ab" is "a" then "b", so it takes q(a) P(b), and "a" keeps q(a) (1 - P(b)); a
    candidate only when a's probability is at least 1% of the likeliest shared token's."""
    shared = drafter_row[[1, 0, 3]]  # a, b, c
    if shared[0] < shared.max() + np.log(0.01):
        return np.array([shared[0], shared[1], -np.inf, shared[2]])
    going_on = np.exp(drafter_row[0] - np.logaddexp.reduce(drafter_row))  # P(b | ..., a) over all drafter tokens
    return np.array([shared[0] + np.log1p(-going_on), shared[1], shared[0] + np.log(going_on), shared[2]])


def test_the_intersection_law_is_the_drafter_s_restricted_and_renormalized():
    drafter_row = DRAFTER_ROWS["random"]
    wrapped = wrapped_drafter(CallableLM(lambda ctx: drafter_row, len(D_TEXTS)), merges=0)
    row = forward_rows(wrapped.new_session(), [1], 1)[-1]
    q = process_logits(row, SamplingParams(temperature=1.0))
    law = np.exp(drafter_row - drafter_row.max())
    shared = law[[1, 0, 3]] / law[[1, 0, 3]].sum()
    np.testing.assert_allclose(q[SHARED], shared, rtol=1e-6)  # float32 laws (dsi.sampling.LAW_DTYPE)
    assert q[2] == 0.0


def test_merges_move_mass_from_a_shared_token_to_the_target_token_it_begins():
    """With merges, "ab" (the target's alone) is drafted with the probability the drafter writes "a" and then
    "b", read from the drafter's row after "a" (here another row than after the context: the drafter is
    context-dependent), and "a" keeps the rest of its mass; b and c keep theirs, and the law sums to 1."""
    after_a = np.log([0.6, 0.1, 0.1, 0.1, 0.1])  # b, a, ba, c, d: after "a", the drafter goes on with "b" at 0.6
    elsewhere = np.log([0.2, 0.5, 0.1, 0.1, 0.1])
    drafter = CallableLM(lambda ctx: after_a if ctx and ctx[-1] == 1 else elsewhere, len(D_TEXTS))
    session = wrapped_drafter(drafter).new_session()
    q = process_logits(forward_rows(session, [3], 1)[-1], SamplingParams(temperature=1.0))  # after "c"
    restricted = np.array([0.5, 0.2, 0.1]) / 0.8  # a, b, c of the drafter's law after "c", renormalized
    np.testing.assert_allclose(q, [restricted[0] * 0.4, restricted[1], restricted[0] * 0.6, restricted[2]],
                               rtol=1e-12)
    assert session.counters["drafter_merge_forwards"] == 1
    forwards = session.counters["drafter_model_forwards"]
    forward_rows(session, [3, 0], 1)  # after "c a": the lookahead computed that row already
    assert session.counters["drafter_model_forwards"] == forwards + (session.counters["drafter_merge_forwards"] - 1)


def test_greedy_decides_the_target_argmax_whatever_the_draft():
    p = process_logits(TARGET_ROWS["mostly off the intersection"], SamplingParams())
    for x in SHARED:
        decision = decide(p, x, None, SamplingParams(), 0)
        assert (decision.token, decision.accepted) == (2, False)


# ---- (b) seeded chi-square of whole generations -----------------------------------------------------------


def chi_square_p(counts, law) -> float:
    """p-value of the counts against the law, cells expected below 5 pooled into one."""
    expected = np.array(list(law.values())) * N_SAMPLES
    small = expected < 5
    observed = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    return chisquare(observed, expected).pvalue


SLOW = pytest.mark.slow  # in CI's slow run: each DSI case costs seconds, and the default run stays under 15 minutes
CASES = [  # method, lookahead, servers, vocab_mode, processing (the default run: SI in both modes, and DSI)
    ("si", 2, 1, "intersection", dict(temperature=1.0)),
    ("si", 3, 1, "auto", dict(temperature=0.8, top_k=3, top_p=0.9)),
    pytest.param("dsi", 2, 1, "auto", dict(temperature=1.0), marks=SLOW),
    pytest.param("dsi", 2, 3, "intersection", dict(temperature=0.8, top_k=3, top_p=0.9), marks=SLOW),
    pytest.param("dsi", "auto", 1, "intersection", dict(temperature=1.0), marks=SLOW),
    ("dsi", "auto", 2, "auto", dict(temperature=1.2, top_k=2)),
    # rows processed with their prefix; the bias is in target ids, so it reaches the drafter's row
    # through the intersection (its shared tokens), and the target's own row everywhere
    ("si", 2, 1, "intersection", dict(temperature=0.9, presence_penalty=0.7, repetition_penalty=1.3,
                                      logit_bias={"2": 1.0, "1": -0.5}, min_p=0.05)),
    pytest.param("dsi", 2, 2, "auto", dict(temperature=0.9, frequency_penalty=0.6, logit_bias={"0": 0.8}, min_p=0.05),
                 marks=SLOW),
]


@pytest.mark.parametrize("method, lookahead, servers, mode, processing", CASES)
def test_sampling_with_a_drafter_of_another_vocabulary_matches_the_target_law(
        method, lookahead, servers, mode, processing, no_thread_leak):
    target = random_lm(len(T_TEXTS), seed=21, sharpness=1.0)
    drafter = random_lm(len(D_TEXTS), seed=99, sharpness=1.5)  # its own tokens take some of its mass
    assert_target_law(target, drafter, D_TEXTS, (0, 3), method, lookahead, servers, mode, processing)


@pytest.mark.parametrize("method, lookahead, servers", [("si", 2, 1), pytest.param("dsi", "auto", 2, marks=SLOW)])
def test_the_law_holds_where_the_drafter_cannot_spell_the_text(method, lookahead, servers, no_thread_leak):
    """A drafter without "c": once the target writes c, the drafter has nothing to propose
    (DraftUnavailable) and the target's own tokens follow; the law is still the target's."""
    target = random_lm(len(T_TEXTS), seed=22, sharpness=1.0)
    drafter = random_lm(4, seed=98, sharpness=1.5)
    assert_target_law(target, drafter, ["b", "a", "ba", "d"], (0, 1), method, lookahead, servers, "auto",
                      dict(temperature=1.0), vocab_intersection=2)


def assert_target_law(target, drafter, d_texts, prompt, method, lookahead, servers, mode, processing,
                      vocab_intersection=3) -> None:
    law = exact_sequence_law(target, prompt, LENGTH, SamplingParams(**processing, seed=0))
    decoder = build_decoder(target=target, drafter=drafter, method=method, lookahead=lookahead,
                            num_target_servers=servers, vocab_mode=mode, target_tokenizer=PiecesTokenizer(T_TEXTS),
                            drafter_tokenizer=PiecesTokenizer(d_texts))
    try:
        counts, accepted, rejected, lookaheads = sample_counts_checked(decoder, prompt, processing, law,
                                                                       vocab_intersection)
    finally:
        decoder.close()
    assert counts.sum() == N_SAMPLES
    assert accepted > N_SAMPLES // 10 and rejected > N_SAMPLES // 10  # both branches, often
    assert lookaheads > 0  # the law was extended to "ab" (a merge: "a" + "b"; its rows are kept across requests)
    first = forward_rows(wrapped_drafter(drafter, d_texts=d_texts).new_session(), list(prompt), 1)[-1]
    assert np.isfinite(first[2])  # "ab" can be drafted at the first position
    p_value = chi_square_p(counts, law)
    expected = np.array(list(law.values())) * N_SAMPLES
    assert p_value > ALPHA, f"p={p_value:.2e}: counts {counts} vs expected {np.round(expected, 1)}"


def sample_counts_checked(decoder, prompt, processing, law, vocab_intersection):
    lookaheads = 0

    def check(out) -> None:
        nonlocal lookaheads
        extra = out.stats.extra
        assert (extra["vocab_mode"], extra["vocab_intersection"]) == ("intersection", vocab_intersection)
        assert extra["vocab_merge_lookahead"] == 3 and extra["vocab_merges"] == 1  # "ab" = "a" + "b"
        lookaheads += extra.get("drafter_merge_forwards", 0)

    counts, accepted, rejected = seeded_counts(decoder, prompt, processing, law, len(T_TEXTS), check)
    return counts, accepted, rejected, lookaheads


def seeded_counts(decoder, prompt, processing, law, vocab_size, check=None):
    """How often each sequence of ``law`` came out of N_SAMPLES generations with seeds 0..N-1, and the drafts
    accepted and rejected over them; ``check(result)`` on each."""
    index = {seq: i for i, seq in enumerate(law)}
    counts = np.zeros(len(law))
    accepted = rejected = 0
    for seed in range(N_SAMPLES):
        out = decoder.generate(make_request(prompt, LENGTH, SamplingParams(**processing, seed=seed), None,
                                            vocab_size))
        counts[index[tuple(out.tokens)]] += 1
        accepted += out.stats.accepted_tokens
        rejected += out.stats.rejections
        if check is not None:
            check(out)
    return counts, accepted, rejected


def test_the_chi_square_check_detects_a_sampler_that_keeps_every_draft():
    """Guard: the same check rejects "always accept" (the drafter's restricted law at every position)."""
    target = random_lm(len(T_TEXTS), seed=21, sharpness=1.0)
    drafter = random_lm(len(D_TEXTS), seed=99, sharpness=1.5)
    params = SamplingParams(temperature=1.0, seed=0)
    law = exact_sequence_law(target, (0, 3), LENGTH, params)
    wrapped = wrapped_drafter(drafter)

    class Restricted:  # the wrapped drafter's rows as a target-vocabulary model
        def next_logits(self, context):
            return forward_rows(wrapped.new_session(), context, 1)[-1]

    biased = exact_sequence_law(Restricted(), (0, 3), LENGTH, params)
    keys = list(law)
    probs = np.array([biased.get(k, 0.0) for k in keys])
    draws = np.random.default_rng(0).choice(len(keys), size=N_SAMPLES, p=probs / probs.sum())
    counts = np.bincount(draws, minlength=len(keys)).astype(float)
    assert chi_square_p(counts, law) < ALPHA


@pytest.mark.parametrize("method, lookahead, servers, mode", [("si", 2, 1, "intersection"), ("dsi", 2, 2, "auto"),
                                                              pytest.param("dsi", "auto", 3, "intersection",
                                                                           marks=SLOW)])
def test_a_constrained_request_keeps_the_masked_target_law_across_vocabularies(method, lookahead, servers, mode,
                                                                               no_thread_leak):
    """A constraint (in the target's vocabulary: a, b, ab, c and an EOS) masks the target's law; the drafter's
    rows, in the target's ids through the intersection, are masked alike, and where they allow nothing (only the
    target's own "ab" or EOS is left) the target's row decides. The output's law is the target's, masked to the
    grammar and renormalised, enumerated in float64."""
    from dsi.constraints import BoundConstraint, Constraint, TokenTable

    texts = [*T_TEXTS, "<e>"]
    eos = len(T_TEXTS)
    table = TokenTable(tuple(t.encode() for t in T_TEXTS) + (b"",), (eos,))
    processing = dict(temperature=1.0, constraint=BoundConstraint(Constraint.regex("[ac]b?[ac]?"), table))
    target = random_lm(len(texts), seed=23, sharpness=1.0)
    drafter = random_lm(len(D_TEXTS), seed=97, sharpness=1.5)
    prompt = (0, 3)
    law = exact_sequence_law(target, prompt, LENGTH, SamplingParams(**processing, seed=0), frozenset({eos}))
    assert all(seq[0] != 1 for seq in law)  # "b" first: refused by the grammar
    decoder = build_decoder(target=target, drafter=drafter, method=method, lookahead=lookahead,
                            num_target_servers=servers, vocab_mode=mode,
                            target_tokenizer=PiecesTokenizer(texts, eos_token_id=eos),
                            drafter_tokenizer=PiecesTokenizer(D_TEXTS))
    try:
        counts, accepted, rejected = seeded_counts(decoder, prompt, processing, law, len(texts))
    finally:
        decoder.close()
    assert accepted > N_SAMPLES // 10 and rejected > N_SAMPLES // 10
    p_value = chi_square_p(counts, law)
    expected = np.array(list(law.values())) * N_SAMPLES
    assert p_value > ALPHA, f"p={p_value:.2e}: counts {counts} vs expected {np.round(expected, 1)}"
