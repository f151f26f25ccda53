"""Sampling: one seed gives one output, for any number of target servers and any timing."""

from __future__ import annotations

import pytest

import dsi
from dsi.models import synthetic_pair
from tests.conftest import Jitter


@pytest.mark.parametrize("params", [
    dsi.SamplingParams(temperature=1.0, seed=11),
    dsi.SamplingParams(temperature=0.7, top_k=8, top_p=0.9, seed=12345),
    dsi.SamplingParams(temperature=0.9, seed=5, presence_penalty=0.6, frequency_penalty=0.2, repetition_penalty=1.2,
                       logit_bias={3: 1.5}, min_p=0.02, min_tokens=10, stop_token_ids=[0]),
])
def test_same_seed_same_tokens_for_any_sp_and_latency(params, no_thread_leak):
    """Also across window policies: fixed k and event-driven windows (which end where timing puts
    them) give the same tokens for one seed."""
    target, drafter = synthetic_pair(0.7, vocab_size=20, seed=4)
    outputs = {}
    for servers in (1, 2, 4, 7):
        for trial, lookahead in enumerate((3, "auto")):
            jt = Jitter(target, 0.002, seed=servers * 10 + trial)
            jd = Jitter(drafter, 0.0007, seed=servers * 10 + trial + 5)
            out = dsi.generate(
                target=jt, drafter=jd, prompt=[1, 2, 3], max_new_tokens=40, lookahead=lookahead,
                num_target_servers=servers, sampling=params,
            )
            outputs[(servers, trial)] = out.tokens
            assert out.stats.rejections > 0  # residual sampling actually exercised
    assert len({tuple(t) for t in outputs.values()}) == 1


def test_different_seeds_give_different_samples():
    target, drafter = synthetic_pair(0.7, vocab_size=20, seed=4)
    runs = {
        tuple(
            dsi.generate(
                target=target, drafter=drafter, prompt=[1], max_new_tokens=20,
                sampling=dsi.SamplingParams(temperature=1.0, seed=s),
            ).tokens
        )
        for s in range(5)
    }
    assert len(runs) == 5


@pytest.mark.hf
def test_a_drafter_of_another_vocabulary_keeps_one_seed_one_output_across_sp_timing_and_request_history(no_thread_leak):
    """A drafter with its own tokenizer (the token-level intersection): the seeded tokens do not depend on
    SP, the window policy, the timing, or what the decoder ran before (a request that repeats the text of
    an earlier one once gave other tokens: the drafter's row followed the way its session had spelled
    that text, dsi.models.vocab.bridge). Both models write words whose tokens merge differently in the two
    vocabularies, so the drafter's spelling of a text matters."""
    pytest.importorskip("tokenizers")
    from dsi.engine.api import build_decoder, make_request
    from tests import tiny_vocab
    from tests.conftest import Jitter

    target = tiny_vocab.word_salad_lm("words")
    drafter = tiny_vocab.word_salad_lm("tiny_hf", seed=7)
    options = dict(target_tokenizer=target.tokenizer, drafter_tokenizer=drafter.tokenizer,
                   vocab_mode="intersection")
    prompt = tiny_vocab.encode("words", "the quick")
    rejected = 0
    for seed in range(3):
        params = dsi.SamplingParams(temperature=1.0, seed=seed)
        outputs = set()
        for servers, lookahead in ((1, 1), (2, 3), (3, "auto")):
            decoder = build_decoder(target=Jitter(target, 0.001, seed=servers), drafter=Jitter(drafter, 0.0004, seed=seed),
                                    method="dsi", lookahead=lookahead, num_target_servers=servers, **options)
            try:
                first = decoder.generate(make_request(prompt, 12, params, None, target.vocab_size))
                again = prompt + first.tokens  # the text this decoder's drafter has spelled already
                out = decoder.generate(make_request(again, 16, params, None, target.vocab_size))
            finally:
                decoder.close()
            rejected += out.stats.rejections
            outputs.add(tuple(out.tokens))
        fresh = dsi.generate(target=target, drafter=drafter, prompt=again, max_new_tokens=16, sampling=params,
                             method="dsi", lookahead=3, num_target_servers=2, **options)
        outputs.add(tuple(fresh.tokens))
        assert len(outputs) == 1, (seed, outputs)
    assert rejected > 0  # the drafts' law reached the output (residual draws)
