"""Recovering a greedy run's match pattern from synthetic models."""

from __future__ import annotations

import numpy as np
import pytest

from dsi.errors import ConfigError
from dsi.models import synthetic_pair
from dsi.sim.replay import greedy_match_pattern, next_logits_fn


def greedy_tokens(target, prompt, n):
    fn = next_logits_fn(target)
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(int(np.argmax(fn(tuple(ctx)))))
    return ctx[len(prompt) :]


@pytest.mark.parametrize("latency", [False, True])
def test_pattern_is_the_drafters_agreement_on_each_greedy_prefix(latency):
    kw = dict(target_tpot=0.01, drafter_tpot=0.001) if latency else {}
    target, drafter = synthetic_pair(0.6, seed=4, **kw)
    prompt = [1, 2, 3]
    tokens = greedy_tokens(target, prompt, 40)
    matches = greedy_match_pattern(target, drafter, prompt, tokens)
    inner = next_logits_fn(drafter)  # the SyntheticDrafter, whose agrees() decides by context
    expected = [inner.agrees(tuple(prompt + tokens[:i])) for i in range(40)]
    assert matches == expected
    assert 0 < sum(matches) < 40


def test_a_token_that_is_not_the_targets_greedy_token_is_an_error():
    target, drafter = synthetic_pair(0.6, seed=4)
    tokens = greedy_tokens(target, [1], 5)
    tokens[3] = (tokens[3] + 1) % 32
    with pytest.raises(ConfigError, match=r"tokens\[3\]=.* is not the target's greedy token"):
        greedy_match_pattern(target, drafter, [1], tokens)
    assert len(greedy_match_pattern(target, drafter, [1], tokens, check=False)) == 5


def test_models_without_next_logits_are_rejected():
    with pytest.raises(ConfigError, match="exposes no next_logits"):
        next_logits_fn(object())
