"""Resolving and loading MODEL strings with the hf backend: directories, .gguf files (converted once),
hub ids, errors. The backend choice and :mod:`dsi.models.sources` are in test_backends.py."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from dsi.errors import ConfigError, ModelError, VocabularyMismatchError
from dsi.models import loading
from dsi.models.hf import checkpoint as hf_checkpoint
from dsi.models.cache import MARKER, cache_dir
from dsi.models.hf.checkpoint import ensure_converted, gguf_cache_key, resolve_model_dir
from tests.tiny_gguf import add_llama, finish


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DSI_CACHE_DIR", str(tmp_path / "cache"))


# ----------------------------------------------------------------------------------------------
# No torch needed


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("DSI_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_dir() == tmp_path / "a"
    monkeypatch.delenv("DSI_CACHE_DIR")
    assert cache_dir() == tmp_path / "x" / "dsi"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "dsi"


def test_missing_path_errors(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model_dir(str(tmp_path / "nope"))
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model_dir("./relative/missing.gguf")
    with pytest.raises(ConfigError, match="MODEL=''"):
        resolve_model_dir("")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="no config.json"):
        resolve_model_dir(str(tmp_path / "empty"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelError, match="not a .gguf file"):
        resolve_model_dir(str(tmp_path / "weights.bin"))


def test_hub_id_offline_is_a_clear_error(monkeypatch):
    pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", "/nonexistent-hf-home")
    with pytest.raises(ModelError, match="HF_HUB_OFFLINE is set"):
        resolve_model_dir("some-org/some-model")


def _fake_converter(calls: list):
    def convert(gguf, out, progress):
        calls.append(gguf)
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps({"from": str(gguf)}))

    return convert


def test_gguf_is_converted_once_and_cached(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF fake")
    calls: list = []
    first = hf_checkpoint.converted_gguf_dir(gguf, progress=False, converter=_fake_converter(calls))
    second = hf_checkpoint.converted_gguf_dir(gguf, progress=False, converter=_fake_converter(calls))
    assert first == second and len(calls) == 1
    assert first.parent == cache_dir() / "converted"
    assert json.loads((first / MARKER).read_text())["source"] == str(gguf)
    # a changed file (new mtime) is a new cache entry, converted again
    os.utime(gguf, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
    third = hf_checkpoint.converted_gguf_dir(gguf, progress=False, converter=_fake_converter(calls))
    assert third != first and len(calls) == 2


def test_interrupted_conversion_is_not_used(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF fake")
    out = tmp_path / "out"

    def broken(g, o, progress):
        o.mkdir(parents=True)
        (o / "config.json").write_text("{}")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ensure_converted(gguf, out, progress=False, converter=broken)
    assert not out.exists() and list(tmp_path.glob(".out.tmp-*")) == []
    calls: list = []
    ensure_converted(gguf, out, progress=False, converter=_fake_converter(calls))
    assert len(calls) == 1 and (out / MARKER).is_file()


def test_marker_fields_must_match(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    calls: list = []
    out = tmp_path / "out"
    ensure_converted(gguf, out, progress=False, converter=_fake_converter(calls), marker={"sha256": "a"})
    ensure_converted(gguf, out, progress=False, converter=_fake_converter(calls), marker={"sha256": "a"})
    ensure_converted(gguf, out, progress=False, converter=_fake_converter(calls), marker={"sha256": "b"})
    assert len(calls) == 2


def test_gguf_cache_key_is_stable(tmp_path):
    f = tmp_path / "My Model.Q4.gguf"
    f.write_bytes(b"1")
    assert gguf_cache_key(f) == gguf_cache_key(f)
    assert gguf_cache_key(f).startswith("My_Model.Q4-")


# ----------------------------------------------------------------------------------------------
# Real (tiny) checkpoints: need torch + transformers


def _hf():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.set_num_threads(1)
    return torch, transformers


def tiny_tokenizer(words: list[str]):
    """A whitespace word-level tokenizer: <unk>=0, <eos>=1, then ``words``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


WORDS = [f"w{i}" for i in range(95)]


def save_tiny_llama(path, vocab: int = 97, seed: int = 0, words=WORDS):
    torch, transformers = _hf()
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      eos_token_id=1, bos_token_id=None, pad_token_id=None)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    if words is not None:
        tiny_tokenizer(words).save_pretrained(path)
    return model


@pytest.mark.hf
def test_load_model_from_directory(tmp_path):
    torch, _ = _hf()
    raw = save_tiny_llama(tmp_path / "m")
    model = loading.load_model(tmp_path / "m", dtype="fp32", progress=False)
    ids = model.encode("w3 w10 w7")
    assert ids == [5, 12, 9]
    with torch.no_grad():
        ref = raw(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(model.new_session().extend(ids), ref, atol=1e-5)
    assert model.decode(ids) == "w3 w10 w7"
    assert model.eos_token_ids == (1,) and model.max_context == 64
    assert model.source_dir == tmp_path / "m"


@pytest.mark.hf
def test_load_model_errors(tmp_path):
    _, transformers = _hf()
    transformers.ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=32).save_pretrained(tmp_path / "vit")
    with pytest.raises(ModelError, match="'vit' model, not a causal language model"):
        loading.load_model(tmp_path / "vit", dtype="fp32", progress=False)
    save_tiny_llama(tmp_path / "m")
    with pytest.raises(ConfigError, match="dtype='int4'"):
        loading.load_model(tmp_path / "m", dtype="int4", progress=False)
    with pytest.raises(ConfigError, match="fp16 is not supported"):
        loading.load_model(tmp_path / "m", dtype="fp16", device="cpu", progress=False)
    with pytest.raises(ModelError, match="does not exist"):
        loading.load_model(tmp_path / "missing", dtype="fp32", progress=False)


@pytest.mark.hf
def test_load_pair_vocabulary_checks(tmp_path):
    _hf()
    save_tiny_llama(tmp_path / "t", seed=0)
    save_tiny_llama(tmp_path / "d", seed=1)
    target, drafter = loading.load_pair(tmp_path / "t", tmp_path / "d", dtype="fp32", progress=False)
    assert target.role == "target" and drafter.role == "drafter"

    save_tiny_llama(tmp_path / "small", vocab=98)
    with pytest.raises(VocabularyMismatchError, match="vocab_size=97.*vocab_size=98.*vocab_mode='shared' needs one"):
        loading.load_pair(tmp_path / "t", tmp_path / "small", dtype="fp32", progress=False, vocab_mode="shared")

    save_tiny_llama(tmp_path / "other", words=[f"v{i}" for i in range(95)])
    with pytest.raises(VocabularyMismatchError, match="tokenizers differ.*vocab_mode='shared' needs one vocabulary"):
        loading.load_pair(tmp_path / "t", tmp_path / "other", dtype="fp32", progress=False, vocab_mode="shared")
    # by default a drafter of another vocabulary loads (it drafts through text); without a tokenizer it cannot
    _, other = loading.load_pair(tmp_path / "t", tmp_path / "other", dtype="fp32", progress=False)
    assert other.tokenizer.get_vocab() != target.tokenizer.get_vocab()
    save_tiny_llama(tmp_path / "bare", vocab=98, words=None)
    with pytest.raises(VocabularyMismatchError, match=r"different vocabularies \(97 vs 98 ids\) and the drafter has no "
                                                      "tokenizer"):
        loading.load_pair(tmp_path / "t", tmp_path / "bare", dtype="fp32", progress=False)
    with pytest.raises(ConfigError, match="vocab_mode='words' must be one of auto, shared, string, intersection"):
        loading.load_pair(tmp_path / "t", tmp_path / "d", dtype="fp32", progress=False, vocab_mode="words")


def write_tiny_gguf(path, seed: int = 0):
    """A tiny Llama written as an F32 GGUF file (with a byte-level BPE tokenizer), plus the source model.

    The query/key weights are permuted the way llama.cpp stores them (tests/tiny_gguf.py); transformers
    undoes that on load.
    """
    torch, transformers = _hf()
    gguf = pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = [*bytes_to_unicode().values(), "Ġt", "he", "<|endoftext|>"]
    vocab = len(tokens)
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      rms_norm_eps=1e-6, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_merges(["Ġ t", "h e"])
    w.add_token_types([1] * (vocab - 1) + [3])
    w.add_eos_token_id(vocab - 1)
    add_llama(w, model)
    finish(w)
    return model


@pytest.mark.hf
def test_gguf_file_converts_to_bf16_safetensors_and_loads(tmp_path, monkeypatch):
    torch, _ = _hf()
    raw = write_tiny_gguf(tmp_path / "tiny.gguf")
    model = loading.load_model(tmp_path / "tiny.gguf", dtype="fp32", progress=False)
    converted = model.source_dir
    assert converted.parent == cache_dir() / "converted"
    assert (converted / "model.safetensors").is_file() and (converted / "tokenizer.json").is_file()
    assert "quantization_config" not in json.loads((converted / "config.json").read_text())
    # the weights were stored in bf16: compare with the source model rounded to bf16
    ids = model.encode(" the cat")
    assert ids == [256, 257, 220, 66, 64, 83]
    rounded = raw.to(torch.bfloat16).float()
    with torch.no_grad():
        ref = rounded(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(model.new_session().extend(ids), ref, atol=1e-4)
    assert model.eos_token_ids == (258,)

    # later loads read the cache and never convert again
    def no_convert(*args):
        raise AssertionError("converted twice")

    monkeypatch.setattr(hf_checkpoint, "convert_gguf", no_convert)
    again = loading.load_model(tmp_path / "tiny.gguf", dtype="bf16", progress=False)
    assert again.source_dir == converted and again.dtype == "bf16"


@pytest.mark.hf
def test_directory_without_tokenizer_loads_for_token_ids(tmp_path, caplog):
    _hf()
    save_tiny_llama(tmp_path / "m", words=None)
    model = loading.load_model(tmp_path / "m", dtype="fp32", progress=False)
    assert model.tokenizer is None
    assert model.new_session().extend([3, 4]).shape == (2, 97)
    with pytest.raises(ConfigError, match="no tokenizer"):
        model.encode("w1")
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
