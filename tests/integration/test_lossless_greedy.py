"""Greedy DSI and SI reproduce non-SI token for token, whatever the timing."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import dsi
from dsi.models import CallableLM, synthetic_pair
from tests.conftest import Jitter

CONFIGS = list(
    itertools.product(
        [0.0, 0.3, 0.7, 0.95, 1.0],  # acceptance
        [1, 2, 3, 5, "auto"],  # lookahead ("auto": event-driven windows)
        [1, 2, 4, 7],  # target servers
    )
)


@pytest.mark.parametrize("acceptance, lookahead, servers", CONFIGS)
def test_greedy_dsi_and_si_equal_non_si(acceptance, lookahead, servers, no_thread_leak):
    seed = int(acceptance * 100) + 7 * (4 if lookahead == "auto" else lookahead) + servers
    target, drafter = synthetic_pair(acceptance, vocab_size=24, seed=seed)
    rng = np.random.default_rng(seed)
    prompt = [int(t) for t in rng.integers(0, 24, size=int(rng.integers(1, 6)))]
    reference = dsi.generate(target=target, prompt=prompt, method="ar", max_new_tokens=40).tokens
    # random latencies make results arrive in every order
    jt, jd = Jitter(target, 0.0015, seed), Jitter(drafter, 0.0005, seed + 1)
    si = dsi.generate(target=jt, drafter=jd, prompt=prompt, method="si", max_new_tokens=40,
                      lookahead=3 if lookahead == "auto" else lookahead)
    out = dsi.generate(
        target=jt, drafter=jd, prompt=prompt, method="dsi", max_new_tokens=40,
        lookahead=lookahead, num_target_servers=servers,
    )
    assert si.tokens == reference
    assert out.tokens == reference
    assert len(out.tokens) == 40
    stats = out.stats
    assert stats.new_tokens == 40
    assert stats.accepted_tokens + stats.rejections + stats.bonus_tokens == 40
    if acceptance == 1.0:
        assert stats.rejections == 0 and stats.preempted_tasks == 0
    if acceptance == 0.0:
        assert stats.accepted_tokens == 0


PENALISED = dsi.SamplingParams(presence_penalty=0.8, frequency_penalty=0.3, repetition_penalty=1.4,
                               logit_bias={2: 1.5, 7: -3.0}, min_tokens=12, stop_token_ids=[5])


@pytest.mark.parametrize("acceptance, lookahead, servers", [(0.3, 2, 1), (0.7, 3, 2), (0.95, 5, 4), (0.7, "auto", 3),
                                                           (1.0, "auto", 7)])
def test_greedy_with_penalties_bias_and_min_tokens_equals_non_si(acceptance, lookahead, servers, no_thread_leak):
    """Greedy decoding of processed rows (each with its own prefix, drafts included): SI and DSI
    commit exactly non-SI's tokens, stop id and min_tokens included."""
    seed = 11 + servers
    target, drafter = synthetic_pair(acceptance, vocab_size=24, seed=seed)
    prompt = [3, 9, 3, 1]
    run = dict(prompt=prompt, max_new_tokens=40, sampling=PENALISED)
    reference = dsi.generate(target=target, method="ar", **run).tokens
    plain = dsi.generate(target=target, method="ar", prompt=prompt, max_new_tokens=40).tokens
    assert reference != plain  # the processing changes the output
    assert 5 not in reference[:11]
    jt, jd = Jitter(target, 0.0015, seed), Jitter(drafter, 0.0005, seed + 1)
    si = dsi.generate(target=jt, drafter=jd, method="si", lookahead=3 if lookahead == "auto" else lookahead, **run)
    out = dsi.generate(target=jt, drafter=jd, method="dsi", lookahead=lookahead, num_target_servers=servers, **run)
    assert si.tokens == reference and out.tokens == reference
    if acceptance >= 0.95:
        assert out.stats.accepted_tokens > len(reference) // 2  # the drafter, processed alike, stays accepted


@pytest.mark.parametrize("method", ["si", "dsi"])
def test_eos_is_committed_only_by_the_target(method, no_thread_leak):
    """The drafter proposes EOS (token 0) everywhere; the target emits it only after 5 tokens."""
    vocab = 6

    def target_fn(ctx):
        return np.eye(vocab)[0 if len(ctx) >= 7 else 1 + len(ctx) % 5] * 5

    target = CallableLM(target_fn, vocab)
    drafter = CallableLM(lambda ctx: np.eye(vocab)[0] * 5, vocab)
    out = dsi.generate(target=target, drafter=drafter, prompt=[1, 2], method=method, max_new_tokens=20, eos_token_id=0)
    ref = dsi.generate(target=target, prompt=[1, 2], method="ar", max_new_tokens=20, eos_token_id=0)
    assert out.tokens == ref.tokens == [3, 4, 5, 1, 2, 0]
    assert out.finish_reason == "stop"
    assert out.stats.rejections == 5


@pytest.mark.parametrize("method", ["ar", "si", "dsi"])
def test_any_of_several_eos_ids_stops_generation(method, no_thread_leak):
    vocab = 8
    target = CallableLM(lambda ctx: np.eye(vocab)[7 if len(ctx) >= 5 else 2 + len(ctx) % 3] * 5, vocab)
    drafter = CallableLM(lambda ctx: np.eye(vocab)[2 + len(ctx) % 3] * 5, vocab)
    out = dsi.generate(target=target, drafter=drafter, prompt=[1], method=method, max_new_tokens=30, eos_token_id=[6, 7])
    assert out.tokens == [3, 4, 2, 3, 7] and out.finish_reason == "stop"


def test_drafter_agreeing_on_eos_stops_generation(no_thread_leak):
    vocab = 5
    model = CallableLM(lambda ctx: np.eye(vocab)[0 if len(ctx) >= 4 else 3] * 5, vocab)
    out = dsi.generate(target=model, drafter=model, prompt=[1], max_new_tokens=50, eos_token_id=0, lookahead=2)
    assert out.tokens == [3, 3, 3, 0]
    assert out.stats.rejections == 0 and out.finish_reason == "stop"


def test_streaming_callback_sees_every_token_in_order(no_thread_leak):
    target, drafter = synthetic_pair(0.6, vocab_size=16, seed=2)
    streamed = []
    out = dsi.generate(
        target=target, drafter=drafter, prompt=[3], max_new_tokens=30, on_tokens=streamed.extend
    )
    assert streamed == out.tokens


@pytest.mark.parametrize("max_window", [1, 2, 6])
@pytest.mark.parametrize("servers", [1, 3])
def test_greedy_event_driven_dsi_with_a_window_cap_equals_non_si(max_window, servers, no_thread_leak):
    target, drafter = synthetic_pair(0.8, vocab_size=24, seed=max_window + servers)
    reference = dsi.generate(target=target, prompt=[3, 1], method="ar", max_new_tokens=40).tokens
    jt, jd = Jitter(target, 0.002, servers), Jitter(drafter, 0.0002, servers + 1)
    out = dsi.generate(target=jt, drafter=jd, prompt=[3, 1], max_new_tokens=40, lookahead="auto",
                       max_window=max_window, num_target_servers=servers)
    assert out.tokens == reference
    assert 0 < out.stats.mean_window <= max_window
