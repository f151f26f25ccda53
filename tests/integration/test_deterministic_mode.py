"""The deterministic mode (dsi.models.determinism): every token computed in a forward of its own, so a
row is a function of the tokens alone, bitwise, on the llama.cpp and hf backends.

What is proved here, on tiny models built in the test (a quantized GGUF for llama.cpp, a random Llama
in bf16 and fp32 for hf):

- a row's logits are the same bits however the forward was cut (one token or a batch, a prompt
  prefilled at once or in chunks, after a cache hit, after other sequences in the same session) and
  whatever thread count runs it (hf: the mode's CPU forwards run on one torch intra-op thread, in the
  calling thread only, since an fp32 product's reduction order follows the thread count on some CPUs:
  MKL on an AMD EPYC gave rows 1.2e-7 apart on 1 and 2 threads before);
- repeated seeded requests on one decoder, with other requests in between, give the same tokens;
- greedy SI and DSI (fixed k and event-driven, 1-3 servers, jittered latencies) equal non-SI token for
  token, with no near-tie exception, and seeded sampling gives the same tokens for any SP.

Without the mode, hf bf16 rows depend on the cut (about 5e-3 here); the tiny quantized GGUFs do not
show llama.cpp's departures (too few quantization blocks per row for a different accumulation order to
change a sum; gguf-py cannot write the Q4_K weights whose repacked kernels do): the embedded pair
shows them (tests/integration/test_llamacpp_real.py).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import dsi  # noqa: E402
from dsi.engine.api import build_decoder, make_request  # noqa: E402
from dsi.errors import ConfigError  # noqa: E402
from dsi.models import CallableLM, WithLatency  # noqa: E402
from dsi.models.determinism import is_deterministic, set_deterministic  # noqa: E402
from tests.tiny_hf import make_model_dir  # noqa: E402

PROMPTS = [[5, 17, 3, 9], [40, 2, 2, 7, 11, 30, 8], [100, 3], [12, 60, 61, 62, 63, 1, 5, 9, 14]]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("det") / "target", seed=0, layers=2, hidden=64)


@pytest.fixture(scope="module")
def hf_drafter_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("det") / "drafter", seed=1, layers=1, hidden=64)


def _hf(path, dtype, deterministic, plan=None):
    from dsi.models.hf.model import HFModel

    model = HFModel.load(str(path), dtype=dtype, progress=False, threads=1, forward_plan=plan)
    model.deterministic = deterministic
    return model


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    pytest.importorskip("llama_cpp")
    from tests.tiny_gguf import write_tiny_gguf

    path, _, _ = write_tiny_gguf(tmp_path_factory.mktemp("det") / "q8.gguf", seed=0, layers=2, hidden=64,
                                 quant="Q8_0")
    return path


def _cuts(model, tokens: list[int]) -> list[np.ndarray]:
    """The row of position ``len(tokens) - 1`` computed in many ways (float64 copies)."""
    rows = []
    p = len(tokens) - 1
    s = model.new_session()
    for n in (1, 2, 5):  # the position inside batches of several sizes, after a prefix prefilled at once
        s.truncate(0)
        s.extend(tokens[:p])
        rows.append(np.asarray(s.extend(tokens[p:] + tokens[:n - 1])[0], np.float64))
    s.truncate(0)
    rows.append(np.asarray(s.extend(tokens)[-1], np.float64))  # the whole prompt at once
    s.truncate(0)
    s.extend(tokens[:3])
    rows.append(np.asarray(s.extend(tokens[3:])[-1], np.float64))  # in two chunks
    s.truncate(0)
    for t in tokens:
        row = s.extend([t])[-1]
    rows.append(np.asarray(row, np.float64))  # one by one
    s.truncate(0)
    s.extend([*tokens, 7, 8, 9])  # a longer sequence before, then a cache hit
    s.truncate(p)
    rows.append(np.asarray(s.extend(tokens[p:])[-1], np.float64))
    s.close()
    return rows


def _spread(rows: list[np.ndarray]) -> float:
    return max(float(np.abs(r - rows[0]).max()) for r in rows)


TOKENS = [5, 17, 3, 9, 40, 2, 2, 7, 11, 30, 8, 100, 3, 12]


@pytest.mark.parametrize("plan", ["dynamic", "static", "padded"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_hf_rows_are_the_same_bits_however_the_forward_is_cut(hf_dir, dtype, plan):
    """Also on the static cache (and graphs' shapes): what a rollback leaves past the length is never read."""
    from dsi.models.hf.forward_plan import ForwardPlan

    plans = {"dynamic": None, "static": ForwardPlan("static"), "padded": ForwardPlan("static", cuda_graphs=True)}
    model = _hf(hf_dir, dtype, deterministic=True, plan=plans[plan])
    assert _spread(_cuts(model, TOKENS)) == 0.0


def test_hf_bf16_rows_depend_on_the_cut_without_the_mode(hf_dir):
    """The departure the mode removes: batched bf16 products round by blocking."""
    model = _hf(hf_dir, "bf16", deterministic=False)
    assert _spread(_cuts(model, TOKENS)) > 0.0


def test_llama_cpp_rows_are_the_same_bits_however_the_forward_is_cut(gguf_path):
    from dsi.models.llamacpp import LlamaCppModel

    model = LlamaCppModel(gguf_path, threads=2, deterministic=True)
    one_thread = LlamaCppModel(gguf_path, threads=1, deterministic=True)
    try:
        rows = _cuts(model, TOKENS) + _cuts(one_thread, TOKENS)
        assert _spread(rows) == 0.0
    finally:
        model.close()
        one_thread.close()


LONG = [int(t) for t in np.random.default_rng(0).integers(5, 300, 620)]  # past 256 tokens: a 512-cell KV view


@pytest.fixture(scope="module")
def long_gguf_path(tmp_path_factory):
    pytest.importorskip("llama_cpp")
    from tests.tiny_gguf import write_tiny_gguf

    path, _, _ = write_tiny_gguf(tmp_path_factory.mktemp("det") / "q8-long.gguf", seed=0, layers=2, hidden=64,
                                 quant="Q8_0", max_positions=1024)
    return path


def _one_by_one_rows(path, threads: int, deterministic: bool) -> np.ndarray:
    """LONG's rows, every token in a forward of its own (float64), on ``threads`` llama.cpp threads."""
    from dsi.models.llamacpp import LlamaCppModel

    model = LlamaCppModel(path, threads=threads, deterministic=deterministic, n_ctx=1024)
    try:
        session = model.new_session()
        return np.stack([np.asarray(session.extend([t])[0], np.float64) for t in LONG])
    finally:
        model.close()


def test_llama_cpp_one_token_rows_past_256_tokens_depend_on_the_thread_count_with_flash_attention(long_gguf_path):
    """What the mode turns off: llama.cpp's CPU flash attention splits a one-token forward's KV across the
    threads once the cache view reaches 512 cells, and merges the parts in another order than one thread
    sums them. The first 256 positions agree; later ones do not."""
    two, one = (_one_by_one_rows(long_gguf_path, threads, deterministic=False) for threads in (2, 1))
    per_position = np.abs(two - one).max(axis=1)
    assert per_position[:256].max() == 0.0
    assert per_position[256:].max() > 0.0


def test_llama_cpp_rows_in_the_mode_do_not_depend_on_the_thread_count_past_256_tokens(long_gguf_path):
    from dsi.models.llamacpp import LlamaCppModel

    two, one = (_one_by_one_rows(long_gguf_path, threads, deterministic=True) for threads in (2, 1))
    assert np.array_equal(two, one)
    model = LlamaCppModel(long_gguf_path, threads=2, deterministic=True, n_ctx=1024)
    try:  # the mode's batched call cuts into the same one-token forwards
        batched = np.asarray(model.new_session().extend(LONG), np.float64)
    finally:
        model.close()
    assert np.array_equal(batched, one)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_hf_rows_in_the_mode_do_not_depend_on_the_thread_count(tmp_path, dtype):
    """Before the mode fixed one intra-op thread, fp32 failed here on an AMD EPYC (MKL: rows 1.2e-7 apart from
    position 7 on) and passed on the Intel Xeon of other days, where the two counts happened to agree; so this
    test alone shows the fix only on some CPUs. The next two check the mechanism, which holds on any CPU."""
    from dsi.models.hf.model import HFModel

    folder = make_model_dir(tmp_path / "long", seed=0, layers=2, hidden=64, positions=512)
    rows = []
    for threads in (2, 1, None):
        model = HFModel.load(str(folder), dtype=dtype, progress=False, threads=threads)
        model.deterministic = True
        rows.append(np.asarray(model.new_session().extend(LONG[:300]), np.float64))
    assert np.array_equal(rows[0], rows[1]) and np.array_equal(rows[0], rows[2])


def _threads_seen(model) -> tuple[list[int], object]:
    """The torch intra-op threads of every forward of ``model`` (read in layer 0, in the forward's thread)."""
    import torch

    seen: list[int] = []
    handle = model.layers[0].register_forward_pre_hook(lambda module, args: seen.append(torch.get_num_threads()))
    return seen, handle


def test_hf_forwards_in_the_mode_run_on_one_intra_op_thread_and_give_the_caller_its_setting_back(hf_dir):
    import threading

    import torch

    from dsi.errors import TaskCancelled

    before = torch.get_num_threads()
    try:
        for threads in (2, None):
            torch.set_num_threads(2)
            model = _hf(hf_dir, "fp32", True)
            model.threads = threads
            seen, handle = _threads_seen(model)
            session = model.new_session()
            session.extend(TOKENS[:3])
            session.extend_rows(TOKENS[3:6], None, 1, True)
            handle.remove()
            assert seen == [1] * 6, threads  # every one-token forward on one thread, whatever ``threads`` says
            assert torch.get_num_threads() == 2  # and the caller's setting as it was
            flag = threading.Event()
            handle = model.layers[0].register_forward_pre_hook(lambda module, args: flag.set())
            with pytest.raises(TaskCancelled):  # cancelled inside a forward (before layer 1): given back too
                session.extend(TOKENS[6:8], cancel=flag)
            handle.remove()
            assert torch.get_num_threads() == 2 and session.tokens == tuple(TOKENS[:6])
            model.deterministic = False  # without the mode: ``threads`` (None: the caller's setting)
            seen, handle = _threads_seen(model)
            model.new_session().extend(TOKENS[:3])
            handle.remove()
            assert seen == [2], threads
    finally:
        torch.set_num_threads(before)


def test_hf_one_thread_in_the_mode_is_the_calling_thread_s_alone(hf_dir, no_thread_leak):
    """torch's intra-op setting (OpenMP) belongs to the calling thread: a mode forward in one thread and a
    two-thread forward of another session in another thread, overlapping (a barrier in layer 0), each run on
    their own count, and the mode's rows are the bits of a forward alone."""
    import threading

    import torch

    mode, other = _hf(hf_dir, "fp32", True), _hf(hf_dir, "fp32", False)
    mode.threads = other.threads = 2
    alone = np.asarray(mode.new_session().extend(TOKENS), np.float64)
    barrier = threading.Barrier(2, timeout=10)
    seen: dict[str, list[int]] = {"mode": [], "other": []}

    def meet(name):
        def hook(module, args):
            if len(seen[name]) < 3:  # the first three forwards of each overlap
                barrier.wait()
            seen[name].append(torch.get_num_threads())
        return hook

    handles = [mode.layers[0].register_forward_pre_hook(meet("mode")),
               other.layers[0].register_forward_pre_hook(meet("other"))]
    out, errors = {}, []

    def run(name, model, calls):
        try:
            session = model.new_session()
            out[name] = [np.asarray(session.extend(part), np.float64) for part in calls]
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    workers = [threading.Thread(target=run, args=("mode", mode, [TOKENS[:3], TOKENS[3:]]), name="dsi-test-mode"),
               threading.Thread(target=run, args=("other", other, [TOKENS[:4], [7], [8]]), name="dsi-test-other")]
    try:
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=60)
    finally:
        for handle in handles:
            handle.remove()
    assert not errors, errors
    assert seen["mode"] == [1] * len(TOKENS) and seen["other"] == [2, 2, 2]
    assert np.array_equal(np.concatenate(out["mode"]), alone)


def test_a_llama_cpp_session_follows_a_switch_into_the_mode_with_the_tokens_it_held(long_gguf_path):
    """A session made before the switch held rows computed with flash attention in batches; at its next
    forward it makes a context for the mode and recomputes its tokens, so what follows is the mode's."""
    from dsi.models.llamacpp import LlamaCppModel

    reference = _one_by_one_rows(long_gguf_path, 1, deterministic=True)
    model = LlamaCppModel(long_gguf_path, threads=2, n_ctx=1024)
    try:
        session = model.new_session()
        default = np.asarray(session.extend(LONG[:600]), np.float64)
        assert not np.array_equal(default, reference[:600])  # the default's batched rows are other bits
        model.deterministic = True
        rows = np.asarray(session.extend(LONG[600:]), np.float64)
        assert session.tokens == tuple(LONG)
        assert np.array_equal(rows, reference[600:])
        model.deterministic = False  # and back: the session keeps its tokens, recomputed as the default does
        fresh = model.new_session()
        fresh.extend(LONG)
        after = session.extend([7])[0]
        assert session.tokens == (*LONG, 7)
        assert np.array_equal(after, fresh.extend([7])[0])
    finally:
        model.close()


def test_the_mode_is_off_by_default_and_switchable_on_both_backends(gguf_path, hf_dir):
    from dsi.models.llamacpp import LlamaCppModel

    model = LlamaCppModel(gguf_path, threads=1)
    try:
        assert model.deterministic is False and not is_deterministic(model)
        model.deterministic = True
        assert is_deterministic(model)
    finally:
        model.close()
    assert _hf(hf_dir, "fp32", None).deterministic is False
    with pytest.raises(ConfigError, match=r"deterministic='yes' must be True, False or None"):
        _hf(hf_dir, "fp32", "yes")


def _pair(backend, hf_dir, hf_drafter_dir, gguf_path, dtype="bf16"):
    if backend == "hf":
        return _hf(hf_dir, dtype, True), _hf(hf_drafter_dir, dtype, True)
    from dsi.models.llamacpp import LlamaCppModel

    target = LlamaCppModel(gguf_path, threads=1, deterministic=True)
    vocab = target.vocab_size
    return target, CallableLM(lambda ctx: np.cos(np.arange(vocab) * (1 + len(ctx) % 5)), vocab)


@pytest.mark.parametrize("backend", ["hf", "llama.cpp"])
@pytest.mark.parametrize("method, lookahead", [("ar", 1), ("si", 3), ("dsi", 2), ("dsi", "auto")])
def test_repeated_seeded_requests_give_the_same_tokens_whatever_ran_between(backend, method, lookahead, hf_dir,
                                                                             hf_drafter_dir, request, no_thread_leak):
    gguf = request.getfixturevalue("gguf_path") if backend == "llama.cpp" else None
    target, drafter = _pair(backend, hf_dir, hf_drafter_dir, gguf)
    decoder = build_decoder(target=target, drafter=drafter, method=method, lookahead=lookahead,
                            num_target_servers=2)
    vocab = target.vocab_size
    try:
        for seed in range(4):
            sampling = dsi.SamplingParams(temperature=1.0, seed=seed)
            decoder.generate(make_request(PROMPTS[seed % 3], 3, dsi.SamplingParams(), None, vocab))  # in between
            first = decoder.generate(make_request(PROMPTS[3], 10, sampling, None, vocab)).tokens
            decoder.generate(make_request(PROMPTS[(seed + 1) % 3], 5, sampling, None, vocab))  # in between
            again = decoder.generate(make_request(PROMPTS[3], 10, sampling, None, vocab)).tokens
            assert first == again, seed
    finally:
        decoder.close()


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("lookahead, servers", [(1, 1), (3, 2), ("auto", 1), ("auto", 3)])
def test_greedy_si_and_dsi_equal_non_si_bit_for_bit_in_the_mode(hf_dir, hf_drafter_dir, dtype, lookahead, servers,
                                                               no_thread_leak):
    target, drafter = _hf(hf_dir, dtype, True), _hf(hf_drafter_dir, dtype, True)
    jittered = WithLatency(target, 0.002, 0.002, cv=0.8, seed=3)  # window cuts and cache hits vary with timing
    for prompt in PROMPTS:
        reference = dsi.generate(target=target, prompt=prompt, method="ar", max_new_tokens=16).tokens
        if lookahead != "auto":
            si = dsi.generate(target=target, drafter=drafter, prompt=prompt, method="si", lookahead=lookahead,
                              max_new_tokens=16).tokens
            assert si == reference
        out = dsi.generate(target=jittered, drafter=drafter, prompt=prompt, method="dsi", lookahead=lookahead,
                           num_target_servers=servers, max_new_tokens=16).tokens
        assert out == reference, (prompt, lookahead, servers)


def test_seeded_dsi_sampling_is_the_same_for_any_number_of_servers_in_the_mode(hf_dir, hf_drafter_dir,
                                                                             no_thread_leak):
    target, drafter = _hf(hf_dir, "bf16", True), _hf(hf_drafter_dir, "bf16", True)
    jittered = WithLatency(target, 0.002, 0.002, cv=0.8, seed=5)
    sampling = dsi.SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    outs = {(sp, k): dsi.generate(target=jittered, drafter=drafter, prompt=PROMPTS[1], method="dsi", lookahead=k,
                                  num_target_servers=sp, max_new_tokens=16, sampling=sampling).tokens
            for sp in (1, 2, 3) for k in (2, "auto")}
    assert len(set(map(tuple, outs.values()))) == 1, outs


def test_set_deterministic_switches_the_backends_and_refuses_a_model_without_a_mode(hf_dir):
    model = _hf(hf_dir, "fp32", False)
    wrapped = WithLatency(model, 0.0, 0.0)
    set_deterministic([wrapped], True)
    assert model.deterministic is True and is_deterministic(wrapped)
    pure = CallableLM(lambda ctx: np.zeros(4), 4)
    set_deterministic([pure], True)  # a function of its context: nothing to switch
    assert is_deterministic(pure)

    class Opaque:
        name = "opaque"
        vocab_size = 4

        def new_session(self):
            raise AssertionError

    with pytest.raises(ConfigError, match="'opaque' has no deterministic mode"):
        set_deterministic([Opaque()], True)
    set_deterministic([Opaque()], False)  # asking for nothing is fine
