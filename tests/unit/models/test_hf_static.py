"""The hf backend's static KV cache and graphs' padded shapes (dsi.models.hf.forward_plan) on the CPU: the plan's checks,
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
from dsi.models.hf.model import HFModel  # noqa: E402
from dsi.models.hf.forward_plan import (  # noqa: E402
    ATTEND_MIN, DEFAULT_KV_CACHE_LEN, GRAPH_MAX_TOKENS, ForwardInputs, ForwardPlan, GraphSet, attended, greedy_ids,
    padded_size, visibility,
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


def test_attention_spans_end_where_a_forward_writes_and_with_graphs_double_from_a_minimum():
    assert [attended(end, 4096, False) for end in (1, 200, 257, 5000)] == [1, 200, 257, 4096]
    assert [attended(end, 4096, True) for end in (1, ATTEND_MIN, ATTEND_MIN + 1, 1500, 4096, 5000)] == \
        [ATTEND_MIN, ATTEND_MIN, 2 * ATTEND_MIN, 2048, 4096, 4096]
    assert attended(300, 600, True) == 512 and attended(520, 600, True) == 600  # never past the cache


@pytest.mark.parametrize("graphs", [False, True])
def test_attention_reads_the_span_of_the_cache_not_all_of_it_and_the_rows_stay_exact(graphs, monkeypatch):
    """A session of a model with a long context attends over the cache positions up to what each forward writes
    (with graphs' padded shapes, a power of two from ATTEND_MIN), not over all of its preallocated positions, and
    its rows are a from-scratch forward's, also past the first span and after a rollback."""
    raw = tiny_llama(layers=2, vocab=97, positions=2048)
    keys_read = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(query, key, value, *args, **kwargs):
        keys_read.append(key.shape[2])
        return sdpa(query, key, value, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    ids = [(7 * i + 3) % 97 for i in range(ATTEND_MIN + 40)]
    session = _static(raw, cuda_graphs=graphs).new_session()
    assert session._cache.max_len == 2048
    first = ATTEND_MIN - 3
    session.extend(ids[:first])
    keys_read.clear()
    rows = session.extend(ids[first:first + 5])  # crosses the first span: 5 tokens (8 with graphs) written
    assert set(keys_read) == {2 * ATTEND_MIN if graphs else first + 5}
    np.testing.assert_allclose(rows, reference(raw, ids[:first + 5])[first:], atol=1e-5)
    session.truncate(10)
    keys_read.clear()
    rows = session.extend(ids[10:12])
    assert set(keys_read) == {ATTEND_MIN if graphs else 12}
    np.testing.assert_allclose(rows, reference(raw, ids[:12])[10:], atol=1e-5)


def test_padding_queries_see_the_context_and_themselves_and_no_real_query_sees_them():
    seen = visibility(start=3, size=4, real=2, span=10, allowed=None)
    want = np.zeros((4, 10), dtype=bool)
    want[0, :4] = want[1, :5] = True  # real queries at 3 and 4: causal
    want[2, :3] = want[3, :3] = True  # padding at 5 and 6: the context ...
    want[2, 5] = want[3, 6] = True  # ... and itself
    np.testing.assert_array_equal(seen, want)
    tree = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 0, 1]], dtype=bool)  # two siblings after 3 tokens
    seen = visibility(start=3, size=2, real=2, span=8, allowed=tree)
    np.testing.assert_array_equal(seen[:, :5], tree)
    assert not seen[:, 5:].any()


def test_a_forward_s_inputs_are_one_buffer_its_device_views_read():
    """ForwardInputs: ids padded with 0, positions (a tree's for the real tokens, the cache positions for the
    padding), cache positions and the visibility, written through the host's views and read through the device's
    (one buffer on a CPU), and written anew by the next fill."""
    inputs = ForwardInputs(size=4, span=256, device=torch.device("cpu"))
    tree = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 0, 1]], dtype=bool)
    inputs.fill([5, 9], start=3, positions=[3, 3], allowed=tree)  # two siblings at depth 1, padded to 4
    inputs.send()
    assert inputs.ids.tolist() == [[5, 9, 0, 0]] and inputs.positions.tolist() == [[3, 3, 5, 6]]
    assert inputs.write_at.tolist() == [3, 4, 5, 6]
    np.testing.assert_array_equal(inputs.visible.numpy(), visibility(3, 4, 2, 256, tree))
    inputs.fill([1, 2, 3, 4], start=10)
    assert inputs.ids.tolist() == [[1, 2, 3, 4]] and inputs.positions.tolist() == [[10, 11, 12, 13]]
    np.testing.assert_array_equal(inputs.visible.numpy(), np.arange(256)[None] <= np.arange(10, 14)[:, None])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_ids_are_the_argmax_and_minus_one_for_a_row_with_a_nan_anywhere(dtype):
    """greedy_ids reads a NaN off the value at the argmax (torch's argmax takes a NaN for the largest value): the
    same ids as a whole pass that looks for NaN, whether the NaN is the row's largest value or not."""
    rows = torch.randn(6, 1000, generator=torch.Generator().manual_seed(0)).to(dtype)
    rows[1, 17] = float("nan")
    rows[2, rows[2].argmax()] = float("nan")  # the NaN where the largest value was
    rows[3, :] = float("nan")
    rows[4, :] = float("-inf")
    rows[4, 999] = float("nan")  # the only non-inf value is NaN
    rows[5, :] = float("-inf")  # no NaN: the first -inf's id
    whole = torch.where(torch.isnan(rows).any(dim=-1), -1, rows.argmax(dim=-1))
    assert greedy_ids(rows).tolist() == whole.tolist() == [int(rows[0].argmax()), -1, -1, -1, -1, 0]


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
    with caplog.at_level(logging.WARNING, logger="dsi.models.hf.forward_plan"):
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


class _FakeCuda:
    """torch.cuda's graph pieces as a CPU stands in for them: a capture counts how many captures overlap, and keeps
    the forward its body ran (:func:`_body` leaves it in ``captured``); a replay runs that forward again on the
    tensors it was captured with, writing its output in place, as a graph's kernels do. With ``paused`` (a
    :class:`tests.torch_calls.TorchCalls`), what a replay runs is not counted: on a GPU it is the graph's kernels,
    no host's calls."""

    def __init__(self, fail: bool = False, paused=None) -> None:
        import threading

        self.fail, self.lock, self.captured, self.paused = fail, threading.Lock(), threading.local(), paused
        self.underway = self.most_underway = self.replays = 0

    def install(self, monkeypatch) -> None:
        import contextlib

        from dsi.models.hf import forward_plan as hf_static

        fake = self

        class Graph:
            def __init__(self):
                self.forward = None

            def replay(self):
                fake.replays += 1
                with fake.paused.pause() if fake.paused is not None else contextlib.nullcontext():
                    self.forward()

        @contextlib.contextmanager
        def graph(g, pool=None, stream=None, capture_error_mode="global"):
            assert capture_error_mode == "thread_local" and pool == "pool"
            with fake.lock:
                fake.underway += 1
                fake.most_underway = max(fake.most_underway, fake.underway)
            try:
                __import__("time").sleep(0.02)  # long enough for another thread's capture to overlap, were it let
                if fake.fail:
                    raise RuntimeError("operation not permitted when stream is capturing\nmore")
                fake.captured.forward = None
                yield
                g.forward = fake.captured.forward
            finally:
                with fake.lock:
                    fake.underway -= 1

        monkeypatch.setattr(hf_static, "capturable", lambda device: True)  # the inputs stay on the CPU
        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "graph", graph)
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
        monkeypatch.setattr(torch.cuda, "current_stream",
                            lambda device=None: type("S", (), {"synchronize": lambda self: None})())

    def replaying(self, body):
        """``body`` as a capture sees it: each call also leaves, for the capture underway, a forward that runs
        ``body`` again and writes its outputs into this call's, in place."""
        def recorded(inputs):
            out = body(inputs)

            def again():
                for kept, new in zip(out, body(inputs)):
                    kept.copy_(new)

            self.captured.forward = again
            return out

        return recorded


class _Owner:
    """An HFModel's part a GraphSet uses: a device and a name; and ``body`` (logits = a function of the inputs, so
    that a replay's output can be checked), counting its calls."""

    def __init__(self, fake: _FakeCuda) -> None:
        self.device, self.name, self.calls = torch.device("cpu"), "tiny", 0
        self.body = fake.replaying(self._forward)

    def _forward(self, inputs):
        self.calls += 1
        logits = (inputs.ids * 10 + inputs.positions + inputs.write_at[None]).float()[..., None]  # [1, size, 1]
        return logits, logits[0, :, 0].long()


def _filled(graphs, size: int, start: int, span: int):
    inputs = graphs.inputs(size, span)
    inputs.fill(list(range(1, size + 1)), start)
    inputs.send()
    return inputs


def test_a_graph_is_captured_once_per_size_and_span_and_replays_read_the_new_inputs(monkeypatch):
    """GraphSet's bookkeeping, with torch.cuda's graph calls stood in for on the CPU: the first forward of a
    (size, span) warms up and captures, later ones replay what their inputs' buffers hold (the output is the new
    inputs', not the captured ones'), and a new span is a new graph on inputs of its own."""
    fake = _FakeCuda()
    fake.install(monkeypatch)
    owner = _Owner(fake)
    graphs = GraphSet(owner, owner.body, stream=None)
    assert not graphs.disabled
    first, _ = graphs.run(_filled(graphs, 4, 10, 256))
    assert graphs.captures == 1 and fake.replays == 1
    assert owner.calls == 3  # the warm-up, the capture's forward, and the fake replay's one call
    for start in (20, 30):
        out, ids = graphs.run(_filled(graphs, 4, start, 256))
        want = torch.arange(1, 5) * 10 + 2 * torch.arange(start, start + 4)  # ids, positions and write_at: new
        torch.testing.assert_close(out[0, :, 0], want.float())
        torch.testing.assert_close(ids, want)
    assert out is first  # the graph's own output buffer, rewritten by each replay
    assert graphs.captures == 1 and fake.replays == 3 and owner.calls == 5  # replays: no capture again
    assert graphs.inputs(4, 256) is graphs.inputs(4, 256)  # one buffer a shape: where its graph reads
    graphs.run(_filled(graphs, 4, 300, 512))  # the next span: a graph of its own
    graphs.run(_filled(graphs, 1, 300, 512))
    assert graphs.captures == 3 and sorted(graphs._graphs) == [(1, 512), (4, 256), (4, 512)]
    assert sorted(graphs._inputs) == [(1, 512), (4, 256), (4, 512)]


def test_captures_in_one_process_take_turns(monkeypatch):
    """Sessions whose first forwards come together (target servers as threads, the drafter) capture one at a
    time: PyTorch supports one capture underway at a time."""
    import threading

    fake = _FakeCuda()
    fake.install(monkeypatch)
    owners = [_Owner(fake) for _ in range(4)]
    sets = [GraphSet(owner, owner.body, stream=None) for owner in owners]
    barrier = threading.Barrier(len(sets))

    def first_forward(graphs):
        barrier.wait()
        graphs.run(_filled(graphs, 2, 5, 256))

    threads = [threading.Thread(target=first_forward, args=(g,)) for g in sets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [g.captures for g in sets] == [1, 1, 1, 1]
    assert fake.most_underway == 1


def test_each_capture_says_what_it_cost(monkeypatch, caplog):
    """Graphs cost a user time at start-up (a session's first forward of each shape warms up and captures): each
    capture says its shape and time, and the session's total so far, at INFO (``dsi -v``)."""
    fake = _FakeCuda()
    fake.install(monkeypatch)
    owner = _Owner(fake)
    graphs = GraphSet(owner, owner.body, stream=None)
    with caplog.at_level(logging.INFO, logger="dsi.models.hf.forward_plan"):
        for size, span in ((1, 256), (4, 256), (1, 256), (1, 512)):  # the third replays: nothing to say
            graphs.run(_filled(graphs, size, 5, span))
    said = [r.getMessage() for r in caplog.records if "captured a CUDA graph" in r.getMessage()]
    assert [m.split(" in ")[0] for m in said] == [f"tiny: captured a CUDA graph of {n} tokens over {s} positions"
                                                  for n, s in ((1, 256), (4, 256), (1, 512))]
    assert said[-1].endswith(f"(this session: 3 graphs, {graphs.capture_s:.2f} s)")
    assert graphs.captures == 3 and graphs.capture_s > 0


def test_a_failed_capture_runs_that_session_eagerly_and_says_so_once(monkeypatch, caplog):
    fake = _FakeCuda(fail=True)
    fake.install(monkeypatch)
    owner = _Owner(fake)
    with caplog.at_level(logging.WARNING, logger="dsi.models.hf.forward_plan"):
        sets = [GraphSet(owner, owner.body, stream=None) for _ in range(2)]
        assert [g.run(_filled(g, 2, 5, 256)) for g in sets] == [None, None]  # the caller runs it eagerly
        assert sets[0].run(_filled(sets[0], 2, 5, 256)) is None and owner.calls == 2  # not tried again
    said = [r.getMessage() for r in caplog.records if "could not be captured" in r.getMessage()]
    assert said == ["tiny: a CUDA graph could not be captured (RuntimeError: operation not permitted when stream "
                    "is capturing); its forwards run eagerly"]
    assert all(g.disabled and g.captures == 0 for g in sets)


def test_a_replayed_forward_makes_no_device_call_but_its_copies_and_gives_the_rows(monkeypatch):
    """A session with graphs (torch.cuda's graph calls stood in for on the CPU, the session's own forward
    captured and replayed): its rows and greedy ids are a from-scratch forward's, and once a shape is captured,
    a forward's torch calls outside the replay are its copies and views only (on a GPU every other call would be
    a kernel launch of its own): the inputs are made on the host and cross in one copy
    (hf_static.ForwardInputs), the mask is made additive and the argmax taken inside the graph."""
    from dsi.models.base import extend_rows

    from tests.torch_calls import TorchCalls

    count = TorchCalls()
    fake = _FakeCuda(paused=count)
    fake.install(monkeypatch)
    raw = tiny_llama(layers=2, vocab=97, positions=512)
    ids = [(7 * i + 3) % 97 for i in range(40)]
    ref = reference(raw, ids)
    session = _static(raw, cuda_graphs=True).new_session()
    session._graphs._body = fake.replaying(session._graphs._body)
    np.testing.assert_allclose(session.extend(ids[:20]), ref[:20], atol=1e-5)  # 20 tokens: padded to 32
    for k in (1, 3, 4):  # a step, and windows of 3 and 4 (one graph of 4)
        extend_rows(session, ids[20:20 + k], None, 2 if k > 1 else 1, greedy=True)
        session.truncate(20)
    captured = session._graphs.captures
    with count:
        step = extend_rows(session, ids[20:21], None, 1, greedy=True)
        window = extend_rows(session, ids[21:24], None, 2, greedy=True)
        rows = extend_rows(session, ids[24:28], None, 4, greedy=False)
    assert session._graphs.captures == captured == 3  # sizes 32, 1 and 4, one span
    assert step.tolist() == [int(np.argmax(ref[20]))]
    assert window.tolist() == np.argmax(ref[22:24], axis=-1).tolist()
    np.testing.assert_allclose(rows, ref[24:28], atol=1e-5)
    assert "to" in count.work() and set(count.work()) <= {"to", "_to_copy", "copy_"}, sorted(set(count.calls))
    from dsi.trees import ROOT, DraftTree

    tree = DraftTree((2, 7, 9, 6, 8, 3), (ROOT, ROOT, ROOT, 0, 0, 3))  # main path 0, 3, 5: computed first
    plain = HFModel(raw).new_session()
    want = plain.tree_rows(ids[:12], tree)
    np.testing.assert_allclose(session.tree_rows(ids[:12], tree), want, atol=1e-5)  # replayed: rows in tree order
    assert session.tree_rows(ids[:12], tree, greedy=True).tolist() == np.argmax(want, axis=-1).tolist()
    assert session.tokens == plain.tokens
    np.testing.assert_allclose(session.extend([4, 2]), plain.extend([4, 2]), atol=1e-5)  # the main path kept


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_a_graph_s_body_reads_nothing_on_the_host(architecture):
    """What a session captures as a graph (its forward on the static cache, the additive mask and the greedy ids:
    HFSession._graph_body), for the Llama architecture and the Qwen2 one of the GPU run's pair and 14B target,
    makes no host read and no shape of the data's: run on the CPU, no such torch call is dispatched, for a step,
    a padded window and a tree's mask. (On a GPU, gpu_check.sh's part 0 captures them for real.)"""
    from tests.torch_calls import TorchCalls

    if architecture == "llama":
        raw = tiny_llama(layers=2, vocab=97, positions=512)
    else:
        torch.manual_seed(0)
        raw = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True, use_sliding_window=False,
            pad_token_id=None)).eval()
    session = _static(raw, cuda_graphs=True).new_session()
    session.extend(IDS[:9])
    tree = np.tril(np.ones((4, 13), dtype=bool))
    tree[2, 10] = False  # a side node that does not see the one before it
    for size, new, allowed in ((1, [5], None), (4, [5, 6, 7], None), (4, [5, 6, 7, 8], tree)):
        inputs = session._graphs.inputs(size, 256)
        inputs.fill(new, 9, allowed=allowed)
        inputs.send()
        with torch.inference_mode(), TorchCalls() as calls:
            logits, ids = session._graph_body(inputs)
        assert logits.shape == (1, size, 97) and ids.shape == (size,)
        assert not calls.host_reads(), calls.host_reads()
        assert "scaled_dot_product_attention" in calls.calls  # the model's own forward was seen


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
def test_cuda_graphs_are_captured_and_replay_a_from_scratch_forward_s_rows(caplog):
    """On a GPU (gpu_check.sh part 0): sessions in four threads of one process at once, each capturing its graphs
    at their first use, give the CPU's from-scratch rows for a prompt, one-token steps, windows of 2 to 5 tokens,
    a rollback, a second attention span and a draft tree in one forward; every one of them captured its graphs
    (none fell back to eager forwards), and a replayed forward synchronises with the host once, for its ids
    (its inputs cross from pinned memory without a wait)."""
    import copy
    import threading
    import warnings

    from dsi.models.base import extend_rows, forward_rows
    from dsi.trees import ROOT, DraftTree

    raw = tiny_llama(layers=3, vocab=97, positions=1024)
    ids = [(7 * i + 3) % 97 for i in range(ATTEND_MIN + 20)]
    ref = reference(raw, ids)
    model = HFModel(copy.deepcopy(raw), device="cuda:0", forward_plan=ForwardPlan("static", cuda_graphs=True))
    failures: list[str] = []
    sessions = []

    def work():
        try:
            session = model.new_session()
            sessions.append(session)
            got = [session.extend(ids[:20])]
            for t in ids[20:24]:
                got.append(session.extend([t]))
            for k in (2, 3, 4, 5):
                got.append(session.extend(ids[len(session.tokens): len(session.tokens) + k]))
            np.testing.assert_allclose(np.concatenate(got), ref[:38], atol=1e-4)
            session.truncate(30)
            np.testing.assert_allclose(session.extend(ids[30:34]), ref[30:34], atol=1e-4)
            forward_rows(session, ids[: ATTEND_MIN - 2], 1)  # a prompt's length: eager
            np.testing.assert_allclose(session.extend(ids[ATTEND_MIN - 2: ATTEND_MIN + 3]),
                                       ref[ATTEND_MIN - 2: ATTEND_MIN + 3], atol=1e-4)  # into the second span
        except Exception as exc:  # noqa: BLE001 - reported on the main thread
            failures.append(f"{type(exc).__name__}: {exc}")

    with caplog.at_level(logging.WARNING, logger="dsi.models.hf.forward_plan"):
        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert not failures, failures
    assert not [r for r in caplog.records if "could not be captured" in r.getMessage()]
    assert all(not s._graphs.disabled and s._graphs.captures >= 5 for s in sessions)
    assert {span for s in sessions for _, span in s._graphs._graphs} == {ATTEND_MIN, 2 * ATTEND_MIN}

    session = sessions[0]
    tree = DraftTree((2, 7, 9, 6, 8, 3), (ROOT, ROOT, ROOT, 0, 0, 3))
    cpu = HFModel(raw).new_session()
    np.testing.assert_allclose(session.tree_rows(ids[:12], tree), cpu.tree_rows(ids[:12], tree), atol=1e-4)
    session.truncate(12)
    extend_rows(session, ids[12:16], None, 2, greedy=True)  # captured (size 4) before the count
    session.truncate(12)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = extend_rows(session, ids[12:16], None, 2, greedy=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got.tolist() == np.argmax(ref[14:16], axis=-1).tolist()
    assert len(caught) <= 2, [str(w.message) for w in caught]  # the argmax ids out (the inputs' copy: no wait)
