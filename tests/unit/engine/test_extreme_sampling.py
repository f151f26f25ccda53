"""Numerical edge cases end to end: overflowing temperatures and NaN logits in every engine.

A temperature so small that ``logits / temperature`` overflows (the issue's 1e-320) used to give
NaN probabilities and the last vocabulary id repeated. It now gives the limit as the temperature
goes to 0: the greedy output (the synthetic models have no exact ties). A model whose logits
contain NaN fails the request with an error that says so, on the greedy and the sampling paths.
"""

from __future__ import annotations

import numpy as np
import pytest

import dsi
from dsi.errors import ModelError, WorkerError
from dsi.models import synthetic_pair
from dsi.sampling import SamplingParams

CONFIGS = [("ar", 1, 1), ("si", 3, 1), ("dsi", 2, 2), ("dsi", "auto", 2)]


@pytest.mark.parametrize("temperature", [1e-320, 5e-324, 1e-310])
@pytest.mark.parametrize("method, lookahead, servers", CONFIGS)
def test_a_temperature_that_overflows_gives_the_greedy_output(temperature, method, lookahead, servers,
                                                              no_thread_leak):
    target, drafter = synthetic_pair(0.7, vocab_size=24, seed=4)
    greedy = dsi.generate(target=target, prompt=[1, 2, 3], method="ar", max_new_tokens=20).tokens
    assert len(set(greedy)) > 3  # a varied reference: one id repeated would not pass for it
    out = dsi.generate(target=target, drafter=drafter, prompt=[1, 2, 3], method=method, lookahead=lookahead,
                       num_target_servers=servers, max_new_tokens=20,
                       sampling=SamplingParams(temperature=temperature, top_p=0.9, seed=9))
    assert out.tokens == greedy


class NaNAfter:
    """A model whose logits are fine for contexts shorter than ``length`` and NaN at token 3 after."""

    def __init__(self, inner, length: int) -> None:
        self.inner, self.length = inner, length

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    def new_session(self):
        return _NaNSession(self, self.inner.new_session())


class _NaNSession:
    def __init__(self, owner, inner) -> None:
        self._owner, self._inner = owner, inner

    @property
    def tokens(self):
        return self._inner.tokens

    def extend(self, tokens, cancel=None):
        start = len(self._inner.tokens)
        rows = np.array(self._inner.extend(tokens, cancel), dtype=np.float64)  # [n, V]
        for i in range(len(tokens)):
            if start + i + 1 >= self._owner.length:
                rows[i, 3] = np.nan
        return rows

    def truncate(self, length):
        self._inner.truncate(length)

    def close(self):
        self._inner.close()


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, seed=2)])
@pytest.mark.parametrize("broken, method, lookahead, servers",
                         [("target", *config) for config in CONFIGS]
                         + [("drafter", *config) for config in CONFIGS if config[0] != "ar"])  # non-SI: no drafter
def test_nan_logits_fail_the_request_with_a_clear_error(broken, method, lookahead, servers, sampling,
                                                        no_thread_leak):
    target, drafter = synthetic_pair(0.7, vocab_size=24, seed=4)
    if broken == "target":
        target = NaNAfter(target, 6)
    else:
        drafter = NaNAfter(drafter, 6)
    expected = WorkerError if method == "dsi" else ModelError  # DSI reports a worker's failure
    with pytest.raises(expected, match="NaN logits"):
        dsi.generate(target=target, drafter=drafter, prompt=[1, 2, 3], method=method, lookahead=lookahead,
                     num_target_servers=servers, max_new_tokens=12, sampling=sampling)
