"""The embedded pair on the llama.cpp backend, as shipped (Q4_K_M): SI and DSI outputs equal the
backend's own non-SI output, or depart from it only where the target's two best tokens are a
numerical near-tie (a batched verification forward and a one-token forward take different quantized
kernels: docs/results.md section 8). Runs where the pair's GGUF is in the cache."""

from __future__ import annotations

import pytest

pytest.importorskip("llama_cpp")

import dsi  # noqa: E402
from dsi.evaluate.compare import CODE_PROMPTS, NEAR_TIE_MARGIN, first_divergence  # noqa: E402
from dsi.models import embedded  # noqa: E402

pytestmark = [
    pytest.mark.realmodel,
    pytest.mark.skipif(not embedded.is_cached(), reason="the embedded pair's GGUF is not cached (run `dsi demo`)"),
]


@pytest.fixture(scope="module")
def pair():
    from dsi.models.loading import load_pair

    target, drafter = load_pair("default-target", "default-drafter", backend="llama.cpp", progress=False, threads=1)
    yield target, drafter
    target.close()
    drafter.close()


@pytest.mark.parametrize("method, lookahead, servers", [("si", 4, 1), ("dsi", "auto", 1)])
def test_si_and_dsi_equal_non_si_up_to_near_ties(pair, method, lookahead, servers, no_thread_leak):
    target, drafter = pair
    prompt = target.encode(CODE_PROMPTS[1])
    reference = dsi.generate(target=target, prompt=prompt, method="ar", max_new_tokens=32).tokens
    out = dsi.generate(target=target, drafter=drafter, prompt=prompt, method=method, lookahead=lookahead,
                       num_target_servers=servers, max_new_tokens=32).tokens
    divergence = first_divergence(target, prompt, reference, out)
    assert divergence is None or abs(divergence["margin"]) <= NEAR_TIE_MARGIN["llama.cpp"], divergence
    assert out[: divergence["index"] if divergence else None] == reference[: divergence["index"] if divergence
                                                                          else None]
    assert target.decode(reference).strip()  # real text came out
