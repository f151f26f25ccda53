"""Sampled verification drawn inside vLLM: engines running dsi_vllm's logits processor answer each sampled row with
its coupled draw (dsi.coupling, dsi.models.engines.draws), so only tokens cross.

On real vLLM engines (the venv of ``packaging/vllm-venv.sh``; slow: each engine takes about 40 s to start here):
non-SI, SI and DSI through the engines give the tokens the local target gives with coupled draws, for every seed
and processing tried, without moving a row; the law through them is the target's (chi-square); requests the
processor does not draw (penalties) move rows as before; an engine that garbles its draws is dropped and the
output stays exact.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import dsi  # noqa: E402
from dsi.models.engines.target import EngineSession, EngineTarget  # noqa: E402
from tests.conftest import exact_sequence_law  # noqa: E402
from tests.engine_models import dirs, local, prompts  # noqa: E402,F401
from tests.engine_servers import RelayProxy, start_all, start_vllm, vllm_python  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.slow]

TOKENS = 16
PROCESSINGS = [dict(temperature=1.0), dict(temperature=0.8, top_k=5), dict(temperature=1.2, top_p=0.9, min_p=0.02)]


@pytest.fixture(scope="module")
def drawing_engines(dirs):
    if vllm_python() is None:
        pytest.skip("no vLLM venv: bash packaging/vllm-venv.sh builds it (CI does)")
    servers = start_all([lambda: start_vllm(dirs["target"], draws=True) for _ in range(2)])
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture
def rows_moved(monkeypatch):
    """How many forwards moved rows (EngineSession._extend_rows) during the test."""
    calls = [0]
    moving = EngineSession._extend_rows

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return moving(self, *args, **kwargs)

    monkeypatch.setattr(EngineSession, "_extend_rows", counted)
    return calls


def _local_coupled(target, prompt, params):
    coupled = dsi.SamplingParams(**params, coupled=True)
    return dsi.generate(target=target, prompt=prompt, method="ar", max_new_tokens=TOKENS, sampling=coupled).tokens


def test_the_engines_are_found_to_draw(drawing_engines, local):
    engines = EngineTarget([e.url for e in drawing_engines], reference=local[0])
    assert all(info.draws for info in engines.engines.values())
    assert engines.draws(dsi.SamplingParams(temperature=0.7, top_p=0.9))
    assert not engines.draws(dsi.SamplingParams())  # greedy: argmax rows, as before
    assert not engines.draws(dsi.SamplingParams(temperature=1.0, presence_penalty=0.5))  # not made in the engine


@pytest.mark.parametrize("params", PROCESSINGS, ids=["T1", "topk", "topp-minp"])
def test_sampled_non_si_si_and_dsi_through_the_engines_give_the_local_coupled_tokens_without_moving_a_row(
        drawing_engines, local, prompts, params, rows_moved, no_thread_leak):
    target, drafter, _ = local
    urls = [e.url for e in drawing_engines]
    for seed in range(3):
        prompt = prompts[seed % len(prompts)]
        expected = _local_coupled(target, prompt, dict(params, seed=seed))
        for method, lookahead, servers in (("ar", 1, 1), ("si", 3, 1), ("dsi", "auto", 2)):
            out = dsi.generate(target=target, drafter=None if method == "ar" else drafter, prompt=prompt,
                               method=method, lookahead=lookahead, num_target_servers=servers, max_new_tokens=TOKENS,
                               sampling=dsi.SamplingParams(**params, seed=seed), target_servers=urls[:servers])
            assert out.tokens == expected, (seed, method)
    assert rows_moved[0] == 0


def test_the_law_through_the_engines_draws_is_the_targets(drawing_engines, local, prompts, no_thread_leak):
    """Chi-square of DSI over both engines against the local target's exact law of two tokens (top_k=2: four
    sequences)."""
    from scipy.stats import chisquare

    target, drafter, _ = local
    prompt, length, samples = prompts[0], 2, 300
    processing = dict(temperature=1.0, top_k=2)
    law = exact_sequence_law(target, prompt, length, dsi.SamplingParams(**processing))
    index = {seq: i for i, seq in enumerate(law)}
    counts = np.zeros(len(law))
    with dsi.build_decoder(target=target, drafter=drafter, method="dsi", lookahead=2, num_target_servers=2,
                           target_servers=[e.url for e in drawing_engines]) as decoder:
        for seed in range(samples):
            out = decoder.generate(dsi.make_request(prompt, length, dsi.SamplingParams(**processing, seed=seed)))
            counts[index[tuple(out.tokens)]] += 1
    expected = np.array(list(law.values())) * samples
    assert chisquare(counts, expected).pvalue > 1e-4, (counts, expected)


def test_a_request_the_processor_does_not_draw_moves_rows_and_gives_the_local_tokens(
        drawing_engines, local, prompts, rows_moved, no_thread_leak):
    target, drafter, _ = local
    params = dsi.SamplingParams(temperature=0.9, top_k=5, presence_penalty=0.6, seed=3)
    expected = dsi.generate(target=target, drafter=drafter, prompt=prompts[1], method="si", lookahead=3,
                            max_new_tokens=TOKENS, sampling=params).tokens  # the standard rule: SI's own tokens
    out = dsi.generate(target=target, drafter=drafter, prompt=prompts[1], method="si", lookahead=3,
                       max_new_tokens=TOKENS, sampling=params, target_servers=[drawing_engines[0].url])
    assert out.tokens == expected
    assert rows_moved[0] > 0


class GarbledDraws(RelayProxy):
    """A drawing engine behind a relaying proxy that, once armed, answers each draw with a choice of no token."""

    def __init__(self, upstream: str) -> None:
        self.armed, self.garbled = False, 0
        super().__init__(upstream)

    def alter(self, request: dict, answer: dict) -> dict:
        if self.armed and "dsi_seed" in (request.get("vllm_xargs") or {}):
            self.garbled += 1
            answer["choices"][0]["logprobs"] = None
        return answer


def test_an_engine_that_garbles_its_draws_is_dropped_and_the_output_stays_exact(drawing_engines, local, prompts,
                                                                                 no_thread_leak):
    target, drafter, _ = local
    liar = GarbledDraws(drawing_engines[1].url)
    try:
        params = dict(temperature=1.0, seed=5)
        expected = _local_coupled(target, prompts[2], params)
        decoder = dsi.build_decoder(target=target, drafter=drafter, method="dsi", lookahead=2, num_target_servers=2,
                                    target_servers=[liar.url, drawing_engines[0].url])
        try:
            liar.armed = True  # after the start check: it found the liar drawing
            out = decoder.generate(dsi.make_request(prompts[2], TOKENS, dsi.SamplingParams(**params)))
        finally:
            decoder.close()
        assert out.tokens == expected
        assert liar.garbled > 0  # it did garble, and was not believed
    finally:
        liar.close()
