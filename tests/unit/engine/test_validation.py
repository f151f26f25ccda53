"""Bad input raises a clear error from the dsi hierarchy, naming the value and what is allowed."""

from __future__ import annotations

import numpy as np
import pytest

import dsi
from dsi.errors import ConfigError, DSIError, ModelError, VocabularyMismatchError, WorkerError
from dsi.models import CallableLM, synthetic_pair


@pytest.fixture
def pair():
    return synthetic_pair(0.8, vocab_size=16, seed=1)


def _call(pair, **overrides):
    target, drafter = pair
    kwargs = dict(target=target, drafter=drafter, prompt=[1, 2], max_new_tokens=4)
    kwargs.update(overrides)
    return dsi.generate(**kwargs)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"lookahead": 0}, "lookahead=0 must be an integer >= 1"),
        ({"lookahead": 2.5}, "lookahead=2.5"),
        ({"lookahead": "fast"}, "lookahead='fast' must be an integer >= 1 or 'auto'"),
        ({"lookahead": "auto", "method": "si"}, "SI needs an integer lookahead"),
        ({"lookahead": 3, "max_window": 4}, "max_window=4 applies to lookahead='auto' only"),
        ({"lookahead": "auto", "max_window": 0}, "max_window=0 must be None or an integer >= 1"),
        ({"num_target_servers": 0}, "num_target_servers=0 must be an integer >= 1"),
        ({"max_new_tokens": 0}, "max_new_tokens=0 must be an integer >= 1"),
        ({"max_new_tokens": -3}, "max_new_tokens=-3"),
        ({"method": "beam"}, "method='beam' must be one of auto, dsi, si, ar"),
        ({"transport": "carrier-pigeon"}, "transport='carrier-pigeon'"),
        ({"prompt": []}, "prompt is empty"),
        ({"prompt": "hello"}, "tokenize text first"),
        ({"prompt": [1, 16]}, r"prompt\[1\]=16 is outside the vocabulary \[0, 16\)"),
        ({"prompt": [-1]}, r"prompt\[0\]=-1 is outside"),
        ({"prompt": [1.5]}, r"prompt\[0\]=1.5 \(float\) is not a token id"),
        ({"eos_token_id": 99}, "eos_token_id=99"),
        ({"sampling": {"temperature": 1}}, "must be a dsi.SamplingParams"),
        ({"drafter": None}, "needs a drafter"),
        ({"target": object()}, "is not a language model"),
    ],
)
def test_invalid_arguments(pair, overrides, message, no_thread_leak):
    with pytest.raises(ConfigError, match=message):
        _call(pair, **overrides)


def test_errors_share_one_base():
    for cls in (ConfigError, ModelError, VocabularyMismatchError, WorkerError):
        assert issubclass(cls, DSIError)


def test_vocabulary_mismatch():
    target, _ = synthetic_pair(0.8, vocab_size=16)
    _, drafter = synthetic_pair(0.8, vocab_size=17)
    with pytest.raises(VocabularyMismatchError, match="drafter vocab_size=17 differs from target vocab_size=16"):
        dsi.generate(target=target, drafter=drafter, prompt=[1], max_new_tokens=3)


@pytest.mark.parametrize("method", ["ar", "si", "dsi"])
@pytest.mark.parametrize(
    "bad_logits, message",
    [
        (lambda ctx: np.zeros(5), r"shape \(5,\); expected \(8,\)"),
        (lambda ctx: np.full(8, np.nan), "NaN logits"),
        (lambda ctx: np.array([0.0, 1.0, np.nan, 3.0, np.inf, 5.0, 6.0, -np.inf]), "NaN logits"),
        (lambda ctx: np.array([0.0, 1.0, 2.0, np.inf, 4.0, 5.0, 6.0, -np.inf]), r"\+inf logits"),
    ],
)
def test_bad_next_logits_fail_the_call(method, bad_logits, message, no_thread_leak):
    good = CallableLM(lambda ctx: np.arange(8.0), 8)
    bad = CallableLM(bad_logits, 8)
    with pytest.raises((ModelError, WorkerError), match=message):
        dsi.generate(target=bad, drafter=good, prompt=[1], max_new_tokens=3, method=method)


def test_callable_lm_validates_its_arguments():
    with pytest.raises(ConfigError, match="vocab_size=1 must be an integer >= 2"):
        CallableLM(lambda ctx: np.zeros(1), 1)
    with pytest.raises(ConfigError, match="must be callable"):
        CallableLM(3, 4)


def test_worker_exception_surfaces_without_partial_output(no_thread_leak):
    """A target that breaks after a few positions makes the call raise, never return short output."""

    def flaky(ctx):
        if len(ctx) > 6:
            raise RuntimeError("GPU fell off the bus")
        return np.sin(np.arange(8.0) * len(ctx))

    target = CallableLM(flaky, 8)
    drafter = CallableLM(lambda ctx: np.cos(np.arange(8.0) * len(ctx)), 8)
    with pytest.raises(WorkerError, match="GPU fell off the bus"):
        dsi.generate(target=target, drafter=drafter, prompt=[1, 2], max_new_tokens=20, num_target_servers=3)


def test_drafter_exception_surfaces(no_thread_leak):
    target = CallableLM(lambda ctx: np.sin(np.arange(8.0) * len(ctx)), 8)

    def broken(ctx):
        raise ValueError("drafter weights are corrupt")

    with pytest.raises(WorkerError, match="drafter weights are corrupt"):
        dsi.generate(target=target, drafter=CallableLM(broken, 8), prompt=[1, 2], max_new_tokens=10)
