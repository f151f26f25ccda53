"""Coupled draws (dsi.coupling) and their keyed noise (dsi_vllm.noise): the noise is the same bits in numpy and
torch, uniform and independent across tokens, positions and seeds; a draw follows its law; and one seed gives the
same tokens whatever decodes the request, where the standard rule's tokens depend on the drafter."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare, kstest

import dsi
from dsi.coupling import coupled_draw, gumbel
from dsi_vllm.noise import uniform_bits
from tests.conftest import random_lm


def test_the_noise_is_the_same_bits_in_numpy_and_torch():
    torch = pytest.importorskip("torch")
    ids = np.arange(152_064)
    for seed, position in ((0, 0), (7, 3), (2**63 - 1, 10**9)):
        host = uniform_bits(ids, seed, position)
        engine = uniform_bits(torch.arange(152_064), seed, position).numpy()
        assert np.array_equal(host, engine)
        assert 0 <= host.min() and host.max() < 2**53


def test_the_noise_is_uniform_and_independent_of_token_position_and_seed():
    ids = np.arange(50_000)
    u = (uniform_bits(ids, 3, 5) + 0.5) / 2**53
    assert kstest(u, "uniform").pvalue > 1e-4
    # neighbouring keys: no correlation between tokens, positions or seeds
    for other in (uniform_bits(ids, 3, 6), uniform_bits(ids, 4, 5), uniform_bits(ids + 1, 3, 5)):
        v = (other + 0.5) / 2**53
        assert abs(np.corrcoef(u, v)[0, 1]) < 0.02
    # one position's noise over seeds, for one token, is uniform too (what a draw's law rests on)
    across = np.array([uniform_bits(np.array([11]), seed, 5)[0] for seed in range(5000)]) / 2**53
    assert kstest(across, "uniform").pvalue > 1e-4
    g = gumbel(3, 5, ids)
    assert abs(g.mean() - np.euler_gamma) < 0.03 and abs(g.std() - np.pi / np.sqrt(6)) < 0.03


def test_a_draw_follows_its_law_and_never_takes_a_token_of_probability_zero():
    law = np.array([0.5, 0.0, 0.2, 0.25, 0.05], dtype=np.float32)
    counts = np.bincount([coupled_draw(law, seed, 9) for seed in range(20_000)], minlength=law.size)
    assert counts[1] == 0
    kept = law > 0
    assert chisquare(counts[kept], law[kept] / law.sum() * 20_000).pvalue > 1e-4
    with pytest.raises(dsi.ModelError, match="no positive probability"):
        coupled_draw(np.zeros(4), 0, 0)


def _tokens(method, drafter, seed, coupled):
    target = random_lm(8, seed=21, sharpness=1.0)
    params = dsi.SamplingParams(temperature=1.0, seed=seed, coupled=coupled)
    return dsi.generate(target=target, drafter=drafter, prompt=[1, 2], method=method, lookahead=3,
                        num_target_servers=2, max_new_tokens=12, sampling=params).tokens


def test_one_seed_gives_the_same_tokens_whatever_decodes_it_with_coupled_draws(no_thread_leak):
    """Non-SI, SI and DSI with two different drafters give one seed's tokens; with the standard rule the drafter
    changes them (the comparison this test would fail without coupling)."""
    drafters = [random_lm(8, seed=99, sharpness=1.5), random_lm(8, seed=7, sharpness=0.5)]
    standard_differs = 0
    for seed in range(6):
        plain = _tokens("ar", None, seed, True)
        for method in ("si", "dsi"):
            for drafter in drafters:
                assert _tokens(method, drafter, seed, True) == plain, (seed, method, drafter)
        standard_differs += _tokens("si", drafters[0], seed, False) != _tokens("si", drafters[1], seed, False)
    assert standard_differs > 0


def test_coupled_is_a_boolean():
    with pytest.raises(dsi.ConfigError, match="coupled=1 must be true or false"):
        dsi.SamplingParams(temperature=1.0, coupled=1)


@pytest.mark.parametrize("processing", [dict(temperature=1.0), dict(temperature=0.7, top_k=40),
                                        dict(temperature=1.3, top_p=0.9), dict(temperature=0.9, min_p=0.05, top_p=0.8),
                                        dict(temperature=0.6, top_k=3, top_p=0.5)])
def test_the_engines_draw_is_the_hosts(processing):
    """What dsi_vllm's processor computes inside vLLM (torch) against dsi's host (numpy): the same law within
    float32 rounding, the same support, and the same draw for every seed and position tried."""
    torch = pytest.importorskip("torch")
    from dsi.sampling import process_logits
    from dsi_vllm.draws import draw, law

    rng = np.random.default_rng(5)
    torch_args = dict(temperature=processing["temperature"], top_k=processing.get("top_k", 0),
                      top_p=processing.get("top_p", 1.0), min_p=processing.get("min_p", 0.0))
    for vocab in (50, 32_000):
        row = (rng.standard_normal(vocab) * 3).astype(np.float32)
        host = process_logits(row, dsi.SamplingParams(**processing))
        engine = law(torch.from_numpy(row), **torch_args).numpy()
        assert np.array_equal(host > 0, engine > 0)
        assert np.allclose(host, engine, rtol=1e-5, atol=1e-9)
        for seed in range(40):
            position = 1000 + seed
            assert draw(torch.from_numpy(row), seed, position, **torch_args) == coupled_draw(host, seed, position)


def test_a_bad_draw_argument_is_named():
    pytest.importorskip("torch")
    from dsi_vllm.draws import draw_args

    assert draw_args({"other": 1}) is None
    assert draw_args({"dsi_seed": 3})["temperature"] == 1.0
    for extra, name in (({"dsi_seed": -1}, "dsi_seed=-1"), ({"dsi_seed": 1, "dsi_temperature": 0}, "dsi_temperature=0"),
                        ({"dsi_seed": 1, "dsi_top_k": 1.5}, "dsi_top_k=1.5"), ({"dsi_seed": 1, "dsi_top_p": 0},
                                                                              "dsi_top_p=0"),
                        ({"dsi_seed": 1, "dsi_min_p": 2}, "dsi_min_p=2"), ({"dsi_probe": "x"}, "dsi_probe='x'")):
        with pytest.raises(ValueError, match=name):
            draw_args(extra)
