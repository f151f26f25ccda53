"""Losslessness on real transformer models (tiny, random, float32, built from config).

Greedy DSI and SI reproduce ``model.generate(do_sample=False)`` for Llama and GPT-2 over many
prompts, lookaheads and server counts; DSI sampling on a tiny-vocabulary Llama matches the
model's exact two-token law (seeded chi-square, alpha = 1e-4).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from scipy.stats import chisquare  # noqa: E402

import dsi  # noqa: E402
from dsi.engine.api import build_decoder, make_request  # noqa: E402
from dsi.models.hf import HFModel  # noqa: E402
from dsi.sampling import SamplingParams, process_logits  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]


def llama(seed, vocab=97, layers=2):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0, eos_token_id=None, pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(config).eval()


def gpt2(seed, vocab=97, layers=2):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=layers, n_head=4, n_positions=128,
                                     bos_token_id=0, eos_token_id=None)
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.mark.parametrize("build", [llama, gpt2], ids=["llama", "gpt2"])
def test_greedy_dsi_and_si_equal_transformers_generate(build, no_thread_leak):
    target_model = build(0)
    # a drafter that is the target with noise added to its weights: it agrees often, not always
    drafter_model = build(0)
    with torch.no_grad():
        for p in drafter_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    target, drafter = HFModel(target_model), HFModel(drafter_model)
    rng = np.random.default_rng(0)
    accepted = rejected = 0
    for case in range(4):
        prompt = [int(t) for t in rng.integers(1, 97, size=int(rng.integers(2, 9)))]
        ref = target_model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                    pad_token_id=0)[0, len(prompt):].tolist()
        for lookahead in (1, 4, "auto"):
            si = dsi.generate(target=target, drafter=drafter, prompt=prompt, method="si", max_new_tokens=16,
                              lookahead=2 if lookahead == "auto" else lookahead)
            assert si.tokens == ref, (case, lookahead)
            for servers in (1, 3):
                out = dsi.generate(target=target, drafter=drafter, prompt=prompt, max_new_tokens=16,
                                   lookahead=lookahead, num_target_servers=servers)
                assert out.tokens == ref, (case, lookahead, servers)
                accepted += out.stats.accepted_tokens
                rejected += out.stats.rejections
    assert accepted > 0 and rejected > 0  # both branches were exercised


@pytest.mark.parametrize("lookahead", [1, "auto"])
def test_dsi_sampling_matches_the_exact_law_of_a_tiny_vocabulary_model(lookahead, no_thread_leak):
    vocab, length, samples = 5, 2, 2000
    target_model, drafter_model = llama(3, vocab=vocab), llama(4, vocab=vocab)
    with torch.no_grad():  # make the distributions far from uniform so that errors would show
        target_model.lm_head.weight.mul_(8.0)
        drafter_model.lm_head.weight.mul_(8.0)
    target, drafter = HFModel(target_model), HFModel(drafter_model)
    prompt = (1, 2, 3)
    params = SamplingParams(temperature=1.0)

    def probs(context):
        with torch.no_grad():
            row = target_model(torch.tensor([list(context)])).logits[0, -1].double().numpy()
        return process_logits(row, params)

    law = {}
    for a, pa in enumerate(probs(prompt)):
        for b, pb in enumerate(probs(prompt + (a,))):
            law[(a, b)] = pa * pb
    decoder = build_decoder(target=target, drafter=drafter, lookahead=lookahead, num_target_servers=2)
    counts = dict.fromkeys(law, 0)
    rejections = 0
    try:
        for seed in range(samples):
            out = decoder.generate(make_request(prompt, length, SamplingParams(temperature=1.0, seed=seed), None, vocab))
            counts[tuple(out.tokens)] += 1
            rejections += out.stats.rejections
    finally:
        decoder.close()
    keys = [k for k in law if law[k] * samples >= 5]  # chi-square needs expected counts >= 5
    observed = np.array([counts[k] for k in keys] + [samples - sum(counts[k] for k in keys)])
    expected = np.array([law[k] for k in keys] + [1 - sum(law[k] for k in keys)]) * samples
    assert rejections > samples // 10  # the residual branch was exercised often
    _, p_value = chisquare(observed, expected)
    assert p_value > 1e-4, (observed, expected.round(1))
