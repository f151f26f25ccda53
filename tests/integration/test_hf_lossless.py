"""Losslessness on real transformer models (tiny, random, float32, built from config).

Greedy DSI and SI reproduce ``model.generate(do_sample=False)`` for Llama and GPT-2 over many
prompts, lookaheads and server counts; DSI sampling on a tiny-vocabulary Llama matches the
model's exact two-token law (seeded chi-square, alpha = 1e-4). A drafter with a much shorter
context than the target (16 positions vs 256) never fails a request: prompts shorter than, equal
to and longer than its context give the target's own output.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from scipy.stats import chisquare  # noqa: E402

import dsi  # noqa: E402
from dsi.engine.api import build_decoder, make_request  # noqa: E402
from dsi.models.hf.model import HFModel  # noqa: E402
from dsi.models.hf.forward_plan import ForwardPlan  # noqa: E402
from dsi.sampling import Prefix, SamplingParams, process_logits  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]


def llama(seed, vocab=97, layers=2, positions=128):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=positions, bos_token_id=0, eos_token_id=None, pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(config).eval()


def gpt2(seed, vocab=97, layers=2, positions=128):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=layers, n_head=4, n_positions=positions,
                                     bos_token_id=0, eos_token_id=None)
    return transformers.GPT2LMHeadModel(config).eval()


PLANS = {"dynamic": ForwardPlan(), "static": ForwardPlan("static"), "padded": ForwardPlan("static", cuda_graphs=True)}


def noisy_pair(build, plan: str = "dynamic"):
    """(target module, target, drafter): the drafter is the target with noise added to its weights, so
    it agrees often, not always; both with the forward plan ``plan`` (the KV cache, graphs' padded shapes)."""
    target_model, drafter_model = build(0), build(0)
    with torch.no_grad():
        for p in drafter_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return (target_model, HFModel(target_model, forward_plan=PLANS[plan]),
            HFModel(drafter_model, forward_plan=PLANS[plan]))


@pytest.mark.parametrize("build, plan", [
    (llama, "dynamic"), (gpt2, "dynamic"), (llama, "static"),
    pytest.param(llama, "padded", marks=pytest.mark.slow),  # padded plans: also tests/unit/models/test_hf_static.py
    pytest.param(gpt2, "padded", marks=pytest.mark.slow)], ids=["llama", "gpt2", "llama-static", "llama-padded",
                                                                "gpt2-padded"])
def test_greedy_dsi_and_si_equal_transformers_generate(build, plan, no_thread_leak):
    target_model, target, drafter = noisy_pair(build, plan)
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


@pytest.mark.parametrize("lookahead, processing", [
    pytest.param(1, {}, marks=pytest.mark.slow),  # the plain law: also tests/stats (synthetic, GGUF) by default
    # CI's slow run (the default run's time): the processed law is tested on synthetic and GGUF rows by default
    pytest.param("auto", dict(presence_penalty=0.6, repetition_penalty=1.4, logit_bias={2: 0.8}, min_p=0.02),
                 marks=pytest.mark.slow),
    pytest.param("auto", {}, marks=pytest.mark.slow),  # on the static cache with graphs' padded shapes (below)
    pytest.param(3, dict(top_k=4, top_p=0.95), marks=pytest.mark.slow),  # decided on the device (below)
    pytest.param(3, dict(presence_penalty=0.6, repetition_penalty=1.4, logit_bias={2: 0.8}, min_p=0.02),
                 marks=pytest.mark.slow),  # processed, decided on the device
], ids=["k1", "auto-processed", "auto-static-padded", "k3-device", "k3-device-processed"])
def test_dsi_sampling_matches_the_exact_law_of_a_tiny_vocabulary_model(lookahead, processing, no_thread_leak, request):
    """The second token's row counts the first as output (penalties); every row is biased."""
    vocab, length, samples = 5, 2, 1200
    target_model, drafter_model = llama(3, vocab=vocab), llama(4, vocab=vocab)
    with torch.no_grad():  # make the distributions far from uniform so that errors would show
        target_model.lm_head.weight.mul_(8.0)
        drafter_model.lm_head.weight.mul_(8.0)
    plan = {"auto-static-padded": PLANS["padded"], "k3-device": ForwardPlan(device_decisions=True),
            "k3-device-processed": ForwardPlan(device_decisions=True)}.get(request.node.callspec.id, PLANS["dynamic"])
    target, drafter = HFModel(target_model, forward_plan=plan), HFModel(drafter_model, forward_plan=plan)
    prompt = (1, 2, 3)
    params = SamplingParams(temperature=1.0, **processing)

    def probs(context):
        with torch.no_grad():
            row = target_model(torch.tensor([list(context)])).logits[0, -1].double().numpy()
        p = process_logits(row, params, Prefix(context, len(prompt)))
        return p / p.sum(dtype=np.float64)  # the float32 law, summing to 1 in float64 (the expected counts')

    law = {}
    for a, pa in enumerate(probs(prompt)):
        for b, pb in enumerate(probs(prompt + (a,))):
            law[(a, b)] = pa * pb
    decoder = build_decoder(target=target, drafter=drafter, lookahead=lookahead, num_target_servers=2)
    counts = dict.fromkeys(law, 0)
    rejections = 0
    try:
        for seed in range(samples):
            out = decoder.generate(make_request(prompt, length, SamplingParams(temperature=1.0, seed=seed, **processing),
                                                None, vocab))
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


DRAFTER_POSITIONS = 16


def short_context_pair(arch):
    """A target of 256 positions and a drafter of 16 (Llama: the target plus noise; GPT-2: its own
    learned 16 position embeddings, which a longer sequence would index out of range)."""
    if arch == "llama":
        target_model, drafter_model = llama(0, positions=256), llama(0, positions=DRAFTER_POSITIONS)
        with torch.no_grad():
            for p in drafter_model.parameters():
                p.add_(0.05 * torch.randn_like(p))
    else:
        target_model, drafter_model = gpt2(0, positions=256), gpt2(1, positions=DRAFTER_POSITIONS)
    target, drafter = HFModel(target_model), HFModel(drafter_model)
    assert (target.max_context, drafter.max_context) == (256, DRAFTER_POSITIONS)
    return target, drafter


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("prompt_len", [9, DRAFTER_POSITIONS, DRAFTER_POSITIONS + 5])
def test_greedy_with_a_drafter_of_shorter_context_equals_non_si(arch, prompt_len, no_thread_leak):
    target, drafter = short_context_pair(arch)
    prompt = [int(t) for t in np.random.default_rng(prompt_len).integers(1, 97, size=prompt_len)]
    new = 20  # well past the drafter's 16 positions
    reference = dsi.generate(target=target, prompt=prompt, method="ar", max_new_tokens=new).tokens
    assert len(reference) == new
    si = dsi.generate(target=target, drafter=drafter, prompt=prompt, method="si", lookahead=3, max_new_tokens=new)
    assert si.tokens == reference
    for lookahead, servers in [(1, 1), (3, 2), ("auto", 2)]:
        out = dsi.generate(target=target, drafter=drafter, prompt=prompt, lookahead=lookahead,
                           num_target_servers=servers, max_new_tokens=new)
        assert out.tokens == reference, (lookahead, servers)
        assert out.stats.extra["drafter_context_limited"] >= 1
        assert out.stats.bonus_tokens >= prompt_len + new - max(prompt_len, DRAFTER_POSITIONS + 1)
        if prompt_len > DRAFTER_POSITIONS:
            assert out.stats.drafted_tokens == 0 and out.stats.drafter_forwards == 0


def test_sampling_with_a_drafter_of_shorter_context(no_thread_leak):
    """Past the prompt, positions beyond the drafter's context are the target's own samples: with a
    prompt longer than that context, exactly non-SI's tokens for the same seed; with a shorter one,
    the same tokens for every window policy and server count (drafts exist at the same positions)."""
    target, drafter = short_context_pair("llama")
    rng = np.random.default_rng(1)
    long_prompt = [int(t) for t in rng.integers(1, 97, size=DRAFTER_POSITIONS + 2)]
    short_prompt = long_prompt[:10]
    for seed in range(2):
        sampling = SamplingParams(temperature=1.0, seed=seed)
        reference = dsi.generate(target=target, prompt=long_prompt, method="ar", max_new_tokens=12,
                                 sampling=sampling).tokens
        assert dsi.generate(target=target, drafter=drafter, prompt=long_prompt, method="si", lookahead=2,
                            max_new_tokens=12, sampling=sampling).tokens == reference
        assert dsi.generate(target=target, drafter=drafter, prompt=long_prompt, lookahead="auto",
                            num_target_servers=2, max_new_tokens=12, sampling=sampling).tokens == reference
        outputs = {tuple(dsi.generate(target=target, drafter=drafter, prompt=short_prompt, lookahead=lookahead,
                                      num_target_servers=servers, max_new_tokens=12, sampling=sampling).tokens)
                   for lookahead, servers in [(1, 1), (4, 2), ("auto", 2)]}
        assert len(outputs) == 1, outputs


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_fp32_logprobs_of_si_and_dsi_equal_non_si_at_every_token(mode, no_thread_leak):
    """Greedy, so every method emits the same tokens: each token's logprob and top 5 are non-SI's,
    to float32 rounding (rows of a window forward vs one-token forwards), after rejections too."""
    _, target, drafter = noisy_pair(llama)
    params = SamplingParams(presence_penalty=0.3)  # processed mode differs from raw
    run = dict(prompt=[5, 9, 2, 7], max_new_tokens=24, sampling=params, logprobs=5, logprobs_mode=mode)
    ref = dsi.generate(target=target, method="ar", **run)
    for method, k, sp in [("si", 3, None), ("dsi", 3, 2), ("dsi", "auto", 3)]:
        out = dsi.generate(target=target, drafter=drafter, method=method, lookahead=k, num_target_servers=sp, **run)
        assert out.tokens == ref.tokens and out.stats.rejections > 0
        for got, want in zip(out.logprobs, ref.logprobs, strict=True):
            assert got.logprob == pytest.approx(want.logprob, abs=2e-5)
            assert [i for i, _ in got.top] == [i for i, _ in want.top]
            np.testing.assert_allclose([v for _, v in got.top], [v for _, v in want.top], atol=2e-5)
