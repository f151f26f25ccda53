"""Verification math: logit processing, counter-based RNG, and exact laws of the decisions."""

from __future__ import annotations

import numpy as np
import pytest

import dsi.sampling as sampling
from dsi.errors import ConfigError
from dsi.sampling import (
    Purpose,
    SamplingParams,
    bonus,
    decide,
    draft_token,
    process_logits,
    residual,
    sample_from,
    uniform,
)
from tests.conftest import interval_law

SAMPLE = SamplingParams(temperature=1.0, seed=7)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"temperature": -0.1}, "temperature=-0.1"),
        ({"temperature": float("nan")}, "temperature=nan"),
        ({"top_k": -1}, "top_k=-1"),
        ({"top_k": 1.5}, "top_k=1.5"),
        ({"top_p": 0.0}, "top_p=0.0"),
        ({"top_p": 1.5}, "top_p=1.5"),
        ({"seed": -1}, "seed=-1"),
        ({"seed": 2**63}, "seed="),
        ({"seed": "x"}, "seed='x'"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(".", r"\.")):
        SamplingParams(**kwargs)


def test_uniform_is_a_pure_function_of_its_key():
    a = uniform(3, 10, Purpose.ACCEPT)
    assert a == uniform(3, 10, Purpose.ACCEPT)
    others = {uniform(4, 10, Purpose.ACCEPT), uniform(3, 11, Purpose.ACCEPT), uniform(3, 10, Purpose.RESIDUAL)}
    assert a not in others
    values = np.array([uniform(1, i, Purpose.DRAFT) for i in range(20000)])
    assert values.min() >= 0.0 and values.max() < 1.0
    # uniform on [0, 1): mean and decile counts within generous bounds
    assert abs(values.mean() - 0.5) < 0.01
    counts = np.histogram(values, bins=10, range=(0, 1))[0]
    assert counts.min() > 1800 and counts.max() < 2200


def test_process_logits_greedy_is_one_hot_of_first_argmax():
    probs = process_logits(np.array([1.0, 3.0, 3.0, 0.0]), SamplingParams())
    assert probs.tolist() == [0.0, 1.0, 0.0, 0.0]


def test_process_logits_temperature_top_k_top_p():
    logits = np.log(np.array([0.5, 0.25, 0.15, 0.1]))
    assert np.allclose(process_logits(logits, SamplingParams(temperature=1.0)), [0.5, 0.25, 0.15, 0.1])
    hot = process_logits(logits, SamplingParams(temperature=2.0))
    expected = np.sqrt([0.5, 0.25, 0.15, 0.1])
    assert np.allclose(hot, expected / expected.sum())
    top2 = process_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert np.allclose(top2, [2 / 3, 1 / 3, 0, 0])
    # top_p: smallest prefix reaching 0.7 is {0.5, 0.25}
    nucleus = process_logits(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert np.allclose(nucleus, [2 / 3, 1 / 3, 0, 0])
    # top_p below the top token's mass keeps exactly that token
    assert np.allclose(process_logits(logits, SamplingParams(temperature=1.0, top_p=0.1)), [1, 0, 0, 0])


def test_top_k_keeps_ties_with_the_kth_value():
    probs = process_logits(np.array([2.0, 1.0, 1.0, 0.0]), SamplingParams(temperature=1.0, top_k=2))
    assert (probs > 0).tolist() == [True, True, True, False]


def test_sample_from_has_exactly_the_given_law():
    probs = np.array([0.1, 0.0, 0.35, 0.05, 0.5])
    law = interval_law(lambda u: sample_from(probs, u), np.cumsum(probs))
    assert set(law) == {0, 2, 3, 4}  # never the zero-mass token
    for token, mass in law.items():
        assert mass == pytest.approx(probs[token], abs=1e-15)
    assert sample_from(probs, 0.999999999999) == 4


def _decide_law(p, q, params, monkeypatch):
    """Exact law of the committed token when x ~ q and decide() runs on (p, x, q).

    Enumerates the drafter's draw, the acceptance uniform and the residual uniform over the
    intervals on which the real functions are constant, by patching the counter-based RNG.
    """
    law = np.zeros_like(p)
    current = {}

    def fake_uniform(seed, position, purpose):
        return current[purpose]

    monkeypatch.setattr(sampling, "uniform", fake_uniform)
    for x in np.flatnonzero(q):
        ratio = min(1.0, p[x] / q[x])
        res_cdf = np.cumsum(residual(p, q))
        for u_a_lo, u_a_hi in ((0.0, ratio), (ratio, 1.0)):
            if u_a_hi <= u_a_lo:
                continue
            current[Purpose.ACCEPT] = (u_a_lo + u_a_hi) / 2
            branch = interval_law(
                lambda u: (current.__setitem__(Purpose.RESIDUAL, u), decide(p, int(x), q, params, 0))[1],
                res_cdf,
            )
            for decision, mass in branch.items():
                law[decision.token] += q[x] * (u_a_hi - u_a_lo) * mass
    return law


@pytest.mark.parametrize("vocab", [2, 3, 5, 8])
@pytest.mark.parametrize("case", range(6))
def test_decide_emits_exactly_the_target_law(vocab, case, monkeypatch):
    rng = np.random.default_rng([vocab, case])
    p = rng.dirichlet(np.ones(vocab) * 0.7)
    q = rng.dirichlet(np.ones(vocab) * 0.7)
    if case == 0:
        q = p.copy()  # drafter equal to target: residual never used
    if case == 1:
        q = np.roll(p, 1)  # shifted drafter: residual carries most of the mass
    if case == 2:
        p[0], q[0] = 0.0, q[0] + 0.2  # draft can be a token the target never emits
        p /= p.sum()
        q /= q.sum()
    law = _decide_law(p, q, SAMPLE, monkeypatch)
    np.testing.assert_allclose(law, p, rtol=0, atol=1e-12)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_exact_law_of_windowed_decoding_with_residual_and_bonus_branches(k, monkeypatch):
    """Enumerate SI/DSI windows (k drafts, decide each, bonus after k acceptances, new window
    after a rejection) over a context-dependent pair, vocab 3, in float64: the law of the first
    n emitted tokens must equal the target's joint law exactly.
    """
    vocab, n = 3, 4

    def dist(seed, context):
        rng = np.random.default_rng([seed, len(context), *context])
        return rng.dirichlet(np.ones(vocab) * 0.8)

    def p_of(ctx):
        return dist(1, ctx)  # target

    def q_of(ctx):
        return dist(2, ctx)  # drafter

    def bonus_law(p):
        def run(u):
            monkeypatch.setattr(sampling, "uniform", lambda *a: u)
            return bonus(p, SAMPLE, 0)

        return interval_law(run, np.cumsum(p))

    def law_from(context, left, drafted):
        """Law of the next `left` tokens; `drafted` = drafts accepted so far in this window."""
        if left == 0:
            return {(): 1.0}
        p = p_of(context)
        out: dict = {}

        def add(prefix, mass, sub):
            for rest, m in sub.items():
                out[prefix + rest] = out.get(prefix + rest, 0.0) + mass * m

        if drafted == k:  # all k drafts accepted: the extra row gives the bonus token
            for token, mass in bonus_law(p).items():
                add((token,), mass, law_from(context + (token,), left - 1, 0))
            return out
        q = q_of(context)
        for x in range(vocab):
            accept = min(1.0, p[x] / q[x])
            add((x,), q[x] * accept, law_from(context + (x,), left - 1, drafted + 1))
            res = residual(p, q)
            for token in range(vocab):
                if q[x] * (1 - accept) * res[token] > 0:
                    add((token,), q[x] * (1 - accept) * res[token], law_from(context + (token,), left - 1, 0))
        return out

    law = law_from((), n, 0)
    assert len(law) == vocab**n
    for seq, mass in law.items():
        expected = np.prod([p_of(seq[:i])[seq[i]] for i in range(n)])
        assert mass == pytest.approx(expected, abs=1e-13)


def test_golden_logits_accept_and_reject():
    params = SamplingParams(temperature=1.0, seed=0)
    p = process_logits(np.array([10.0, -np.inf, -np.inf, -np.inf]), params)  # target sure of 0
    q_same = p.copy()
    assert decide(p, 0, q_same, params, 5).accepted  # drafter equal to target: always accepted
    q_disjoint = process_logits(np.array([-np.inf, 10.0, -np.inf, -np.inf]), params)
    d = decide(p, 1, q_disjoint, params, 5)  # disjoint drafter: always rejected, corrected to 0
    assert (d.token, d.accepted) == (0, False)
    greedy = SamplingParams()
    assert decide(process_logits(np.array([0.0, 2.0, 1.0]), greedy), 1, None, greedy, 0).accepted
    d = decide(process_logits(np.array([0.0, 2.0, 1.0]), greedy), 2, None, greedy, 0)
    assert (d.token, d.accepted) == (1, False)


def test_draft_and_bonus_tokens_are_keyed_by_position():
    q = np.full(6, 1 / 6)
    tokens = [draft_token(q, SAMPLE, pos) for pos in range(200)]
    assert tokens == [draft_token(q, SAMPLE, pos) for pos in range(200)]
    assert len(set(tokens)) == 6
    assert [bonus(q, SAMPLE, pos) for pos in range(50)] != tokens[:50]


def test_draft_from_logits_greedy_and_sampling():
    from dsi.sampling import draft_from_logits

    logits = np.array([0.0, 2.0, 1.0])
    assert draft_from_logits(logits, SamplingParams(), 5) == (1, None)
    token, q = draft_from_logits(logits, SAMPLE, 5)
    np.testing.assert_allclose(q, process_logits(logits, SAMPLE))
    assert token == draft_token(q, SAMPLE, 5)


def test_choice_seeds_keep_choice_zero_and_give_the_others_their_own():
    from dsi.sampling import choice_seed

    assert choice_seed(7, 0) == 7
    seeds = {choice_seed(s, i) for s in (0, 7, 2**63 - 1) for i in range(1, 50)}
    assert len(seeds) == 3 * 49 and all(0 <= x < 2**63 for x in seeds)
    assert choice_seed(7, 1) != 8 and choice_seed(7, 1) == choice_seed(7, 1)
    SamplingParams(seed=choice_seed(2**63 - 1, 3))  # a valid seed


def test_a_server_decides_a_chain_as_the_engine_does_and_sends_back_one_law():
    """read_chain_laws (a target server's side) against decide on every row's full law (the engine's side): the
    same decisions, in order, up to the first rejection; only the law a decision reads travels."""
    from dsi.errors import ModelError
    from dsi.sampling import LazyLaws, ReadLaws, decide_row, read_chain_laws

    vocab, n, prompt = 40, 5, (3, 1)
    branches = set()
    for trial in range(60):
        rng = np.random.default_rng(trial)
        params = SamplingParams(temperature=0.9, seed=trial)
        drafts = [int(t) for t in rng.integers(0, vocab, n - 1)]
        context = prompt + tuple(drafts)
        logits = rng.normal(0.0, 1.0, (n, vocab)).astype(np.float32)
        qs = [rng.dirichlet(np.full(vocab, 0.5)).astype(np.float32) for _ in drafts]
        laws = LazyLaws.of_chain(logits, params, context, len(prompt))
        read = read_chain_laws(laws, context, [float(q[x]) for q, x in zip(qs, drafts)], params)
        assert isinstance(read, ReadLaws) and len(read) == n and len(read.laws) == 1
        first = len(context) - n + 1
        for j, (x, q) in enumerate(zip(drafts, qs)):
            want = decide(laws[j], x, q, params, first + j)
            assert decide_row(read, j, x, q, params, first + j) == want
            if not want.accepted:
                assert set(read.laws) == {j} and len(read.accept_probs) == j + 1
                branches.add("rejected")
                break
        else:
            assert set(read.laws) == {n - 1}  # every draft accepted: the last row's law, for its decision or bonus
            assert bonus(read[n - 1], params, len(context)) == bonus(laws[n - 1], params, len(context))
            branches.add("all accepted")
    assert branches == {"rejected", "all accepted"}
    # an engine that decides otherwise than its server (here: rejects where the server accepted) is told so
    logits = np.zeros((2, vocab), dtype=np.float32)
    laws = LazyLaws.of_chain(logits, SamplingParams(temperature=1.0), (0, 7), 1)
    read = read_chain_laws(laws, (0, 7), [1.0 / vocab], SamplingParams(temperature=1.0))  # p == q: accepted
    assert set(read.laws) == {1}
    with pytest.raises(ModelError, match="was not read by its target server"):
        read[0]
    with pytest.raises(ConfigError, match="2 rows compare 1 drafts; got 2"):
        read_chain_laws(laws, (0, 7), [0.1, 0.2], SamplingParams(temperature=1.0))
