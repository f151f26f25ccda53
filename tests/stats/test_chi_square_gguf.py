"""Seeded chi-square tests on the llama.cpp backend: SI and DSI sampling over a tiny GGUF target
(tests/tiny_gguf.py) have exactly the target's law, computed from llama.cpp's own logits."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

pytest.importorskip("llama_cpp")
pytest.importorskip("torch")

import dsi  # noqa: E402
from dsi.engine.api import build_decoder, make_request  # noqa: E402
from dsi.models.llamacpp import LlamaCppModel  # noqa: E402
from dsi.sampling import Prefix, process_logits  # noqa: E402
from tests.tiny_gguf import write_tiny_gguf  # noqa: E402

ALPHA = 1e-4
N_SAMPLES = 1000
LENGTH = 3
PROCESSING = dict(temperature=1.0, top_k=2)  # at most 2^3 continuations
# with the rows' prefixes: penalties over the generated tokens, a bias, min_p
PROCESSED = dict(PROCESSING, presence_penalty=0.7, repetition_penalty=1.3, logit_bias={5: 1.0}, min_p=0.05)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    target = LlamaCppModel(write_tiny_gguf(root / "t.gguf", seed=0)[0], threads=1)
    drafter = LlamaCppModel(write_tiny_gguf(root / "d.gguf", seed=1, layers=1)[0], threads=1)
    yield target, drafter
    target.close()
    drafter.close()


def exact_law(model, prompt, params) -> dict:
    """The law of the next LENGTH tokens, each row processed with the tokens before it."""
    session = model.new_session()
    law = {(): 1.0}
    try:
        for _ in range(LENGTH):
            nxt = {}
            for seq, prob in law.items():
                session.truncate(0)
                context = list(prompt) + list(seq)
                p = process_logits(session.extend(context)[-1], params, Prefix(context, len(prompt)))
                p = p / p.sum(dtype=np.float64)  # the float32 law, summing to 1 in float64 (the expected counts')
                for token in np.flatnonzero(p):
                    nxt[seq + (int(token),)] = prob * p[token]
            law = nxt
    finally:
        session.close()
    return law


@pytest.mark.parametrize("method, lookahead, servers, deterministic, processing",
                         [("si", 2, 1, False, PROCESSING),
                          pytest.param("dsi", 2, 2, False, PROCESSED, marks=pytest.mark.slow),
                          pytest.param("dsi", "auto", 2, False, PROCESSING, marks=pytest.mark.slow),
                          ("si", 2, 1, True, PROCESSED),
                          ("dsi", "auto", 2, True, PROCESSING)], ids=lambda v: "processed" if v is PROCESSED else None)
def test_sampling_on_llama_cpp_matches_the_target_law(pair, method, lookahead, servers, deterministic, processing,
                                                      no_thread_leak):
    """Also in the deterministic mode (every token computed alone): the law is untouched."""
    target, drafter = pair
    target.deterministic = drafter.deterministic = deterministic
    prompt = target.encode("def add(a, b):")
    law = exact_law(target, prompt, dsi.SamplingParams(**processing, seed=0))
    index = {seq: i for i, seq in enumerate(law)}
    counts = np.zeros(len(law))
    decoder = build_decoder(target=target, drafter=drafter, method=method, lookahead=lookahead,
                            num_target_servers=servers)
    try:
        for seed in range(N_SAMPLES):
            request = make_request(prompt, LENGTH, dsi.SamplingParams(**processing, seed=seed), None,
                                   target.vocab_size)
            counts[index[tuple(decoder.generate(request).tokens)]] += 1
    finally:
        decoder.close()
        target.deterministic = drafter.deterministic = False
    expected = np.array(list(law.values())) * N_SAMPLES
    _, p_value = chisquare(counts, expected)
    assert p_value > ALPHA, f"p={p_value:.2e}: counts {counts} vs expected {np.round(expected, 1)}"
