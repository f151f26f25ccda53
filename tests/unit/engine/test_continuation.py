"""A request continued by another decoder (``Request.committed``): what ``dsi serve`` hands over mid-generation
when it chooses speculation by load (dsi.server.load_choice).

Every decoder goes on after the committed tokens as if it had committed them itself: greedy, the whole request's
tokens; plain sampling, whose every token is drawn with the uniform of its absolute position, the same tokens as a
whole seeded run; the logit processors see the committed tokens as output (penalties, min_tokens), not as prompt.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

import dsi
from dsi.engine.api import make_request
from dsi.errors import ConfigError
from tests.conftest import random_lm

VOCAB = 40
PROMPT = (3, 1, 4, 1, 5)


def build(kind: str, sharpness: float = 3.0):
    target, drafter = random_lm(VOCAB, seed=7, sharpness=sharpness), random_lm(VOCAB, seed=8, sharpness=sharpness)
    return dsi.build_decoder(target=target, drafter=None if kind == "ar" else drafter, method=kind,
                             num_target_servers=2, lookahead=3)


@pytest.mark.parametrize("kind", ["ar", "si", "dsi"])
@pytest.mark.parametrize("cut", [1, 5, 11])
def test_a_greedy_continuation_gives_the_whole_requests_tokens(kind, cut, no_thread_leak):
    request = make_request(PROMPT, 16, None, None, VOCAB)
    with build(kind) as decoder:
        whole = decoder.generate(request).tokens
        continued = decoder.generate(replace(request, committed=tuple(whole[:cut])))
    assert continued.tokens == whole
    assert continued.stats.new_tokens == 16  # the committed tokens count as the request's output


def test_plain_sampling_continued_draws_what_the_whole_seeded_run_draws():
    """Penalties and min_tokens read the committed tokens as output: a continuation that took them for prompt
    would draw other tokens."""
    params = dsi.SamplingParams(temperature=1.0, seed=11, presence_penalty=2.0, frequency_penalty=2.0,
                                min_tokens=12)
    request = make_request(PROMPT, 20, params, [0], VOCAB)
    with build("ar", sharpness=0.5) as decoder:
        whole = decoder.generate(request).tokens
        for cut in (1, 6, 13):
            assert decoder.generate(replace(request, committed=tuple(whole[:cut]))).tokens == whole
        as_prompt = make_request(PROMPT + tuple(whole[:6]), 14, params, [0], VOCAB)
        assert decoder.generate(as_prompt).tokens != whole[6:]  # the check above can tell the difference


def test_a_continuation_with_logprobs_reports_only_its_own_tokens():
    request = make_request(PROMPT, 10, None, None, VOCAB, logprobs=2)
    with build("si") as decoder:
        whole = decoder.generate(request)
        continued = decoder.generate(replace(request, committed=tuple(whole.tokens[:4])))
    assert continued.tokens == whole.tokens
    assert [e.token for e in continued.logprobs] == whole.tokens[4:]


@pytest.mark.parametrize("committed, match", [
    ((1, 2, VOCAB), r"committed\[2\]=40"),
    (tuple(range(8)), "committed holds 8 tokens; a continuation needs fewer than max_new_tokens=8"),
    ((5, 0), r"committed ends with a stop id \(\(0,\)\)"),
    ("ab", "committed='ab'"),
])
def test_a_bad_continuation_is_refused_before_any_forward(committed, match):
    request = make_request(PROMPT, 8, None, [0], VOCAB)
    with build("ar") as decoder:
        with pytest.raises(ConfigError, match=match):
            decoder.generate(replace(request, committed=committed))
        assert decoder.generate(request).stats.new_tokens >= 1  # the decoder serves the next request
