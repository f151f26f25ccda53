"""The llama.cpp backend on tiny GGUF files written in-test (tests/tiny_gguf.py): logits against
transformers on the same weights, the session contract (rows, cache reuse, truncate, cancellation
mid-forward), the GGUF tokenizer and chat template against the HF tokenizer, and lossless greedy
SI and DSI against the backend's own non-SI output."""

from __future__ import annotations

import threading

import numpy as np
import pytest

pytest.importorskip("llama_cpp")
torch = pytest.importorskip("torch")

import dsi  # noqa: E402
from dsi.errors import ConfigError, ContextLengthError, ModelError, TaskCancelled  # noqa: E402
from dsi.models.base import forward_rows  # noqa: E402
from dsi.models.llamacpp import LlamaCppModel  # noqa: E402
from dsi.trees import DraftTree  # noqa: E402
from tests.bad_ids import bad_ids  # noqa: E402
from tests.tiny_gguf import write_tiny_gguf  # noqa: E402
from tests.tiny_hf import CORPUS  # noqa: E402
from tests.transport_support import ray_cluster  # noqa: E402  (sets Ray's environment before Ray is imported)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, hf, tok = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "target.gguf", seed=0)
    model = LlamaCppModel(path, threads=1)
    yield model, hf, tok
    model.close()


@pytest.fixture(scope="module")
def tiny_drafter(tmp_path_factory):
    path, _, _ = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "drafter.gguf", seed=1, layers=1)
    model = LlamaCppModel(path, threads=1)
    yield model
    model.close()


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


def test_logits_match_transformers_on_the_same_weights(tiny):
    model, hf, tok = tiny
    ids = tok.encode(CORPUS[1])
    session = model.new_session()
    rows = session.extend(ids)
    assert rows.shape == (len(ids), model.vocab_size) and rows.dtype == np.float32
    np.testing.assert_allclose(rows, hf_logits(hf, ids), atol=2e-3, rtol=0)
    session.close()


def test_only_the_rows_asked_for_and_greedy_ids(tiny):
    model, hf, tok = tiny
    ids = tok.encode(CORPUS[0])
    ref = hf_logits(hf, ids)
    session = model.new_session()
    last3 = session.extend_rows(ids, None, 3, greedy=False)
    np.testing.assert_allclose(last3, ref[-3:], atol=2e-3, rtol=0)
    session.truncate(0)
    greedy = session.extend_rows(ids, None, 4, greedy=True)
    assert greedy.dtype == np.int64 and greedy.tolist() == ref[-4:].argmax(-1).tolist()
    session.close()


def test_the_cache_is_reused_and_truncate_rolls_back_exactly(tiny):
    model, hf, tok = tiny
    ids = tok.encode(CORPUS[2])
    ref = hf_logits(hf, ids)
    session = model.new_session()
    session.extend(ids[:5])
    rows = session.extend(ids[5:])  # on top of the cached 5
    np.testing.assert_allclose(rows, ref[5:], atol=2e-3, rtol=0)
    session.truncate(3)
    assert session.tokens == tuple(ids[:3])
    again = forward_rows(session, ids, 2)  # reuses the 3 cached, runs the rest
    np.testing.assert_allclose(again, ref[-2:], atol=2e-3, rtol=0)
    with pytest.raises(ConfigError, match="truncate"):
        session.truncate(len(ids) + 1)
    session.close()


class FlipsAfter:
    """A cancel flag that reads unset ``n`` times, then set: it fires inside llama_decode."""

    def __init__(self, n: int) -> None:
        self.calls = 0
        self.n = n

    def is_set(self) -> bool:
        self.calls += 1
        return self.calls > self.n

    def wait(self, timeout=None) -> bool:
        return self.is_set()


def test_a_cancel_stops_the_forward_inside_llama_decode_and_leaves_the_session_as_it_was(tiny):
    model, hf, tok = tiny
    ids = tok.encode(CORPUS[1])
    session = model.new_session()
    session.extend(ids[:4])
    flag = FlipsAfter(1)  # the check before the batch passes; the abort callback then fires
    with pytest.raises(TaskCancelled):
        session.extend(ids[4:], flag)
    assert flag.calls >= 2  # llama.cpp asked the flag during the forward
    assert session.tokens == tuple(ids[:4])
    rows = session.extend(ids[4:])  # the cache holds exactly the 4 tokens
    np.testing.assert_allclose(rows, hf_logits(hf, ids)[4:], atol=2e-3, rtol=0)
    event = threading.Event()
    event.set()
    with pytest.raises(TaskCancelled):
        session.extend([1, 2], event)
    assert session.tokens == tuple(ids)
    session.close()


def test_limits_and_bad_ids_are_clear_errors(tiny, tmp_path):
    model, _, _ = tiny
    session = model.new_session()
    with pytest.raises(ContextLengthError, match="n_ctx=256"):
        session.extend([1] * 257)
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        session.extend([model.vocab_size])
    assert session.tokens == ()
    session.close()
    with pytest.raises(ConfigError, match="n_ctx=0"):
        LlamaCppModel(model.source_path, n_ctx=0)
    with pytest.raises(ConfigError, match="is not a file"):
        LlamaCppModel(tmp_path / "missing.gguf")
    with pytest.raises(ConfigError, match="threads=0"):
        model.threads = 0


class NativeGuard:
    """The llama.cpp binding, except that the calls taking token ids or text fail the test: an argument
    Python refuses must be refused before them (llama.cpp aborts the process on an id outside its vocabulary)."""

    GUARDED = ("llama_detokenize", "llama_tokenize", "llama_decode", "llama_token_to_piece")

    def __init__(self, ll) -> None:
        self._ll = ll

    def __getattr__(self, name):
        if name in self.GUARDED:
            raise AssertionError(f"{name} was reached with an argument Python should have refused")
        return getattr(self._ll, name)


def test_decode_of_an_id_outside_the_vocabulary_is_an_error_not_an_abort(tiny):
    """Issue 49: ``decode([151936])`` on the embedded target aborted the process (std::out_of_range, exit code
    134). Run in a child process, so that a regression shows as its exit code instead of killing pytest."""
    import subprocess
    import sys

    model, _, _ = tiny
    code = (
        "import sys\n"
        "from dsi.errors import ConfigError\n"
        "from dsi.models.llamacpp import LlamaCppModel\n"
        "model = LlamaCppModel(sys.argv[1], threads=1)\n"
        "for ids in ([model.vocab_size], [-1], [5, 2**31], [2**64]):\n"
        "    for decode in (model.decode, model.tokenizer.decode):\n"
        "        try:\n"
        "            decode(ids)\n"
        "        except ConfigError as exc:\n"
        "            print('refused:', exc, flush=True)\n"
        "print('decoded:', repr(model.decode([5])))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(model.source_path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    refused = [line for line in proc.stdout.splitlines() if line.startswith("refused:")]
    assert len(refused) == 8, proc.stdout
    assert f"ids[0]={model.vocab_size} is outside the vocabulary [0, {model.vocab_size})" in refused[0]
    assert "ids[0]=-1 is outside the vocabulary" in refused[2]
    assert f"ids[1]={2**31} is outside" in refused[4]
    assert f"decoded: {model.decode([5])!r}" in proc.stdout


@pytest.mark.parametrize("ids, message", bad_ids(320))
def test_bad_ids_are_refused_in_python_before_llama_cpp_sees_them(tiny, monkeypatch, ids, message):
    model, _, _ = tiny
    assert model.vocab_size == 320  # the messages above name it
    monkeypatch.setattr(model.tokenizer, "_ll", NativeGuard(model.tokenizer._ll))
    for decode in (model.decode, model.tokenizer.decode):
        with pytest.raises(ConfigError, match=message):
            decode(ids)
    session = model.new_session()
    session.extend([5, 6])
    monkeypatch.setattr(session, "_ll", NativeGuard(session._ll))
    with pytest.raises(ConfigError, match=message.replace("ids", "tokens", 1)):
        session.extend(ids)
    with pytest.raises(ConfigError, match=message.replace("ids", "prefix", 1)):
        session.tree_rows(ids, DraftTree.chain([7]))
    assert session.tokens == (5, 6)
    session.close()


def test_bad_text_lengths_and_tree_tokens_are_refused_before_llama_cpp_and_numpy_integers_pass(tiny, monkeypatch):
    model, _, tok = tiny
    ids = tok.encode(CORPUS[0])
    for as_numpy in (np.array(ids, dtype=np.int32), np.array(ids, dtype=np.uint16), [np.int64(t) for t in ids]):
        assert model.decode(as_numpy) == model.decode(ids)
    session = model.new_session()
    rows = session.extend(np.array(ids[:6], dtype=np.int64))
    assert session.tokens == tuple(ids[:6]) and all(type(t) is int for t in session.tokens)
    session.truncate(np.int64(3))
    np.testing.assert_array_equal(session.extend(tuple(np.int32(t) for t in ids[3:6])), rows[3:])
    session.close()
    monkeypatch.setattr(model.tokenizer, "_ll", NativeGuard(model.tokenizer._ll))
    for text in (123, None, b"bytes", ["a"]):
        with pytest.raises(ConfigError, match=r"text=.* must be a str"):
            model.encode(text)
        with pytest.raises(ConfigError, match=r"text=.* must be a str"):
            model.tokenizer.encode(text)
    with pytest.raises(ConfigError, match=r"system=3 \(int\) must be a str"):
        model.encode("hi", chat=True, system=3)
    session = model.new_session()
    session.extend([5, 6, 7])
    monkeypatch.setattr(session, "_ll", NativeGuard(session._ll))
    for length in (1.5, True, None, "1", -1, 4):
        with pytest.raises(ConfigError, match=rf"truncate length={length!r} must be an integer in \[0, 3\]"):
            session.truncate(length)
    for num_rows in (0, 3, 1.0, True):
        with pytest.raises(ConfigError, match=rf"num_rows={num_rows!r} must be an integer in \[1, 2\]"):
            session.extend_rows([8, 9], None, num_rows, greedy=True)
    with pytest.raises(ConfigError, match="at least one token"):
        session.extend([])
    with pytest.raises(ConfigError, match=r"tree.tokens\[1\]=320 is outside the vocabulary"):
        session.tree_rows([5, 6, 7], DraftTree((8, 320), (-1, 0)))
    with pytest.raises(ConfigError, match="a prefix of at least one token"):
        session.tree_rows([], DraftTree.chain([8]))
    assert session.tokens == (5, 6, 7)
    for bad in (1.5, -1, "4"):
        with pytest.raises(ConfigError, match=r"prompt_len=.* must be an integer >= 0"):
            model.check_length(bad)
        with pytest.raises(ConfigError, match=r"max_new_tokens=.* must be an integer >= 0"):
            model.check_length(3, bad)
    session.close()


def test_the_gguf_tokenizer_and_chat_template_match_the_hf_tokenizer(tiny):
    model, _, tok = tiny
    for text in CORPUS:
        assert model.tokenizer.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
        assert model.decode(tok.encode(text)) == tok.decode(tok.encode(text))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": CORPUS[0]}]
    assert model.tokenizer.apply_chat_template(messages, tokenize=False) == \
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert model.encode(CORPUS[4], chat=True) == tok.encode(
        tok.apply_chat_template([{"role": "user", "content": CORPUS[4]}], add_generation_prompt=True,
                                tokenize=False), add_special_tokens=False)
    assert model.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert model.decode([model.eos_token_id], skip_special_tokens=False) == "<|im_end|>"
    assert model.decode([model.eos_token_id]) == ""
    assert model.tokenizer.get_vocab()["<|im_start|>"] == tok.convert_tokens_to_ids("<|im_start|>")


@pytest.mark.parametrize("method, lookahead, servers", [
    ("si", 3, 1), ("dsi", 2, 2), ("dsi", "auto", 2), ("dsi", 4, 1),
])
@pytest.mark.parametrize("same_drafter", [True, False])
def test_greedy_si_and_dsi_equal_the_backend_s_own_non_si(tiny, tiny_drafter, method, lookahead, servers,
                                                          same_drafter, no_thread_leak):
    model, _, tok = tiny
    drafter = model if same_drafter else tiny_drafter  # all accepted / many rejections
    prompt = tok.encode(CORPUS[0])
    reference = dsi.generate(target=model, prompt=prompt, method="ar", max_new_tokens=40).tokens
    out = dsi.generate(target=model, drafter=drafter, prompt=prompt, method=method, lookahead=lookahead,
                       num_target_servers=servers, max_new_tokens=40)
    assert out.tokens == reference
    if not same_drafter:
        assert out.stats.rejections > 0  # the comparison covered corrections


def test_processes_rebuild_the_gguf_model_from_its_recipe_and_stay_lossless(tiny, tiny_drafter, no_thread_leak):
    model, _, tok = tiny
    prompt = tok.encode(CORPUS[2])
    reference = dsi.generate(target=model, prompt=prompt, method="ar", max_new_tokens=24).tokens
    out = dsi.generate(target=model, drafter=tiny_drafter, prompt=prompt, method="dsi", lookahead=3,
                       num_target_servers=2, max_new_tokens=24, transport="processes")
    assert out.tokens == reference


def test_threads_can_change_between_forwards(tiny):
    model, hf, tok = tiny
    ids = tok.encode(CORPUS[4])
    session = model.new_session()
    try:
        model.threads = 2
        first = session.extend(ids[:6])
        model.threads = 1  # picked up by the next forward of the open session
        rest = session.extend(ids[6:])
    finally:
        model.threads = 1
        session.close()
    np.testing.assert_allclose(np.concatenate([first, rest]), hf_logits(hf, ids), atol=2e-3, rtol=0)


def test_the_cli_runs_gguf_files_on_llama_cpp_losslessly(tiny, tiny_drafter, capsys):
    import json

    from dsi.cli.main import main

    model, _, tok = tiny
    ids = ",".join(map(str, tok.encode(CORPUS[0])))
    common = ["--target", str(model.source_path), "--drafter", str(tiny_drafter.source_path), "--backend",
              "llama.cpp", "--prompt-ids", ids, "--max-new-tokens", "24", "--json", "--threads", "1"]
    outputs = {}
    for method in ("ar", "si", "dsi"):
        assert main(["generate", *common, "--method", method]) == 0
        outputs[method] = json.loads(capsys.readouterr().out)["token_ids"]
    assert outputs["si"] == outputs["dsi"] == outputs["ar"] and len(outputs["ar"]) == 24
    assert main(["selftest", "--target", str(model.source_path), "--drafter", str(tiny_drafter.source_path),
                 "--backend", "llama.cpp", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["backend"] == "llama.cpp" and report["passed"]


def test_dsi_serve_answers_text_and_chat_from_a_gguf_pair(tiny, tiny_drafter):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from dsi.server import ServeConfig, create_app
    from tests.unit.server.conftest import running_server

    model, _, tok = tiny
    prompt = CORPUS[0]
    expected = model.decode(dsi.generate(target=model, prompt=model.encode(prompt), method="ar",
                                         max_new_tokens=16).tokens)
    chat_ids = model.encode(CORPUS[4], chat=True)
    expected_chat = dsi.generate(target=model, prompt=chat_ids, method="ar", max_new_tokens=16,
                                 eos_token_id=list(model.eos_token_ids)).tokens
    config = ServeConfig(method="dsi", lookahead=3, num_target_servers=2, temperature=0.0, model_name="tiny")
    with running_server(create_app(model, tiny_drafter, config)) as server:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 16}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": CORPUS[4]}], "max_tokens": 16})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(chat_ids)  # the GGUF's chat template, as HF renders it
        assert r.json()["choices"][0]["message"]["content"] == model.decode(expected_chat)


@pytest.mark.ray
def test_ray_actors_rebuild_the_gguf_model_and_stay_lossless(tiny, tiny_drafter, no_thread_leak):
    pytest.importorskip("ray")
    ray_cluster()
    model, _, tok = tiny
    prompt = tok.encode(CORPUS[3])
    reference = dsi.generate(target=model, prompt=prompt, method="ar", max_new_tokens=16).tokens
    out = dsi.generate(target=model, drafter=tiny_drafter, prompt=prompt, method="dsi", lookahead="auto",
                       num_target_servers=2, max_new_tokens=16, transport="ray",
                       transport_options={"num_cpus": 0})
    assert out.tokens == reference


def test_release_frees_a_llama_cpp_model_and_the_one_a_cross_vocabulary_drafter_wraps(tmp_path):
    from dsi.models.vocab.bridge import CrossVocabularyDrafter
    from dsi.models.loading import release

    path, _, _ = write_tiny_gguf(tmp_path / "m.gguf", seed=2, layers=1)
    model = LlamaCppModel(path, threads=1)
    model.new_session().close()
    release(model)
    with pytest.raises(ModelError, match="was closed"):
        model.new_session()
    wrapped = LlamaCppModel(path, threads=1)
    bridge = CrossVocabularyDrafter.__new__(CrossVocabularyDrafter)  # only its wrapped model matters here
    bridge.drafter = wrapped
    release(bridge)
    with pytest.raises(ModelError, match="was closed"):
        wrapped.new_session()
    release(object())  # any other model: left to the garbage collector, nothing raised


def test_amx_builds_load_weights_without_extra_buffers_unless_asked():
    """ggml's AMX kernels segfault on the embedded Q4_K_M pair (docs/models.md): a build that has them
    loads weights without extra buffer types, unless DSI_LLAMA_AMX=1; any other build keeps them."""
    from dsi.models.llamacpp import extra_buffers_safe

    amx = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | AMX_INT8 = 1 | REPACK = 1 | "
    plain = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | REPACK = 1 | "
    assert extra_buffers_safe(plain, {}) is True
    assert extra_buffers_safe(amx, {}) is False
    assert extra_buffers_safe(amx, {"DSI_LLAMA_AMX": "1"}) is True
    assert extra_buffers_safe(amx, {"DSI_LLAMA_AMX": "0"}) is False


def test_the_loaded_model_s_params_follow_the_build(tiny, monkeypatch):
    """What the loader asks llama.cpp for, with this machine's real binding: extra buffers exactly when the
    build's system info allows them."""
    import dsi.models.llamacpp as backend

    ll = backend.binding()
    info = ll.llama_print_system_info().decode()
    monkeypatch.delenv("DSI_LLAMA_AMX", raising=False)
    assert bool(backend._model_params(ll).use_extra_bufts) == ("AMX_INT8 = 1" not in info)
    monkeypatch.setenv("DSI_LLAMA_AMX", "1")
    assert bool(backend._model_params(ll).use_extra_bufts) is True
