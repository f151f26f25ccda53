"""Log-probabilities of generated tokens (dsi.logprobs): every committed token reports the numbers of
the row that decided it, equal to what non-SI computes at that position, for every method, window
policy and number of servers, raw and processed, after rejections and preemptions too."""

from __future__ import annotations

import numpy as np
import pytest

import dsi
from dsi.engine.api import make_request
from dsi.errors import ConfigError
from dsi.logprobs import entry, log_softmax, logprob_row, logprob_rows
from dsi.models import synthetic_pair
from dsi.models.base import forward_rows
from dsi.sampling import Prefix, SamplingParams, process_logits, shape_logits
from tests.conftest import Jitter

PROMPT = [3, 1, 4, 1, 5]
CONFIGS = [("ar", 1, None), ("si", 3, None), ("dsi", 2, 1), ("dsi", 3, 3), ("dsi", "auto", 2)]
PARAMS = {
    "greedy": SamplingParams(),
    "sampling": SamplingParams(temperature=0.9, top_k=12, seed=5),
    "processed greedy": SamplingParams(presence_penalty=0.8, logit_bias={4: 1.5}),
    "processed sampling": SamplingParams(temperature=1.1, seed=9, frequency_penalty=0.5, min_p=0.02, top_p=0.95),
}


def test_an_entry_has_the_token_and_the_top_n_most_likely_first_ties_by_id():
    row = (np.log(np.array([0.1, 0.3, 0.1, 0.4, 0.1])) + 2.0, 2.0)  # values and their log-normaliser
    e = entry(row, 2, 3)
    assert e.token == 2 and e.logprob == pytest.approx(np.log(0.1))
    assert [i for i, _ in e.top] == [3, 1, 0]  # 0, 2 and 4 tie at 0.1: the lowest id
    assert [v for _, v in e.top] == pytest.approx(np.log([0.4, 0.3, 0.1]))
    assert entry(row, 2, 0).top == ()
    assert [i for i, _ in entry(row, 0, 9).top] == [3, 1, 0, 2, 4]  # N past the vocabulary: all of it


def test_the_two_modes_are_the_models_row_and_the_law_drawn_from():
    logits = np.array([2.0, 1.0, 0.5, -1.0])
    prefix = Prefix([1, 0], prompt_len=1)

    def dense(row):  # (values, lse) -> the log-probabilities
        return row[0].astype(np.float64) - row[1]

    np.testing.assert_allclose(np.exp(dense(logprob_row(logits, SamplingParams(), prefix, "raw"))),
                               np.exp(logits) / np.exp(logits).sum(), rtol=1e-6)
    sampled = SamplingParams(temperature=0.5, top_k=2, presence_penalty=1.0)
    processed = dense(logprob_row(logits, sampled, prefix, "processed"))
    np.testing.assert_allclose(np.exp(processed), process_logits(logits, sampled, prefix), rtol=1e-6, atol=1e-7)
    assert np.isneginf(processed[2:]).all()  # outside the top 2: impossible, -inf
    greedy = SamplingParams(presence_penalty=1.0)  # greedy: the softmax of the logits greedy takes the argmax of
    np.testing.assert_allclose(dense(logprob_row(logits, greedy, prefix, "processed")),
                               log_softmax(shape_logits(logits, greedy, prefix)), rtol=1e-6)
    rows = logprob_rows(np.stack([logits, logits + 3.0]), SamplingParams(), [1, 0], 1, frozenset(), "raw")
    np.testing.assert_allclose(rows.dense()[0], rows.dense()[1], atol=1e-6)  # a shift of the logits changes nothing


def reference_entries(target, prompt, tokens, params, n, mode):
    """What non-SI reports: each token's row from one forward over prompt + tokens."""
    session = target.new_session()
    rows = forward_rows(session, [*prompt, *tokens], len(tokens) + 1)[:-1]  # row i decides tokens[i]
    session.close()
    stops = frozenset()
    return [entry(logprob_row(rows[i], params, Prefix([*prompt, *tokens[:i]], len(prompt), stops), mode), t, n)
            for i, t in enumerate(tokens)]


@pytest.mark.parametrize("mode", ["raw", "processed"])
@pytest.mark.parametrize("name", list(PARAMS))
def test_every_token_reports_the_row_non_si_computes_for_it(name, mode, no_thread_leak):
    params = PARAMS[name]
    target, drafter = synthetic_pair(0.7, vocab_size=32, seed=3)
    greedy_tokens = None
    for method, k, sp in CONFIGS:
        jt, jd = Jitter(target, 0.001, 7), Jitter(drafter, 0.0003, 8)
        out = dsi.generate(target=jt, drafter=jd, prompt=PROMPT, method=method, lookahead=k, num_target_servers=sp,
                           max_new_tokens=30, sampling=params, logprobs=4, logprobs_mode=mode)
        assert [e.token for e in out.logprobs] == out.tokens
        want = reference_entries(target, PROMPT, out.tokens, params, 4, mode)
        for got, ref in zip(out.logprobs, want, strict=True):
            assert got.token == ref.token and got.logprob == pytest.approx(ref.logprob, abs=1e-6)
            assert [i for i, _ in got.top] == [i for i, _ in ref.top]
            np.testing.assert_allclose([v for _, v in got.top], [v for _, v in ref.top], atol=1e-6)
        if method != "ar":
            assert out.stats.rejections > 0  # entries after rejections (and DSI's preemptions)
        if params.greedy:
            greedy_tokens = greedy_tokens or out.tokens
            assert out.tokens == greedy_tokens


def test_logprobs_reach_the_token_callback_with_their_tokens(no_thread_leak):
    target, drafter = synthetic_pair(0.7, vocab_size=32, seed=3)
    seen = []
    out = dsi.generate(target=target, drafter=drafter, prompt=PROMPT, max_new_tokens=12, lookahead=3,
                       num_target_servers=2, logprobs=2, on_tokens=lambda tokens, entries: seen.append((tokens, entries)))
    assert [t for tokens, _ in seen for t in tokens] == out.tokens
    assert [e for _, entries in seen for e in entries] == out.logprobs
    assert "logprobs" in out.to_dict() and len(out.to_dict()["logprobs"]) == 12
    plain = dsi.generate(target=target, drafter=drafter, prompt=PROMPT, max_new_tokens=4, lookahead=3)
    assert plain.logprobs is None and "logprobs" not in plain.to_dict()


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(logprobs=-1), "logprobs=-1 must be None or an integer in [0, 32]"),
    (dict(logprobs=33), "logprobs=33 must be None"),
    (dict(logprobs=2, logprobs_mode="logits"), "logprobs_mode='logits' must be one of 'raw', 'processed'"),
])
def test_bad_logprobs_arguments_are_refused_naming_the_value(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        make_request(PROMPT, 4, SamplingParams(), None, 32, **kwargs)


def test_a_readme_style_call_with_every_processor_at_its_default_is_plain_decoding(no_thread_leak):
    target, drafter = synthetic_pair(0.9, vocab_size=32, seed=3)
    params = SamplingParams(presence_penalty=0.0, repetition_penalty=1.0, logit_bias={}, min_p=0.0)
    assert params == SamplingParams() and params.raw_argmax
    out = dsi.generate(target=target, drafter=drafter, prompt=PROMPT, max_new_tokens=8, sampling=params, logprobs=None)
    assert out.tokens == dsi.generate(target=target, prompt=PROMPT, method="ar", max_new_tokens=8).tokens
