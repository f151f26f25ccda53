"""Emulated batched steps (dsi.models.emulated.steps): forwards that arrive while a step runs share the next one,
whose cost their tokens set; a cancelled forward leaves without being counted; decoders over a model whose
sessions share steps give the same tokens as without."""

from __future__ import annotations

import threading
import time

import pytest

from dsi.engine.api import build_decoder, make_request
from dsi.errors import ConfigError
from dsi.models import WithLatency
from dsi.models.emulated.steps import SharedSteps
from tests.conftest import random_lm


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_forwards_arriving_during_a_step_share_the_next_one():
    steps = SharedSteps(step_s=0.5, token_s=0.0)
    first = threading.Thread(target=steps.join, args=(5,))
    first.start()
    wait_until(lambda: steps.steps == 0 and steps._thread is not None and not steps._waiting)  # the first step runs
    others = [threading.Thread(target=steps.join, args=(n,)) for n in (1, 2, 3)]
    for t in others:
        t.start()
    wait_until(lambda: len(steps._waiting) == 3 or steps.steps >= 1)
    for t in [first, *others]:
        t.join(timeout=10)
    assert (steps.steps, steps.forwards, steps.tokens) == (2, 4, 11)  # a step of 5 tokens, then one of 1 + 2 + 3


def test_a_cancelled_forward_leaves_at_its_step_uncounted():
    steps = SharedSteps(step_s=0.01, token_s=0.001)
    cancel = threading.Event()
    cancel.set()
    assert steps.join(7, cancel) is True
    assert steps.join(3) is False
    assert (steps.forwards, steps.tokens) == (1, 3)


def test_bad_step_times_are_refused():
    with pytest.raises(ConfigError, match="step_s=-1 must be a number of seconds >= 0"):
        SharedSteps(-1, 0.0)
    with pytest.raises(ConfigError, match="steps='x' must be a dsi.models.emulated.steps.SharedSteps"):
        WithLatency(random_lm(8, seed=1), 0.0, 0.0, steps="x")


@pytest.mark.parametrize("method", ["ar", "si", "dsi"])
def test_decoders_over_shared_steps_give_the_same_tokens(method, no_thread_leak):
    target, drafter = random_lm(30, seed=3, sharpness=3.0), random_lm(30, seed=4, sharpness=3.0)
    steps = SharedSteps(step_s=0.001, token_s=0.0001)
    stepped = WithLatency(target, 0.0, 0.0, steps=steps)
    request = make_request([1, 2, 3], 12, None, None, 30)
    with build_decoder(target=target, method="ar") as plain:
        expected = plain.generate(request).tokens
    options = {} if method == "ar" else dict(drafter=drafter, lookahead=3, num_target_servers=2)
    with build_decoder(target=stepped, method=method, **options) as decoder:
        assert decoder.generate(request).tokens == expected
    assert steps.forwards > 0 and steps.tokens >= steps.forwards
    assert stepped.forward_costs().one_token_s == pytest.approx(0.0011)
