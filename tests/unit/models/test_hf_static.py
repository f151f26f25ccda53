"""The hf backend's static KV cache and graphs' padded shapes (dsi.models.hf_static) on the CPU: the plan's checks,
the masks, a rollback that moves a position and copies nothing, the cache's length as the context limit, the
fallback to eager forwards said once, reuse across requests, and the CLI's options. (Every HFModel session test
also runs on these caches: tests/unit/models/test_hf.py's PLANS; trees: test_tree_rows.py; losslessness:
tests/integration/test_hf_lossless.py; the deterministic mode: test_deterministic_mode.py.)"""

from __future__ import annotations

import logging

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dsi.errors import ConfigError, ContextLengthError  # noqa: E402
from dsi.models.hf import HFModel  # noqa: E402
from dsi.models.hf_static import (  # noqa: E402
    DEFAULT_KV_CACHE_LEN, GRAPH_MAX_TOKENS, ForwardPlan, GraphSet, padded_size, visibility,
)
from tests.unit.models.test_hf import IDS, reference, tiny_llama  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]


@pytest.mark.parametrize("kwargs, message", [
    (dict(kv_cache="paged"), "kv_cache='paged' must be one of dynamic, static"),
    (dict(kv_cache="static", kv_cache_len=0), "kv_cache_len=0 must be an integer >= 1"),
    (dict(kv_cache_len=64), "kv_cache_len=64 sizes a static cache"),
    (dict(cuda_graphs=True), "cuda_graphs=True needs kv_cache='static'"),
    (dict(kv_cache="static", cuda_graphs="yes"), "cuda_graphs='yes' must be True or False"),
])
def test_a_forward_plan_refuses_what_cannot_work(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ForwardPlan(**kwargs)


def test_the_cache_length_is_the_user_s_the_model_s_or_the_default_whichever_is_least():
    assert ForwardPlan("static").cache_len(None) == DEFAULT_KV_CACHE_LEN
    assert ForwardPlan("static").cache_len(100) == 100
    assert ForwardPlan("static", kv_cache_len=50).cache_len(100) == 50
    assert ForwardPlan("static", kv_cache_len=500).cache_len(100) == 100


def test_padded_sizes_are_powers_of_two_up_to_the_graph_limit_and_only_with_graphs():
    assert [padded_size(n, True) for n in (1, 2, 3, 5, 8, 9, 33)] == [1, 2, 4, 8, 8, 16, 64]
    assert padded_size(GRAPH_MAX_TOKENS + 1, True) == GRAPH_MAX_TOKENS + 1  # a prompt: as it is
    assert padded_size(5, False) == 5


def test_padding_queries_see_the_context_and_themselves_and_no_real_query_sees_them():
    seen = visibility(start=3, size=4, real=2, max_len=10, allowed=None, device=torch.device("cpu")).numpy()
    want = np.zeros((4, 10), dtype=bool)
    want[0, :4] = want[1, :5] = True  # real queries at 3 and 4: causal
    want[2, :3] = want[3, :3] = True  # padding at 5 and 6: the context ...
    want[2, 5] = want[3, 6] = True  # ... and itself
    np.testing.assert_array_equal(seen, want)
    tree = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 1]], dtype=torch.bool)  # two siblings after 3 tokens
    seen = visibility(start=3, size=2, real=2, max_len=8, allowed=tree, device=torch.device("cpu")).numpy()
    np.testing.assert_array_equal(seen[:, :5], tree.numpy())
    assert not seen[:, 5:].any()


def _static(raw, **plan):
    return HFModel(raw, forward_plan=ForwardPlan("static", **plan))


def test_a_rollback_moves_a_position_and_copies_nothing_and_the_rows_stay_exact():
    raw = tiny_llama()
    session = _static(raw).new_session()
    session.extend(IDS[:8])
    layer = session._cache.layers[0]
    pointers = (layer.keys.data_ptr(), layer.values.data_ptr())
    assert layer.keys.shape[2] == raw.config.max_position_embeddings  # preallocated to the model's context
    session.truncate(3)
    assert session._cache.length == 3 and session.tokens == tuple(IDS[:3])
    rows = session.extend(IDS[3:])
    assert (layer.keys.data_ptr(), layer.values.data_ptr()) == pointers  # no buffer was made again
    np.testing.assert_allclose(rows, reference(raw, IDS)[3:], atol=1e-5)
    session.close()
    assert session.tokens == ()
    np.testing.assert_allclose(session.extend(IDS[:4]), reference(raw, IDS[:4]), atol=1e-5)  # usable after close


def test_the_static_cache_s_length_is_the_session_s_context_limit():
    raw = tiny_llama()
    model = _static(raw, kv_cache_len=10)
    assert model.max_context == 10 and model.model_context == raw.config.max_position_embeddings
    session = model.new_session()
    session.extend(IDS[:9])
    with pytest.raises(ContextLengthError, match="exceed max_context=10"):
        session.extend(IDS[9:11])
    assert session.tokens == tuple(IDS[:9])  # refused before anything ran
    np.testing.assert_allclose(session.extend([IDS[9]]), reference(raw, IDS[:10])[-1:], atol=1e-5)


def test_near_the_end_of_the_cache_a_padded_forward_runs_unpadded():
    raw = tiny_llama()
    session = _static(raw, kv_cache_len=12, cuda_graphs=True).new_session()
    session.extend(IDS[:7])
    rows = session.extend(IDS[7:12])  # 5 tokens would pad to 8, past the 12 positions: run as 5
    np.testing.assert_allclose(rows, reference(raw, IDS[:12])[7:], atol=1e-5)


def test_models_with_sliding_window_layers_are_refused_a_static_cache():
    torch.manual_seed(0)
    config = transformers.MistralConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        sliding_window=8)
    raw = transformers.MistralForCausalLM(config).eval()
    with pytest.raises(ConfigError, match="sliding-window layers: use kv_cache='dynamic'"):
        _static(raw)
    model = HFModel(raw)
    assert not model.one_forward_trees  # nor a tree's mask, which would replace the window's: trees go path by path
    with pytest.raises(ConfigError, match="sliding-window"):
        model.forward_plan = ForwardPlan("static")
    assert model.forward_plan == ForwardPlan()


def test_graphs_on_a_cpu_fall_back_to_eager_forwards_and_say_so_once(caplog):
    raw = tiny_llama()
    with caplog.at_level(logging.WARNING, logger="dsi.models.hf_static"):
        model = _static(raw, cuda_graphs=True)
        sessions = [model.new_session() for _ in range(3)]
        for session in sessions:
            np.testing.assert_allclose(session.extend(IDS[:5]), reference(raw, IDS[:5]), atol=1e-5)
    said = [r for r in caplog.records if "CUDA graphs need a CUDA device" in r.getMessage()]
    assert len(said) == 1
    assert all(isinstance(s._graphs, GraphSet) and s._graphs.disabled and s._graphs.captures == 0 for s in sessions)


def test_one_decoder_reuses_its_static_cache_across_requests_and_gives_non_si_s_tokens():
    import dsi
    from dsi.engine.api import build_decoder, make_request

    raw = tiny_llama()
    want = [raw.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
            for p in (IDS[:5], IDS[:7], IDS[:5])]
    decoder = build_decoder(target=_static(raw, cuda_graphs=True), method="ar")
    try:
        got = [decoder.generate(make_request(p, 6, dsi.SamplingParams(), None, raw.config.vocab_size)).tokens
               for p in (IDS[:5], IDS[:7], IDS[:5])]
    finally:
        decoder.close()
    assert got == want


def test_the_cli_passes_the_cache_and_graphs_to_the_hf_backend_and_refuses_them_elsewhere():
    import argparse

    from dsi.cli.backend import forward_plan, max_model_len
    from dsi.models.loading import BackendChoice

    def args(**kw):
        base = dict(kv_cache=None, cuda_graphs=False, max_model_len=None,
                    backend_choice=BackendChoice("hf", "asked for"))
        return argparse.Namespace(**{**base, **kw})

    assert forward_plan(args()) is None
    assert forward_plan(args(cuda_graphs=True, max_model_len=256)) == ForwardPlan("static", 256, True)
    assert forward_plan(args(kv_cache="static")) == ForwardPlan("static")
    assert max_model_len(args(kv_cache="static", max_model_len=256)) is None  # it sizes the static cache
    with pytest.raises(ConfigError, match="--cuda-graphs replays fixed buffers: it needs --kv-cache static"):
        forward_plan(args(kv_cache="dynamic", cuda_graphs=True))
    with pytest.raises(ConfigError, match="with a dynamic cache"):
        max_model_len(args(max_model_len=256))
    with pytest.raises(ConfigError, match="apply to the hf backend"):
        forward_plan(args(kv_cache="static", backend_choice=BackendChoice("llama.cpp", "a GGUF on the CPU")))
