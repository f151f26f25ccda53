"""Logit processors of SamplingParams (penalties, logit_bias, min_p, min_tokens, stop ids):
their semantics against an independent per-token reference, batched rows against single rows,
the request's stop set, and the exact float64 law of speculative windows with processed rows."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from dsi import sampling
from dsi.engine.api import make_request
from dsi.errors import ConfigError
from dsi.models.base import drafts_ids_only, top_hint
from dsi.sampling import (
    Prefix,
    Purpose,
    SamplingParams,
    bonus,
    decide,
    draft_from_logits,
    process_logits,
    process_rows,
    residual,
    shape_rows,
)
from tests.conftest import interval_law

VOCAB = 7


def reference(logits, params: SamplingParams, tokens, prompt_len, stops) -> np.ndarray:
    """vLLM's order, one token at a time in plain Python: min_tokens, logit_bias, repetition,
    frequency and presence penalties, then temperature, min_p, top-k, top-p (greedy: one-hot argmax)."""
    x = [float(v) for v in logits]
    output = list(tokens[prompt_len:])
    if len(output) < params.min_tokens:
        for t in stops:
            x[t] = -math.inf
    for t, b in params.logit_bias:
        x[t] += b
    seen = set(tokens)
    for t in range(len(x)):
        if t in seen and params.repetition_penalty != 1.0:
            x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
        count = output.count(t)
        x[t] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
    if params.greedy:
        best = max(range(len(x)), key=lambda t: (x[t], -t))
        return np.eye(len(x))[best]
    s = [v / params.temperature for v in x]
    top = max(s)
    w = [math.exp(v - top) for v in s]
    if params.min_p:
        w = [v if v >= params.min_p else 0.0 for v in w]  # w is p / p_max
    if params.top_k:
        kth = sorted(w, reverse=True)[params.top_k - 1]
        w = [v if v >= kth else 0.0 for v in w]
    total = sum(w)
    p = [v / total for v in w]
    if params.top_p < 1.0:
        order = sorted(range(len(p)), key=lambda t: (-x[t], t))
        kept, mass = [], 0.0
        for t in order:
            kept.append(t)
            mass += p[t]
            if mass >= params.top_p:
                break
        p = [p[t] if t in kept else 0.0 for t in range(len(p))]
        total = sum(p)
        p = [v / total for v in p]
    return np.array(p)


CASES = {
    "presence": dict(presence_penalty=1.3),
    "negative presence": dict(presence_penalty=-0.7),
    "frequency": dict(frequency_penalty=0.6),
    "repetition": dict(repetition_penalty=1.8),
    "repetition < 1": dict(repetition_penalty=0.5),
    "bias": dict(logit_bias={2: 4.0, 5: -100.0}),
    "min_p": dict(min_p=0.2),
    "min_tokens": dict(min_tokens=4),
    "combined": dict(presence_penalty=0.8, frequency_penalty=0.4, repetition_penalty=1.4, logit_bias={"3": 2.5},
                     min_p=0.05, min_tokens=3, top_k=4, top_p=0.9),
}


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_processing_matches_an_independent_per_token_reference(case, greedy):
    rng = np.random.default_rng(sorted(CASES).index(case))
    params = SamplingParams(temperature=0.0 if greedy else 0.8, **CASES[case])
    stops = frozenset({0, 6})
    for trial in range(20):
        logits = rng.normal(0.0, 2.0, VOCAB)
        length = int(rng.integers(1, 9))
        tokens = [int(t) for t in rng.integers(0, VOCAB, length)]
        prompt_len = int(rng.integers(0, length + 1))
        got = process_logits(logits, params, Prefix(tokens, prompt_len, stops))
        want = reference(logits, params, tokens, prompt_len, stops)
        # the same support (min_tokens holds the same ids back), but for probabilities below float32's range
        assert (want[got > 0] > 0).all() and (got[want > 1e-37] > 0).all()
        # the law is float32 (dsi.sampling.LAW_DTYPE): each probability within float32 rounding of the reference's
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-12)


def test_each_penalty_counts_what_its_definition_says():
    logits = np.zeros(4)
    tokens, prompt_len = [1, 1, 2, 2, 2, 3], 2  # prompt [1, 1], output [2, 2, 2, 3]
    prefix = Prefix(tokens, prompt_len)
    shaped = sampling.shape_logits(logits, SamplingParams(presence_penalty=1.0), prefix)
    assert shaped.tolist() == [0.0, 0.0, -1.0, -1.0]  # the output only, once per token
    shaped = sampling.shape_logits(logits, SamplingParams(frequency_penalty=1.0), prefix)
    assert shaped.tolist() == [0.0, 0.0, -3.0, -1.0]  # times the count in the output
    shaped = sampling.shape_logits(np.array([2.0, 2.0, -2.0, 2.0]), SamplingParams(repetition_penalty=2.0), prefix)
    assert shaped.tolist() == [2.0, 1.0, -4.0, 1.0]  # prompt and output; divides positives, multiplies negatives


def test_greedy_takes_the_argmax_of_the_processed_row():
    logits = np.array([3.0, 2.9, 0.0])
    prefix = Prefix([5, 0], prompt_len=1)  # token 0 was generated
    assert process_logits(logits, SamplingParams(), prefix).argmax() == 0
    assert process_logits(logits, SamplingParams(presence_penalty=0.5), prefix).argmax() == 1
    assert process_logits(logits, SamplingParams(logit_bias={2: 10.0})).argmax() == 2
    token, q = draft_from_logits(logits, SamplingParams(presence_penalty=0.5), 2, prefix)
    assert token == 1 and q is None


def test_min_tokens_holds_back_every_stop_id_until_enough_are_generated():
    logits = np.array([5.0, 0.0, 5.0, 0.0])
    params = SamplingParams(temperature=1.0, min_tokens=2)
    stops = frozenset({0, 2})
    held = process_logits(logits, params, Prefix([1, 3], 1, stops))  # one token generated
    assert held[0] == held[2] == 0.0 and held.sum() == pytest.approx(1.0)
    free = process_logits(logits, params, Prefix([1, 3, 3], 1, stops))  # two generated
    assert free[0] > 0.4 and free[2] > 0.4
    with pytest.raises(ConfigError, match="no token is possible"):
        process_logits(np.array([0.0, -np.inf]), SamplingParams(min_tokens=1), Prefix([1], 1, frozenset({0})))


def test_processors_that_read_the_prefix_refuse_a_row_without_one():
    with pytest.raises(ConfigError, match="need the tokens before the row"):
        process_logits(np.zeros(3), SamplingParams(presence_penalty=1.0))
    process_logits(np.zeros(3), SamplingParams(logit_bias={1: 1.0}, min_p=0.5))  # no prefix needed


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7, **CASES["combined"]),
                                    SamplingParams(**CASES["combined"]), SamplingParams(temperature=1.1)])
def test_rows_of_one_forward_are_each_processed_with_their_own_prefix(params):
    rng = np.random.default_rng(3)
    tokens = [int(t) for t in rng.integers(0, VOCAB, 9)]
    rows = rng.normal(0.0, 2.0, (5, VOCAB))
    stops = frozenset({4})
    batched = process_rows(rows, params, tokens, 3, stops)
    for j in range(5):
        prefix = Prefix(tokens[: len(tokens) - 5 + 1 + j], 3, stops)
        np.testing.assert_array_equal(batched[j], process_logits(rows[j], params, prefix))


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(presence_penalty=2.5), "presence_penalty=2.5 must be a number in [-2, 2]"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty=nan"),
    (dict(repetition_penalty=0.0), "repetition_penalty=0.0 must be a number > 0"),
    (dict(min_p=1.5), "min_p=1.5 must be in [0, 1]"),
    (dict(min_tokens=-1), "min_tokens=-1 must be an integer >= 0"),
    (dict(min_tokens=1.5), "min_tokens=1.5"),
    (dict(logit_bias={1: 101.0}), "logit_bias[1]=101.0 must be a number in [-100, 100]"),
    (dict(logit_bias={"x": 1.0}), "logit_bias key 'x' must be a token id"),
    # JSON's keys are ASCII digits: "²" is a digit to str.isdigit (int() refuses it), "٥" one to int() (5)
    (dict(logit_bias={"²": 1.0}), "logit_bias key '²' must be a token id: 1 to 10 ASCII digits"),
    (dict(logit_bias={"٥": 1.0}), "logit_bias key '٥' must be a token id: 1 to 10 ASCII digits"),
    (dict(logit_bias={"5" * 5000: 1.0}), "(5002 characters) must be a token id: 1 to 10 ASCII digits"),
    (dict(logit_bias={" 5": 1.0}), "logit_bias key ' 5' must be a token id"),
    (dict(logit_bias={"-1": 1.0}), "logit_bias key '-1' must be a token id"),
    # integers too long to convert to text (over 4300 digits) or to a float are named, not a bare ValueError
    (dict(logit_bias={1: 10**5000}), "logit_bias[1]=<an integer of 16610 bits> must be a number in [-100, 100]"),
    (dict(seed=10**5000), "seed=<an integer of 16610 bits> must be an integer in [0, 2**63 - 1]"),
    (dict(temperature=10**400), "temperature=<an integer of 1329 bits> must be a finite number"),
    (dict(min_p=10**400), "min_p=<an integer of 1329 bits> must be in [0, 1]"),
    (dict(stop_token_ids=[10**5000, -1]), "stop_token_ids=<a list holding an integer too long to show> must be"),
    (dict(logit_bias=[1, 2]), "logit_bias entry 1 must be a"),
    (dict(logit_bias="1:2"), "logit_bias='1:2' must map token ids to biases"),
    (dict(stop_token_ids=[1, -2]), "stop_token_ids=[1, -2] must be a list of token ids"),
    (dict(ignore_eos=1), "ignore_eos=1 must be true or false"),
])
def test_bad_processor_values_are_refused_with_the_value_named(kwargs, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        SamplingParams(**kwargs)


def test_bias_keys_from_json_are_token_ids_and_the_params_stay_hashable():
    assert SamplingParams(logit_bias={"0": 1, "9999999999": 2}).logit_bias == ((0, 1.0), (9999999999, 2.0))
    a = SamplingParams(logit_bias={"7": 1.0, 3: -2})
    b = SamplingParams(logit_bias=[(3, -2.0), (7, 1)])
    assert a == b and a.logit_bias == ((3, -2.0), (7, 1.0)) and hash(a) == hash(b)
    assert SamplingParams(stop_token_ids=[5, 2, 5]).stop_token_ids == (2, 5)


def test_which_requests_may_read_argmax_ids_and_top_k_rows_only():
    assert SamplingParams().raw_argmax and SamplingParams(min_p=0.3).raw_argmax  # min_p keeps the argmax
    for kwargs in ({"presence_penalty": 0.1}, {"logit_bias": {1: 1.0}}, {"min_tokens": 1}, {"repetition_penalty": 1.1}):
        params = SamplingParams(**kwargs)
        assert params.moves_argmax and not params.raw_argmax
        assert top_hint(SamplingParams(temperature=1.0, top_k=5, **kwargs)) is None  # may lift a token into the top
    assert top_hint(SamplingParams(temperature=1.0, top_k=5, min_p=0.1)) == 5

    class StringModeDrafter:
        proposes_only_ids = True

    assert drafts_ids_only(StringModeDrafter(), SamplingParams(presence_penalty=1.0))
    assert not drafts_ids_only(object(), SamplingParams(presence_penalty=1.0))
    assert not drafts_ids_only(StringModeDrafter(), SamplingParams(temperature=1.0))


def test_the_requests_stop_set_is_eos_unless_ignored_plus_the_stop_ids():
    assert make_request([1], 4, SamplingParams(stop_token_ids=[3]), 2, VOCAB).eos_token_ids == {2, 3}
    assert make_request([1], 4, SamplingParams(stop_token_ids=[3], ignore_eos=True), 2, VOCAB).eos_token_ids == {3}
    with pytest.raises(ConfigError, match=r"logit_bias names token id\(s\) \[9\] outside the vocabulary \[0, 7\)"):
        make_request([1], 4, SamplingParams(logit_bias={9: 1.0}), None, VOCAB)
    with pytest.raises(ConfigError, match=r"stop_token_ids names token id\(s\) \[7\]"):
        make_request([1], 4, SamplingParams(stop_token_ids=[7]), None, VOCAB)


# ---- the exact law of speculative windows over processed rows ------------------------------------

SMALL, PROMPT, STOP = 3, (1,), 2
TARGET_PARAMS = SamplingParams(temperature=0.9, presence_penalty=0.9, frequency_penalty=0.3, repetition_penalty=1.5,
                               logit_bias={0: 0.7}, min_p=0.1, min_tokens=2)


def _logits(seed, context):
    return np.random.default_rng([seed, len(context), *context]).normal(0.0, 1.5, SMALL)


def _law_of_windows(k, n, drafter_params, monkeypatch, float64_laws=True):
    """The law of the first ``n`` tokens of SI / DSI windows of ``k`` drafts, enumerated in float64
    through the real decide / bonus / draft functions (uniforms patched per interval), with target
    rows processed by TARGET_PARAMS and drafter rows by ``drafter_params`` (None: raw, unprocessed);
    generation ends at STOP. ``float64_laws``: the processed laws widened to float64 and normalised there (the
    composition's exactness); else the float32 laws as they are (each sums to 1 within float32 rounding)."""
    stops = frozenset({STOP})

    def law(probs):
        return probs / probs.sum(dtype=np.float64) if float64_laws else probs

    def p_of(ctx):
        return law(process_logits(_logits(1, ctx), TARGET_PARAMS, Prefix(PROMPT + ctx, len(PROMPT), stops)))

    def q_of(ctx):
        if drafter_params is None:
            return law(process_logits(_logits(2, ctx), SamplingParams(temperature=1.0)))
        return law(process_logits(_logits(2, ctx), drafter_params, Prefix(PROMPT + ctx, len(PROMPT), stops)))

    def with_uniform(purpose, u, run):
        monkeypatch.setattr(sampling, "uniform", lambda seed, position, what: u if what == purpose else 0.5)
        return run()

    def law_from(ctx, left, drafted):
        if left == 0 or (ctx and ctx[-1] == STOP):
            return {(): 1.0}
        p = p_of(ctx)
        out: dict = {}

        def add(token, mass, sub):
            for rest, m in sub.items():
                out[(token, *rest)] = out.get((token, *rest), 0.0) + mass * m

        if drafted == k:
            for token, mass in interval_law(lambda u: with_uniform(Purpose.BONUS, u, lambda: bonus(p, TARGET_PARAMS, 0)),
                                            np.cumsum(p)).items():
                add(token, mass, law_from(ctx + (token,), left - 1, 0))
            return out
        q = q_of(ctx)
        for x in np.flatnonzero(q):
            ratio = min(1.0, p[x] / q[x])
            for lo, hi in ((0.0, ratio), (ratio, 1.0)):
                if hi <= lo:
                    continue
                u_accept = (lo + hi) / 2

                def run_decide(u, u_accept=u_accept, x=int(x)):
                    monkeypatch.setattr(sampling, "uniform",
                                        lambda seed, position, what: u_accept if what == Purpose.ACCEPT else u)
                    return decide(p, x, q, TARGET_PARAMS, 0)

                for decision, mass in interval_law(run_decide, np.cumsum(residual(p, q))).items():
                    nxt = drafted + 1 if decision.accepted else 0
                    add(decision.token, q[x] * (hi - lo) * mass, law_from(ctx + (decision.token,), left - 1, nxt))
        return out

    return law_from((), n, 0), p_of


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("drafter", ["same", "different", "raw"])
@pytest.mark.parametrize("float64_laws", [True, False], ids=["float64-laws", "float32-laws"])
def test_windows_over_processed_rows_emit_exactly_the_processed_target_law(k, drafter, float64_laws, monkeypatch):
    """Exact (to float64 rounding) for laws that sum to 1; with the float32 laws the engine computes, within
    their rounding: a law off 1 by e moves a token's mass by about e (the drafter's and the target's)."""
    drafter_params = {"same": TARGET_PARAMS, "raw": None,
                      "different": SamplingParams(temperature=1.3, logit_bias={1: 2.0}, repetition_penalty=0.7)}[drafter]
    law, p_of = _law_of_windows(k, 3, drafter_params, monkeypatch, float64_laws)
    tolerance = 1e-13 if float64_laws else 1e-6
    assert sum(law.values()) == pytest.approx(1.0, abs=tolerance)
    for seq, mass in law.items():
        expected = np.prod([p_of(seq[:i])[seq[i]] for i in range(len(seq))])
        assert mass == pytest.approx(expected, abs=tolerance), seq
    # the processing matters: the unprocessed target's law is another one
    plain = SamplingParams(temperature=0.9)
    assert any(abs(mass - np.prod([process_logits(_logits(1, seq[:i]), plain)[seq[i]] for i in range(len(seq))])) > 1e-3
               for seq, mass in law.items())
    assert all(STOP not in seq[:1] for seq in law)  # min_tokens=2: no stop as the first token


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(**CASES["combined"])], ids=["plain", "processed"])
def test_greedy_tokens_are_the_argmax_of_each_processed_row(params):
    rng = np.random.default_rng(8)
    tokens = [int(t) for t in rng.integers(0, VOCAB, 9)]
    rows = rng.normal(0.0, 2.0, (5, VOCAB))
    rows[2, 4] = np.inf  # the limit: a +inf logit is the token
    want = [int(np.argmax(process_logits(rows[j], params, Prefix(tokens[: 5 + j], 3, frozenset({1}))))) for j in range(5)]
    assert sampling.greedy_tokens(rows, params, tokens, 3, frozenset({1})).tolist() == want
    rows[1, 0] = np.nan
    with pytest.raises(sampling.ModelError, match="NaN"):
        sampling.greedy_tokens(rows, params, tokens, 3)


def test_sparse_greedy_agrees_with_the_dense_processed_argmax_on_ties_and_infinities():
    """greedy_tokens reads only the touched ids; the dense shape_rows argmax is the definition. Small
    integer logits make ties common; -inf, +inf and min_tokens holding every possible token are drawn too."""
    rng = np.random.default_rng(23)
    disagreements, raised = [], 0
    for _ in range(1500):
        vocab, n = int(rng.integers(2, 10)), int(rng.integers(1, 4))
        rows = rng.integers(-3, 4, (n, vocab)).astype(np.float32)
        if rng.random() < 0.25:
            rows[rng.random((n, vocab)) < 0.4] = -np.inf
        if rng.random() < 0.1:
            rows[rng.random((n, vocab)) < 0.2] = np.inf
        rows[~(rows > -np.inf).any(axis=1), 0] = 0.0  # a row the model could give
        tokens = [int(t) for t in rng.integers(0, vocab + 2, int(rng.integers(n, 8)))]  # ids past V too
        params = SamplingParams(
            presence_penalty=float(rng.choice([0, 0.5, -1, 2])), frequency_penalty=float(rng.choice([0, 0.3, -2])),
            repetition_penalty=float(rng.choice([1, 1.3, 0.7])), min_tokens=int(rng.choice([0, 3])),
            logit_bias={int(i): float(rng.choice([-100, -1, 1, 3, 100])) for i in rng.integers(0, vocab + 1, 2)})
        stops = frozenset(int(t) for t in rng.integers(0, vocab, 3))
        prompt_len = int(rng.integers(0, len(tokens) - n + 2))
        try:
            dense = np.argmax(shape_rows(rows, params, tokens, prompt_len, stops), axis=-1).tolist()
        except ConfigError:
            with pytest.raises(ConfigError, match="no token is possible"):
                sampling.greedy_tokens(rows, params, tokens, prompt_len, stops)
            raised += 1
            continue
        sparse = sampling.greedy_tokens(rows, params, tokens, prompt_len, stops).tolist()
        if sparse != dense:
            disagreements.append((rows.tolist(), tokens, params, sorted(stops), prompt_len, dense, sparse))
    assert not disagreements, disagreements[:3]
    assert raised > 0  # the all -inf case was reached


def test_a_greedy_processed_draft_is_the_argmax_of_the_drafters_processed_row():
    """draft_from_logits takes the sparse path (greedy_tokens) for processed greedy rows: the same
    token as the dense definition, with ties; a missing prefix is refused as before."""
    rng = np.random.default_rng(29)
    for _ in range(400):
        vocab = int(rng.integers(2, 12))
        row = rng.integers(-3, 4, vocab).astype(np.float32)
        tokens = [int(t) for t in rng.integers(0, vocab + 2, int(rng.integers(1, 9)))]
        stops = frozenset(int(t) for t in rng.integers(0, vocab, 2))
        prefix = Prefix(tokens, int(rng.integers(0, len(tokens) + 1)), stops)
        params = SamplingParams(presence_penalty=float(rng.choice([0, 1.0])),
                                repetition_penalty=float(rng.choice([1, 1.4])),
                                logit_bias={int(rng.integers(0, vocab)): float(rng.choice([-2, 2]))},
                                min_tokens=int(rng.choice([0, 20])))
        try:
            want = int(np.argmax(shape_rows(row[None], params, prefix.tokens, prefix.prompt_len, prefix.stop_ids)[0]))
        except ConfigError:
            continue  # min_tokens holding every possible token: refused on both paths (tested above)
        assert draft_from_logits(row, params, len(tokens), prefix) == (want, None)
    with pytest.raises(ConfigError, match="need the tokens before the row"):
        draft_from_logits(np.zeros(4), SamplingParams(presence_penalty=1.0), 3)


@pytest.mark.parametrize("vocab", [50, 3000])
def test_the_ids_a_row_s_processors_touch_are_the_prompt_s_and_output_s_as_a_set_says(vocab):
    """The ids the prompt or the output holds (found once per prompt, and grown by each token added), and the ids
    the processors touch (bias, held stop ids, penalised ids), against sets built from scratch for each row."""
    from dsi.sampling import _Counts, touched_ids

    rng = np.random.default_rng(vocab)
    stops = frozenset({1, vocab - 1, vocab + 5})  # one outside the row's vocabulary
    for trial in range(20):
        tokens = [int(t) for t in rng.integers(-2, vocab + 3, int(rng.integers(0, 300)))]  # ids outside it too
        prompt_len = int(rng.integers(0, len(tokens) + 1))  # a row's prefix holds its prompt
        bias = {int(t): 1.0 for t in rng.integers(0, vocab + 4, 3)}
        counts = _Counts(tokens, prompt_len, vocab)
        again = _Counts(tokens + [3], prompt_len, vocab)
        assert again._prompt is counts._prompt  # one search per prompt
        prefix = list(tokens)
        for step in range(12):
            if step:
                prefix.append(int(rng.integers(-1, vocab + 1)))  # an id outside the vocabulary now and then
            if step % 3 == 0:  # counted from scratch, else by adding the new token
                counts = _Counts(prefix, prompt_len, vocab)
            else:
                counts.add(prefix[-1])
            prompt, output = prefix[:prompt_len], prefix[prompt_len:]
            seen = {t for t in prompt + output if 0 <= t < vocab}
            assert counts.seen.tolist() == sorted(seen)
            for params in (SamplingParams(repetition_penalty=1.2, logit_bias=bias),
                           SamplingParams(presence_penalty=0.5, min_tokens=len(output) + 1),
                           SamplingParams(frequency_penalty=0.5, logit_bias=bias, min_tokens=1)):
                want = {t for t, _ in params.logit_bias if t < vocab}
                if params.min_tokens > len(output):
                    want |= {t for t in stops if 0 <= t < vocab}
                want |= seen if params.repetition_penalty != 1.0 else {t for t in output if 0 <= t < vocab}
                got = touched_ids(params, counts, stops, vocab)
                assert got.dtype == np.int64 and got.tolist() == sorted(want), (trial, step, params)
