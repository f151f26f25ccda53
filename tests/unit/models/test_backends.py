"""Where a model comes from (dsi.models.sources) and which backend runs it (dsi.models.loading).

No torch and no llama.cpp: the backends' loaders are replaced by fakes that record their calls
(``sys.modules`` entries for ``dsi.models.hf.model`` / ``dsi.models.llamacpp``), so these tests check the
dispatch and the rule of ``backend="auto"`` alone.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from dsi.errors import ConfigError, ModelError, VocabularyMismatchError
from dsi.models import CallableLM, embedded, loading
from dsi.models.hf import checkpoint as hf_checkpoint
from dsi.models.loading import BackendChoice, choose_backend, load_model, load_pair
from dsi.models.sources import ModelSource, gguf_file, resolve_source


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DSI_CACHE_DIR", str(tmp_path / "cache"))


def checkpoint(path: Path, gguf: bool = False) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    if gguf:
        (path / "model.Q4_K_M.gguf").write_bytes(b"GGUF")
    return path


def gguf(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF")
    return path


# ----------------------------------------------------------------------------------------------
# Sources


def test_every_kind_of_model_string(tmp_path):
    source = resolve_source("Default-Target")
    assert (source.kind, source.embedded, source.name) == ("embedded", embedded.TARGET.name, "Default-Target")
    assert source.gguf == embedded.cache_dir() / "gguf" / f"{embedded.TARGET.name}.gguf"
    assert not source.gguf.exists()  # resolving downloads nothing

    plain = resolve_source(checkpoint(tmp_path / "plain"))
    assert (plain.kind, plain.directory, plain.gguf, plain.has_gguf) == ("directory", tmp_path / "plain", None, False)
    both = resolve_source(checkpoint(tmp_path / "both", gguf=True))
    assert (both.kind, both.gguf.name, both.has_gguf) == ("directory", "model.Q4_K_M.gguf", True)

    only = tmp_path / "only"
    gguf(only / "m.gguf")
    assert resolve_source(only) == ModelSource(str(only), "gguf", gguf=only / "m.gguf")
    assert resolve_source(only / "m.gguf") == ModelSource(str(only / "m.gguf"), "gguf", gguf=only / "m.gguf")

    hub = resolve_source("some-org/some-model")
    assert (hub.kind, hub.hub_id, hub.has_gguf, hub.is_checkpoint) == ("hub", "some-org/some-model", False, True)


def test_model_strings_that_are_none_of_the_forms(tmp_path):
    with pytest.raises(ConfigError, match="MODEL='  ' must be an existing directory, a .gguf file, a hub id"):
        resolve_source("  ")
    with pytest.raises(ModelError, match="does not exist"):
        resolve_source(str(tmp_path / "missing.gguf"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelError, match="not a .gguf file"):
        resolve_source(tmp_path / "weights.bin")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="has no config.json"):
        resolve_source(tmp_path / "empty")
    gguf(tmp_path / "two" / "a.gguf")
    gguf(tmp_path / "two" / "b.gguf")
    with pytest.raises(ModelError, match=r"several .gguf files \(a.gguf, b.gguf\); pass one of them"):
        resolve_source(tmp_path / "two")
    with pytest.raises(ConfigError, match="kind='zip' must be one of"):
        ModelSource("x", "zip")


def test_gguf_file_fetches_the_embedded_one_and_explains_missing_ones(tmp_path, monkeypatch):
    fetched = []
    monkeypatch.setattr(embedded, "ensure_gguf", lambda name, progress: fetched.append(name) or Path("/x.gguf"))
    assert gguf_file(resolve_source("default-drafter"), progress=False) == Path("/x.gguf")
    assert fetched == [embedded.DRAFTER.name]
    assert gguf_file(resolve_source(gguf(tmp_path / "m.gguf"))) == tmp_path / "m.gguf"
    with pytest.raises(ConfigError, match="checkpoint directory .* has no single .gguf file: it holds none"):
        gguf_file(resolve_source(checkpoint(tmp_path / "plain")))
    several = checkpoint(tmp_path / "several")
    gguf(several / "a.gguf")
    gguf(several / "b.gguf")
    with pytest.raises(ConfigError, match=r"it holds several \(a.gguf, b.gguf\)"):
        gguf_file(resolve_source(several))
    with pytest.raises(ConfigError, match="hub checkpoint 'org/m' is a transformers checkpoint without a .gguf"):
        gguf_file(resolve_source("org/m"))


def test_the_hf_backend_converts_only_what_it_has_to(tmp_path, monkeypatch):
    plain = checkpoint(tmp_path / "plain", gguf=True)
    assert hf_checkpoint.checkpoint_dir(resolve_source(plain)) == plain  # a checkpoint is used as it is
    calls = []

    def converter(g, out, progress):
        calls.append(g)
        out.mkdir(parents=True)

    converted = hf_checkpoint.checkpoint_dir(resolve_source(gguf(tmp_path / "m.gguf")), converter=converter)
    assert calls == [tmp_path / "m.gguf"] and converted.parent == embedded.cache_dir() / "converted"


# ----------------------------------------------------------------------------------------------
# The rule of backend="auto"


def sources(tmp_path, *kinds: str) -> list[ModelSource]:
    made = {
        "embedded": lambda i: resolve_source("default-target"),
        "gguf": lambda i: resolve_source(gguf(tmp_path / f"m{i}.gguf")),
        "checkpoint": lambda i: resolve_source(checkpoint(tmp_path / f"c{i}")),
        "checkpoint+gguf": lambda i: resolve_source(checkpoint(tmp_path / f"cg{i}", gguf=True)),
        "hub": lambda i: resolve_source("org/model"),
    }
    return [made[k](i) for i, k in enumerate(kinds)]


@pytest.mark.parametrize("kinds, devices, dtype, binding, expected, why", [
    (("embedded", "embedded"), (), None, True, "llama.cpp", "GGUF models on the CPU"),
    (("gguf", "gguf"), ("cpu", None), None, True, "llama.cpp", "GGUF models on the CPU"),
    (("gguf",), ("CPU",), None, True, "llama.cpp", "GGUF models on the CPU"),
    (("embedded", "embedded"), ("cpu", "cuda:1"), None, True, "hf", "device cuda:1 asked for"),
    (("gguf", "gguf"), ("cuda",), None, True, "hf", "device cuda asked for"),
    (("embedded", "embedded"), (), "fp32", True, "hf", "dtype='fp32' asked for"),
    (("checkpoint", "checkpoint"), (), None, True, "hf", "is a transformers checkpoint"),
    (("checkpoint+gguf",), (), None, True, "hf", "is a transformers checkpoint"),
    (("gguf", "checkpoint"), (), None, True, "hf", "is a transformers checkpoint"),
    (("hub",), (), None, True, "hf", "hub checkpoint 'org/model' is a transformers checkpoint"),
    (("embedded", "embedded"), (), None, False, "hf", "pip install 'dsi[llama]'"),
])
def test_auto_picks_llamacpp_for_gguf_on_the_cpu_and_hf_otherwise(tmp_path, kinds, devices, dtype, binding,
                                                                   expected, why):
    choice = choose_backend(sources(tmp_path, *kinds), "auto", devices=devices, dtype=dtype, binding=binding)
    assert choice.backend == expected
    assert why in choice.reason


def test_an_explicit_backend_is_kept_when_it_can_run_the_models(tmp_path):
    assert choose_backend(sources(tmp_path, "gguf", "gguf"), "hf", devices=("cuda",), binding=False) == \
        BackendChoice("hf", "asked for")
    assert choose_backend(sources(tmp_path, "checkpoint+gguf", "embedded"), "llama.cpp", devices=("cpu",),
                          binding=True) == BackendChoice("llama.cpp", "asked for")


@pytest.mark.parametrize("kinds, options, error, message", [
    (("checkpoint",), {}, ConfigError,
     r"backend='llama.cpp' needs a .gguf file, but the transformers checkpoint directory .* has none"),
    (("hub",), {}, ConfigError, "the hub checkpoint 'org/model' has none"),
    (("gguf",), {"dtype": "fp32"}, ConfigError,
     r"dtype='fp32' with backend='llama.cpp': llama.cpp runs the GGUF's weights as they are stored.*leave dtype unset"),
    (("gguf",), {"devices": ("cpu", "cuda:0")}, ConfigError,
     r"device='cuda:0' with backend='llama.cpp'.*runs on the CPU only; use device 'cpu'.*backend='hf' for CUDA"),
    (("gguf",), {"binding": False}, ModelError, r"needs the llama-cpp-python binding: pip install 'dsi\[llama\]'"),
])
def test_impossible_llamacpp_combinations_say_what_is_allowed(tmp_path, kinds, options, error, message):
    options = {"binding": True, **options}
    with pytest.raises(error, match=message):
        choose_backend(sources(tmp_path, *kinds), "llama.cpp", **options)


def test_an_unknown_backend_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="backend='vllm' must be one of auto, hf, llama.cpp"):
        choose_backend(sources(tmp_path, "gguf"), "vllm")
    with pytest.raises(ConfigError, match="backend='llamacpp' must be one of"):
        load_model(gguf(tmp_path / "m.gguf"), backend="llamacpp")


# ----------------------------------------------------------------------------------------------
# Dispatch to the backends' loaders (fakes)


def counting(vocab: int):
    def next_logits(ctx):
        row = np.zeros(vocab)
        row[(ctx[-1] + 1) % vocab if ctx else 0] = 1.0
        return row

    return next_logits


class FakeLlama(CallableLM):
    """Stands for LlamaCppModel: records how it was loaded."""

    loads: list = []

    def __init__(self, gguf_path, *, n_ctx=None, threads=None, name=None, role=None, vocab=7, deterministic=None):
        super().__init__(counting(vocab), vocab)
        self.source_path, self.n_ctx, self.threads, self.name, self.role = Path(gguf_path), n_ctx, threads, name, role
        self.deterministic = bool(deterministic)
        self.tokenizer = None

    @classmethod
    def load(cls, gguf_path, **kwargs):
        cls.loads.append((str(gguf_path), kwargs))
        vocab = 8 if "odd" in str(gguf_path) else 7
        return cls(gguf_path, vocab=vocab, **kwargs)


class FakeHF(FakeLlama):
    loads: list = []

    @classmethod
    def load(cls, spec, **kwargs):
        cls.loads.append((str(spec), kwargs))
        return cls(spec, name=str(spec), role=kwargs.get("role"))


@pytest.fixture
def fakes(monkeypatch):
    """Fake backend modules; the llama.cpp binding counts as installed."""
    FakeLlama.loads, FakeHF.loads = [], []
    monkeypatch.setitem(sys.modules, "dsi.models.llamacpp", types.SimpleNamespace(LlamaCppModel=FakeLlama))
    monkeypatch.setitem(sys.modules, "dsi.models.hf.model", types.SimpleNamespace(HFModel=FakeHF))
    monkeypatch.setattr(loading, "binding_available", lambda: True)
    monkeypatch.setattr(embedded, "ensure_gguf", lambda name, progress: Path(f"/cache/{name}.gguf"))
    return FakeLlama, FakeHF


def test_auto_loads_the_embedded_pair_with_llamacpp_without_converting(fakes, monkeypatch):
    monkeypatch.setattr(hf_checkpoint, "checkpoint_dir", lambda *a, **k: pytest.fail("converted for hf"))
    target, drafter = load_pair("default-target", "default-drafter", threads=1, n_ctx=256, progress=False)
    assert (target.role, drafter.role) == ("target", "drafter")
    assert FakeLlama.loads == [
        (f"/cache/{embedded.TARGET.name}.gguf",
         {"n_ctx": 256, "threads": 1, "name": "default-target", "role": "target", "deterministic": None}),
        (f"/cache/{embedded.DRAFTER.name}.gguf",
         {"n_ctx": 256, "threads": 1, "name": "default-drafter", "role": "drafter", "deterministic": None}),
    ]
    assert FakeHF.loads == []


def test_hf_gets_its_defaults_and_the_pair_is_checked(fakes, tmp_path):
    target, _ = load_pair(gguf(tmp_path / "t.gguf"), gguf(tmp_path / "d.gguf"), dtype="fp32", progress=False)
    assert FakeLlama.loads == [] and [kw["dtype"] for _, kw in FakeHF.loads] == ["fp32", "fp32"]
    FakeHF.loads.clear()
    load_model(checkpoint(tmp_path / "c"), progress=False)
    assert FakeHF.loads == [(str(tmp_path / "c"), {"dtype": "bf16", "device": "cpu", "role": None, "progress": False,
                                                  "threads": None, "trust_remote_code": False,
                                                  "forward_plan": None})]
    with pytest.raises(VocabularyMismatchError, match="vocab_size=7 .* vocab_size=8"):
        load_pair(gguf(tmp_path / "t.gguf"), gguf(tmp_path / "odd.gguf"), backend="llama.cpp", progress=False,
                  vocab_mode="shared")


def test_options_of_one_backend_are_refused_on_the_other(fakes, tmp_path):
    m = gguf(tmp_path / "m.gguf")
    with pytest.raises(ConfigError, match=r"n_ctx=512 applies to the llama.cpp backend only \(the hf backend was "
                                          r"chosen: dtype='bf16' asked for"):
        load_model(m, dtype="bf16", n_ctx=512)
    with pytest.raises(ConfigError, match="trust_remote_code=True with backend='llama.cpp'"):
        load_model(m, backend="llama.cpp", trust_remote_code=True)
    from dsi.models.hf.forward_plan import ForwardPlan

    with pytest.raises(ConfigError, match=r"forward_plan=.* applies to the hf backend only \(the llama.cpp backend"):
        load_model(m, backend="llama.cpp", forward_plan=ForwardPlan("static"))
    load_model(m, trust_remote_code=True)  # auto: remote code means transformers
    assert [spec for spec, _ in FakeHF.loads] == [str(m)] and FakeLlama.loads == []
    with pytest.raises(ConfigError, match="device='cuda' with backend='llama.cpp'"):
        load_pair(m, m, backend="llama.cpp", drafter_device="cuda")
