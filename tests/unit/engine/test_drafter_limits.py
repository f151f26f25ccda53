"""A drafter's context limit never fails a request the target can serve, and output stays lossless.

The drafter here holds at most ``L`` tokens (``CallableLM(max_context=L)``, which raises
``ContextLengthError`` past it, like an HF model); the target has no limit. Prompts shorter than,
equal to and longer than ``L``: greedy SI and DSI still equal non-SI token for token, and the
drafter is never asked to hold more than ``L`` tokens (with a prompt longer than ``L`` it is not
even prefilled). A drafter that hides its limit and raises mid-way only stops drafting; any other
drafter error still fails the request.

Sampling: every position is decided from its prefix, its draft (if any) and uniforms keyed by its
absolute position (:mod:`dsi.sampling`). Which positions have a draft depends only on the
drafter's limit (position ``i`` has one iff ``i <= L``), not on windows or timing, so for a fixed
seed DSI's sampled output is the same for every lookahead, server count and transport. It is
*not* the same as with an unlimited drafter: where a draft existed the token comes from the
accept/residual uniforms, without one from the bonus uniform; both are exact samples of the target
law (tests/stats checks the law). With a prompt longer than ``L`` no position has a draft, so SI
and DSI give exactly non-SI's tokens for the same seed.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import dsi
from dsi.engine.drafter import capped_drafts
from dsi.errors import ConfigError, ContextLengthError, WorkerError
from dsi.models import CallableLM, synthetic_pair

VOCAB, L, NEW = 24, 10, 18
PROMPTS = {"shorter": [3, 1, 4, 1, 5], "equal": list(range(2, 2 + L)), "longer": list(range(1, L + 4))}
GREEDY_CONFIGS = [("si", 1, 1), ("si", 3, 1), ("dsi", 1, 1), ("dsi", 3, 2), ("dsi", "auto", 1), ("dsi", "auto", 2)]


class Watched:
    """Wraps a model: records the longest sequence any session was asked to hold and every
    ``ContextLengthError`` raised. ``declare=False`` hides the inner model's ``max_context``
    (a drafter whose limit is only discovered by hitting it)."""

    def __init__(self, model, declare: bool = True) -> None:
        self.model = model
        self.declare = declare
        self.longest = 0
        self.limit_errors = 0
        self.extends = 0
        self._lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def __getattr__(self, name):
        if name == "max_context" and self.declare:
            return self.model.max_context
        raise AttributeError(name)

    def new_session(self):
        return _WatchedSession(self, self.model.new_session())


class _WatchedSession:
    def __init__(self, owner: Watched, inner) -> None:
        self._owner, self._inner = owner, inner

    @property
    def tokens(self):
        return self._inner.tokens

    def extend(self, tokens, cancel=None):
        owner = self._owner
        with owner._lock:
            owner.extends += 1
            owner.longest = max(owner.longest, len(self._inner.tokens) + len(tokens))
        try:
            return self._inner.extend(tokens, cancel)
        except ContextLengthError:
            with owner._lock:
                owner.limit_errors += 1
            raise

    def truncate(self, length):
        self._inner.truncate(length)

    def close(self):
        self._inner.close()


def make_pair(acceptance: float, seed: int, limit: int = L, declare: bool = True):
    target, drafter = synthetic_pair(acceptance, vocab_size=VOCAB, seed=seed)
    limited = CallableLM(drafter.next_logits, VOCAB, name="limited-drafter", max_context=limit)
    return target, Watched(limited, declare)


def test_capped_drafts_counts_the_room_after_a_context():
    model = CallableLM(lambda ctx: np.zeros(4), 4, max_context=10)
    # d drafts after n tokens feed the drafter n + d - 1 tokens
    assert [capped_drafts(model, n, 5) for n in (3, 6, 9, 10, 11, 40)] == [5, 5, 2, 1, 0, 0]
    assert capped_drafts(CallableLM(lambda ctx: np.zeros(4), 4), 10**6, 5) == 5  # no declared limit
    assert capped_drafts(model, 3, 0) == 0


@pytest.mark.parametrize("case", list(PROMPTS))
@pytest.mark.parametrize("method, lookahead, servers", GREEDY_CONFIGS)
def test_greedy_output_equals_non_si_and_the_drafter_stays_within_its_context(case, method, lookahead, servers,
                                                                               no_thread_leak):
    prompt = PROMPTS[case]
    target, drafter = make_pair(0.7, seed=len(prompt))
    reference = dsi.generate(target=target, prompt=prompt, method="ar", max_new_tokens=NEW).tokens
    out = dsi.generate(target=target, drafter=drafter, prompt=prompt, method=method, lookahead=lookahead,
                       num_target_servers=servers, max_new_tokens=NEW)
    assert out.tokens == reference
    assert drafter.limit_errors == 0 and drafter.longest <= L  # capped in advance, never refused
    assert out.stats.extra["drafter_context_limited"] >= 1
    # every position past L has no draft: the target's own token (or a correction before it)
    assert out.stats.bonus_tokens >= len(prompt) + NEW - max(len(prompt), L + 1)
    if case == "longer":
        assert drafter.extends == 0  # the prompt alone does not fit: the drafter is not even prefilled
        assert out.stats.bonus_tokens == NEW and out.stats.drafted_tokens == 0


@pytest.mark.parametrize("method, lookahead, servers", [("si", 3, 1), ("dsi", 2, 2), ("dsi", "auto", 2)])
def test_a_drafter_that_hides_its_limit_and_hits_it_only_stops_drafting(method, lookahead, servers, no_thread_leak):
    prompt = PROMPTS["shorter"]
    target, drafter = make_pair(0.9, seed=3, declare=False)
    reference = dsi.generate(target=target, prompt=prompt, method="ar", max_new_tokens=NEW).tokens
    out = dsi.generate(target=target, drafter=drafter, prompt=prompt, method=method, lookahead=lookahead,
                       num_target_servers=servers, max_new_tokens=NEW)
    assert out.tokens == reference
    assert drafter.limit_errors >= 1  # the limit was only found by hitting it
    assert out.stats.extra["drafter_context_limited"] >= 1


@pytest.mark.parametrize("method", ["si", "dsi"])
def test_any_other_drafter_error_still_fails_the_request(method, no_thread_leak):
    target, _ = make_pair(0.5, seed=1)

    def broken(ctx):
        if len(ctx) > 7:
            raise ConfigError(f"broken drafter at {len(ctx)} tokens")  # not a declared context limit
        return np.zeros(VOCAB)

    drafter = CallableLM(broken, VOCAB, max_context=50)
    expected = WorkerError if method == "dsi" else ConfigError
    with pytest.raises(expected, match="broken drafter at 8 tokens"):
        dsi.generate(target=target, drafter=drafter, prompt=[1, 2, 3], method=method, max_new_tokens=NEW)


@pytest.mark.parametrize("seed", range(4))
def test_sampling_with_no_room_for_drafts_is_exactly_non_si(seed, no_thread_leak):
    prompt = PROMPTS["longer"]
    target, drafter = make_pair(0.7, seed=11)
    sampling = dsi.SamplingParams(temperature=1.0, top_k=10, seed=seed)
    reference = dsi.generate(target=target, prompt=prompt, method="ar", max_new_tokens=NEW, sampling=sampling)
    for method, lookahead in [("si", 3), ("dsi", 2), ("dsi", "auto")]:
        out = dsi.generate(target=target, drafter=drafter, prompt=prompt, method=method, lookahead=lookahead,
                           max_new_tokens=NEW, sampling=sampling)
        assert out.tokens == reference.tokens, (method, lookahead)
    assert drafter.extends == 0


def test_sampled_dsi_output_with_a_limited_drafter_is_the_same_for_every_window_policy_and_pool(no_thread_leak):
    prompt = PROMPTS["shorter"]
    target, drafter = make_pair(0.7, seed=12)
    for seed in range(3):
        sampling = dsi.SamplingParams(temperature=0.9, seed=seed)
        outputs = {}
        for lookahead, servers in [(1, 1), (3, 2), ("auto", 1), ("auto", 3)]:
            out = dsi.generate(target=target, drafter=drafter, prompt=prompt, lookahead=lookahead,
                               num_target_servers=servers, max_new_tokens=NEW, sampling=sampling)
            outputs[(lookahead, servers)] = out.tokens
            assert out.stats.bonus_tokens >= len(prompt) + NEW - (L + 1)
        assert len(set(map(tuple, outputs.values()))) == 1, outputs
    assert drafter.limit_errors == 0 and drafter.longest <= L


def test_processes_transport_with_a_limited_drafter(no_thread_leak):
    prompt = PROMPTS["equal"]
    target, drafter = make_pair(0.8, seed=5)
    reference = dsi.generate(target=target, prompt=prompt, method="ar", max_new_tokens=NEW).tokens
    sampling = dsi.SamplingParams(temperature=1.0, seed=4)
    sampled = dsi.generate(target=target, drafter=drafter, prompt=prompt, lookahead=2, max_new_tokens=NEW,
                           sampling=sampling).tokens
    decoder = dsi.build_decoder(target=target, drafter=drafter.model, lookahead="auto", num_target_servers=2,
                                transport="processes")
    try:
        from dsi.engine.api import make_request

        assert decoder.generate(make_request(prompt, NEW, dsi.SamplingParams(), None, VOCAB)).tokens == reference
        assert decoder.generate(make_request(prompt, NEW, sampling, None, VOCAB)).tokens == sampled
    finally:
        decoder.close()
